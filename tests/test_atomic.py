"""kvlab.atomic: a write is seen whole or not at all, and what a dead writer left is cleaned up, never a live one's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvlab import atomic
from kvlab.atomic import (
    atomic_dir,
    atomic_path,
    atomic_write_bytes,
    atomic_write_text,
    default_mode,
    remove_stale,
    stale_temporaries,
    temporary_of,
)


def dead_pid() -> int:
    """The id of a process that has exited (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture()
def sleeper():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child.pid
    child.kill()
    child.wait()


def temp(folder, target: str, pid: int, rand: str = "0123abcd", data: bytes = b"half"):
    p = folder / f".{target}.{pid}.{rand}.tmp"
    p.write_bytes(data)
    return p


def test_a_dead_writers_temporary_is_listed_and_removed_by_the_next_write(tmp_path):
    left = temp(tmp_path, "c.kvcache", dead_pid())
    assert temporary_of(left)[0] == "c.kvcache"
    assert stale_temporaries(tmp_path) == [left] == stale_temporaries(tmp_path, "c.kvcache")
    atomic_write_bytes(tmp_path / "c.kvcache", b"new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvcache"]


def test_a_live_writers_temporary_is_never_removed(tmp_path, sleeper):
    live = temp(tmp_path, "c.kvcache", sleeper)
    assert stale_temporaries(tmp_path) == [] and remove_stale(tmp_path / "c.kvcache") == []
    atomic_write_bytes(tmp_path / "c.kvcache", b"new")
    assert live.read_bytes() == b"half"


def test_pid_one_is_alive_and_its_temporaries_kept(tmp_path):
    # pid 1 always exists; as another user's process it answers PermissionError, which counts as alive.
    kept = temp(tmp_path, "c.kvcache", 1)
    assert remove_stale(tmp_path / "c.kvcache") == [] and kept.exists()


def test_this_process_keeps_its_own_temporary_and_removes_one_that_only_shares_its_pid(tmp_path):
    # A pid is reused (a container's restart gives the same program the same pid): a temporary with
    # this process's id that this process did not make is a dead writer's.
    reused = temp(tmp_path, "c.kvcache", os.getpid(), "feedbeef")
    with atomic_path(tmp_path / "c.kvcache") as mine:
        assert not reused.exists()
        mine.write_bytes(b"in progress")
        assert remove_stale(tmp_path / "c.kvcache") == [] and stale_temporaries(tmp_path) == []
        assert mine.exists()
    assert (tmp_path / "c.kvcache").read_bytes() == b"in progress"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvcache"]


def test_a_write_removes_every_dead_writers_temporary_in_its_folder_and_no_lookalike(tmp_path):
    # A store that saves each cache under a new name: the next save into the folder cleans up.
    pid = dead_pid()
    other = temp(tmp_path, "other.kvcache", pid)
    lookalikes = [tmp_path / n for n in (f".c.kvcache.{pid}.tmp", f".c.kvcache.{pid}.XYZ12345.tmp", "c.kvcache.tmp")]
    for p in lookalikes:
        p.write_bytes(b"not kvlab's")
    live = tmp_path / f".third.kvcache.{os.getppid()}.0123abcd.tmp"  # a write in progress elsewhere
    live.write_bytes(b"in progress")
    atomic_write_text(tmp_path / "c.kvcache", "new")
    assert not other.exists() and all(p.exists() for p in lookalikes) and live.exists()
    assert stale_temporaries(tmp_path) == []


def test_a_dead_writers_temporary_folder_is_removed_and_a_link_only_unlinked(tmp_path):
    pid = dead_pid()
    folder = tmp_path / f".model.{pid}.0123abcd.tmp"
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "w.bin").write_bytes(b"x")
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "precious").write_bytes(b"y")
    link = tmp_path / f".model.{pid}.deadbeef.tmp"
    link.symlink_to(keep, target_is_directory=True)
    assert sorted(remove_stale(tmp_path / "model")) == sorted([folder, link])
    assert not folder.exists() and not link.is_symlink() and (keep / "precious").exists()


def test_mode_is_given_or_the_umask_default(tmp_path):
    p = atomic_write_bytes(tmp_path / "a", b"x", mode=0o640)
    assert p.stat().st_mode & 0o777 == 0o640
    mask = os.umask(0)
    os.umask(mask)
    q = atomic_write_bytes(tmp_path / "b", b"x")
    assert q.stat().st_mode & 0o777 == default_mode() == 0o666 & ~mask


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = atomic_write_bytes(tmp_path / "c", b"old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("boom")
    assert path.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["c"]
    assert atomic._OURS == set()


def test_two_writers_never_share_a_temporary(tmp_path):
    with atomic_path(tmp_path / "c") as a, atomic_path(tmp_path / "c") as b:
        assert a != b and a.exists() and b.exists()
        a.write_bytes(b"a")
        b.write_bytes(b"b")
    assert (tmp_path / "c").read_bytes() == b"a"  # the outer one renamed last


def test_atomic_dir_renames_a_finished_folder(tmp_path):
    stale = tmp_path / f".conv.{dead_pid()}.0123abcd.tmp"
    stale.mkdir()
    with atomic_dir(tmp_path / "conv") as tmp:
        (tmp / "config.json").write_text("{}")
        assert tmp.name.startswith(".conv.") and not stale.exists()
    assert (tmp_path / "conv" / "config.json").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv"]


def test_atomic_dir_keeps_a_folder_another_writer_finished_first(tmp_path):
    with atomic_dir(tmp_path / "conv") as tmp:
        (tmp / "mine").write_text("mine")
        (tmp_path / "conv").mkdir()
        (tmp_path / "conv" / "theirs").write_text("theirs")
    assert sorted(p.name for p in (tmp_path / "conv").iterdir()) == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["conv"]


def test_atomic_dir_removes_its_temporary_on_failure(tmp_path):
    with pytest.raises(ValueError):
        with atomic_dir(tmp_path / "conv") as tmp:
            (tmp / "half").write_text("x")
            raise ValueError
    assert list(tmp_path.iterdir()) == [] and atomic._OURS == set()


def test_a_private_folder_leaves_only_the_target_and_takes_what_a_library_left_in_it(tmp_path):
    with atomic_path(tmp_path / "c.kvcache", private_folder=True) as tmp:
        folder = tmp.parent
        assert folder.parent == tmp_path and tmp.name == "c.kvcache" and tmp.exists()
        assert temporary_of(folder) == ("c.kvcache", os.getpid()) and folder.stat().st_mode & 0o777 == 0o700
        (folder / ".tmpAbC123").write_bytes(b"a library's own temporary")
        tmp.write_bytes(b"new")
        assert stale_temporaries(tmp_path) == []  # this process's own, in progress
    assert (tmp_path / "c.kvcache").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvcache"] and atomic._OURS == set()
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_path(tmp_path / "c.kvcache", private_folder=True) as tmp:
            (tmp.parent / ".tmpDeF456").write_bytes(b"half")
            raise RuntimeError("boom")
    assert (tmp_path / "c.kvcache").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.kvcache"] and atomic._OURS == set()


def test_a_dead_writers_private_folder_goes_with_what_it_holds_and_a_live_ones_stays(tmp_path, sleeper):
    dead = tmp_path / f".c.kvcache.{dead_pid()}.0123abcd.tmp"
    live = tmp_path / f".c.kvcache.{sleeper}.89abcdef.tmp"
    for folder in (dead, live):
        folder.mkdir()
        (folder / ".tmpXyZ789").write_bytes(b"the library's half-written file")
        (folder / "c.kvcache").write_bytes(b"")
    users = tmp_path / ".tmpUsEr12"  # named like the library's, outside any kvlab name: never touched
    users.write_bytes(b"someone else's")
    assert stale_temporaries(tmp_path) == [dead]
    atomic_write_bytes(tmp_path / "c.kvcache", b"new")
    with atomic_path(tmp_path / "c.kvcache", private_folder=True) as tmp:
        tmp.write_bytes(b"newer")
    assert not dead.exists() and (live / ".tmpXyZ789").read_bytes() == b"the library's half-written file"
    assert users.read_bytes() == b"someone else's"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".tmpUsEr12", live.name, "c.kvcache"])


def test_a_private_folder_is_made_exclusively(tmp_path, monkeypatch):
    # Two writers of one process drawing the same name: the second fails and leaves the first's folder alone.
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: "0123abcd")
    with atomic_path(tmp_path / "c", private_folder=True) as first:
        first.write_bytes(b"first")
        with pytest.raises(FileExistsError):
            with atomic_path(tmp_path / "c", private_folder=True):
                pass
        with pytest.raises(FileExistsError):
            with atomic_path(tmp_path / "c"):
                pass
        with pytest.raises(FileExistsError):
            with atomic_dir(tmp_path / "c"):
                pass
        # Still this process's own, in progress: not removed as a dead writer's.
        assert first.read_bytes() == b"first" and remove_stale(tmp_path / "c") == []
    assert (tmp_path / "c").read_bytes() == b"first" and sorted(p.name for p in tmp_path.iterdir()) == ["c"]
