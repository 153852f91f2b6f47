"""The ``kvlab`` command line."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from kvlab.cache.compact import POSITIONS
from kvlab.errors import AuditTargetError, KvlabError
from kvlab.files.identity import package_versions, show
from kvlab.files.inspect import inspect_file, inspect_folder, load_into
from kvlab.measure.audit.compact_source import CACHE, READERS
from kvlab.measure.audit.run import audit
from kvlab.measure.audit.target import ENGINE, resolve
from kvlab.measure.certify import certify
from kvlab.measure.check import check_rows, format_rows
from kvlab.measure.mismatch import FINETUNE_DEFAULTS, format_study, mismatch_study
from kvlab.models.catalog import model_rows
from kvlab.models.gguf import prepare as prepare_models
from kvlab.models.loaded import DEFAULT_MODEL
from kvlab.models.sources import load_model
from kvlab.peers import kshift, summary
from kvlab.peers.audit import audit_engine, llama_cpp_cache_reuse
from kvlab.peers.prepare import prepare as prepare_peers
from kvlab.sweep.study import load_study


def _models(args) -> int:
    if args.prepare is not None:
        for name, folder in prepare_models(args.prepare or None).items():
            print(f"{name}: ready in {folder}")
        return 0
    rows = model_rows()
    columns = [
        ("name", "name", "<"),
        ("family", "family", "<"),
        ("layers", "layers", ">"),
        ("kv_heads", "kv heads", ">"),
    ]
    columns += [("head_dim", "head_dim", ">"), ("rope", "rope", "<"), ("cached", "cached", "<")]
    # Each column as wide as its longest cell, so a long rope summary never pushes a row out of line.
    widths = [max(len(title), *(len(str(r[key])) for r in rows)) for key, title, _ in columns]
    head = "  ".join(f"{title:{align}{w}}" for (_, title, align), w in zip(columns, widths))
    print(head.rstrip())
    print("-" * len(head.rstrip()))
    for r in rows:
        print("  ".join(f"{str(r[key]):{align}{w}}" for (key, _, align), w in zip(columns, widths)).rstrip())
    return 0


def _check(args) -> int:
    torch.manual_seed(0)
    model = load_model(args.model)
    rows = check_rows(model)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(
            f"kvlab check on {model.name}: two fragments; K/V against the phase reference (each fragment "
            "prefilled alone at its landing positions); KL (nats) against the joined prefill"
        )
        print(format_rows(rows))
    return 0


def _certify(args) -> int:
    torch.manual_seed(0)
    targets = {
        "merge": args.merge, "shift": args.shift, "store": args.store, "compact": args.compact, "press": args.press
    }  # fmt: skip
    if args.engine_merge:
        if any(targets.values()):
            raise AuditTargetError(
                "--engine-merge is audited on its own: drop --merge, --shift, --store, --compact and --press"
            )
        spec = llama_cpp_cache_reuse if args.engine_merge == LLAMA_CPP else args.engine_merge
        cert = audit_engine(load_model(args.model), resolve(ENGINE, spec))
    elif any(targets.values()):
        # Every target imported and its signature read before the model loads: a bad one costs nothing.
        resolved = {kind: resolve(kind, spec) for kind, spec in targets.items() if spec}
        if args.positions is None and (args.compact or args.press):
            raise AuditTargetError("--compact and --press need --positions kept or --positions original")
        cert = audit(load_model(args.model), **resolved, positions=args.positions, reader=args.reader)
    else:
        if args.positions or args.reader != CACHE:
            raise AuditTargetError("--positions and --reader apply to --compact or --press; neither was given")
        cert = certify(load_model(args.model))
    print(cert.table(verbose=args.verbose))
    if args.json:
        print(f"certificate: {cert.write_json(args.json)}")
    return 0 if cert.passed else 1


def _mismatch(args) -> int:
    results = mismatch_study(load_model(args.model), steps=args.steps)
    print(format_study(results))
    if args.verbose:
        for res in results.values():
            print()
            print(res.table())
    return 0


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _inspect(args) -> int:
    path = Path(args.file)
    if path.is_dir():
        return _inspect_folder(path, args.model)
    # With a model, load_cache checks the tensor digests itself: read the file once.
    found = inspect_file(path, verify=not args.model)
    h = found.header
    size = _size(found.size)
    if h is None:
        print(
            f"{path} ({size}): a safetensors file with no kvlab header: no producer fingerprint, no "
            "digests. load_cache refuses it unless allow_unverified=True."
        )
        return 1
    p = h["producer"] or {}
    layers = h["layers"]
    text = h["text"]
    print(f"{path} ({size}): kvlab cache, format {h['format_version']}")
    # The header's strings are the file's: printed with !r or show() where a terminal may not take them.
    if p:
        print(
            f"  made by    {_printable(h['model_name'])}: {_printable(p.get('source'))}, "
            f"{_printable(p.get('architecture'))}, {_printable(p.get('dtype'))}, "
            f"quantization {_printable(p.get('quantization'))}"
        )
        print(f"  weights    {_printable(p.get('weights_sha256'))}")
    else:
        print(
            f"  made by    {_printable(h['model_name'])} (no producer fingerprint: load_cache needs allow_unverified=True)"
        )
    print(
        f"  tokens     {h['length']} at positions {h['start']}..{h['start'] + h['length'] - 1}"
        + ("" if h["token_ids"] is not None else " (token ids not stored)")
    )
    print(
        f"  layers     {len(layers)}: {show([L['type'] for L in layers])}; layer 0 keys {layers[0]['keys']}, {h['dtype']}"
    )
    if text is not None:
        print(f"  text       {text[:70]!r}{' ...' if len(text) > 70 else ''}")
    if args.model:
        model = load_into(path, args.model)  # a mismatch raises FingerprintMismatch, printed by main with every field
    print(f"  tensors    all {2 * len(layers)} match their {h['tensor_digest']} digests")
    if args.model:
        print(f"  loads into {model.name}: yes, every strict fingerprint field matches")
    if found.leftovers:
        print(
            f"  left over  {len(found.leftovers)} temporary file(s) of a save that died: "
            f"{', '.join(f'{_printable(t.path.name)} ({_size(t.size)})' for t in found.leftovers)}; "
            "the next save into this folder removes them"
        )
    return 0


def _folder_holds(t) -> str:
    """What a private temporary folder of a save holds, the library's own temporary named as such."""
    if t.inside is None:
        return ""
    parts = [
        f"{_printable(e.name)} ({_size(e.size)}"
        + (", the safetensors library's temporary)" if e.library_temporary else ")")
        for e in t.inside
    ]
    return f"; its folder holds {', '.join(parts)}" if parts else "; its folder is empty"


def _printable(x) -> str:
    """A header string as a terminal can show it: as is when it encodes, else escaped."""
    s = str(x)
    try:
        s.encode(sys.stdout.encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return ascii(s)
    return s if s.isprintable() else ascii(s)


def _inspect_folder(folder, model_name: str | None) -> int:
    """List the cache files of a folder, whether each is intact, and the temporaries of saves that died."""
    found = inspect_folder(folder, model_name)
    model = found.model
    rows = []
    for f in found.files:
        if f.error is not None:
            what = f"{type(f.error).__name__}: {_printable(f.why[:300])}"
        elif f.header is None:
            what = "safetensors, no kvlab header: load_cache needs allow_unverified=True"
        else:
            h = f.header
            made = f"{_printable(h['model_name'])}, {h['length']} tokens at {h['start']}, {len(h['layers'])} layers, {h['dtype']}"
            what = f"{made}: " + (f"intact, loads into {model.name}" if model else "intact")
        rows.append((f, what))
    stale, strays = found.stale, found.strays
    print(
        f"{folder}: {found.intact} intact cache file(s), {len(found.files) - found.intact} with a problem, "
        f"{len(stale)} temporary file(s) left by saves that died"
        + (f", {len(strays)} begun by the safetensors library for a kvlab save" if strays else "")
        + (f", {found.others} other file(s)" if found.others else "")
    )
    width = max((len(f.path.name) for f, _ in rows), default=0)
    for f, what in rows:
        print(f"  {_printable(f.path.name):<{width}}  {_size(f.size):>9}  {what}")

    def when(t) -> str:
        if t.mtime is None:  # removed meanwhile
            return "(gone)"
        return datetime.datetime.fromtimestamp(t.mtime).strftime("%Y-%m-%d %H:%M")

    if stale:
        print("  left by saves that died (the next save into this folder removes them; or delete them):")
    for t in stale:
        target, pid = t.writer
        name = _printable(t.path.name) + ("/" if t.is_folder else "")
        print(
            f"    {name}  {_size(t.size)}  {when(t)}: a save of {_printable(target)} by process {pid}, "
            f"now gone{_folder_holds(t)}"
        )
    if strays:
        print(
            "  begun by the safetensors library for a kvlab save and never renamed: an earlier kvlab let the library "
            "write beside the cache file (kvlab never deletes these: their names do not say whether the save still "
            "runs; delete them when none does):"
        )
    for t in strays:
        print(f"    {_printable(t.path.name)}  {_size(t.size)}  {when(t)}")
    if found.lookalikes:
        # An earlier kvlab's save killed before the library wrote its header leaves such a file
        # too, but so may any program built on the same crate: listed, not counted.
        shown = ", ".join(f"{_printable(t.path.name)} ({_size(t.size)})" for t in found.lookalikes)
        print(f"  named as the safetensors library names its temporaries, but with no kvlab header: {shown}")
    return 0 if found.clean else 1


def _peers(args) -> int:
    if args.prepare is not None:
        for name, files in prepare_peers(args.prepare or None).items():
            print(f"{name}: " + "; ".join(f"{kind} {path}" for kind, path in files.items()))
        return 0
    torch.manual_seed(0)
    model = load_model(args.model)
    print(summary.peer_table(model))
    if args.quantised:
        # Opt-in: 2 x 512 tokens with f16, q8_0 and q4_0 K caches takes about 2 minutes on
        # SmolLM2 on 2 cores (3 prefills of 1024 tokens per type), more than the tables above.
        print(f"\nK-shift on a quantised K cache (V f16): next-token KL (nats), two fragments of {args.lengths} tokens")
        print(kshift.format_quantised(kshift.quantised_shift_table(model, lengths=args.lengths)))
    return 0


def _report(args) -> int:
    from kvlab.lab.report import run_report  # noqa: PLC0415 - it imports the lab extra: `kvlab report` only

    params = {name: value for name, value in (args.param or [])}
    report = run_report(
        Path(args.out),
        only=args.only,
        params=params,
        model=args.model,
        progress=not args.no_progress,
        no_input=args.no_input,
        jobs=args.jobs,
    )
    print(f"report: {report.index}")
    for r in report.failed:
        print(f"kvlab report: {r.name} failed: {r.error}", file=sys.stderr)
    return 1 if report.failed else 0


def _sweep(args) -> int:
    from kvlab.sweep.run import plan, run_study  # noqa: PLC0415 - runs on the lab extra (Dask): `kvlab sweep` only

    study = load_study(args.study, output=args.out, timeout=args.timeout)
    if args.dry_run:
        todo, done = plan(study, study.output, args.force)
        runs = {t["point"] for t in todo}
        print(
            f"{study.path.name}: {study.notebook.name}, {len(study.points)} points ({len(todo)} to run, "
            f"{len(done)} done), output {study.output}"
        )
        for p in study.points:
            shown = ", ".join(f"{k}={json.dumps(v)[:40]}" for k, v in p.varied.items())
            print(f"  {'run ' if p.folder_name in runs else 'done'}  {p.folder_name:<40} {shown}")
        return 0
    result = run_study(study, scheduler=args.scheduler, workers=args.workers, force=args.force)
    failed = result.failed
    print(
        f"sweep {study.path.name}: {len(result.records)} points, {result.ran} run, {result.skipped} already done, "
        f"{len(failed)} failed; table {result.out / 'results.csv'}, summary {result.out / 'index.html'}"
    )
    for r in failed:
        print(f"  failed {r['point']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


MODEL_HELP = "a kvlab model name (kvlab models), a Hugging Face model folder or a .gguf file"


class _Version(argparse.Action):
    """``--version``: print kvlab's installed version and exit (read only when asked: it costs a metadata read)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        version = package_versions("kvlab")["kvlab"]
        if version is None:
            parser.exit(1, "kvlab: not installed, so it has no version (pip install -e .)\n")
        print(f"kvlab {version}")
        parser.exit()


#: ``--engine-merge`` with no target: llama.cpp's own cache reuse.
LLAMA_CPP = "llama.cpp"


def parser() -> argparse.ArgumentParser:
    """The ``kvlab`` argument parser, every subcommand with its options."""
    parser = argparse.ArgumentParser(prog="kvlab", description="Is a merged or reloaded KV cache still right?")
    parser.add_argument("--version", action=_Version, help="print kvlab's version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("models", help="list the models kvlab can load, or prepare (convert) them ahead of time")
    p.add_argument(
        "--prepare",
        nargs="*",
        metavar="NAME",
        help="convert these real models now (default: every installed one), with a progress bar on a terminal",
    )
    p.set_defaults(func=_models)
    p = sub.add_parser("check", help="every merge strategy against both references, as a table")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=_check)
    p = sub.add_parser(
        "certify",
        help="check a model's rotation, exact strategies, sliding windows, refusals, cache files and noise floor",
        description="Every line states its measured value beside its bound. Exit status 0: certified (no line failed "
        "or was refused); 1: not certified; 2: the model cannot be loaded, or a --merge/--shift/--store target cannot "
        "be imported or breaks its contract.",
    )
    p.add_argument("model", help=MODEL_HELP)
    p.add_argument("--json", metavar="FILE", help="also write the certificate as JSON (atomically)")
    p.add_argument("--verbose", action="store_true", help="print every line's detail, not only a failing one's")
    audit = p.add_argument_group(
        "audit a store's own code on this model instead (docs/audit.md); MODULE is imported as `python -m` would, "
        "the current folder first"
    )
    audit.add_argument("--merge", metavar="MODULE:FUNCTION", help="a merge: FUNCTION(caches[, model]) -> DynamicCache")
    audit.add_argument(
        "--shift",
        metavar="MODULE:FUNCTION",
        help="a shift: FUNCTION(cache, delta[, model]), in place or returning a cache",
    )
    audit.add_argument(
        "--store",
        metavar="MODULE:OBJECT",
        help="a store: OBJECT.save(cache, path[, model]), OBJECT.load(path[, model])",
    )
    audit.add_argument(
        "--compact",
        metavar="MODULE:FUNCTION",
        help="a compaction: FUNCTION(cache, keep[, model]) -> DynamicCache holding, per layer and head, the tokens "
        "keep names (needs --positions)",
    )
    audit.add_argument(
        "--press",
        metavar="MODULE:FUNCTION",
        help="a press: FUNCTION(model, input_ids) -> the DynamicCache kept after prefilling and compressing "
        "(needs --positions)",
    )
    audit.add_argument(
        "--positions",
        choices=POSITIONS,
        help="where a compaction's or press's kept keys sit: kept (re-rotated to the kept slots, next token at "
        "kept) or original (their own phase, next token at the original length)",
    )
    audit.add_argument(
        "--reader",
        choices=READERS,
        default=CACHE,
        help="how the store's reader places the next token after a compaction or press: cache (default: from "
        "get_seq_length(), as generate does) or explicit (it passes position_ids itself, as kvpress's pipeline does)",
    )
    audit.add_argument(
        "--engine-merge",
        metavar="MODULE:FUNCTION",
        nargs="?",
        const=LLAMA_CPP,
        help="a merge inside llama.cpp: FUNCTION(engine, fragments) leaves the merge in sequence 0; alone, "
        "llama.cpp's own cache reuse (needs the peers extra and a model with a GGUF file)",
    )
    p.set_defaults(func=_certify)
    p = sub.add_parser(
        "inspect",
        help="who made a cache file, and is it intact (optionally: does it fit a model); for a folder, every cache "
        "file in it and the temporaries of saves that died",
        description="Exit status 0: intact (for a folder: every cache file intact, nothing left over); 1: no kvlab "
        "header (for a folder: a file with a problem, or temporaries left by saves that died); 2: refused.",
    )
    p.add_argument("file", help="a cache file, or a folder of them")
    p.add_argument(
        "--model", default=None, help="also load it into this model, refusing any fingerprint mismatch; " + MODEL_HELP
    )
    p.set_defaults(func=_inspect)
    p = sub.add_parser("mismatch", help="KL and top-1 flips when each same-shape variant reads the model's cache")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--steps", type=int, default=FINETUNE_DEFAULTS["steps"], help="fine-tune steps")
    p.add_argument("--verbose", action="store_true", help="also print every probe's top-1 tokens")
    p.set_defaults(func=_mismatch)
    p = sub.add_parser("peers", help="kvlab beside llama.cpp on the same GGUF (needs the `peers` extra)")
    p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP + "; a model with a GGUF file")
    p.add_argument(
        "--quantised",
        action="store_true",
        help="also llama.cpp's K-shift with f16, q8_0 and q4_0 K caches against its own references (minutes)",
    )
    p.add_argument(
        "--lengths", nargs="+", type=int, default=[512], metavar="N", help="tokens per fragment for --quantised"
    )
    p.add_argument(
        "--prepare",
        nargs="*",
        metavar="NAME",
        default=None,
        help="make the requantised copies (Q4_0, F32) llama.cpp's side runs, and convert the Q4_0 one, for these "
        "real models (default: every installed one), then exit",
    )
    p.set_defaults(func=_peers)
    p = sub.add_parser("report", help="execute the notebooks with papermill into an HTML report")
    p.add_argument(
        "--model", default=None, help="model for every notebook (default: each notebook's own); " + MODEL_HELP
    )
    p.add_argument("--out", default="reports")
    p.add_argument("--only", nargs="+", metavar="NB", help="notebook names, e.g. 01_phase_error")
    p.add_argument("-p", "--param", nargs=2, action="append", metavar=("NAME", "VALUE"), help="a notebook parameter")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-input", action="store_true", help="HTML without code: markdown, outputs and figures only")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        metavar="N",
        help="notebooks run at once, each kernel on CPUs/N torch threads (default: one per CPU core)",
    )
    p.set_defaults(func=_report)
    p = sub.add_parser("sweep", help="run a notebook over a parameter grid (a STUDY.toml) on Dask")
    p.add_argument("study", help="study file (TOML): notebook, [grid], [zip], seeds, repeats, output, timeout")
    p.add_argument(
        "--scheduler",
        default=None,
        metavar="ADDR",
        help="an existing Dask scheduler (tcp://host:port or a scheduler JSON file); default: a local cluster",
    )
    p.add_argument("--workers", type=int, default=None, help="local worker processes (default: from cores and memory)")
    p.add_argument("--force", action="store_true", help="rerun points that already have a current record")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="seconds per point (overrides the study's)")
    p.add_argument("--dry-run", action="store_true", help="list the grid and what would run; run nothing")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (overrides the study's)")
    p.set_defaults(func=_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run parsed arguments; a refusal (a :class:`kvlab.KvlabError`) is printed and exits 2."""
    try:
        return args.func(args)
    except KvlabError as e:
        print(f"kvlab: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
