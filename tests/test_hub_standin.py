"""The Hub stand-in (tests/fakes/hub_server.py) proven with huggingface_hub's real public functions: what
works against it here is what the real Hub client does (preupload + NDJSON commit, HEAD + GET on resolve
URLs, tree listings), with no network and no Xet transfer. LFS (batch + PUT + verify, ``lfsFile`` commit
lines) is opt-in with ``lfs_threshold``, and needs huggingface_hub's Xet path off (``HF_HUB_DISABLE_XET``)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import (
    CommitOperationAdd,
    HfApi,
    constants,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    BadRequestError,
    EntryNotFoundError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.conftest import REPO
from tests.fakes.hub_server import HubStandIn, git_blob_oid, lfs_pointer

TOKEN = "hf_test_write"
KEY = "ab" + "0123456789abcdef" * 3 + "0123456789ab"  # 64 hex, like a manifest key
MANIFEST = f"manifests/ab/{KEY}.json"


@pytest.fixture(autouse=True)
def _isolated(no_ambient_hf_auth):
    """No token, offline mode or cache from this machine's huggingface_hub set-up (conftest)."""


@pytest.fixture
def hub():
    with HubStandIn(write_token=TOKEN) as server:
        yield server


def _local(tmp_path: Path, name: str, data: bytes) -> str:
    path = tmp_path / "src" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _commit(api: HfApi, repo_id: str, repo_type: str, files: dict[str, str], message: str = "push"):
    ops = [CommitOperationAdd(path_in_repo=p, path_or_fileobj=local) for p, local in files.items()]
    return api.create_commit(repo_id, operations=ops, commit_message=message, repo_type=repo_type, revision="main")


@pytest.fixture
def no_xet(monkeypatch):
    """huggingface_hub uploads every "lfs" file through Xet whenever hf_xet is installed (a client-side choice:
    ``is_xet_available()``); HF_HUB_DISABLE_XET is its documented switch back to the LFS basic transfer. It is
    read once at import, so the constant is patched too."""
    monkeypatch.setenv("HF_HUB_DISABLE_XET", "1")
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


def _http(method: str, url: str, body: bytes | dict | None = None, token: str | None = None):
    """(status, headers, body) of a raw request, errors included."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    request = urllib.request.Request(url, data=data, method=method)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


@pytest.mark.parametrize("repo_type", ["model", "dataset"])
def test_commit_then_list_and_download(hub, tmp_path, repo_type):
    hub.create_repo("owner/cache", repo_type=repo_type)
    manifest, blob = b'{"key": "%s"}' % KEY.encode(), bytes(range(256)) * 40
    writer = HfApi(endpoint=hub.endpoint, token=TOKEN)
    info = _commit(writer, "owner/cache", repo_type, {
        MANIFEST: _local(tmp_path, "m.json", manifest), "blobs/aa/blob.bin": _local(tmp_path, "b.bin", blob)})
    assert len(info.oid) == 40 and info.commit_url.endswith(f"/commit/{info.oid}")
    assert info.repo_url.repo_id == "owner/cache" and info.repo_url.repo_type == repo_type
    assert hub.files("owner/cache", repo_type) == {MANIFEST: manifest, "blobs/aa/blob.bin": blob}
    assert hub.commits("owner/cache", repo_type)[-1] == {
        "oid": info.oid, "message": "push", "paths": [MANIFEST, "blobs/aa/blob.bin"]}

    reader = HfApi(endpoint=hub.endpoint)  # reads need no token
    tree = list(reader.list_repo_tree("owner/cache", path_in_repo="manifests", recursive=True,
                                      repo_type=repo_type, revision="main"))
    assert [(type(e).__name__, e.path) for e in tree] == [("RepoFolder", "manifests/ab"), ("RepoFile", MANIFEST)]
    assert (tree[1].size, tree[1].blob_id, tree[1].lfs, tree[1].xet_hash) == (
        len(manifest), git_blob_oid(manifest), None, None)
    flat = list(reader.list_repo_tree("owner/cache", repo_type=repo_type))  # not recursive: top level only
    assert [e.path for e in flat] == ["blobs", "manifests"]
    assert reader.repo_info("owner/cache", repo_type=repo_type).sha == info.oid
    assert reader.file_exists("owner/cache", MANIFEST, repo_type=repo_type)
    assert not reader.file_exists("owner/cache", "manifests/ab/missing.json", repo_type=repo_type)

    for path, data in ((MANIFEST, manifest), ("blobs/aa/blob.bin", blob)):
        local = hf_hub_download("owner/cache", path, repo_type=repo_type, revision="main",
                                local_dir=tmp_path / "out", endpoint=hub.endpoint, token=False)
        assert Path(local) == tmp_path / "out" / path and Path(local).read_bytes() == data
    prefix = "" if repo_type == "model" else "/datasets"
    assert ("HEAD", f"{prefix}/owner/cache/resolve/main/{MANIFEST}") in hub.requests
    assert ("GET", f"{prefix}/owner/cache/resolve/main/{MANIFEST}") in hub.requests
    assert [m for m, p in hub.requests if "/preupload/" in p or "/commit/" in p] == ["POST", "POST"]
    assert not any("xet" in p.lower() or "lfs" in p.lower() for _, p in hub.requests)  # plain HTTP only


def test_missing_paths_behave_like_the_hub(hub):
    hub.create_repo("owner/data", repo_type="dataset")
    api = HfApi(endpoint=hub.endpoint)
    assert list(api.list_repo_tree("owner/data", recursive=True, repo_type="dataset")) == []  # empty repo
    hub.commit_files("owner/data", {MANIFEST: b"{}"}, repo_type="dataset")
    for folder in ("manifests/zz", MANIFEST):  # a missing folder, or a file, is a 404 EntryNotFound
        with pytest.raises(RemoteEntryNotFoundError):
            list(api.list_repo_tree("owner/data", path_in_repo=folder, recursive=True, repo_type="dataset"))
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("owner/data", "manifests/ab/nope.json", repo_type="dataset", endpoint=hub.endpoint)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("owner/missing", "x.json", repo_type="dataset", endpoint=hub.endpoint)
    with pytest.raises(RepositoryNotFoundError):
        list(api.list_repo_tree("owner/data", repo_type="model"))  # right id, wrong repo type
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("owner/data", MANIFEST, repo_type="dataset", revision="nope", endpoint=hub.endpoint)
    assert not api.repo_exists("owner/missing", repo_type="dataset")
    assert api.repo_exists("owner/data", repo_type="dataset")


def test_reads_at_an_old_commit_sha(hub, tmp_path):
    hub.create_repo("owner/model")
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    first = _commit(api, "owner/model", "model", {"a.json": _local(tmp_path, "a1", b"v1")}, "one")
    second = _commit(api, "owner/model", "model", {
        "a.json": _local(tmp_path, "a2", b"v2"), "sub/b.json": _local(tmp_path, "b", b"b")}, "two")
    assert first.oid != second.oid

    def read(rev: str) -> bytes:
        return Path(hf_hub_download("owner/model", "a.json", revision=rev, cache_dir=tmp_path / "cache",
                                    endpoint=hub.endpoint)).read_bytes()

    assert (read(first.oid), read(second.oid), read("main")) == (b"v1", b"v2", b"v2")
    assert [e.path for e in api.list_repo_tree("owner/model", recursive=True, revision=first.oid)] == ["a.json"]
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("owner/model", "sub/b.json", revision=first.oid, endpoint=hub.endpoint,
                        local_dir=tmp_path / "old")
    assert hub.files("owner/model", revision=first.oid) == {"a.json": b"v1"}
    # Re-committing unchanged content is a no-op client-side (the preupload oid matches): no new commit.
    again = _commit(api, "owner/model", "model", {"a.json": _local(tmp_path, "a3", b"v2")}, "three")
    assert again.oid == second.oid and len(hub.commits("owner/model")) == 3


def test_writes_need_the_write_token(hub, tmp_path):
    hub.create_repo("owner/data", repo_type="dataset")
    seeded = hub.commit_files("owner/data", {MANIFEST: b"{}"}, repo_type="dataset")
    local = _local(tmp_path, "x", b"x")
    for token in (None, "hf_wrong"):
        with pytest.raises(HfHubHTTPError) as err:
            _commit(HfApi(endpoint=hub.endpoint, token=token), "owner/data", "dataset", {"x.json": local})
        assert err.value.response.status_code == 401
    with pytest.raises(HfHubHTTPError):
        HfApi(endpoint=hub.endpoint).create_repo("owner/other", repo_type="dataset")
    assert hub.head("owner/data", "dataset") == seeded and "owner/other" not in json.dumps(hub._state())
    assert not any("/commit/" in p for _, p in hub.requests)  # refused at preupload, before any commit
    # ... while reads need none.
    assert hf_hub_download("owner/data", MANIFEST, repo_type="dataset", endpoint=hub.endpoint,
                           local_dir=tmp_path / "out", token=False)


def test_concurrent_commits_both_land(hub, tmp_path):
    hub.create_repo("owner/data", repo_type="dataset")
    barrier, results, errors = threading.Barrier(2), {}, []

    def push(name: str) -> None:
        try:
            api = HfApi(endpoint=hub.endpoint, token=TOKEN)
            barrier.wait()
            results[name] = _commit(api, "owner/data", "dataset",
                                    {f"manifests/{name}.json": _local(tmp_path, name, name.encode())}, name).oid
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=push, args=(n,)) for n in ("left", "right")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors and len(set(results.values())) == 2
    assert hub.files("owner/data", "dataset") == {"manifests/left.json": b"left", "manifests/right.json": b"right"}
    assert sorted(c["message"] for c in hub.commits("owner/data", "dataset")[1:]) == ["left", "right"]


def test_fail_commits_leaves_the_repo_unchanged(hub, tmp_path):
    hub.create_repo("owner/data", repo_type="dataset")
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    before = hub.commits("owner/data", "dataset")
    hub.fail_commits = 1
    with pytest.raises(HfHubHTTPError) as err:
        _commit(api, "owner/data", "dataset", {MANIFEST: _local(tmp_path, "m", b"{}")})
    assert err.value.response.status_code == 500
    assert hub.fail_commits == 0 and hub.commits("owner/data", "dataset") == before
    assert hub.files("owner/data", "dataset") == {}
    assert _commit(api, "owner/data", "dataset", {MANIFEST: _local(tmp_path, "m2", b"{}")}).oid
    assert hub.files("owner/data", "dataset") == {MANIFEST: b"{}"}


def test_paginated_tree_and_snapshot_download(hub, tmp_path):
    hub.create_repo("owner/data", repo_type="dataset")
    files = {f"manifests/{i:02x}/{i:064x}.json": b"%d" % i for i in range(5)}
    hub.commit_files("owner/data", files, repo_type="dataset")
    hub.tree_page_size = 3  # 10 entries (5 folders, 5 files) => 4 pages, followed by huggingface_hub
    api = HfApi(endpoint=hub.endpoint)
    tree = list(api.list_repo_tree("owner/data", path_in_repo="manifests", recursive=True, repo_type="dataset"))
    assert sorted(e.path for e in tree if hasattr(e, "size")) == sorted(files)
    assert sum(1 for m, p in hub.requests if "/tree/" in p) == 4
    out = snapshot_download("owner/data", repo_type="dataset", local_dir=tmp_path / "snap", endpoint=hub.endpoint)
    assert {p: (Path(out) / p).read_bytes() for p in files} == files


def test_runs_as_a_separate_process(tmp_path):
    port_file = tmp_path / "endpoint"
    proc = subprocess.Popen([sys.executable, "-m", "tests.fakes.hub_server", "--port-file", str(port_file),
                             "--repo", "owner/data:dataset", "--repo", "owner/model"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
            time.sleep(0.05)
        endpoint = port_file.read_text().strip()
        api = HfApi(endpoint=endpoint, token=TOKEN)
        info = _commit(api, "owner/data", "dataset", {MANIFEST: _local(tmp_path, "m", b"{}")})
        assert [e.path for e in api.list_repo_tree("owner/model")] == []
        with urllib.request.urlopen(f"{endpoint}/_standin/state") as response:
            state = json.load(response)
        assert state["repos"]["dataset:owner/data"]["branches"]["main"] == info.oid
        assert list(state["repos"]["dataset:owner/data"]["files"]) == [MANIFEST]
        assert state["lfs_threshold"] is None
        assert _http("POST", f"{endpoint}/_standin/lfs_threshold", {"threshold": 1024})[0] == 200
        with urllib.request.urlopen(f"{endpoint}/_standin/state") as response:
            assert json.load(response)["lfs_threshold"] == 1024
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


@pytest.mark.parametrize("repo_type", ["model", "dataset"])
def test_lfs_threshold_sends_large_files_through_lfs(hub, tmp_path, no_xet, repo_type):
    hub.lfs_threshold = 1024
    hub.create_repo("owner/cache", repo_type=repo_type)
    manifest, blob = b'{"key": "%s"}' % KEY.encode(), bytes(range(256)) * 40  # 76 bytes inline, 10240 via LFS
    sha = hashlib.sha256(blob).hexdigest()
    writer = HfApi(endpoint=hub.endpoint, token=TOKEN)
    files = {MANIFEST: _local(tmp_path, "m.json", manifest), "blobs/aa/blob.bin": _local(tmp_path, "b.bin", blob)}
    info = _commit(writer, "owner/cache", repo_type, files)

    prefix, api = "" if repo_type == "model" else "/datasets", f"/api/{repo_type}s/owner/cache"
    lfs = f"{prefix}/owner/cache.git/info/lfs/objects"
    assert hub.requests == [("POST", f"{api}/preupload/main"), ("POST", f"{lfs}/batch"), ("PUT", f"{lfs}/{sha}"),
                            ("POST", f"{lfs}/verify"), ("POST", f"{api}/commit/main")]  # one PUT: the large file
    assert hub.files("owner/cache", repo_type) == {MANIFEST: manifest, "blobs/aa/blob.bin": blob}
    assert hub.lfs_files("owner/cache", repo_type) == {"blobs/aa/blob.bin": sha}  # the manifest went inline
    assert hub.lfs_objects("owner/cache", repo_type) == {sha: blob}
    assert hub.commits("owner/cache", repo_type)[-1]["paths"] == [MANIFEST, "blobs/aa/blob.bin"]

    reader = HfApi(endpoint=hub.endpoint)
    tree = {e.path: e for e in reader.list_repo_tree("owner/cache", recursive=True, repo_type=repo_type)}
    big, small = tree["blobs/aa/blob.bin"], tree[MANIFEST]
    assert (big.size, big.blob_id, big.lfs.sha256, big.lfs.size, big.lfs.pointer_size, big.xet_hash) == (
        len(blob), git_blob_oid(lfs_pointer(blob)), sha, len(blob), len(lfs_pointer(blob)), None)
    assert (small.size, small.blob_id, small.lfs) == (len(manifest), git_blob_oid(manifest), None)
    meta = get_hf_file_metadata(hf_hub_url("owner/cache", "blobs/aa/blob.bin", repo_type=repo_type,
                                           endpoint=hub.endpoint))
    assert (meta.etag, meta.size, meta.commit_hash, meta.xet_file_data) == (sha, len(blob), info.oid, None)
    for path, data, etag in ((MANIFEST, manifest, git_blob_oid(manifest)), ("blobs/aa/blob.bin", blob, sha)):
        local = Path(hf_hub_download("owner/cache", path, repo_type=repo_type, cache_dir=tmp_path / "cache",
                                     endpoint=hub.endpoint, token=False))
        assert local.read_bytes() == data and local.resolve().name == etag  # cached blob named by its etag
    assert not any("xet" in p.lower() for _, p in hub.requests)

    # Unchanged: the batch answers "already stored" (no actions => no PUT) and the commit is skipped as a no-op.
    before = len(hub.requests)
    again = _commit(writer, "owner/cache", repo_type, files, "again")
    assert again.oid == info.oid and len(hub.commits("owner/cache", repo_type)) == 2
    assert [m for m, p in hub.requests[before:] if m != "GET"] == ["POST", "POST"]  # preupload + batch


def test_lfs_commit_of_an_object_never_uploaded_changes_nothing(hub, tmp_path, no_xet):
    hub.lfs_threshold = 100
    for name in ("owner/a", "owner/b"):
        hub.create_repo(name, repo_type="dataset")
    api = HfApi(endpoint=hub.endpoint, token=TOKEN)
    big = CommitOperationAdd("big.bin", path_or_fileobj=_local(tmp_path, "big", b"x" * 500))
    api.preupload_lfs_files("owner/a", additions=[big], repo_type="dataset")  # uploaded to owner/a only
    assert list(hub.lfs_objects("owner/a", "dataset")) == [hashlib.sha256(b"x" * 500).hexdigest()]
    before = hub.commits("owner/b", "dataset")
    small = CommitOperationAdd(MANIFEST, path_or_fileobj=_local(tmp_path, "m", b"{}"))
    # LFS objects are per repo (as on the Hub): owner/b never got this one, so its lfsFile line is refused.
    with pytest.raises(BadRequestError) as err:
        api.create_commit("owner/b", operations=[big, small], commit_message="x", repo_type="dataset")
    assert err.value.response.status_code == 400 and "big.bin" in err.value.response.headers["X-Error-Message"]
    assert hub.commits("owner/b", "dataset") == before  # nothing applied, not even the small file
    assert hub.files("owner/b", "dataset") == {}

    # The same, straight over HTTP, with an oid no repo has.
    header = {"key": "header", "value": {"summary": "raw"}}
    line = {"key": "lfsFile", "value": {"path": "c.bin", "algo": "sha256", "oid": "c" * 64, "size": 3}}
    payload = b"\n".join(json.dumps(x).encode() for x in (header, line))
    status, _, _ = _http("POST", f"{hub.endpoint}/api/datasets/owner/a/commit/main", payload, TOKEN)
    assert status == 400 and len(hub.commits("owner/a", "dataset")) == 1 and hub.files("owner/a", "dataset") == {}


def test_lfs_endpoints_check_the_token_and_the_bytes(hub):
    hub.create_repo("owner/model")
    data, other = b"large object" * 10, b"something else" * 10
    oid = hashlib.sha256(data).hexdigest()
    batch = f"{hub.endpoint}/owner/model.git/info/lfs/objects/batch"
    request = {"operation": "upload", "transfers": ["basic", "multipart"], "hash_algo": "sha256",
               "objects": [{"oid": oid, "size": len(data)}, {"oid": "nope", "size": 1}], "ref": {"name": "main"}}
    for token in (None, "hf_wrong"):
        assert _http("POST", batch, request, token)[0] == 401
    status, headers, body = _http("POST", batch, request, TOKEN)
    answer = json.loads(body)
    assert status == 200 and headers["Content-Type"] == "application/vnd.git-lfs+json"
    assert answer["transfer"] == "basic" and answer["objects"][1]["error"]["code"] == 422
    actions = answer["objects"][0]["actions"]
    href = actions["upload"]["href"]
    assert href.startswith(f"{hub.endpoint}/owner/model.git/info/lfs/objects/{oid}?")
    assert _http("PUT", href.replace("signature=", "signature=0"), data)[0] == 403  # a forged href
    assert _http("PUT", href, other[:len(data)])[0] == 400  # bytes that do not hash to the oid
    assert _http("POST", actions["verify"]["href"], {"oid": oid, "size": len(data)}, TOKEN)[0] == 404
    assert hub.lfs_objects("owner/model") == {}
    assert _http("PUT", href, data)[0] == 200  # the signed href is the credential (no Authorization header)
    assert _http("POST", actions["verify"]["href"], {"oid": oid, "size": len(data)}, TOKEN)[0] == 200
    assert hub.lfs_objects("owner/model") == {oid: data}
    again = json.loads(_http("POST", batch, request, TOKEN)[2])["objects"][0]
    assert again == {"oid": oid, "size": len(data)}  # already stored: no actions
    assert _http("POST", batch, {**request, "transfers": ["xet"]}, TOKEN)[0] == 422  # never offers Xet


def test_xet_is_not_served(hub, tmp_path, monkeypatch):
    """Without HF_HUB_DISABLE_XET, huggingface_hub (hf_xet installed) asks for a Xet write token instead of
    calling the LFS batch endpoint: the stand-in refuses it (400, with the hint), and nothing is committed."""
    pytest.importorskip("hf_xet")
    monkeypatch.delenv("HF_HUB_DISABLE_XET", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)
    hub.lfs_threshold = 100
    hub.create_repo("owner/model")
    with pytest.raises(OSError, match="xet-write-token"):  # hf_xet's ConnectionError, raised from Rust
        _commit(HfApi(endpoint=hub.endpoint, token=TOKEN), "owner/model", "model",
                {"big.bin": _local(tmp_path, "big", b"x" * 500)})
    assert ("GET", "/api/models/owner/model/xet-write-token/main") in hub.requests
    assert not any("/lfs/" in p or "/commit/" in p for _, p in hub.requests)
    status, headers, _ = _http("GET", f"{hub.endpoint}/api/models/owner/model/xet-write-token/main", token=TOKEN)
    assert status == 400 and "HF_HUB_DISABLE_XET" in headers["X-Error-Message"]
