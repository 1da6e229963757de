"""The manifest codec against hostile and broken manifests: every reader says "malformed" (or
"stale") in one line, never a traceback, never a hang, and never serves the entry."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from aotbuild import constants
from aotbuild.cache import manifest as codec
from aotbuild.cache.manage import gc, verify
from aotbuild.cache.store import Store
from aotbuild.cli.commands import main
from aotbuild.errors import ManifestError, StaleManifest
from aotbuild.remote.schemes import parse_remote
from tests import manifests
from tests.conftest import REPO


@pytest.fixture
def store(tmp_path) -> Store:
    from aotbuild.strategies.registry import checked_store

    return checked_store(tmp_path / "c")


def good(store: Store, tmp_path, name: str = "good") -> str:
    return manifests.add_entry(store, tmp_path / "src", name, {"x.so": b"kernel-" + name.encode()})


def valid(store: Store, key: str) -> dict:
    return json.loads(store.layout.manifest(key).read_text())


def cli(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


def _set(data: dict, path: str, value) -> dict:
    *parents, leaf = path.split(".")
    node = data
    for p in parents:
        node = node[p]
    node[leaf] = value
    return data


LYING_FIELDS = [  # (field path, value, what the reason names)
    ("signatures", 5, "signatures"),
    ("signatures", [1, 2], "signatures"),
    ("factors", [1], "factors"),
    ("build", [], "build"),
    ("files", {"x": 1}, "files"),
    ("shape", {"height": "64", "width": 64, "batch_size": 1}, "shape"),
    ("embeds_weights", "no", "embeds_weights"),
    ("proof", {"load_s": 1.0, "compiles": "0", "max_abs_diff": 0, "tolerance": 1e-4, "instances": 1}, "proof"),
    ("packages", [{"path": "not-a-file.pt2", "signature": "s"}], "packages"),
    ("packages", [{"path": "x.so", "signature": "s", "instances": [3]}], "instances"),
    ("recipe", "", "recipe"),
    ("component", "vae", "differ from its factors"),
]


@pytest.mark.parametrize("field,value,named", LYING_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v, _ in LYING_FIELDS])
def test_a_manifest_that_parses_but_lies_is_malformed_for_every_reader(store, tmp_path, field, value, named):
    key = good(store, tmp_path)
    manifests.write_raw(store, key, _set(valid(store, key), field, value))
    entry, why = store.open_entry(key)
    assert entry is None and why.startswith("manifest is malformed") and named in why, why
    assert list(store.iter_manifests()) == []
    code, out = cli("ls", "--cache", str(store.root))
    assert code == 0 and "0 entries" in out and "Traceback" not in out
    code, out = cli("show", "--cache", str(store.root), key[:12])
    assert code == 1 and out.count("\n") == 1 and "cannot be used" in out and named in out, out
    code, out = cli("verify", "--cache", str(store.root))
    assert code == 1 and "malformed" in out and "Traceback" not in out
    code, out = cli("gc", "--stale", "--cache", str(store.root))
    assert code == 1 and out.count("\n") == 1 and "Traceback" not in out, out  # refuses to guess: verify first
    code, out = cli("verify", "--fix", "--cache", str(store.root))
    assert code == 0 and not store.layout.manifest(key).exists()  # fixed: nothing remains
    assert cli("verify", "--cache", str(store.root))[0] == 0  # its orphan blob went with it


def test_a_manifest_copied_under_another_keys_name_is_no_hit(store, tmp_path):
    """The swapped-manifest attack: a real entry's manifest renamed, and then its key field edited too."""
    a, b = good(store, tmp_path, "a"), manifests.manifest(manifests.factors("b")).key
    manifests.write_raw(store, b, valid(store, a))
    assert "not the name it is stored under" in store.open_entry(b)[1]
    manifests.write_raw(store, b, {**valid(store, a), "key": b})
    entry, why = store.open_entry(b)
    assert entry is None and "not the key of its factors" in why
    assert [m.key for m in store.iter_manifests()] == [a]
    problems = verify(store)
    assert [p.kind for p in problems] == ["malformed"] and problems[0].key is None


def test_json_nested_100000_deep_is_refused_by_counting_not_recursing(store, tmp_path):
    key = good(store, tmp_path)
    deep = '{"key": ' + "[" * 100_000 + "]" * 100_000 + "}"
    manifests.write_raw(store, key, deep)
    with pytest.raises(ManifestError, match=f"nested 100001 deep, more than a manifest may be \\({codec.MAX_DEPTH}\\)"):
        codec.read(store.layout.manifest(key), key)
    assert codec.json_depth('{"a": "[[[[[[", "b": [[1]]}') == 3  # brackets inside strings do not count
    code, out = cli("verify", "--cache", str(store.root))
    assert code == 1 and "nested 100001 deep" in out


@pytest.mark.parametrize("text,named", [
    (b"\xff\xfe{}", "not UTF-8"),
    (b'{"format": 2, "key": NaN}', "not JSON"),
    (b"[]", "not a JSON object"),
    (b"", "not JSON"),
])
def test_bytes_that_are_no_manifest(store, tmp_path, text, named):
    key = good(store, tmp_path)
    store.layout.manifest(key).write_bytes(text)
    assert named in store.open_entry(key)[1]


def test_a_manifest_bigger_than_the_cap_is_refused_unread(store, tmp_path, monkeypatch):
    key = good(store, tmp_path)
    monkeypatch.setattr(codec, "MAX_BYTES", 1000)
    manifests.write_raw(store, key, {**valid(store, key), "build": {"pad": "x" * 2000}})
    assert "more than a manifest may have (1000)" in store.open_entry(key)[1]


def test_nan_or_a_duplicate_file_in_a_manifest_is_refused(store, tmp_path):
    key = good(store, tmp_path)
    data = valid(store, key)
    manifests.write_raw(store, key, {**data, "files": data["files"] * 2})
    assert "listed twice" in store.open_entry(key)[1]


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink"])
def test_a_manifest_that_is_no_regular_file_never_hangs_a_reader(store, tmp_path, kind):
    key = good(store, tmp_path)
    path = store.layout.manifest(key)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    else:
        path.symlink_to("/etc/passwd")
    for args in (["verify"], ["ls"], ["show", key[:12]], ["gc", "--stale"], ["verify", "--fix"]):
        proc = subprocess.run([sys.executable, "-m", "aotbuild.cli", *args, "--cache", str(store.root)],
                              capture_output=True, text=True, timeout=120, cwd=REPO)
        assert "Traceback" not in proc.stderr and proc.returncode in (0, 1), (args, proc.stderr)
        if args == ["verify"]:
            assert proc.returncode == 1 and "malformed" in proc.stdout, proc.stdout
    assert store.open_entry(key)[0] is None
    assert not os.path.lexists(path)  # verify --fix removed it
    assert os.path.exists("/etc/passwd")


def test_a_manifest_in_the_wrong_folder_is_reported_and_fixed(store, tmp_path):
    key = good(store, tmp_path)
    wrong = store.layout.manifests / ("00" if not key.startswith("00") else "11") / f"{key}.json"
    wrong.parent.mkdir()
    os.rename(store.layout.manifest(key), wrong)
    problems = verify(store)
    assert {p.kind for p in problems} == {"malformed", "orphan"}
    assert any("its key's folder" in p.detail for p in problems)
    verify(store, fix=True)
    assert verify(store) == [] and not wrong.exists()


def test_an_older_format_is_stale_not_malformed_and_gc_stale_frees_it(store, tmp_path):
    key = good(store, tmp_path)
    old = valid(store, key)
    old["format"] = old["factors"]["format"] = constants.FORMAT_VERSION - 1
    manifests.write_raw(store, key, old)
    with pytest.raises(StaleManifest) as info:
        codec.read(store.layout.manifest(key), key)
    assert info.value.files and not isinstance(info.value, ManifestError)
    entry, why = store.open_entry(key)
    older = constants.FORMAT_VERSION - 1
    assert entry is None and why.startswith(f"stale: the entry is of format {older}") and "gc --stale" in why
    assert verify(store) == []  # stale is no damage: nothing to fix, its blobs are no orphans
    report = gc(store, stale=True)
    assert [(k, why) for k, why, _ in report.removed] == [(key, f"format {older}, this aotbuild reads "
                                                               f"{constants.FORMAT_VERSION}")]
    assert not store.layout.manifest(key).exists() and verify(store) == []
    assert not list(store.blob_files())  # its blob went with it


def test_a_remote_cannot_hand_over_a_lying_or_stale_manifest(store, tmp_path):
    remote_store = Store(tmp_path / "remote")
    key = good(remote_store, tmp_path)
    remote = parse_remote(f"file://{remote_store.root}")
    manifests.write_raw(remote_store, key, {**valid(remote_store, key), "signatures": 5})
    why = remote.fetch(key, store)
    assert why.startswith("refused: the remote's manifest is malformed") and "signatures" in why
    stale = {**valid(remote_store, key), "signatures": [], "format": 1}
    manifests.write_raw(remote_store, key, stale)
    assert remote.fetch(key, store).startswith("refused: the remote's entry is stale")
    assert not store.layout.manifest(key).is_file() and not list(store.blob_files())


def test_the_codec_round_trips_and_refuses_to_write_what_it_cannot_read(store, tmp_path):
    from aotbuild.cache.manifest import Proof

    f = manifests.factors("rt")
    m = manifests.manifest(f, [("a/x.so", "cd" * 32, 3)], signatures=("sig",),
                           proof=Proof(load_s=1.5, compiles=0, max_abs_diff=1e-7, tolerance=1e-4, instances=4))
    assert codec.from_json(m.to_json(), m.key) == m
    with pytest.raises(ManifestError, match="not the key of its factors"):
        codec.from_json(json.dumps({**m.as_json(), "factors": manifests.factors("other")}), m.key)
    bad = manifests.manifest(f, [("../up", "cd" * 32, 3)])
    with pytest.raises(ManifestError, match="unsafe"):
        bad.to_json()


@pytest.mark.parametrize("kind", ["fifo", "folder", "symlink"])
@pytest.mark.parametrize("named", [True, False], ids=["named", "orphan"])
def test_verify_keeps_going_past_odd_blobs_and_fix_leaves_nothing_to_report(store, tmp_path, kind, named):
    """A blob replaced by a folder stopped verify; a FIFO hung it. Now each is reported (corrupt when a
    manifest names it, orphan when none does), --fix removes it, and verify then exits 0."""
    key = good(store, tmp_path)
    other = good(store, tmp_path, "other")
    victim = store.layout.blob(store.read_manifest(key).files[0].sha256)
    if not named:
        store.remove_manifest(key)
    victim.chmod(0o644)
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    elif kind == "folder":
        victim.mkdir()
        (victim / "x").write_text("x")
    else:
        victim.symlink_to("/etc/passwd")
    code, out = cli("verify", "--cache", str(store.root))
    assert code == 1 and ("corrupt" if named else "orphan") in out and "Traceback" not in out, out
    assert store.open_entry(key)[0] is None
    code, out = cli("verify", "--fix", "--cache", str(store.root))
    assert code == 0 and "fixed" in out and "remain" not in out, out
    assert cli("verify", "--cache", str(store.root)) == (0, f"0 problem(s) found in {store.root}\n")
    assert store.open_entry(other)[0] is not None and os.path.exists("/etc/passwd")


def test_verify_fix_says_what_remains_and_exits_1_for_an_unreadable_manifest(store, tmp_path, monkeypatch):
    key = good(store, tmp_path)
    real = Store.load_manifest

    def load(self, k):
        if k == key:
            raise PermissionError(13, "Permission denied")
        return real(self, k)

    monkeypatch.setattr(Store, "load_manifest", load)
    code, out = cli("verify", "--fix", "--json", "--cache", str(store.root))
    report = json.loads(out)
    assert code == 1 and [p["kind"] for p in report["remaining"]] == ["unreadable"]
    assert store.layout.manifest(key).exists()


@pytest.mark.parametrize("strategy,record,named", [
    ("aot-package", {"constants": {"w": 5}}, "constants"),
    ("aot-package", {"baked": {"w": 5}}, "baked"),
    ("aot-package", {"strides": 5}, "strides"),
    ("aot-compile", {"floats": ["x"]}, "floats"),
    ("aot-compile", {"grad": "yes"}, "grad"),
    ("aot-compile", {"structure": 3}, "structure"),
])
def test_each_strategy_checks_its_own_records(store, tmp_path, strategy, record, named):
    """The codec checks what every record holds; the rest is the strategy's (Strategy.check_records),
    applied by a checked store: a malformed record is a miss with its reason for every reader."""
    f = manifests.factors(target={"strategy": strategy})
    src = tmp_path / "x.so"
    src.write_bytes(b"kernel")
    digest, size = store.put_blob(src)
    m = manifests.manifest(f, [("x.so", digest, size)], packages=({"path": "x.so", "signature": "s", **record},))
    manifests.write_raw(store, m.key, m.as_json())
    assert codec.from_json(json.dumps(m.as_json()), m.key).packages  # the codec alone accepts it
    entry, why = store.open_entry(m.key)
    assert entry is None and why.startswith("manifest is malformed") and f"packages[].{named}" in why, why
    assert list(store.iter_manifests()) == []
    ok = manifests.manifest(f, [("x.so", digest, size)], packages=({"path": "x.so", "signature": "s"},))
    manifests.write_raw(store, ok.key, ok.as_json())
    assert store.open_entry(ok.key)[0] is not None


def test_a_manifest_naming_too_many_files_or_bytes_is_malformed(tmp_path, monkeypatch):
    from aotbuild.cache.manifest import from_json

    many = manifests.manifest(manifests.factors("many"), [(f"f/{i}", "a" * 64, 1) for i in range(11)]).as_json()
    big = manifests.manifest(manifests.factors("big"), [("a", "b" * 64, 10 ** 12), ("b", "c" * 64, 10 ** 12)]).as_json()
    monkeypatch.setenv("AOTBUILD_MAX_ENTRY_FILES", "10")
    with pytest.raises(ValueError, match=r"11 files, more than an entry may have \(10; AOTBUILD_MAX_ENTRY_FILES"):
        from_json(json.dumps(many), many["key"])
    monkeypatch.setenv("AOTBUILD_MAX_ENTRY_BYTES", str(10 ** 12))
    with pytest.raises(ValueError, match=r"2000000000000 bytes declared, more than an entry may have"):
        from_json(json.dumps(big), big["key"])
    monkeypatch.delenv("AOTBUILD_MAX_ENTRY_FILES")
    assert from_json(json.dumps(many), many["key"]).key == many["key"]


def test_a_blob_named_by_many_paths_is_copied_once_when_links_fail(tmp_path, monkeypatch):
    import os
    import shutil

    from aotbuild.cache import trees

    blob = tmp_path / "blob"
    blob.write_bytes(b"x" * 1000)
    copies = []
    real_copy, real_link = shutil.copyfile, os.link
    monkeypatch.setattr(trees.shutil, "copyfile", lambda a, b: (copies.append(a), real_copy(a, b))[1])

    def link(src, dst):  # the store is on another filesystem: the blob itself cannot be linked
        if str(src) == str(blob):
            raise OSError(18, "Invalid cross-device link")
        return real_link(src, dst)

    monkeypatch.setattr(trees.os, "link", link)
    installed, _ = trees.lay_tree([(f"d/{i}.so", blob) for i in range(200)], tmp_path / "out")
    assert installed == 200 and len(copies) == 1
    assert all((tmp_path / "out" / "d" / f"{i}.so").read_bytes() == b"x" * 1000 for i in range(200))
