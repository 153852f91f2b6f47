"""``LoadedModel``: a torch causal LM, its tokenizer and where it came from; kvlab's cache folder."""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from unittest import mock

import torch
from tqdm import tqdm
from transformers.utils import logging as tf_logging

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DEFAULT_MODEL = "smollm2-135m"


@dataclass
class LoadedModel:
    """A model ready for kvlab: the torch module, its tokenizer and where it came from."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    config: object
    source: dict = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def cache_root() -> Path:
    return Path(os.environ.get("KVLAB_CACHE") or Path.home() / ".cache" / "kvlab")


def notice(text: str) -> None:
    """A one-time notice: stderr on a terminal or in a script, stdout inside a Jupyter kernel.

    In a kernel, stderr is stored as its own output and nbval counts it as a difference; on
    stdout the line joins the cell's text, where ``notebooks/sanitize.cfg`` removes it, so a
    notebook run on a cold cache still matches its stored outputs.
    """
    print(text, file=sys.stdout if "ipykernel" in sys.modules else sys.stderr, flush=True)


@contextlib.contextmanager
def quiet_transformers():
    """Keep transformers' progress bars and info chatter out of notebooks and reports."""
    bars, level = tf_logging.is_progress_bar_enabled(), tf_logging.get_verbosity()
    tf_logging.disable_progress_bar()
    tf_logging.set_verbosity_error()
    try:
        yield
    finally:
        tf_logging.set_verbosity(level)
        if bars:
            tf_logging.enable_progress_bar()


@contextlib.contextmanager
def quiet_gguf_reader():
    """Silence the progress bar transformers' GGUF reader draws while it dequantizes.

    It calls ``tqdm.auto.tqdm`` itself, which no logging switch reaches; inside a Jupyter kernel
    that is a widget (nbval then sees an unexpected ``text/plain`` output), elsewhere a bar on
    stderr. Only this module's ``tqdm`` is replaced, for the length of the block.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils  # noqa: PLC0415 - slow: only to read a GGUF

    with mock.patch.object(gguf_utils, "tqdm", partial(tqdm, disable=True)):
        yield
