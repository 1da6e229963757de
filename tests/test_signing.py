"""Signed entries: serving machines load only what a trusted key signed (Nix's binary-cache model)."""

from __future__ import annotations

import base64
import json
import os
import pickle
import shutil
import stat

import pytest

from aotbuild.cache import signing
from aotbuild.cache.store import Store, Unusable
from aotbuild.errors import UsageError
from tests import manifests
from tests.conftest import invoke_cli, run_cli, run_python


class _Marker:
    """Unpickling it writes a file: a pickle that ran."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture
def keys(tmp_path):
    ci, _ = signing.keygen(tmp_path / "keys" / "ci")
    other, _ = signing.keygen(tmp_path / "keys" / "other")
    return ci, other


def signed_entry(store: Store, tmp_path, name: str, key_file, blobs: dict[str, bytes] | None = None) -> str:
    key = manifests.add_entry(store, tmp_path / "src", name, blobs or {"x.so": b"kernel-" + name.encode()})
    if key_file is not None:
        store.put_manifest(signing.sign(store.read_manifest(key), key_file))
    return key


def test_keygen_writes_a_pair_told_apart_by_content_and_never_overwrites(tmp_path):
    private, public = signing.keygen(tmp_path / "keys" / "ci-2026")
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    for path, kind in ((private, "private"), (public, "public")):
        header, name, data = path.read_text().split()
        assert header == f"aotbuild-ed25519-{kind}-v1" and name == "ci-2026" and len(base64.b64decode(data)) == 32
    with pytest.raises(UsageError, match="never overwrites"):
        signing.keygen(tmp_path / "keys" / "ci-2026")
    proc = run_cli("keygen", str(tmp_path / "keys" / "ci-2026"))
    assert proc.returncode == 2 and "never overwrites" in proc.stderr
    assert run_cli("keygen", str(tmp_path / "cli")).returncode == 0 and (tmp_path / "cli.pub").is_file()


def test_build_signs_what_it_stores_rebuilds_what_it_finds_unsigned_and_refuses_a_bad_key_first(
        cache, fake_compiles, keys, tmp_path):
    from aotbuild.builder import build as builder
    from aotbuild.builder.build import ResultStatus
    from tests.conftest import TINY_RECIPE

    ci, other = keys
    bad = tmp_path / "bad.key"
    bad.write_text("not a key\n")
    with pytest.raises(UsageError, match="not a private key file"):
        builder.build([str(TINY_RECIPE)], cache, sign_key=bad)
    assert fake_compiles == []  # refused before any job ran
    first = builder.build([str(TINY_RECIPE)], cache, sign_key=ci)
    assert {r.status for r in first.results} == {ResultStatus.BUILT}
    store = Store(cache)
    keys_built = [r.job.key for r in first.results]
    assert all([s["key"] for s in store.read_manifest(k).signed_by] == ["ci"] for k in keys_built)
    assert {r.status for r in builder.build([str(TINY_RECIPE)], cache, sign_key=ci).results} == {ResultStatus.CACHED}
    # Another key finds entries it did not build: it builds (and signs) its own, never signs what it found
    second = builder.build([str(TINY_RECIPE)], cache, sign_key=other)
    assert {r.status for r in second.results} == {ResultStatus.BUILT} and len(fake_compiles) == 2 * len(keys_built)
    for k in keys_built:
        assert [s["key"] for s in store.read_manifest(k).signed_by] == ["other"]
    trusting = Store(cache, trusted=signing.load_trusted([tmp_path / "keys" / "other.pub"]))
    assert all(trusting.open_entry(k)[0] is not None for k in keys_built)


def test_a_signature_covers_the_manifest_not_its_signatures_or_the_key(keys, tmp_path):
    ci, other = keys
    store = Store(tmp_path / "c")
    key = signed_entry(store, tmp_path, "a", ci)
    manifest = store.read_manifest(key)
    assert [s["key"] for s in manifest.signed_by] == ["ci"] and manifest.key == key  # the key did not change
    twice = signing.sign(signing.sign(manifest, other), ci)  # several signers; a signer's renewed, not doubled
    assert sorted(s["key"] for s in twice.signed_by) == ["ci", "other"]
    trusted = signing.load_trusted([tmp_path / "keys" / "ci.pub"])
    assert signing.check(twice, trusted) == ""


def test_only_an_entry_a_trusted_key_signed_is_handed_out_before_any_blob_is_read(keys, tmp_path, monkeypatch):
    ci, other = keys
    store = Store(tmp_path / "c")
    mine = signed_entry(store, tmp_path, "mine", ci)
    theirs = signed_entry(store, tmp_path, "theirs", other)
    unsigned = signed_entry(store, tmp_path, "unsigned", None)
    flipped = signed_entry(store, tmp_path, "flipped", ci)
    data = json.loads(store.layout.manifest(flipped).read_text())
    sig = bytearray(base64.b64decode(data["signed_by"][0]["sig"]))
    sig[0] ^= 1
    data["signed_by"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    manifests.write_raw(store, flipped, data)
    changed = signed_entry(store, tmp_path, "changed", ci)
    data = json.loads(store.layout.manifest(changed).read_text())
    data["signatures"] = ["another call signature"]  # a field the signature covers
    manifests.write_raw(store, changed, data)

    trusting = Store(store.root, trusted=signing.load_trusted([tmp_path / "keys" / "ci.pub"]))
    import aotbuild.cache.store as store_module

    def no_blob_read(path):
        raise AssertionError(f"a blob was read: {path}")

    monkeypatch.setattr(store_module, "sha256_file", no_blob_read)
    for key, says in ((theirs, "untrusted key (other)"), (unsigned, "unsigned"), (flipped, "bad signature by ci"),
                      (changed, "bad signature by ci")):
        entry, why = trusting.open_entry(key)
        assert entry is None and why.kind is Unusable.UNTRUSTED and says in why, why
    monkeypatch.undo()
    assert trusting.open_entry(mine)[0] is not None
    assert Store(store.root).open_entry(unsigned)[0] is not None  # no trusted keys: unsigned works as before


def test_a_pull_of_an_untrusted_entry_never_fetches_or_unpickles_a_blob(keys, tmp_path, monkeypatch):
    _, other = keys
    marker = tmp_path / "marker"
    remote = Store(tmp_path / "remote")
    key = signed_entry(remote, tmp_path, "a", other, {"fxgraph/entry": pickle.dumps(_Marker(str(marker)))})
    monkeypatch.setenv("AOTBUILD_TRUSTED_KEYS", str(tmp_path / "keys" / "ci.pub"))
    from aotbuild.remote.schemes import parse_remote

    local = Store(tmp_path / "local", trusted=signing.trusted_from_env())
    why = parse_remote(f"file://{remote.root}").fetch(key, local)
    assert why.startswith("refused: signed by an untrusted key (other)")
    assert not local.layout.manifest(key).is_file() and not list(local.blob_files()) and not marker.exists()


def test_signatures_survive_push_and_pull_through_a_folder_remote_and_rotation_works(keys, tmp_path):
    ci, other = keys
    local = Store(tmp_path / "local")
    key = signed_entry(local, tmp_path, "a", None)
    folder = tmp_path / "remote"
    folder.mkdir()
    assert run_cli("sign", key[:12], "--cache", str(local.root), "--sign-key", str(ci)).returncode == 0
    push = run_cli("push", key[:12], "--remote", f"file://{folder}", "--cache", str(local.root))
    assert push.returncode == 0, push.stderr
    # Rotation: the new key signs beside the old on the remote; trust both; then drop the old.
    assert run_cli("sign", key[:12], "--cache", str(local.root), "--sign-key", str(other)).returncode == 0
    again = run_cli("push", key[:12], "--remote", f"file://{folder}", "--cache", str(local.root))
    assert again.returncode == 0
    there = Store(folder).read_manifest(key)
    assert sorted(s["key"] for s in there.signed_by) == ["ci", "other"]
    show = invoke_cli("show", key[:12], "--cache", str(folder))
    assert "signed by:  ci, other" in show.stdout
    for trusted in ("ci.pub", "other.pub", "ci.pub,other.pub"):
        serving = tmp_path / f"serving-{trusted}"
        remote_store = Store(folder, trusted=signing.load_trusted([tmp_path / "keys" / t for t in trusted.split(",")]))
        assert remote_store.open_entry(key)[0] is not None
        from aotbuild.remote.schemes import parse_remote

        pulled = Store(serving, trusted=remote_store.trusted)
        assert parse_remote(f"file://{folder}").fetch(key, pulled) == ""
        assert sorted(s["key"] for s in pulled.read_manifest(key).signed_by) == ["ci", "other"]
    revoked = signing.load_trusted([tmp_path / "keys" / "other.pub"])
    only_ci = signed_entry(local, tmp_path, "b", ci)
    assert Store(local.root, trusted=revoked).open_entry(only_ci)[1].kind is Unusable.UNTRUSTED  # revoked: a miss
    verify = invoke_cli("verify", "--cache", str(local.root), "--trusted-keys", str(tmp_path / "keys" / "other.pub"))
    assert verify.returncode == 1 and "untrusted" in verify.stdout


def test_signatures_survive_the_hub_stand_in(keys, tmp_path, monkeypatch, no_ambient_hf_auth):
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote
    from tests.fakes.hub_server import HubStandIn

    ci, other = keys
    local = Store(tmp_path / "local")
    key = signed_entry(local, tmp_path, "a", None)
    with HubStandIn(write_token="hf_w") as server:
        server.create_repo("org/c", repo_type="dataset")
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_TOKEN", "hf_w")
        sync.sign([key[:12]], ci, local.root)
        report = sync.push([key[:12]], parse_remote("hf://datasets/org/c"), local.root)
        assert report.result.sent == [key]
        serving = Store(tmp_path / "serving", trusted=signing.load_trusted([tmp_path / "keys" / "ci.pub"]))
        assert parse_remote("hf://datasets/org/c").fetch(key, serving) == ""
        assert [s["key"] for s in serving.read_manifest(key).signed_by] == ["ci"]
        assert serving.open_entry(key)[0] is not None
        # Rotation on the Hub: the new key's signature joins the old one; the pack is not sent again.
        sync.sign([key[:12]], other, local.root)
        again = sync.push([key[:12]], parse_remote("hf://datasets/org/c"), local.root)
        assert again.result.sent == [] and again.result.signed == [key] and again.result.bytes_sent == 0
        assert "1 given the new signature" in again.text()
        assert sync.push([key[:12]], parse_remote("hf://datasets/org/c"),
                         local.root).result.signed == []  # nothing new: no commit
        rotated = Store(tmp_path / "rotated", trusted=signing.load_trusted([tmp_path / "keys" / "other.pub"]))
        assert parse_remote("hf://datasets/org/c").fetch(key, rotated) == ""
        assert sorted(s["key"] for s in rotated.read_manifest(key).signed_by) == ["ci", "other"]


SERVE = """
import json, os, sys
from aotbuild import load_compiled, CacheMiss
from aotbuild.strategies.registry import get_strategy
from aotbuild.targets.registry import get_target
recipe, cache = sys.argv[1:3]
name, count = get_strategy("jit-cache").compile_counter(get_target("inductor"))
before = count()
try:
    pipe = load_compiled(recipe, cache=cache, on_miss="error")
    pipe(prompt="a cat", height=64, width=64, num_inference_steps=2, guidance_scale=0.0)
    print("RESULT " + json.dumps({"hits": len(pipe.aotbuild_report.hits), "compiles": count() - before}))
except CacheMiss as exc:
    print("RESULT " + json.dumps({"miss": str(exc)}))
"""


@pytest.mark.slow  # the session's real tiny-sd build, served from a signed copy
def test_a_signed_build_loads_with_its_key_trusted_and_compiles_nothing(built_cache, keys, tmp_path, monkeypatch):
    from aotbuild import CacheMiss, load_compiled
    from tests.conftest import TINY_RECIPE

    ci, other = keys
    root, _ = built_cache
    cache = tmp_path / "signed"
    shutil.copytree(root, cache)
    store = Store(cache)
    for manifest in list(store.iter_manifests()):
        store.put_manifest(signing.sign(manifest, ci))
    script = tmp_path / "serve.py"
    script.write_text(SERVE)

    def serve(trusted: str) -> dict:
        proc = run_python(f"import runpy, sys; sys.argv = ['s', {str(TINY_RECIPE)!r}, {str(cache)!r}]; "
                          f"runpy.run_path({str(script)!r}, run_name='__main__')",
                          env={"AOTBUILD_TRUSTED_KEYS": trusted, "AOTBUILD_CACHE": "",
                               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / f"inductor-{os.path.basename(trusted)}")})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])

    assert serve(str(tmp_path / "keys" / "ci.pub")) == {"hits": 2, "compiles": 0}
    # Another key trusted: a miss before anything is installed, so this process can ask (no fresh one)
    monkeypatch.setenv("AOTBUILD_TRUSTED_KEYS", str(tmp_path / "keys" / "other.pub"))
    with pytest.raises(CacheMiss, match=r"signed by an untrusted key \(ci\)"):
        load_compiled(TINY_RECIPE, cache=cache, on_miss="error")
