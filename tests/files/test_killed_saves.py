"""Saves killed at any moment, inside the safetensors library's own write too, leave nothing past the next save.

A child process forks writers that loop ``save_cache`` over eight files in one folder and
SIGKILLs each at a staggered moment, or the moment the library's own temporary file
(``.tmpXXXXXX``, which it writes and renames over the name kvlab gives it) appears. Forking
from one warm process keeps each kill at a few milliseconds instead of a Python start-up.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import kvlab
from kvlab.atomic import stale_temporaries
from kvlab.cache.fragments import new_cache
from kvlab.files.format import stray_library_temporaries, verify_file
from kvlab.files.io import save_cache

TARGETS = [f"k{i}.kvcache" for i in range(8)]
#: Each file is [10, 2, 512, 16] x 3 layers x keys and values in float32: 3.9 MB, so that the
#: library's write lasts long enough for a kill to land in it.
BATCH, TOKENS = 10, 512

KILLER = textwrap.dedent("""
    import json, os, random, signal, sys, time
    from pathlib import Path

    import torch

    torch.set_num_threads(1)  # no thread pool for a forked writer to inherit half made
    import kvlab
    from kvlab.cache.fragments import new_cache
    from kvlab.errors import CacheFileError
    from kvlab.files.format import is_library_temporary, verify_file
    from kvlab.files.io import save_cache

    folder, kills, batch, tokens = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    targets = [folder / name for name in sys.argv[5:]]
    model = kvlab.load_model("tiny-llama")
    g = torch.Generator().manual_seed(39)
    cache = new_cache(model.config)
    for i in range(len(cache.layers)):
        shape = (batch, 2, tokens, 16)
        cache.update(torch.randn(shape, generator=g), torch.randn(shape, generator=g), i)
    kvlab.fingerprint(model)  # memoized here, so that a forked writer only saves

    def library_temps():
        found = []
        for entry in os.scandir(folder):
            if is_library_temporary(entry.name):
                found.append(entry.name)
            elif entry.is_dir(follow_symlinks=False):
                try:
                    found += [f"{entry.name}/{e.name}" for e in os.scandir(entry.path) if is_library_temporary(e.name)]
                except FileNotFoundError:
                    pass
        return found

    t0 = time.perf_counter()
    for t in targets:
        save_cache(t, cache, model)
    per_save = (time.perf_counter() - t0) / len(targets)
    rng = random.Random(39)
    report = {"per_save_s": per_save, "kills": []}
    for n in range(kills):
        watched = n % 2 == 1
        # Staggered: random delays over about one round of eight saves, each writer
        # starting at another file, so kills land in every step of every file's save.
        start = n % len(targets)
        delay = rng.uniform(0, len(targets) * per_save)
        seen_before = set(library_temps())
        pid = os.fork()
        if pid == 0:
            try:
                while True:
                    for t in targets[start:] + targets[:start]:
                        save_cache(t, cache, model)
            finally:
                os._exit(3)
        t1 = time.perf_counter()
        if watched:  # kill the moment the library's own temporary is there
            while time.perf_counter() - t1 < 5 and not set(library_temps()) - seen_before:
                pass
        else:
            time.sleep(delay)
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)  # reaped: a zombie's pid would still count as alive
        broken = []
        for t in targets:
            try:
                verify_file(t)
            except CacheFileError as e:
                broken.append(f"{t.name}: {e}")
        report["kills"].append(
            {
                "pid": pid,
                "watched": watched,
                "after_s": time.perf_counter() - t1,
                "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                "library_temps": sorted(set(library_temps()) - seen_before),
                "broken": broken,
            }
        )
    print(json.dumps(report))
""")


def entries(folder: Path) -> list[str]:
    """Every name in ``folder``, and ``folder/name`` for what its subfolders hold."""
    out = []
    for p in sorted(folder.iterdir()):
        out.append(p.name)
        if p.is_dir() and not p.is_symlink():
            out += [f"{p.name}/{q.name}" for q in sorted(p.iterdir())]
    return out


def test_killed_saves_leave_nothing_after_the_next_save(tmp_path, capsys):
    from kvlab import cli

    kills = 30
    run = subprocess.run(
        [sys.executable, "-c", KILLER, str(tmp_path), str(kills), str(BATCH), str(TOKENS), *TARGETS],
        capture_output=True,
        timeout=120,
        env=dict(os.environ, TOKENIZERS_PARALLELISM="false"),
    )
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    report = json.loads(run.stdout.decode().strip().splitlines()[-1])
    done = report["kills"]
    assert len(done) == kills and all(k["signal"] == 9 for k in done), done
    # No destination is ever broken, whatever the moment of the kill.
    assert [k["broken"] for k in done if k["broken"]] == []
    # Teeth: the library's own temporary (what the issue found left behind) really was there
    # at kills; the watched ones make sure of it, as a random moment seldom falls in its
    # few milliseconds.
    hit = [k for k in done if k["library_temps"]]
    assert len([k for k in hit if k["watched"]]) >= kills // 4, done

    left = [n for n in entries(tmp_path) if n not in TARGETS]
    assert left, "the last kill left nothing: the test proves nothing"
    # kvlab inspect lists every leftover: each top-level entry, and the library's
    # temporary inside a private folder by name.
    assert cli.main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    listed = {p.name for p in stale_temporaries(tmp_path)} | {p.name for p in stray_library_temporaries(tmp_path)}
    assert {n for n in left if "/" not in n} <= listed
    for name in left:
        assert name.rsplit("/", 1)[-1] in out, (name, out)
    with capsys.disabled():  # the figures of this run, for whoever runs it with -s
        print(
            f"\n{kills} kills, {len(hit)} left the library's temporary ({sum(not k['watched'] for k in hit)} "
            f"at a random moment); {report['per_save_s'] * 1e3:.1f} ms a save"
        )

    # The next save into the folder, of one destination, by another process than the dead writers,
    # takes every leftover: a store that saves each cache under a new name never collects them.
    model = kvlab.load_model("tiny-llama")
    cache = new_cache(model.config)
    for i in range(len(cache.layers)):
        cache.update(torch.zeros(1, 2, 4, 16), torch.zeros(1, 2, 4, 16), i)
    save_cache(tmp_path / TARGETS[0], cache, model)
    assert entries(tmp_path) == TARGETS
    assert verify_file(tmp_path / TARGETS[0])["length"] == 4
    for name in TARGETS[1:]:
        verify_file(tmp_path / name)  # each one whole, as the last completed save left it


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_inspect_lists_what_killed_saves_left_with_sizes_and_a_save_removes_only_kvlabs(tmp_path, capsys):
    from kvlab import cli

    model = kvlab.load_model("tiny-llama")
    cache = new_cache(model.config)
    for i in range(len(cache.layers)):
        cache.update(torch.ones(1, 2, 8, 16), torch.ones(1, 2, 8, 16), i)
    path = save_cache(tmp_path / "a.kvcache", cache, model)
    pid = dead_pid()
    private = tmp_path / f".a.kvcache.{pid}.0123abcd.tmp"
    private.mkdir()
    (private / ".tmpAbC123").write_bytes(path.read_bytes()[:5000])  # the library's, killed mid-write
    (private / "a.kvcache").write_bytes(b"")
    older = tmp_path / ".tmpOlD123"  # an earlier kvlab's save, the library writing beside the file
    older.write_bytes(path.read_bytes()[:3000])
    unheaded = tmp_path / ".tmpZeRo12"  # killed before the library wrote a byte: whose, nobody can say
    unheaded.write_bytes(bytes(2000))
    users = tmp_path / ".tmpUsEr12"
    users.write_bytes(b"someone else's")

    assert cli.main(["inspect", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.startswith(
        f"{tmp_path}: 1 intact cache file(s), 0 with a problem, 1 temporary file(s) left by saves that died, "
        "1 begun by the safetensors library for a kvlab save\n"
    )
    assert re.search(
        rf"{re.escape(private.name)}/  5\.0 kB  .*: a save of a\.kvcache by process {pid}, now gone; its folder "
        r"holds \.tmpAbC123 \(5\.0 kB, the safetensors library's temporary\), a\.kvcache \(0\.0 kB\)",
        out,
    ), out
    assert re.search(r"never renamed.*\n    \.tmpOlD123  3\.0 kB  ", out), out
    assert "with no kvlab header: .tmpUsEr12 (0.0 kB), .tmpZeRo12 (2.0 kB)" in out
    assert cli.main(["inspect", str(path)]) == 0
    assert f"left over  1 temporary file(s) of a save that died: {private.name} (5.0 kB)" in capsys.readouterr().out

    save_cache(path, cache, model)  # removes its dead writer's folder, and nothing it cannot vouch for
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmpOlD123", ".tmpUsEr12", ".tmpZeRo12", "a.kvcache"]
    assert users.read_bytes() == b"someone else's" and stale_temporaries(tmp_path) == []
