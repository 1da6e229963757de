"""A writer stopped midway (killed with -9, a full disk) leaves a miss, never a wrong entry, and its
leftovers are reclaimed: at once, by the next writer, or by ``verify --fix``.

Stand-in artifacts instead of real compiles; mocks only inject the faults (ENOSPC).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap

from aotbuild.builder import build as builder
from aotbuild.builder.build import ResultStatus
from aotbuild.cache.manage import verify
from aotbuild.cache.store import Store
from tests.conftest import REPO, TINY_RECIPE, invoke_cli
from tests.standins import add_entry, check_no_dangling

# -- 1, 15: a killed writer, then verify / verify --fix --------------------------------------------

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from aotbuild.cache.locks import store_lock
    from aotbuild.cache.store import Store
    from tests import manifests

    class Slow:  # a blob that takes its time to arrive, so the writer dies midway through it
        def __init__(self):
            self.left = 50
        def read(self, n):
            self.left -= 1
            if self.left == 45:
                print("writing", flush=True)
            time.sleep(0.1)
            return b"x" * 1000 if self.left > 0 else b""

    store = Store(Path(sys.argv[1]))
    with store_lock(store.root, exclusive=False):
        store.put_blob(Path(sys.argv[2]))          # a first blob, whole
        store.put_blob(Slow())                      # killed while this one is written
        store.put_manifest(manifests.manifest(manifests.factors("killed")))
""")


def test_a_killed_writer_leaves_a_miss_and_verify_fix_reclaims_its_leftovers(tmp_path):
    root = tmp_path / "c"
    first = tmp_path / "first"
    first.write_bytes(b"kernel")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(root), str(first)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    store = Store(root)
    assert store.open_entry("ab" * 32) == (None, "not built")  # the entry is a miss
    found = invoke_cli("verify", "--json", "--cache", str(root))
    assert found.returncode == 1
    kinds = sorted(p["kind"] for p in json.loads(found.stdout)["problems"])
    assert kinds == ["orphan", "temp"]  # the whole first blob, and the half-written temp file
    fixed = invoke_cli("verify", "--fix", "--cache", str(root))
    assert fixed.returncode == 0 and "2 problem(s) fixed" in fixed.stdout
    assert invoke_cli("verify", "--cache", str(root)).returncode == 0
    assert not list(store.blob_files()) and not list(store.layout.tmp.iterdir())


# -- 11: no space left -----------------------------------------------------------------------------

def test_no_space_left_cleans_up_and_the_build_continues_uncached(cache, fake_compiles, monkeypatch):
    import aotbuild.cache.store

    real_fsync = os.fsync
    state = {"fail": True}

    def fsync(fd):
        if state["fail"]:
            state["fail"] = False  # the disk is full once, for the first job's first blob
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(aotbuild.cache.store.os, "fsync", fsync)
    report = builder.build([str(TINY_RECIPE)], cache)
    statuses = [r.status for r in report.results]
    # the build went on
    assert sorted(statuses) == [ResultStatus.BUILT, ResultStatus.UNCACHED] and len(fake_compiles) == 2
    uncached = next(r for r in report.results if r.status == ResultStatus.UNCACHED)
    assert "No space left on device" in uncached.reason and "not stored" in uncached.reason
    store = Store(cache)
    assert not store.layout.manifest(uncached.job.key).is_file() and not list(store.layout.tmp.iterdir())
    check_no_dangling(store)


def test_no_space_left_after_some_blobs_leaves_no_orphan(cache, fake_compiles, monkeypatch):
    """The disk fills after the entry's first blob: that blob is removed at once (journal.py), so
    verify finds nothing to fix."""
    real_put = Store.put_blob
    calls = []

    def put_blob(self, source, expect=None, **bounds):
        calls.append(expect)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(self, source, expect, **bounds)

    monkeypatch.setattr(Store, "put_blob", put_blob)
    report = builder.build([str(TINY_RECIPE)], cache)
    assert sorted(r.status for r in report.results) == [ResultStatus.BUILT, ResultStatus.UNCACHED]
    store = Store(cache)
    assert verify(store) == []  # no orphan blob, no journal, no temp file: without --fix
    assert not list(store.layout.tmp.iterdir())


# -- a journaled writer killed before its manifest -------------------------------------------------

KILLED_JOURNALED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from aotbuild.cache.journal import entry_writer
    from aotbuild.cache.locks import store_lock
    from aotbuild.cache.store import Store

    store = Store(Path(sys.argv[1]))
    with entry_writer(store) as w, store_lock(store.root, exclusive=False):
        w.put_blob(Path(sys.argv[2]))
        print("one blob written", flush=True)
        time.sleep(600)  # killed here, before its manifest
""")


def test_a_writer_killed_with_9_is_reclaimed_by_the_next_writer(tmp_path):
    root = tmp_path / "c"
    first = tmp_path / "first"
    first.write_bytes(b"orphan-to-be")
    proc = subprocess.Popen([sys.executable, "-c", KILLED_JOURNALED, str(root), str(first)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None and proc.stdout.readline().strip() == "one blob written"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    store = Store(root)
    assert sorted(p.kind for p in verify(store)) == ["orphan", "temp"]  # its blob, its dead journal
    add_entry(store, tmp_path, "next", {"x.so": b"the next writer"})  # any writer reclaims first
    assert verify(store) == []  # without --fix
    report = json.loads(invoke_cli("verify", "--json", "--cache", str(root)).stdout)
    assert report["problems"] == [] and report["notes"][-1]["reclaimed_blobs"] == [
        hashlib.sha256(b"orphan-to-be").hexdigest()]
