"""HTML pages from Jinja2 templates (``kvlab/lab/templates``), every value autoescaped."""

from __future__ import annotations

import functools


@functools.cache
def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("kvlab", "lab/templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a misspelt field fails the render instead of printing nothing
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(template: str, **context) -> str:
    """The page ``template`` (a file in ``kvlab/lab/templates``) filled from ``context``."""
    return _environment().get_template(template).render(**context)
