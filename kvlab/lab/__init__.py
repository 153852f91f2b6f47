"""The lab: the merge explorer, figures, the notebook kernel and papermill reports.

:func:`setup` is the first call of every notebook.
"""

from __future__ import annotations

import random
import warnings

#: The warnings a notebook run emits that are not findings: ``(action, message regex,
#: category, module regex)`` for :func:`warnings.filterwarnings`. Only these are silenced;
#: every other warning (kvlab's own :class:`kvlab.CacheFileWarning` for ``strict=False``
#: included) still shows in the notebook.
NOTEBOOK_NOISE: list[tuple[str, str, type[Warning], str]] = []


def setup(seed: int = 0) -> None:
    """Prepare a notebook kernel: seed every generator, keep known noise out of the outputs.

    Seeds :mod:`random`, NumPy's global generator and torch (``torch.manual_seed``), turns
    transformers' logging down to errors and its progress bars off, and adds the targeted
    warning filters of :data:`NOTEBOOK_NOISE`. It loads no model and imports nothing heavy
    beyond torch and transformers (never llama.cpp). ``%matplotlib inline`` stays in the
    notebook: a function cannot run a cell magic's effect on the kernel's display hooks.

    Parameters
    ----------
    seed : int
        The notebook's ``seed`` parameter.
    """
    import numpy as np
    import torch
    from transformers.utils import logging as tf_logging

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    for action, message, category, module in NOTEBOOK_NOISE:
        warnings.filterwarnings(action, message=message, category=category, module=module)
