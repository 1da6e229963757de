"""Damaged blobs are never loaded and the next build rebuilds them; ``verify`` lists what is wrong
in a store, ``verify --fix`` repairs it, and neither touches what a live writer is writing.

Stand-in artifacts instead of real compiles (tests/standins.py, the ``fake_compiles`` fixture).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from aotbuild.builder import build as builder
from aotbuild.builder.build import ResultStatus
from aotbuild.cache.manage import verify
from aotbuild.cache.store import Store
from aotbuild.errors import StoreError
from tests.conftest import TINY_RECIPE, invoke_cli
from tests.standins import add_entry, check_no_dangling

# -- 2, 3: damaged blobs are never a hit and the next build rebuilds them --------------------------

@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_a_damaged_blob_is_a_miss_and_the_next_build_rebuilds_it(cache, fake_compiles, damage):
    first = builder.build([str(TINY_RECIPE)], cache)
    assert {r.status for r in first.results} == {ResultStatus.BUILT}
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
    assert status[key] == ResultStatus.BUILT and fake_compiles == [key]  # only the damaged one is rebuilt
    assert all(s == ResultStatus.CACHED for k, s in status.items() if k != key)
    assert store.open_entry(key)[0] is not None


# -- 4: content that does not match its name -------------------------------------------------------

def test_a_blob_is_refused_when_its_content_does_not_match_the_expected_name(tmp_path):
    store = Store(tmp_path / "c")
    src = tmp_path / "x"
    src.write_bytes(b"payload")
    with pytest.raises(StoreError, match="does not match its content"):
        store.put_blob(src, expect="0" * 64)
    assert not list(store.blob_files()) and not list(store.layout.tmp.iterdir())


# -- 15: verify / verify --fix ---------------------------------------------------------------------

def test_verify_lists_a_corrupt_blob_and_fix_repairs(tmp_path):
    store = Store(tmp_path / "c")
    a = add_entry(store, tmp_path, "a", {"x.so": b"kernel-a", "shared.py": b"both"})
    b = add_entry(store, tmp_path, "b", {"y.so": b"kernel-b", "shared.py": b"both"})
    blob = store.layout.blob(hashlib.sha256(b"kernel-a").hexdigest())
    blob.chmod(0o644)
    blob.write_bytes(b"kernel-A")
    found = invoke_cli("verify", "--cache", str(store.root))
    assert found.returncode == 1
    assert "corrupt" in found.stdout and "hash mismatch" in found.stdout and a[:12] in found.stdout
    assert "aotbuild verify --fix" in found.stdout  # the next step
    assert invoke_cli("verify", "--fix", "--cache", str(store.root)).returncode == 0  # everything it found is fixed
    assert invoke_cli("verify", "--cache", str(store.root)).returncode == 0
    assert not store.layout.manifest(a).is_file() and store.open_entry(b)[0] is not None  # b keeps the blob they shared
    check_no_dangling(store)


def test_verify_leaves_a_running_builds_staging_folder_alone(tmp_path):
    from aotbuild.cache.locks import flocked

    store = Store(tmp_path / "c")
    staging = store.layout.tmp / "job-0123456789ab.x"
    staging.mkdir(parents=True)
    with flocked(staging / ".lock", exclusive=True, timeout=0):
        assert verify(store) == []
    assert [p.kind for p in verify(store)] == ["temp"]  # its build is gone: a leftover


def test_verify_does_not_report_a_writer_that_is_still_writing(tmp_path):
    store = Store(tmp_path / "c")
    fd, path = store._tempfile()  # what put_blob holds open while it writes
    try:
        assert verify(store) == []
    finally:
        os.close(fd)
    assert [(p.kind, p.path.name) for p in verify(store)] == [("temp", Path(path).name)]


def test_verify_suggests_fix_only_for_what_fix_repairs_and_names_the_rest_for_its_owner(tmp_path):
    """It said `run aotbuild verify --fix` for a file aotbuild did not write, which --fix never removes."""
    from click.testing import CliRunner

    from aotbuild.cli.commands import main

    def cli(*args: str):
        return CliRunner().invoke(main, [*args, "--cache", str(store.root)], catch_exceptions=False)

    store = Store(tmp_path / "c")
    add_entry(store, tmp_path, "a", {"x.so": b"kernel-a"})
    store.layout.tmp.mkdir(parents=True, exist_ok=True)
    theirs = store.layout.tmp / "notes.txt"
    theirs.write_text("not aotbuild's")
    alone = cli("verify")
    assert alone.exit_code == 1  # it alone keeps verify at 1 (docs/cli.md says why)
    assert "--fix to repair" not in alone.stdout and "verify --fix`" not in alone.stdout
    assert "(left for its owner)" in alone.stdout
    assert "1 left for its owner (--fix never removes it): foreign: aotbuild did not write it" in alone.stdout

    orphan = tmp_path / "orphan"
    orphan.write_bytes(b"no manifest names it")
    store.put_blob(orphan)
    both = cli("verify")
    assert both.exit_code == 1
    assert "run `aotbuild verify --fix` to repair 1 of them; 1 left for its owner" in both.stdout
    data = json.loads(cli("verify", "--json").stdout)
    assert sorted((p["kind"], p["fixable"]) for p in data["problems"]) == [("foreign", False), ("orphan", True)]
    fixed = cli("verify", "--fix")
    assert fixed.exit_code == 1 and theirs.exists()
    assert "1 problem(s) fixed" in fixed.stdout and "1 remain; 1 left for its owner" in fixed.stdout
