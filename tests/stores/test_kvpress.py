"""kvlab beside kvpress (``pip install kvlab kvpress==0.5.5``): it imports, and certifies on kvpress's transformers."""

from __future__ import annotations

from installed import store_module

from kvlab.cli import main

kvpress = store_module("kvpress", "kvpress")


def test_kvlab_certifies_tiny_llama_beside_kvpress(capsys):
    # kvpress's presses and pipeline import in the same process as kvlab's core.
    assert kvpress.KnormPress and kvpress.KVPressTextGenerationPipeline
    assert main(["certify", "tiny-llama"]) == 0, capsys.readouterr().out
