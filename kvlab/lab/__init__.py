"""The lab: the merge explorer, figures, the notebook kernel and papermill reports.

:func:`setup` is the one set-up call of every notebook.
"""

from __future__ import annotations

import random
import warnings

import numpy as np
import torch
from transformers.utils import logging as tf_logging

#: Warnings the notebooks emit that are noise, not findings, as ``(message regex, category,
#: module regex)`` for :func:`warnings.filterwarnings`: the one place a notebook filter goes,
#: and only ever by message and category, so every other warning (kvlab's own
#: :class:`kvlab.CacheFileWarning` for ``strict=False`` first of all) still shows.
#: Empty today: run with no filter at all, the eight notebooks emit no warning (checked by
#: running each one on SmolLM2 with its set-up's filters removed, and by the Gemma 3 runs of
#: ``tests/lab/test_notebooks.py``, which fail on any stderr output).
NOTEBOOK_NOISE: tuple[tuple[str, type[Warning], str], ...] = ()


def setup(seed: int = 0) -> None:
    """Prepare a notebook's kernel: seed every generator and keep known noise out of the outputs.

    Seeds :mod:`random`, NumPy's global generator and torch; turns transformers' progress bars
    off (without it 06 stores the "Loading weights" bar of the models it loads late) and its
    logging down to errors, as the notebooks' set-up cells did; and adds the targeted filters
    of :data:`NOTEBOOK_NOISE`. No warning is silenced wholesale. It loads no model and imports
    nothing beyond NumPy, torch and transformers (never llama.cpp). ``%matplotlib inline``
    stays in the notebook: it is a magic of the kernel's shell, not a function call.

    Parameters
    ----------
    seed : int
        The notebook's ``seed`` parameter.
    """
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    for message, category, module in NOTEBOOK_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
