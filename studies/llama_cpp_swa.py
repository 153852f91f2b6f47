"""llama.cpp beside kvlab on Gemma 3 (issue 15): conversion fidelity, and what llama.cpp's
K-shift does to sliding-window layers when fragments are merged past the 512-token window.

    .venv/bin/python studies/llama_cpp_swa.py [--model gemma3-270m] [--tokens 400] [--questions 12]

Two llama.cpp cache layouts are tried for the same merge:
* ``swa_full=True`` (the library's default): sliding layers keep every token, so a K-shift
  can rotate all of them and the window is applied by the attention mask at read time;
* ``swa_full=False`` (what ``llama-server`` runs unless given ``--swa-full``): sliding layers
  keep only the window, the layout that makes the server turn cache reuse off.
Each is compared, probe by probe, with llama.cpp's own joined prefill; kvlab's rerotate and
recompute are compared with kvlab's joined prefill. Writes ``results/llama_cpp_<model>.json``
and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import kvlab
from kvlab.atomic import atomic_write_text
from kvlab.errors import PeerError
from kvlab.findings import longctx
from kvlab.peers.conversion import CONVERSION_PROBES, conversion_fidelity
from kvlab.peers.merges import format_rows, merge_side_by_side


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--tokens", type=int, default=400, help="tokens per passage (two passages are merged)")
    ap.add_argument("--questions", type=int, default=12, help="probes read behind each merge")
    ap.add_argument("--conversion-probes", type=int, default=12)
    ap.add_argument("--out", default="results")
    args = ap.parse_args()
    started = time.perf_counter()
    model = kvlab.load_model(args.model)
    doc = {"model": model.name, "command": " ".join(["studies/llama_cpp_swa.py"] + sys.argv[1:])}

    conv = conversion_fidelity(model, CONVERSION_PROBES[: args.conversion_probes])
    doc["conversion"] = {
        "n": conv.n,
        "kl_mean": conv.kl_mean,
        "kl_ci": conv.kl_ci,
        "kl_max": conv.kl_max,
        "top1": conv.top1,
        "kl_f32_mean": conv.kl_f32_mean,
        "kl_f32_ci": conv.kl_f32_ci,
        "same_ids": conv.same_ids,
        "gguf": conv.gguf,
        "desc": conv.desc,
    }
    print(
        f"conversion ({conv.gguf}, n={conv.n}): KL(llama.cpp || kvlab) {conv.kl_mean:.4f} "
        f"[{conv.kl_ci[0]:.4f}, {conv.kl_ci[1]:.4f}], max {conv.kl_max:.4f}, top-1 {conv.top1:.2f}; "
        f"F32 copy {conv.kl_f32_mean:.2e} [{conv.kl_f32_ci[0]:.2e}, {conv.kl_f32_ci[1]:.2e}]; same ids {conv.same_ids:.2f}",
        flush=True,
    )

    # Two generated passages, each cached alone; the questions are the probes. The passages are
    # plain text here (no chat template) so both engines read exactly the same ids.
    s = longctx.make_set(model, 2, args.tokens, seed=0, max_questions=args.questions)
    texts = [p + " " for p in s.passages]
    probes = [f"\nQuestion: {q.text}\nAnswer: {q.lead}".rstrip() for q in s.questions]
    lengths = [len(kvlab.tokenize(model, t)) for t in texts]
    window = getattr(model.config.get_text_config(), "sliding_window", None)
    doc["merge"] = {"fragment_tokens": lengths, "window": window, "n_probes": len(probes), "layouts": {}}
    print(f"merge: fragments of {lengths} tokens (window {window}), {len(probes)} probes", flush=True)
    for swa_full in (True, False):
        label = f"swa_full={swa_full}"
        t0 = time.perf_counter()
        try:
            rows = merge_side_by_side(model, texts, probes, kvlab_rows=swa_full, swa_full=swa_full)
            doc["merge"]["layouts"][label] = {
                "rows": [r.row() | {"kls": r.kls} for r in rows],
                "wall_s": time.perf_counter() - t0,
            }
            print(f"\n{label}\n" + format_rows(rows), flush=True)
        except PeerError as e:
            doc["merge"]["layouts"][label] = {"refused": str(e)}
            print(f"\n{label}: llama.cpp refused: {e}", flush=True)
    doc["wall_s_total"] = time.perf_counter() - started
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"llama_cpp_{model.name}.json", json.dumps(doc, indent=1, default=float))
    print(f"\ndone in {doc['wall_s_total']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
