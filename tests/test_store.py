"""Store, layout and install behaviour with small real files (no compiles)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aotbuild.cache.layout import resolve_cache_root, safe_relpath
from aotbuild.cache.manifest import Manifest
from aotbuild.cache.store import Store, sha256_file
from aotbuild.errors import StoreError, UsageError
from tests import manifests

FACTORS = manifests.factors("store-test")
KEY = manifests.manifest(FACTORS).key


def make_entry(store: Store, tmp_path: Path, files: dict[str, bytes]) -> Manifest:
    key = manifests.add_entry(store, tmp_path / "src", "store-test", files)
    assert key == KEY
    return store.read_manifest(KEY)


def test_roundtrip_and_verification(tmp_path):
    store = Store(tmp_path / "c")
    make_entry(store, tmp_path, {"a/x.so": b"kernel", "b.py": b"wrapper"})
    entry, why = store.open_entry(KEY)
    assert entry is not None and why == ""
    assert {rel: p.read_bytes() for rel, p in entry.files} == {"a/x.so": b"kernel", "b.py": b"wrapper"}
    assert all(sha256_file(p) == p.name for _, p in entry.files)
    assert not list(store.layout.tmp.iterdir())  # no temp file left behind


@pytest.mark.parametrize("damage,reason", [
    (lambda p: p.write_bytes(b"kernEl"), "corrupt"),
    (lambda p: p.write_bytes(b"kern"), "has 4 bytes, expected 6"),
    (lambda p: p.write_bytes(b""), "has 0 bytes"),
    (lambda p: p.unlink(), "missing"),
])
def test_damaged_blob_is_never_a_hit(tmp_path, damage, reason):
    store = Store(tmp_path / "c")
    manifest = make_entry(store, tmp_path, {"x.so": b"kernel"})
    blob = store.layout.blob(manifest.files[0].sha256)
    blob.chmod(0o644)
    damage(blob)
    entry, why = store.open_entry(KEY)
    assert entry is None and reason in why


def test_manifest_refused_before_its_blobs(tmp_path):
    store = Store(tmp_path / "c")
    with pytest.raises(StoreError, match="blob .* is missing"):
        store.put_manifest(manifests.manifest(FACTORS, [("x", "cd" * 32, 1)]))
    assert not store.layout.manifest(KEY).is_file()


def test_malformed_manifest_is_a_miss(tmp_path):
    store = Store(tmp_path / "c")
    path = store.layout.manifest(KEY)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    entry, why = store.open_entry(KEY)
    assert entry is None and why.startswith("manifest is malformed")
    path.write_text(json.dumps(manifests.manifest(FACTORS, [("../escape", "cd" * 32, 1)]).as_json()))
    entry, why = store.open_entry(KEY)
    assert entry is None and "unsafe artifact path" in why


@pytest.mark.parametrize("rel", ["../x", "/abs", "a/../../b", "a//b", "", "a\\b", "./a"])
def test_unsafe_relative_paths(rel):
    with pytest.raises(StoreError):
        safe_relpath(rel)


def test_key_prefix(tmp_path):
    store = Store(tmp_path / "c")
    make_entry(store, tmp_path, {"x": b"1"})
    assert store.resolve_prefix(KEY[:8]) == KEY
    with pytest.raises(UsageError, match="at least 8 hex"):
        store.resolve_prefix("abab")
    with pytest.raises(UsageError, match="no cache entry"):
        store.resolve_prefix("cdcdcdcd" if not KEY.startswith("cd") else "abababab")


def test_cache_root_rule(tmp_path, monkeypatch):
    project = tmp_path / "proj"
    (project / "sub").mkdir(parents=True)
    (project / "pyproject.toml").write_text('[tool.aotbuild]\ncache = "mycache"\n')
    monkeypatch.delenv("AOTBUILD_CACHE", raising=False)
    assert resolve_cache_root(start=project / "sub") == project / "mycache"
    monkeypatch.setenv("AOTBUILD_CACHE", str(tmp_path / "env"))
    assert resolve_cache_root(start=project / "sub") == tmp_path / "env"
    assert resolve_cache_root(tmp_path / "cli", start=project) == tmp_path / "cli"
    monkeypatch.delenv("AOTBUILD_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert resolve_cache_root(start=tmp_path) == tmp_path / "home" / ".cache" / "aotbuild"


def test_inductor_collect_and_install(tmp_path, monkeypatch):
    """Lock files are not artifacts; Triton's device folder is stored without the index and
    installed for the device in use; installs are idempotent."""
    from aotbuild.targets.inductor import InductorTarget

    target = InductorTarget()
    work = tmp_path / "job"
    for rel in ("fxgraph/aa/key/entry", "locks/x.lock", "ab/cab.main.so", "triton/0/HASH/k.cubin"):
        (work / "inductor" / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / "inductor" / rel).write_bytes(rel.encode())
    collected = dict(target.collect(work))
    assert sorted(collected) == ["ab/cab.main.so", "fxgraph/aa/key/entry", "triton/{device}/HASH/k.cubin"]
    active = tmp_path / "active"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(active))
    result = target.install(collected.items(), "cuda:3")
    assert result.installed == 3 and result.present == 0 and result.folder == str(active)
    assert (active / "triton/3/HASH/k.cubin").read_bytes() == b"triton/0/HASH/k.cubin"
    assert (active / "ab/cab.main.so").stat().st_mode & 0o111
    again = target.install(collected.items(), "cuda:3")
    assert again.installed == 0 and again.present == 3


@pytest.mark.parametrize(("prefix", "message"), [
    ("zzzzzzzz", "'zzzzzzzz' is not a key: keys are hex (0-9, a-f)"),
    ("abc", "'abc' is too short for a key: give at least 8 hex characters"),
    ("abcdefgh12", "is not a key: keys are hex"),
])
def test_a_key_prefix_that_is_not_hex_says_so(tmp_path, prefix, message):
    with pytest.raises(UsageError) as info:
        Store(tmp_path).resolve_prefix(prefix)
    assert message in str(info.value)


def test_one_load_hashes_a_blob_two_entries_share_once_and_a_later_load_hashes_it_again(tmp_path, monkeypatch):
    import aotbuild.cache.store as store_module

    store = Store(tmp_path / "c")
    one = manifests.add_entry(store, tmp_path / "src", "shares-a", {"probe.so": b"isa", "a.so": b"A"})
    two = manifests.add_entry(store, tmp_path / "src", "shares-b", {"probe.so": b"isa", "b.so": b"B"})
    hashed = []
    real = store_module.sha256_file
    monkeypatch.setattr(store_module, "sha256_file", lambda p: hashed.append(Path(p).name) or real(p))
    with store.hash_once():
        assert store.open_entry(one)[0] is not None and store.open_entry(two)[0] is not None
    assert len(hashed) == 3  # probe.so once, a.so, b.so
    shared = store.layout.blob(real(tmp_path / "src" / "shares-a" / "probe.so"))
    shared.chmod(0o644)
    shared.write_bytes(b"ISA")  # the same size, changed after that load
    entry, why = store.open_entry(two)  # a later load hashes again
    assert entry is None and "corrupt" in why
