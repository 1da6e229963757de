"""Commands that read a cache write nothing under it (issue 55): `plan` created the built-in models it
planned, the CI gate `plan --cache EMPTY --fail-on-miss` created its folder, a failed `load_compiled`
left `models/` and `locks/` behind, and `pull` created a model before it found the remote unreachable.
A built-in model a read needs for its keys is made outside the cache (aotbuild.builtin.scratch);
`build` and a load that succeeded still keep it in the cache."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from aotbuild.cache.store import Store
from tests import manifests
from tests.conftest import TINY_DICT, TINY_RECIPE, invoke_cli


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time (a folder's changes with what it holds)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            info = os.lstat(os.path.join(dirpath, name))
            out[os.path.relpath(os.path.join(dirpath, name), root)] = (info.st_size, info.st_mtime_ns)
    return out


def test_plan_show_ls_and_verify_write_nothing_under_the_cache(tmp_path):
    store = Store(tmp_path / "cache")
    key = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    root = str(store.root)
    before = snapshot(store.root)
    assert "models" not in {p.split(os.sep)[0] for p in before}
    for args in (["plan", str(TINY_RECIPE)], ["plan", "--json", "--fail-on-miss", str(TINY_RECIPE)],
                 ["show", key[:12]], ["ls"], ["verify"]):
        proc = invoke_cli(*args, "--cache", root)
        assert proc.returncode in (0, 3), (args, proc.stderr[-2000:])
        assert snapshot(store.root) == before, args
    empty = tmp_path / "empty"  # the CI gate on a cache not there yet
    proc = invoke_cli("plan", "--fail-on-miss", "--cache", str(empty), str(TINY_RECIPE))
    assert proc.returncode == 3 and "miss" in proc.stdout, proc.stderr[-2000:]
    assert not empty.exists()


def test_a_failed_load_and_a_pull_from_an_unreachable_remote_write_nothing(tmp_path):
    from aotbuild import CacheMiss, RemoteError, load_compiled, pull

    empty = tmp_path / "empty"
    with pytest.raises(CacheMiss):
        load_compiled(TINY_DICT, cache=empty, on_miss="error")
    assert not empty.exists()
    with pytest.raises(RemoteError, match="no such folder"):
        pull([str(TINY_RECIPE)], f"file://{tmp_path / 'not-mounted' / 'cache'}", cache=empty)
    assert not empty.exists()
    # A load that succeeds keeps the built-in model it made outside the cache in the cache, as a build does.
    pipe = load_compiled(TINY_DICT, cache=empty, on_miss="eager")
    assert len(pipe.aotbuild_report.misses) == 1
    assert (empty / "models" / "tiny-sd-v1" / "model_index.json").is_file()
    assert sorted(p.name for p in empty.iterdir()) == ["models"]


def test_a_build_keeps_its_built_in_models_in_the_cache(tmp_path, fake_compiles):
    from aotbuild import build

    fresh = tmp_path / "fresh"
    report = build(TINY_DICT, cache=fresh)
    assert [r.status for r in report.results] == ["built"] and len(fake_compiles) == 1
    assert (fresh / "models" / "tiny-sd-v1" / "model_index.json").is_file()
