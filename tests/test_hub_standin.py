"""The Hub stand-in (tests/fakes/hub_server.py) proven with huggingface_hub's real public functions: what
works against it here is what the real Hub client does (preupload + NDJSON commit, HEAD + GET on resolve
URLs, tree listings), with no network and no LFS/Xet transfer."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from huggingface_hub import CommitOperationAdd, HfApi, hf_hub_download, snapshot_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.conftest import REPO
from tests.fakes.hub_server import HubStandIn, git_blob_oid

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
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
