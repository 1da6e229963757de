"""gc (to a size limit, of stale entries) and rm remove what they should and nothing else: never a
blob that a manifest still names, even when they fail halfway; they refuse to guess around a
manifest they cannot parse.

Stand-in entries and artifacts (tests/standins.py); mocks only inject the faults (an error halfway
through gc).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from aotbuild.builder import build as builder
from aotbuild.builder.build import ResultStatus, store_job
from aotbuild.cache.manage import gc, rm, verify
from aotbuild.cache.store import Store
from aotbuild.errors import StoreError
from tests import manifests
from tests.conftest import TINY_RECIPE, run_cli
from tests.standins import ARTIFACT_SIZE, add_entry, artifacts, check_no_dangling

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


def test_a_size_needs_its_unit_and_entries_sharing_blobs_count_each_blob_once(tmp_path, monkeypatch):
    """Issue 55: `gc --max-size 20` meant 20 bytes and emptied the cache; text needs a unit (exit 2, the
    form shown), an int from Python stays bytes. Two entries sharing a blob: the dry run printed
    `17.1 MB -> -1484685 B`, doctor and gc disagreed; now gc, doctor and ls give one entries figure."""
    import json

    from aotbuild.cache.layout import parse_size, resolve_max_size
    from aotbuild.cli.doctor import check_store
    from aotbuild.errors import UsageError
    from tests.conftest import invoke_cli

    store = Store(tmp_path / "c")
    shared = os.urandom(1000)
    a = add_entry(store, tmp_path, "a", {"k.so": shared, "a.so": os.urandom(500)})
    add_entry(store, tmp_path, "b", {"k.so": shared, "b.so": os.urandom(300)})
    root = str(store.root)
    for args, env in ((["--max-size", "20"], {}), ([], {"AOTBUILD_MAX_SIZE": "20"})):
        proc = invoke_cli("gc", *args, "--dry-run", "--cache", root, env=env)
        assert proc.returncode == 2 and "'20' has no unit" in proc.stderr and "20GB" in proc.stderr, proc.stderr
    for value in ('"20"', "20"):  # pyproject.toml's, for a build into its own cache: a string with its unit
        (tmp_path / "pyproject.toml").write_text(f"[tool.aotbuild]\nmax_size = {value}\n")
        monkeypatch.delenv("AOTBUILD_MAX_SIZE", raising=False)
        with pytest.raises(UsageError, match="20GB"):
            resolve_max_size(start=tmp_path, project=True)
    assert parse_size(20) == 20 and parse_size("1.5KiB") == 1536 and parse_size("20 GB") == 20 * 10 ** 9
    assert len(list(store.iter_manifests())) == 2

    dry = json.loads(invoke_cli("gc", "--max-size", "0B", "--dry-run", "--json", "--cache", root).stdout)
    assert (dry["size_before"], dry["size_after"]) == (1800, 0)  # 1000 shared + 500 + 300
    assert sum(r["size"] for r in dry["removed"]) == 1800
    proc = invoke_cli("gc", "--max-size", "1KB", "--dry-run", "--cache", root)
    assert proc.stdout.splitlines()[-1] == f"{root}: entries 1.8 KB -> 0 B (dry run)", proc.stdout
    listed = invoke_cli("ls", "--cache", root).stdout
    assert json.loads(invoke_cli("ls", "--json", "--cache", root).stdout)["size"] == 1800
    assert f"2 entries, 1.8 KB in {root}" in listed, listed
    doctor = check_store(store.root, deep=False)
    assert doctor.ok and doctor.detail.startswith("2 entries, 1.8 KB") and doctor.data["size"] == 1800
    assert any(line.startswith("locks:") and line.endswith(str(store.layout.locks)) for line in doctor.lines)
    # the real gc: the older entry goes; the figure after is what is left, each blob once
    os.utime(store.layout.manifest(a), (1_000_000, 1_000_000))
    report = gc(store, max_size=1500)
    assert [(k, s) for k, _, s in report.removed] == [(a, 500)] and (report.size_before, report.size_after) == \
        (1800, 1300)
    check_no_dangling(store)


def test_a_build_past_the_limit_collects_old_entries_and_keeps_its_own(cache, fake_compiles, tmp_path):
    store = Store(cache)
    old = _entries_with_ages(store, tmp_path, 4)
    report = builder.build([str(TINY_RECIPE)], cache, max_size=3 * ARTIFACT_SIZE * 2 + 1500)
    built = [r.job.key for r in report.results if r.status == ResultStatus.BUILT]
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
    assert result.status == ResultStatus.FAILED and "bigger than the cache's size limit" in result.reason
    assert not store.layout.manifest(job.key).is_file() and not list(store.blob_files())


# -- rm --------------------------------------------------------------------------------------------

def test_rm_removes_entries_and_only_their_own_blobs(tmp_path):
    store = Store(tmp_path / "c")
    a = add_entry(store, tmp_path, "a", {"x.so": b"only-a", "shared": b"both"})
    b = add_entry(store, tmp_path, "b", {"y.so": b"only-b", "shared": b"both"})
    assert rm(store, [a]) == [(a, len(b"only-a"))]
    assert not store.layout.manifest(a).is_file() and store.open_entry(b)[0] is not None
    out = run_cli("rm", b[:10], "--cache", str(store.root))
    assert out.returncode == 0 and "1 entry removed" in out.stdout
    assert not list(store.blob_files())


# -- gc --stale: what can never match this environment ---------------------------------------------

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


# -- a manifest that cannot be parsed --------------------------------------------------------------

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
