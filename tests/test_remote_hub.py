"""hf:// remotes through huggingface_hub's real client, against the loopback Hub stand-in.

The stand-in (tests/fakes/hub_server.py) serves the endpoints huggingface_hub calls for tree
listings, downloads (resolve) and commits (preupload + NDJSON commit, files sent inline as "regular"
uploads). It does not cover LFS or Xet transfers: on the real Hub, large packs travel through them,
inside huggingface_hub and below the API aotbuild uses.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import threading

import pytest

from aotbuild.cache.store import Store
from aotbuild.errors import RemoteError
from aotbuild.remote.schemes import HubRemote, parse_remote
from tests import manifests
from tests.fakes.hub_server import HubStandIn
from tests.standins import add_entry, entries, key_of

REPO_ID = "org/aot-cache"
URL = f"hf://datasets/{REPO_ID}"
TOKEN = "hf_test_write"


@pytest.fixture
def hub(monkeypatch, no_ambient_hf_auth):
    with HubStandIn(write_token=TOKEN) as server:
        server.create_repo(REPO_ID, repo_type="dataset")
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        yield server


def writer(monkeypatch) -> HubRemote:
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    remote = parse_remote(URL)
    assert isinstance(remote, HubRemote)
    return remote


def test_push_commits_packs_before_manifests_and_is_incremental(hub, monkeypatch, tmp_path):
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {f"k/{i}.so": bytes([i]) * 100 for i in range(50)})
    b = add_entry(local, tmp_path, "b", {"w.py": b"wrapper"})
    remote = writer(monkeypatch)
    result = remote.push(entries(local, a, b))
    assert sorted(result.sent) == sorted([a, b])
    commits = [c for c in hub.commits(REPO_ID, repo_type="dataset") if c["paths"]]
    assert len(commits) == 2
    assert all(p.startswith("packs/") for p in commits[0]["paths"])  # every pack lands first
    assert all(p.startswith("manifests/") for p in commits[1]["paths"])
    files = hub.files(REPO_ID, repo_type="dataset")
    assert len(files) == 4  # 51 blobs travel as 2 packs + 2 manifests (the Hub limits file counts)
    again = remote.push(entries(local, a, b))
    assert again.sent == [] and sorted(again.present) == sorted([a, b])
    assert len([c for c in hub.commits(REPO_ID, repo_type="dataset") if c["paths"]]) == 2


def test_read_only_pull_needs_no_token(hub, monkeypatch, tmp_path):
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel", "y.py": b"wrapper"})
    writer(monkeypatch).push(entries(local, a))
    monkeypatch.delenv("HF_TOKEN")
    reader = parse_remote(URL)
    assert reader.keys() == {a}
    other = Store(tmp_path / "other")
    assert reader.fetch(a, other) == ""
    entry, why = other.open_entry(a)
    assert entry is not None and {r: p.read_bytes() for r, p in entry.files} == {"x.so": b"kernel", "y.py": b"wrapper"}
    assert other.read_manifest(a).pack is None and '"pack"' not in other.layout.manifest(a).read_text()
    assert reader.fetch(key_of("absent"), other) == "not on the remote"
    with pytest.raises(RemoteError, match="token"):  # and it cannot write
        reader.push(entries(local, add_entry(local, tmp_path, "b", {"z": b"z"})))


def test_a_failed_push_leaves_no_manifest_and_a_retry_completes(hub, monkeypatch, tmp_path):
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel"})
    remote = writer(monkeypatch)
    hub.fail_commits = 1  # the packs commit fails
    with pytest.raises(RemoteError, match="committing packs failed"):
        remote.push(entries(local, a))
    assert remote.keys() == set()

    from huggingface_hub import HfApi

    real = HfApi.create_commit

    def manifests_fail(self, *args, **kwargs):  # fault injection: the second commit dies
        if "manifests" in kwargs.get("commit_message", ""):
            raise ConnectionError("connection reset")
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HfApi, "create_commit", manifests_fail)
    with pytest.raises(RemoteError, match="connection reset"):
        remote.push(entries(local, a))
    assert remote.keys() == set()  # the pack is there, but no reader sees an entry
    assert any(p.startswith("packs/") for p in hub.files(REPO_ID, repo_type="dataset"))
    monkeypatch.setattr(HfApi, "create_commit", real)
    assert remote.push(entries(local, a)).sent == [a]
    assert remote.fetch(a, Store(tmp_path / "other")) == ""


def test_concurrent_pushers_both_land(hub, monkeypatch, tmp_path):
    local = Store(tmp_path / "local")
    keys = [add_entry(local, tmp_path, f"e{i}", {"x.so": f"kernel {i}".encode(), "same.py": b"shared"})
            for i in range(6)]
    remote = writer(monkeypatch)
    errors = []

    def push(part):
        try:
            parse_remote(URL).push(entries(local, *part))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=push, args=(keys[:4],)), threading.Thread(target=push, args=(keys[2:],))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert remote.keys() == set(keys)
    other = Store(tmp_path / "other")
    assert all(remote.fetch(k, other) == "" for k in keys)


def _tar(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def test_a_tampered_pack_is_refused_before_it_is_opened(hub, monkeypatch, tmp_path):
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel"})
    remote = writer(monkeypatch)
    remote.push(entries(local, a))
    manifest_path = HubRemote.manifest_path(a)
    manifest = json.loads(hub.files(REPO_ID, repo_type="dataset")[manifest_path])
    hub.commit_files(REPO_ID, {manifest["pack"]["path"]: _tar({"0" * 64: b"evil"})}, repo_type="dataset")
    other = Store(tmp_path / "other")
    why = remote.fetch(a, other)
    assert why.startswith("refused") and "does not match its hash" in why
    assert not other.layout.manifest(a).is_file()


@pytest.mark.parametrize("member", ["../escape", "/abs/path", "a" * 63 + "/"])
def test_a_pack_with_unsafe_members_is_refused_before_anything_is_written(hub, monkeypatch, tmp_path, member):
    """Even a pack whose hash matches its manifest (whoever wrote the remote made both) is read
    member by member: only plain files named by a digest the manifest lists are stored."""
    import hashlib

    digest = hashlib.sha256(b"payload").hexdigest()
    pack = _tar({member: b"payload"})
    pack_digest = hashlib.sha256(pack).hexdigest()
    m = manifests.manifest(manifests.factors("evil"), [("x.so", digest, 7)],
                           pack={"sha256": pack_digest, "size": len(pack), "path": HubRemote.pack_path(pack_digest)})
    key, manifest = m.key, m.as_json()
    hub.commit_files(REPO_ID, {HubRemote.pack_path(pack_digest): pack,
                               HubRemote.manifest_path(key): json.dumps(manifest).encode()}, repo_type="dataset")
    other = Store(tmp_path / "other")
    why = parse_remote(URL).fetch(key, other)
    assert why.startswith("refused") and "not a plain file named by its sha256" in why
    assert not other.layout.manifest(key).is_file()
    assert not (tmp_path / "escape").exists() and not (tmp_path / "other" / "escape").exists()


def test_unknown_repo_says_how_to_create_it(hub, monkeypatch):
    """... with a command the installed ``hf`` has: ``hf repo create`` (the advice until issue 55) is
    "No such command 'repo'" in huggingface_hub 2.x (``hf repos create``)."""
    import shlex
    import subprocess
    import sys

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(RemoteError, match="hf repos create") as info:
        parse_remote("hf://datasets/org/nothing-here").keys()
    words = shlex.split(re.search(r"`(hf [^`]+)`", str(info.value))[1])
    hf = "import sys; from huggingface_hub.cli.hf import main; sys.argv[0] = 'hf'; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", hf, *words[1:], "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "--repo-type" in proc.stdout, proc.stderr


def test_large_packs_travel_through_the_lfs_endpoints(hub, monkeypatch, tmp_path):
    """With the Hub answering "lfs" for large files (as it does), packs go through the LFS batch API
    and a PUT of the object, then the commit names them; a pull reads them back byte-identical.
    Xet, which huggingface_hub prefers when hf_xet is installed, is switched off: the stand-in does
    not speak it (docs/ci.md)."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    hub.lfs_threshold = 2000
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"big.so": bytes(range(256)) * 40, "small.py": b"wrapper"})
    remote = writer(monkeypatch)
    assert remote.push(entries(local, a)).sent == [a]
    paths = [path for _, path in hub.requests]
    assert any(p.endswith(".git/info/lfs/objects/batch") for p in paths)
    assert any("/info/lfs/objects/" in p and "batch" not in p and "verify" not in p for p in paths)  # the PUT
    assert any(p.startswith("packs/") for p in hub.lfs_files(REPO_ID, repo_type="dataset"))
    monkeypatch.delenv("HF_TOKEN")
    other = Store(tmp_path / "other")
    assert parse_remote(URL).fetch(a, other) == ""
    assert {r: p.read_bytes() for r, p in other.open_entry(a)[0].files}["big.so"] == bytes(range(256)) * 40


def test_a_pack_longer_than_its_manifest_records_is_refused_while_it_downloads(hub, monkeypatch, tmp_path):
    import aotbuild.remote.schemes as remote_module

    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel"})
    remote = writer(monkeypatch)
    remote.push(entries(local, a))
    manifest = json.loads(hub.files(REPO_ID, repo_type="dataset")[HubRemote.manifest_path(a)])
    recorded = manifest["pack"]["size"]
    hub.commit_files(REPO_ID, {manifest["pack"]["path"]: b"\0" * (recorded * 50)}, repo_type="dataset")
    written: list[int] = []
    real_open = open

    def counting_open(path, mode="r", *args, **kwargs):  # what the download writes, never past the bound
        f = real_open(path, mode, *args, **kwargs)
        if "w" in mode and str(path).endswith(".tar"):
            write = f.write
            f.write = lambda data: (written.append(len(data)), write(data))[1]
        return f

    monkeypatch.setattr(remote_module, "open", counting_open, raising=False)
    other = Store(tmp_path / "other")
    why = remote.fetch(a, other)
    assert why.startswith("refused") and f"more than the {recorded}" in why, why
    assert sum(written) <= recorded and not other.layout.manifest(a).is_file()


def test_a_manifest_over_16_mib_on_the_hub_is_refused_before_it_is_parsed(hub, monkeypatch, tmp_path):
    key = "ab" * 32
    hub.commit_files(REPO_ID, {HubRemote.manifest_path(key): b" " * (16 * 1024 * 1024 + 1)}, repo_type="dataset")
    why = parse_remote(URL).fetch(key, Store(tmp_path / "other"))
    assert why.startswith("refused") and "more than the 16777216" in why, why
