"""Nothing lost, nothing wrong ever loaded: faults, races, locks, size limits, verify/gc/rm.

Stand-in artifacts (small real files) instead of real compiles: the builder's plan, verification,
store, locks and gc run for real; only the compile is replaced (``fake_compiles``), and mocks are
used only to inject faults (ENOSPC, an error halfway through gc).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from aotbuild import builder
from aotbuild.builder import BUILT, CACHED, FAILED, UNCACHED, store_job
from aotbuild.errors import StoreError
from aotbuild.manage import gc, rm, verify
from aotbuild.store import Store
from tests import manifests
from tests.conftest import REPO, TINY_RECIPE, run_cli
from tests.test_remote import add_entry

ARTIFACT_SIZE = 3000


def artifacts(folder: Path, key: str, n: int = 3) -> list[tuple[str, Path]]:
    """A job's stand-in output: n files whose bytes depend only on the key (builds are reproducible)."""
    out = []
    for i in range(n):
        path = folder / key[:12] / f"inductor/{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = hashlib.sha256(f"{key}:{i}".encode()).digest()
        path.write_bytes(seed * (ARTIFACT_SIZE // len(seed)))
        out.append((f"inductor/{i}.bin", path))
    return out


@pytest.fixture
def fake_compiles(monkeypatch, tmp_path):
    """builder.build with the compile replaced by stand-in artifacts; returns the list of keys compiled."""
    compiled: list[str] = []

    def fake_build_one(store, job, tick=None, limit=None):
        compiled.append(job.key)
        return store_job(store, job, artifacts(tmp_path / "out", job.key), {"signatures": []}, 0.1, limit)

    monkeypatch.setattr(builder, "_build_one", fake_build_one)
    return compiled


@pytest.fixture
def cache(models_dir, tmp_path) -> Path:
    root = tmp_path / "cache"
    shutil.copytree(models_dir / "models", root / "models")
    return root


def check_no_dangling(store: Store) -> None:
    """The invariant: every manifest on disk names blobs that exist."""
    for m in store.iter_manifests():
        for item in m.files:
            assert store.layout.blob(item.sha256).is_file(), f"{m.key[:12]} points at a missing blob"


# -- 2, 3: damaged blobs are never a hit and the next build rebuilds them ---------------------------

@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_blob_is_a_miss_and_the_next_build_rebuilds_it(cache, fake_compiles, damage):
    first = builder.build([str(TINY_RECIPE)], cache)
    assert {r.status for r in first.results} == {BUILT}
    store = Store(cache)
    key = first.results[0].job.key
    blob = store.layout.blob(store.read_manifest(key).files[0].sha256)
    blob.chmod(0o644)
    data = blob.read_bytes()
    blob.write_bytes({"flip": bytes([data[0] ^ 1]) + data[1:], "truncate": data[:-1], "empty": b""}[damage])
    entry, why = store.open_entry(key)
    assert entry is None and ("corrupt" in why or "bytes, expected" in why)  # never loaded

    fake_compiles.clear()
    second = builder.build([str(TINY_RECIPE)], cache)
    status = {r.job.key: r.status for r in second.results}
    assert status[key] == BUILT and fake_compiles == [key]  # only the damaged one is rebuilt
    assert all(s == CACHED for k, s in status.items() if k != key)
    assert store.open_entry(key)[0] is not None


# -- 4: content that does not match its name ------------------------------------------------------

def test_a_blob_is_refused_when_its_content_does_not_match_the_expected_name(tmp_path):
    store = Store(tmp_path / "c")
    src = tmp_path / "x"
    src.write_bytes(b"payload")
    with pytest.raises(StoreError, match="does not match its content"):
        store.put_blob(src, expect="0" * 64)
    assert not list(store.blob_files()) and not list(store.layout.tmp.iterdir())


# -- 1, 15: a killed writer, then verify / verify --fix --------------------------------------------

WRITER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from aotbuild.locks import store_lock
    from aotbuild.store import Store
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
    found = run_cli("verify", "--json", "--cache", str(root))
    assert found.returncode == 1
    kinds = sorted(p["kind"] for p in json.loads(found.stdout)["problems"])
    assert kinds == ["orphan", "temp"]  # the whole first blob, and the half-written temp file
    fixed = run_cli("verify", "--fix", "--cache", str(root))
    assert fixed.returncode == 0 and "2 problem(s) fixed" in fixed.stdout
    assert run_cli("verify", "--cache", str(root)).returncode == 0
    assert not list(store.blob_files()) and not list(store.layout.tmp.iterdir())


def test_verify_lists_a_corrupt_blob_and_fix_repairs(tmp_path):
    store = Store(tmp_path / "c")
    a = add_entry(store, tmp_path, "a", {"x.so": b"kernel-a", "shared.py": b"both"})
    b = add_entry(store, tmp_path, "b", {"y.so": b"kernel-b", "shared.py": b"both"})
    blob = store.layout.blob(hashlib.sha256(b"kernel-a").hexdigest())
    blob.chmod(0o644)
    blob.write_bytes(b"kernel-A")
    found = run_cli("verify", "--cache", str(store.root))
    assert found.returncode == 1
    assert "corrupt" in found.stdout and "hash mismatch" in found.stdout and a[:12] in found.stdout
    assert "aotbuild verify --fix" in found.stdout  # the next step
    assert run_cli("verify", "--fix", "--cache", str(store.root)).returncode == 0  # everything it found is fixed
    assert run_cli("verify", "--cache", str(store.root)).returncode == 0
    assert not store.has(a) and store.open_entry(b)[0] is not None  # b keeps the blob they shared
    check_no_dangling(store)


def test_verify_leaves_a_running_builds_staging_folder_alone(tmp_path):
    from aotbuild.locks import flocked

    store = Store(tmp_path / "c")
    staging = store.layout.tmp / "job-0123456789ab.x"
    staging.mkdir(parents=True)
    with flocked(staging / ".lock", exclusive=True, timeout=0):
        assert verify(store) == []
    assert [p.kind for p in verify(store)] == ["temp"]  # its build is gone: a leftover


# -- 5: two builders at once ----------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_building_one_recipe_at_once(tmp_path):
    """The real builder and worker, twice at once on one cache, with the stand-in neuron backend."""
    from tests.test_targets import FAKES

    recipe = tmp_path / "tiny_neuron.yaml"
    recipe.write_text("model: {id: builtin:tiny-sd, dtype: float32}\ntarget: neuron\ndevice: cpu\n"
                      "compile: {components: [unet]}\nshapes: [{height: 64, width: 64}, {height: 32, width: 32}]\n"
                      "warmup: {guidance_scale: 0.0}\n")
    root = tmp_path / "cache"
    assert run_cli("plan", "--cache", str(root), str(recipe), env=FAKES).returncode == 0  # creates the model once
    cmd = [sys.executable, "-m", "aotbuild.cli", "build", "--json", "--cache", str(root), str(recipe)]
    env = {**os.environ, **FAKES}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    store = Store(root)
    manifests = list(store.iter_manifests())
    assert len(manifests) == 2 and len({m.key for m in manifests}) == 2  # one entry per key
    assert verify(store) == []  # identical bytes: every blob hashes to its name, nothing left over
    reports = [json.loads(out) for out, _ in outs]
    for report in reports:
        assert {j["status"] for j in report["jobs"]} <= {"built", "cached"}
    # Each job compiled once: the second builder of a job waited for the first (per-key lock).
    built = sorted(j["key"] for r in reports for j in r["jobs"] if j["status"] == "built")
    assert built == sorted({m.key for m in manifests})


# -- 6: readers never see a partial manifest -------------------------------------------------------

def test_readers_never_see_a_partial_manifest_while_writers_and_gc_replace_it(tmp_path):
    store = Store(tmp_path / "c")
    key = add_entry(store, tmp_path, "a", {"x.so": b"kernel"})
    manifest = store.read_manifest(key)
    stop = threading.Event()
    errors: list[str] = []

    def writer():
        i = 0
        while not stop.is_set():
            store.put_manifest(replace(manifest, build={"padding": "p" * (i % 5000), "n": i}))
            i += 1

    def collector():
        while not stop.is_set():
            store.remove_manifest(key)

    threads = [threading.Thread(target=writer), threading.Thread(target=collector)]
    for t in threads:
        t.start()
    try:
        for _ in range(3000):
            path = store.layout.manifest(key)
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                data = json.loads(text)
            except ValueError:
                errors.append(text[:80])
                continue
            if data.get("key") != key or data["files"] != [f.as_json() for f in manifest.files]:
                errors.append("wrong content")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []


# -- 7: a lock held by another process -------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from aotbuild.locks import store_lock
    with store_lock(Path(sys.argv[1]), exclusive=sys.argv[2] == "x"):
        print("held", flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("held", ["x", "s"])
def test_a_held_lock_gives_a_clear_timeout_naming_it(tmp_path, monkeypatch, held):
    store = Store(tmp_path / "c")
    add_entry(store, tmp_path, "a", {"x.so": b"kernel"})
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(store.root), held], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        out = run_cli("gc", "--max-size", "1", "--cache", str(store.root), env={"AOTBUILD_LOCK_TIMEOUT": "0.5"})
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert f"timed out after 0.5 s waiting for the lock {store.root / 'locks' / 'store.lock'}" in out.stderr
        if held == "x":  # a writer facing gc: the job is compiled but not stored, and says why
            from aotbuild.planner import plan

            job = plan([str(TINY_RECIPE)], store.root)[0]
            monkeypatch.setenv("AOTBUILD_LOCK_TIMEOUT", "0.5")
            result = store_job(store, job, artifacts(tmp_path, job.key), {"signatures": []}, 1.0)
            assert result.status == UNCACHED and "timed out" in result.reason
    finally:
        proc.kill()
        proc.wait()


# -- 8, 9, 10: the size limit ----------------------------------------------------------------------

def _entries_with_ages(store: Store, tmp_path: Path, n: int) -> list[str]:
    keys = []
    for i in range(n):
        key = add_entry(store, tmp_path, f"e{i}", {"x.so": os.urandom(1000)})
        os.utime(store.layout.manifest(key), (1_000_000 + i, 1_000_000 + i))  # e0 oldest
        keys.append(key)
    return keys


def test_gc_to_a_size_limit_keeps_recently_used_entries(tmp_path):
    store = Store(tmp_path / "c")
    keys = _entries_with_ages(store, tmp_path, 6)
    store.touch(keys[0])  # the oldest was just loaded
    dry = gc(store, max_size=3500, dry_run=True)
    assert {k for k, _, _ in dry.removed} == set(keys[1:4]) and len(list(store.iter_manifests())) == 6
    report = gc(store, max_size=3500)
    assert report.size_after <= 3500
    assert {m.key for m in store.iter_manifests()} == {keys[0], keys[4], keys[5]}
    assert all(why == "least recently used" for _, why, _ in report.removed)
    check_no_dangling(store)


def test_a_build_past_the_limit_collects_old_entries_and_keeps_its_own(cache, fake_compiles, tmp_path):
    store = Store(cache)
    old = _entries_with_ages(store, tmp_path, 4)
    report = builder.build([str(TINY_RECIPE)], cache, max_size=3 * ARTIFACT_SIZE * 2 + 1500)
    built = [r.job.key for r in report.results if r.status == BUILT]
    assert len(built) == 2 and report.gc is not None
    left = {m.key for m in store.iter_manifests()}
    assert set(built) <= left and len(left & set(old)) == 1 and old[3] in left  # the newest old one stays


@pytest.mark.parametrize("fail_at", [1, 3, 5])
def test_an_error_halfway_through_gc_leaves_no_manifest_pointing_at_nothing(tmp_path, monkeypatch, fail_at):
    store = Store(tmp_path / "c")
    _entries_with_ages(store, tmp_path, 6)
    real_unlink = os.unlink
    real_path_unlink = Path.unlink
    calls = []

    def flaky(*args, **kwargs):
        calls.append(args)
        if len(calls) == fail_at:
            raise OSError(errno.EIO, "injected I/O error")
        return real_unlink(*args, **kwargs)

    def flaky_path(self, missing_ok=False):
        flaky(self)
        return None if not self.exists() and missing_ok else real_path_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(os, "unlink", flaky)
    monkeypatch.setattr(Path, "unlink", flaky_path)
    with pytest.raises(OSError, match="injected"):
        gc(store, max_size=1000)
    monkeypatch.undo()
    check_no_dangling(store)
    gc(store, max_size=1000)  # and a second run finishes the job
    check_no_dangling(store)


def test_an_entry_bigger_than_the_limit_is_a_clear_error_and_nothing_is_stored(cache, tmp_path):
    from aotbuild.planner import plan

    store = Store(cache)
    job = plan([str(TINY_RECIPE)], cache)[0]
    result = store_job(store, job, artifacts(tmp_path, job.key), {"signatures": []}, 1.0, limit=5000)
    assert result.status == FAILED and "bigger than the cache's size limit" in result.reason
    assert not store.has(job.key) and not list(store.blob_files())


# -- 11: no space left -----------------------------------------------------------------------------

def test_no_space_left_cleans_up_and_the_build_continues_uncached(cache, fake_compiles, monkeypatch):
    import aotbuild.store

    real_fsync = os.fsync
    state = {"fail": True}

    def fsync(fd):
        if state["fail"]:
            state["fail"] = False  # the disk is full once, for the first job's first blob
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(aotbuild.store.os, "fsync", fsync)
    report = builder.build([str(TINY_RECIPE)], cache)
    statuses = [r.status for r in report.results]
    assert sorted(statuses) == [BUILT, UNCACHED] and len(fake_compiles) == 2  # the build went on
    uncached = next(r for r in report.results if r.status == UNCACHED)
    assert "No space left on device" in uncached.reason and "not stored" in uncached.reason
    store = Store(cache)
    assert not store.has(uncached.job.key) and not list(store.layout.tmp.iterdir())
    check_no_dangling(store)


def test_no_space_left_after_some_blobs_leaves_no_orphan(cache, fake_compiles, monkeypatch):
    """The disk fills after the entry's first blob: that blob is removed at once (journal.py), so
    verify finds nothing to fix."""
    real_put = Store.put_blob
    calls = []

    def put_blob(self, source, expect=None):
        calls.append(expect)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_put(self, source, expect)

    monkeypatch.setattr(Store, "put_blob", put_blob)
    report = builder.build([str(TINY_RECIPE)], cache)
    assert sorted(r.status for r in report.results) == [BUILT, UNCACHED]
    store = Store(cache)
    assert verify(store) == []  # no orphan blob, no journal, no temp file: without --fix
    assert not list(store.layout.tmp.iterdir())


KILLED_JOURNALED = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from aotbuild.journal import entry_writer
    from aotbuild.locks import store_lock
    from aotbuild.store import Store

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
    report = json.loads(run_cli("verify", "--json", "--cache", str(root)).stdout)
    assert report["problems"] == [] and report["notes"][-1]["reclaimed_blobs"] == [
        hashlib.sha256(b"orphan-to-be").hexdigest()]


def test_a_refused_pull_leaves_no_orphan(tmp_path):
    from aotbuild.remote import parse_remote

    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"a.so": b"good", "b.so": b"bad-to-be"})
    bad = remote_store.layout.blob(remote_store.read_manifest(key).files[1].sha256)
    bad.chmod(0o644)
    bad.write_bytes(b"tampered")
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused")
    assert not local.has(key) and verify(local) == [] and not list(local.blob_files())


# -- rm --------------------------------------------------------------------------------------------

def test_rm_removes_entries_and_only_their_own_blobs(tmp_path):
    store = Store(tmp_path / "c")
    a = add_entry(store, tmp_path, "a", {"x.so": b"only-a", "shared": b"both"})
    b = add_entry(store, tmp_path, "b", {"y.so": b"only-b", "shared": b"both"})
    assert rm(store, [a]) == [(a, len(b"only-a"))]
    assert not store.has(a) and store.open_entry(b)[0] is not None
    out = run_cli("rm", b[:10], "--cache", str(store.root))
    assert out.returncode == 0 and "1 entry removed" in out.stdout
    assert not list(store.blob_files())


# -- 12, 13: what a remote sends is checked before anything is written or deserialised --------------

@pytest.mark.parametrize("path", ["../x", "/etc/x", "a/../../x"])
def test_a_pulled_manifest_with_an_unsafe_path_is_refused(tmp_path, path):
    from aotbuild.remote import parse_remote

    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"x.so": b"kernel"})
    data = remote_store.read_manifest(key).as_json()
    data["files"][0]["path"] = path
    manifests.write_raw(remote_store, key, data)  # the codec would refuse to write it
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused") and "unsafe artifact path" in why, why
    assert not local.has(key) and not (tmp_path / "x").exists()


class _Marker:
    """Unpickling this writes a marker file: what a poisoned cache entry would do."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (Path.write_text, (Path(self.path), "pwned"))


def test_a_tampered_pickle_is_refused_before_anything_deserialises_it(tmp_path):
    import pickle

    from aotbuild.remote import parse_remote

    marker = tmp_path / "marker"
    remote_store = Store(tmp_path / "remote")
    key = add_entry(remote_store, tmp_path, "a", {"fxgraph/entry": pickle.dumps({"graph": "honest"})})
    blob = remote_store.layout.blob(remote_store.read_manifest(key).files[0].sha256)
    blob.chmod(0o644)
    blob.write_bytes(pickle.dumps(_Marker(str(marker))))
    local = Store(tmp_path / "local")
    why = parse_remote(f"file://{remote_store.root}").fetch(key, local)
    assert why.startswith("refused") and "does not match its content" in why
    assert not local.has(key) and not list(local.blob_files())
    assert not marker.exists()


# -- 14: each key factor alone is a miss naming it -------------------------------------------------

@pytest.mark.parametrize("path,value,named", [
    (("env", "torch"), "2.99.0+cpu", "env.torch: 2.99.0+cpu in the cache, 2.13"),
    (("device", "cpu_isa"), "SVE256", "device.cpu_isa: SVE256 in the cache"),
    (("shape", "height"), 128, "shape.height: 128 in the cache"),
    (("compile", "options"), {"cpp.dynamic_threads": False}, "compile.options.cpp.dynamic_threads"),
    (("warmup", "guidance_scale"), 7.5, "warmup.guidance_scale: 7.5 in the cache"),
])
def test_each_key_factor_alone_is_a_miss_naming_it(cache, path, value, named):
    import copy

    from aotbuild.keys import key_of as key_for
    from aotbuild.planner import plan
    job = plan([str(TINY_RECIPE)], cache)[0]
    cached = copy.deepcopy(job.factors)
    cached[path[0]][path[1]] = value
    assert key_for(cached) != job.key
    store = Store(cache)
    store.put_manifest(manifests.manifest(cached, recipe=job.recipe.name))
    why = next(j.reason for j in plan([str(TINY_RECIPE)], cache) if j.key == job.key)  # as `aotbuild plan` says
    assert named in why and why.count(";") == 0  # that factor and only that one


def test_gc_stale_removes_what_can_never_match_this_environment(cache, tmp_path):
    import copy

    from aotbuild.keys import key_of as key_for
    from aotbuild.planner import plan

    store = Store(cache)
    job = plan([str(TINY_RECIPE)], cache)[0]
    variants = {"current": {}, "older torch": {("env", "torch"): "2.5.1+cpu"},
                "other ISA": {("device", "cpu_isa"): "SVE256"}, "old format": {("format",): 0}}
    keys = {}
    for name, changes in variants.items():
        factors = copy.deepcopy(job.factors)
        for path, value in changes.items():
            if len(path) == 1:
                factors[path[0]] = value
            else:
                factors[path[0]][path[1]] = value
        key = key_for(factors)
        src = tmp_path / name
        src.write_bytes(name.encode())
        digest, size = store.put_blob(src)
        data = manifests.manifest(factors, [("x", digest, size)], recipe=job.recipe.name).as_json()
        data["format"] = factors["format"]  # an older aotbuild wrote the old format's manifests
        manifests.write_raw(store, key, data)
        keys[name] = key
    report = gc(store, stale=True)
    reasons = {k: why for k, why, _ in report.removed}
    assert set(reasons) == {keys["older torch"], keys["other ISA"], keys["old format"]}
    assert "env.torch: 2.5.1+cpu in the cache" in reasons[keys["older torch"]]
    assert "device.cpu_isa: SVE256 in the cache" in reasons[keys["other ISA"]]
    assert "format 0" in reasons[keys["old format"]]
    assert [m.key for m in store.iter_manifests()] == [keys["current"]]
    check_no_dangling(store)


def test_manifests_are_readable_by_the_other_users_of_a_shared_store(tmp_path):
    store = Store(tmp_path / "c")
    key = add_entry(store, tmp_path, "a", {"x.so": b"kernel"})
    assert store.layout.manifest(key).stat().st_mode & 0o777 == 0o644
    blob = store.layout.blob(store.read_manifest(key).files[0].sha256)
    assert blob.stat().st_mode & 0o777 == 0o444


def test_gc_and_rm_refuse_to_guess_around_a_manifest_they_cannot_parse(tmp_path):
    store = Store(tmp_path / "c")
    keys = _entries_with_ages(store, tmp_path, 3)
    bad = store.layout.manifest(keys[0])
    bad.write_text("{truncated")
    with pytest.raises(StoreError, match=r"aotbuild verify"):
        gc(store, max_size=0)
    with pytest.raises(StoreError, match=r"aotbuild verify"):
        rm(store, [keys[1]])
    assert len(list(store.blob_files())) == 3  # nothing was deleted
    assert [p.kind for p in verify(store, fix=True)] == ["malformed", "orphan"]
    gc(store, max_size=0)
    assert not list(store.blob_files()) and not list(store.manifest_files())


def test_verify_does_not_report_a_writer_that_is_still_writing(tmp_path):
    store = Store(tmp_path / "c")
    fd, path = store._tempfile()  # what put_blob holds open while it writes
    try:
        assert verify(store) == []
    finally:
        os.close(fd)
    assert [(p.kind, p.path.name) for p in verify(store)] == [("temp", Path(path).name)]


def test_instances_whose_code_differs_do_not_share_a_regional_package():
    from diffusers.models.attention import BasicTransformerBlock

    from aotbuild.strategies.aoti import structure

    a, b, c = (BasicTransformerBlock(8, 2, 4, cross_attention_dim=16) for _ in range(3))
    assert structure(a) == structure(b)  # same shapes, same code: one package serves both
    c.set_chunk_feed_forward(2, 1)  # a plain attribute that changes what forward runs
    assert structure(c) != structure(a)


def test_verify_fix_never_deletes_what_an_unreadable_manifest_names(tmp_path, monkeypatch):
    """Another user's manifest we may not read (faked: this suite runs as root, which reads all)."""
    store = Store(tmp_path / "c")
    mine = add_entry(store, tmp_path, "mine", {"x.so": b"mine"})
    theirs = add_entry(store, tmp_path, "theirs", {"y.so": b"theirs"})
    real = Store.load_manifest

    def load(self, key):
        if key == theirs:
            raise PermissionError(13, "Permission denied")
        return real(self, key)

    monkeypatch.setattr(Store, "load_manifest", load)
    assert [(p.kind, p.key) for p in verify(store, fix=True)] == [("unreadable", theirs)]
    monkeypatch.undo()
    assert store.open_entry(theirs)[0] is not None and store.open_entry(mine)[0] is not None


def test_a_builtin_model_is_shared_readable_and_a_killed_creation_is_reclaimed(tmp_path):
    """mkdtemp made the model folder 0700: another account could not load from a shared store.
    A creation killed midway left models/.tiny-sd-v1.* that nothing reported."""
    import stat

    from aotbuild import builtin
    from aotbuild.locks import flocked

    store = Store(tmp_path / "c")
    models = store.layout.models
    models.mkdir(parents=True)
    dead = models / ".tiny-sd-v1.killed"
    dead.mkdir()
    (dead / builtin.STAGING_LOCK).write_text("")
    (dead / "unet").mkdir()
    alive = models / ".tiny-sd-v1.alive"  # another process creating it right now
    alive.mkdir()
    with flocked(alive / builtin.STAGING_LOCK, exclusive=True, timeout=0):
        problems = verify(store)
        assert [(p.kind, p.path) for p in problems] == [("temp", dead)]
        old = os.umask(0o077)
        try:
            folder = builtin.ensure("builtin:tiny-sd", models)
        finally:
            os.umask(old)
        assert not dead.exists() and alive.exists()  # the dead writer's folder reclaimed, the live one kept
    modes = {p.relative_to(folder).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in (folder, *folder.rglob("*"))}
    assert modes["."] == 0o755 and modes["unet"] == 0o755 and modes["unet/config.json"] == 0o644
    assert not (folder / builtin.STAGING_LOCK).exists()


def test_a_store_written_under_umask_077_is_readable_by_other_users(tmp_path):
    import stat

    old = os.umask(0o077)
    try:
        store = Store(tmp_path / "c")
        key = add_entry(store, tmp_path, "a", {"x.so": b"kernel"})
    finally:
        os.umask(old)
    for path in (store.root / "blobs", store.layout.blob(store.read_manifest(key).files[0].sha256).parent,
                 store.layout.manifest(key).parent, store.layout.locks):
        assert stat.S_IMODE(path.stat().st_mode) == 0o755, path
    assert stat.S_IMODE(store.layout.manifest(key).stat().st_mode) == 0o644
