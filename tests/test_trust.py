"""What a signature proves (issue 32): "built and proven by the holder of this key".

No laundering (a signing build never signs what it found; a push never signs), fail-closed trusted
keys, key files told apart by content, and a remote that can neither block a signed build nor pass
the CI gate with an entry CI did not sign. Every build here is a fake compile (``fake_compiles``):
plan, store, signatures, remotes and the CLI run for real.
"""

from __future__ import annotations

import base64
import itertools
import json
import shutil
from dataclasses import replace

import pytest

from aotbuild.cache import signing
from aotbuild.cache.store import Store
from aotbuild.errors import UsageError
from tests.conftest import TINY_RECIPE, invoke_cli

RECIPE = str(TINY_RECIPE)


@pytest.fixture
def ci(tmp_path):
    """CI's key pair: (private, public) paths."""
    return signing.keygen(tmp_path / "keys" / "ci")


def _plant(cache, remote_root, fake_compiles) -> list[str]:
    """An attacker's unsigned entries for every job of the recipe, marked, on the folder ``remote_root``
    (a remote anyone can write): built (fake) in a cache of its own, marked, pushed."""
    from aotbuild.builder import build as builder
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote

    attacker = cache.parent / "attacker"
    shutil.copytree(cache / "models", attacker / "models")
    keys = [r.job.key for r in builder.build([RECIPE], attacker).results]
    store = Store(attacker)
    for key in keys:
        m = store.read_manifest(key)
        store.put_manifest(replace(m, build={**m.build, "by": "attacker"}))
    remote_root.mkdir(exist_ok=True)
    assert sync.push(keys, parse_remote(f"file://{remote_root}"), attacker).result.sent == keys
    fake_compiles.clear()
    return keys


def _planted(manifest) -> bool:
    return manifest is not None and manifest.build.get("by") == "attacker"


# -- 1. no laundering ----------------------------------------------------------------------------


def test_a_signing_build_rebuilds_an_entry_it_found_unsigned_and_never_signs_it(cache, fake_compiles, ci, tmp_path):
    from aotbuild.builder import build as builder
    from aotbuild.builder.build import ResultStatus
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote

    remote = tmp_path / "remote"
    keys = _plant(cache, remote, fake_compiles)
    sync.pull([RECIPE], parse_remote(f"file://{remote}"), cache)  # into CI's cache, unverified
    assert all(_planted(Store(cache).read_manifest(k)) for k in keys)
    report = builder.build([RECIPE], cache, sign_key=ci[0])
    assert {r.status for r in report.results} == {ResultStatus.BUILT} and sorted(fake_compiles) == sorted(keys)
    trusting = Store(cache, trusted=signing.load_trusted([ci[1]]))
    for key in keys:
        entry, why = trusting.open_entry(key)
        assert entry is not None and not _planted(entry.manifest), why


def test_push_never_signs_and_push_sign_key_is_gone(cache, fake_compiles, ci, tmp_path):
    from aotbuild.builder import build as builder

    keys = [r.job.key for r in builder.build([RECIPE], cache).results]  # unsigned
    remote = tmp_path / "remote"
    remote.mkdir()
    proc = invoke_cli("push", RECIPE, "--remote", f"file://{remote}", "--cache", str(cache), "--sign-key", str(ci[0]))
    assert proc.returncode == 2 and "push --sign-key was removed" in proc.stderr and "aotbuild sign" in proc.stderr
    assert not Store(remote).layout.manifest(keys[0]).is_file()
    proc = invoke_cli("push", RECIPE, "--remote", f"file://{remote}", "--cache", str(cache))
    assert proc.returncode == 0, proc.stderr
    assert all(Store(remote).read_manifest(k).signed_by == () for k in keys)


def test_sign_vouches_only_for_what_it_is_named_and_checks_hashes_first(cache, fake_compiles, ci):
    from aotbuild.builder import build as builder
    from aotbuild.remote import sync

    keys = [r.job.key for r in builder.build([RECIPE], cache).results]
    with pytest.raises(UsageError, match="name the entries to sign"):
        sync.sign([], ci[0], cache)
    store = Store(cache)
    blob = store.layout.blob(store.read_manifest(keys[1]).files[0].sha256)
    blob.chmod(0o644)
    blob.write_bytes(b"tampered")
    with pytest.raises(UsageError, match="nothing signed"):
        sync.sign([k[:12] for k in keys], ci[0], cache)
    assert all(store.read_manifest(k).signed_by == () for k in keys)  # all or nothing
    assert sync.sign([keys[0][:12]], ci[0], cache) == [keys[0]]
    assert signing.signer(store.read_manifest(keys[0]), signing.load_trusted([ci[1]])) == "ci"


@pytest.mark.parametrize("change", ["builder", "toolchain", "proof", "files"])
def test_the_provenance_a_manifest_records_is_inside_what_is_signed(change, ci, tmp_path):
    """Who built it (aotbuild version, host), with what (torch, Python) and what the proof measured:
    a signature over the manifest covers each; changing one after signing is a bad signature."""
    from aotbuild.cache.manifest import FileRecord, Proof
    from tests import manifests

    store = Store(tmp_path / "c")
    key = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    m = replace(store.read_manifest(key), build={"aotbuild": "0.1.0", "host": "ci-1", "torch": "2.5.1",
                                                   "python": "3.11.9"},
                proof=Proof(load_s=1.0, compiles=0, max_abs_diff=0.0, tolerance=1e-3, instances=1, calls=2))
    signed = signing.sign(m, ci[0])
    trusted = signing.load_trusted([ci[1]])
    assert signing.check(signed, trusted) == ""
    changed = {"builder": lambda x: replace(x, build={**x.build, "aotbuild": "9.9", "host": "elsewhere"}),
               "toolchain": lambda x: replace(x, build={**x.build, "torch": "2.6.0"}),
               "proof": lambda x: replace(x, proof=replace(x.proof, compiles=3)),
               "files": lambda x: replace(x, files=(FileRecord("x.so", "0" * 64, 6),))}[change](signed)
    assert signing.check(changed, trusted).startswith("bad signature by ci")


def test_a_junk_signature_under_a_trusted_name_does_not_hide_a_good_one(ci, tmp_path):
    """signed_by is not itself signed: whoever writes the store can add entries to it. A junk one under a
    trusted key's name, before the good signature, must not turn a signed entry into a miss."""
    from tests import manifests

    store = Store(tmp_path / "c")
    key = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    signed = signing.sign(store.read_manifest(key), ci[0])
    trusted = signing.load_trusted([ci[1]])
    good = signed.signed_by[0]
    junk = {**good, "sig": base64.b64encode(b"\0" * 64).decode()}
    assert signing.check(replace(signed, signed_by=(junk, good)), trusted) == ""
    assert signing.check(replace(signed, signed_by=(junk,)), trusted).startswith("bad signature by ci")


def test_an_untrusted_signer_name_is_printed_escaped(ci, tmp_path):
    from tests import manifests

    store = Store(tmp_path / "c")
    m = store.read_manifest(manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"}))
    forged = replace(m, signed_by=({"key": "x\n::error::owned\x1b]0;t\x07", "sig": "AAAA"},))
    why = signing.check(forged, signing.load_trusted([ci[1]]))
    assert why.startswith("signed by an untrusted key") and "\n" not in why and "\x1b" not in why


# -- 2. fail closed ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["", " ", ",", " , "])
def test_a_trusted_keys_setting_that_names_no_key_is_an_error_at_every_entry_point(
        value, cache, fake_compiles, tmp_path, monkeypatch):
    from aotbuild import load_compiled
    from aotbuild.builder import build as builder
    from aotbuild.planner import plan
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote

    builder.build([RECIPE], cache)  # unsigned entries: with verification silently off, these were hits
    remote = tmp_path / "remote"
    remote.mkdir()
    monkeypatch.setenv("AOTBUILD_TRUSTED_KEYS", value)
    for call in (lambda: plan([RECIPE], cache), lambda: load_compiled(RECIPE, cache=cache, on_miss="error"),
                 lambda: sync.pull([RECIPE], parse_remote(f"file://{remote}"), cache)):
        with pytest.raises(UsageError, match="names no key"):
            call()
    for args in (("plan", RECIPE), ("verify",), ("pull", RECIPE, "--remote", f"file://{remote}")):
        proc = invoke_cli(*args, "--cache", str(cache))
        assert proc.returncode == 2 and "names no key" in proc.stderr, (args, proc.stdout, proc.stderr)
    monkeypatch.delenv("AOTBUILD_TRUSTED_KEYS")
    with pytest.raises(UsageError, match="names no key"):  # the explicit forms too
        load_compiled(RECIPE, cache=cache, on_miss="error", trusted_keys=[])
    proc = invoke_cli("plan", RECIPE, "--cache", str(cache), "--trusted-keys", value)
    assert proc.returncode == 2 and "names no key" in proc.stderr


def test_none_is_no_verification_on_purpose_and_unset_is_none(cache, fake_compiles, monkeypatch):
    from aotbuild.builder import build as builder
    from aotbuild.planner import JobStatus, plan

    builder.build([RECIPE], cache)
    monkeypatch.setenv("AOTBUILD_TRUSTED_KEYS", "none")
    assert {j.status for j in plan([RECIPE], cache)} == {JobStatus.HIT}
    monkeypatch.delenv("AOTBUILD_TRUSTED_KEYS")
    assert signing.trusted_from_env() is None and {j.status for j in plan([RECIPE], cache)} == {JobStatus.HIT}
    with pytest.raises(UsageError, match="together with keys"):
        signing.trusted_from_env(["none", "ci.pub"])


# -- 2. key files --------------------------------------------------------------------------------


def test_private_and_public_keys_are_told_apart_by_content(ci, tmp_path, cache, fake_compiles):
    from aotbuild.builder import build as builder

    private, public = ci
    with pytest.raises(UsageError, match="a public key: signing needs the private key"):
        signing.load_private(public)
    with pytest.raises(UsageError, match="a public key: signing needs the private key"):
        builder.build([RECIPE], cache, sign_key=public)
    with pytest.raises(UsageError, match="a private key given as trusted"):
        signing.load_trusted([private])
    # the names do not matter: a public key named .key is still refused for signing
    renamed = tmp_path / "looks-private.key"
    renamed.write_bytes(public.read_bytes())
    with pytest.raises(UsageError, match="a public key"):
        signing.load_private(renamed)
    assert fake_compiles == []


def test_old_key_files_are_refused_naming_the_conversion_and_their_signatures_stay_valid(tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    from tests import manifests

    key = ed25519.Ed25519PrivateKey.generate()
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    old_key, old_pub = tmp_path / "ci.key", tmp_path / "ci.pub"
    old_key.write_text(f"ci:{base64.b64encode(seed).decode()}\n")
    old_pub.write_text(f"ci:{base64.b64encode(raw).decode()}\n")
    store = Store(tmp_path / "c")
    k = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    m = store.read_manifest(k)  # signed as the old code did: the same payload, the same signature form
    old_signed = replace(m, signed_by=({"key": "ci", "sig": base64.b64encode(key.sign(signing.payload(m.as_json())))
                                        .decode()},))
    for path, load in ((old_key, signing.load_private), (old_pub, lambda p: signing.load_trusted([p]))):
        with pytest.raises(UsageError) as info:
            load(path)
        assert f"aotbuild keygen --convert {path}" in str(info.value) and "\n" not in str(info.value)
    for path in (old_key, old_pub):
        proc = invoke_cli("keygen", "--convert", str(path))
        assert proc.returncode == 0, proc.stderr
    assert signing.check(old_signed, signing.load_trusted([old_pub])) == ""
    assert signing.signer(signing.sign(m, old_key), signing.load_trusted([old_pub])) == "ci"
    assert oct(old_key.stat().st_mode & 0o777) == "0o600"


def test_a_key_file_that_is_not_a_regular_file_of_the_format_is_refused_with_the_reason(tmp_path):
    folder = tmp_path / "ci.pub"
    folder.mkdir()
    with pytest.raises(UsageError, match="not a regular file"):
        signing.load_trusted([folder])
    junk = tmp_path / "junk.pub"
    junk.write_text("aotbuild-ed25519-public-v1 ci not-base64!\n")
    with pytest.raises(UsageError, match="not a public key file"):
        signing.load_trusted([junk])
    big = tmp_path / "big.pub"
    big.write_bytes(b"a" * (signing.MAX_KEY_FILE + 1))
    with pytest.raises(UsageError, match="more than"):
        signing.load_trusted([big])


def test_two_keys_under_one_name_or_one_key_under_two_names_is_an_error(tmp_path):
    _, first = signing.keygen(tmp_path / "a" / "ci")
    _, second = signing.keygen(tmp_path / "b" / "ci")
    with pytest.raises(UsageError, match="two trusted keys are named 'ci'"):
        signing.load_trusted([first, second])
    alias = tmp_path / "alias.pub"
    alias.write_text(first.read_text().replace(" ci ", " ci-2026 "))
    with pytest.raises(UsageError, match="also trusted as 'ci'"):
        signing.load_trusted([first, alias])
    assert signing.load_trusted([first, first]) == signing.load_trusted([first])  # the same file twice is one key


def test_show_and_verify_say_which_key_signed_each_entry(cache, fake_compiles, ci, tmp_path, monkeypatch):
    from aotbuild.builder import build as builder

    keys = [r.job.key for r in builder.build([RECIPE], cache, sign_key=ci[0]).results]
    monkeypatch.setenv("AOTBUILD_TRUSTED_KEYS", str(ci[1]))
    show = invoke_cli("show", keys[0][:12], "--cache", str(cache))
    assert "signed by:  ci (verified: trusted key ci)" in show.stdout, show.stdout
    verify = invoke_cli("verify", "--cache", str(cache))
    assert verify.returncode == 0 and f"{len(keys)} entries signed by a trusted key: ci {len(keys)}" in verify.stdout


# -- 3. the remote cannot block or fake a signed build -------------------------------------------


def test_an_unsigned_remote_entry_neither_blocks_a_signed_build_nor_passes_the_gate(
        cache, fake_compiles, ci, tmp_path):
    from aotbuild.builder.build import ResultStatus

    remote = tmp_path / "remote"
    keys = _plant(cache, remote, fake_compiles)
    url = f"file://{remote}"
    gate = ("plan", RECIPE, "--cache", str(cache), "--remote", url, "--trusted-keys", str(ci[1]), "--fail-on-miss")
    proc = invoke_cli(*gate)
    assert proc.returncode == 3 and "refused there: unsigned" in proc.stdout, proc.stdout
    assert invoke_cli("plan", RECIPE, "--cache", str(cache), "--remote", url, "--fail-on-miss").returncode == 0
    proc = invoke_cli("build", RECIPE, "--cache", str(cache), "--sign-key", str(ci[0]), "--push", url, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert {r["status"] for r in report["jobs"]} == {ResultStatus.BUILT}
    assert sorted(report["push"]["superseded"]) == sorted(keys)
    trusting = Store(remote, trusted=signing.load_trusted([ci[1]]))
    assert all(not _planted(trusting.open_entry(k)[0].manifest) for k in keys)
    assert invoke_cli(*gate).returncode == 0


def test_a_manifest_a_trusted_key_signed_is_never_overwritten(cache, fake_compiles, ci, tmp_path):
    from aotbuild.builder import build as builder
    from aotbuild.errors import StoreError
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote

    remote = tmp_path / "remote"
    remote.mkdir()
    keys = [r.job.key for r in builder.build([RECIPE], cache, sign_key=ci[0]).results]
    sync.push(keys, parse_remote(f"file://{remote}"), cache)
    signed = {k: Store(remote).read_manifest(k) for k in keys}
    other = tmp_path / "other"
    shutil.copytree(cache / "models", other / "models")
    builder.build([RECIPE], other)  # unsigned entries for the same keys, and another content
    for key in keys:
        m = Store(other).read_manifest(key)
        Store(other).put_manifest(replace(m, build={**m.build, "by": "attacker"}))
    trusted = signing.load_trusted([ci[1]])
    result = sync.push(keys, parse_remote(f"file://{remote}"), other, trusted=trusted).result
    assert result.sent == [] and result.superseded == [] and sorted(result.present) == sorted(keys)
    assert all(Store(remote).read_manifest(k) == signed[k] for k in keys)
    with pytest.raises(StoreError, match="a trusted key signed the one stored"):
        Store(remote, trusted=trusted).put_manifest(Store(other).read_manifest(keys[0]))


# -- the sequences -------------------------------------------------------------------------------

STEPS = ("pull", "build", "push", "sign", "plan")
#: Every step before every other (each ordered pair), and each step first in a run of all five.
ORDERS = [*itertools.permutations(STEPS, 2), *(STEPS[i:] + STEPS[:i] for i in range(len(STEPS)))]


@pytest.mark.parametrize("order", ORDERS, ids="-".join)
def test_a_planted_unsigned_entry_is_never_served_to_a_machine_that_trusts_only_ci(
        order, cache, fake_compiles, ci, tmp_path):
    """A remote anyone can write holds an attacker's unsigned entries for the recipe's jobs; CI runs
    its steps in this order: pull (unverified, into CI's cache), build --sign-key --push,
    push (plain), sign (what its own builds reported built: `aotbuild sign` vouches only for that),
    plan (the gate). After each step, a machine trusting only CI's key, pulling from the remote or
    reading CI's cache, is never handed a planted entry; and whenever the gate passes, it is served.
    The orders: each step before each other one, and each step first in a run of all five."""
    from aotbuild.builder.build import ResultStatus
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote

    remote_root = tmp_path / "remote"
    keys = _plant(cache, remote_root, fake_compiles)
    url = f"file://{remote_root}"
    remote = parse_remote(url)
    trusted = signing.load_trusted([ci[1]])
    built: list[str] = []
    for n, step in enumerate(order):
        if step == "pull":
            sync.pull([RECIPE], remote, cache)
        elif step == "build":
            proc = invoke_cli("build", RECIPE, "--cache", str(cache), "--sign-key", str(ci[0]), "--push", url, "--json")
            assert proc.returncode == 0, proc.stderr
            built += [r["key"] for r in json.loads(proc.stdout)["jobs"] if r["status"] == ResultStatus.BUILT]
        elif step == "push":
            invoke_cli("push", RECIPE, "--remote", url, "--cache", str(cache))
        elif step == "sign":
            if built:
                sync.sign(built, ci[0], cache)
        else:
            gate = invoke_cli("plan", RECIPE, "--cache", str(cache), "--remote", url, "--trusted-keys", str(ci[1]),
                              "--fail-on-miss")
            assert gate.returncode in (0, 3)
        serving = Store(tmp_path / f"serving-{n}", trusted=trusted)
        for key in keys:
            why = remote.fetch(key, serving)
            assert why == "" or why.startswith("refused: unsigned"), why
            for store in (serving, Store(cache, trusted=trusted)):
                entry, _ = store.open_entry(key)
                assert entry is None or not _planted(entry.manifest), (step, key)
        if step == "plan" and gate.returncode == 0:  # the gate passed: every job is served
            assert all(serving.open_entry(k)[0] is not None for k in keys)


def test_on_the_hub_stand_in_a_signed_push_replaces_an_unsigned_manifest_and_the_gate_reads_it(
        cache, fake_compiles, ci, tmp_path, monkeypatch, no_ambient_hf_auth):
    from aotbuild.builder import build as builder
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote, untrusted_on_remote
    from tests.fakes.hub_server import HubStandIn

    attacker = tmp_path / "attacker"
    shutil.copytree(cache / "models", attacker / "models")
    keys = [r.job.key for r in builder.build([RECIPE], attacker).results]
    for key in keys:
        m = Store(attacker).read_manifest(key)
        Store(attacker).put_manifest(replace(m, build={**m.build, "by": "attacker"}))
    trusted = signing.load_trusted([ci[1]])
    with HubStandIn(write_token="hf_w") as server:
        server.create_repo("org/c", repo_type="dataset")
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        monkeypatch.setenv("HF_TOKEN", "hf_w")
        hub = parse_remote("hf://datasets/org/c")
        assert sync.push(keys, hub, attacker).result.sent == keys
        assert set(untrusted_on_remote(hub, keys, trusted)) == set(keys)  # the gate's view: all misses
        proc = invoke_cli("build", RECIPE, "--cache", str(cache), "--sign-key", str(ci[0]), "--push",
                          "hf://datasets/org/c", "--json")
        assert proc.returncode == 0, proc.stderr
        report = json.loads(proc.stdout)
        assert {r["status"] for r in report["jobs"]} == {"built"}
        assert sorted(report["push"]["superseded"]) == sorted(keys)
        assert untrusted_on_remote(hub, keys, trusted) == {}
        serving = Store(tmp_path / "serving", trusted=trusted)
        assert all(hub.fetch(k, serving) == "" and not _planted(serving.read_manifest(k)) for k in keys)
        # and the attacker's push back over it changes nothing: a trusted-signed manifest stays
        again = sync.push(keys, hub, attacker, trusted=trusted).result
        assert again.sent == [] and sorted(again.present) == sorted(keys)
        assert untrusted_on_remote(hub, keys, trusted) == {}
