"""Remotes with small real entries (no compiles): file:// for real, concurrency, a killed push, shards."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from aotbuild.cache.store import Store
from aotbuild.errors import RemoteError, UsageError
from aotbuild.planner import Job, JobStatus, parse_shard, shard_jobs
from aotbuild.recipe.rules import parse_recipe
from aotbuild.remote.schemes import FolderRemote, HubRemote, parse_remote
from tests.conftest import REPO
from tests.standins import add_entry, entries, key_of


def blob_names(store: Store) -> set[str]:
    """The blob files under the store's blobs/ folder (each is named by its sha256)."""
    return {p.name for p in store.layout.blobs.rglob("*") if p.is_file()}


def listed_blobs(store: Store, *keys: str) -> set[str]:
    """The blobs the manifests of ``keys`` list."""
    return {f.sha256 for key in keys for f in store.read_manifest(key).files}


@pytest.mark.parametrize("url,kind,expected", [
    ("file:///srv/aot", FolderRemote, "/srv/aot"),
    ("hf://org/cache", HubRemote, ("org/cache", "model", None)),
    ("hf://datasets/org/cache@v2", HubRemote, ("org/cache", "dataset", "v2")),
])
def test_parse_remote(url, kind, expected):
    remote = parse_remote(url)
    assert isinstance(remote, kind)
    if kind is FolderRemote:
        assert str(remote.store.root) == expected
    else:
        assert (remote.repo_id, remote.repo_type, remote.revision) == expected


@pytest.mark.parametrize("url,message", [
    ("file://relative/dir", "three slashes"),
    ("hf://only-one-part", "hf://owner/repo"),
    ("ftp://host/x", "is not a remote"),
])
def test_bad_remote_urls_say_what_is_allowed(url, message):
    with pytest.raises(UsageError, match=message):
        parse_remote(url)


def test_folder_push_is_incremental_and_pull_verifies(tmp_path):
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"k/x.so": b"kernel-a", "shared.py": b"same in both"})
    b = add_entry(local, tmp_path, "b", {"k/y.so": b"kernel-b", "shared.py": b"same in both"})
    remote = parse_remote(f"file://{tmp_path / 'remote'}")
    first = remote.push(entries(local, a))
    assert first.sent == [a] and first.bytes_sent == len(b"kernel-a") + len(b"same in both")
    assert len(blob_names(remote.store)) == 2 and blob_names(remote.store) == listed_blobs(remote.store, a)
    second = remote.push(entries(local, a, b))
    assert second.present == [a] and second.sent == [b]
    assert second.bytes_sent == len(b"kernel-b")  # the shared blob was already there
    assert remote.keys() == {a, b}
    # The remote's blobs/ holds exactly what its manifests list: 3 blobs, the shared one once.
    assert len(blob_names(remote.store)) == 3 and blob_names(remote.store) == listed_blobs(remote.store, a, b)

    other = Store(tmp_path / "other")
    assert remote.fetch(a, other) == ""
    entry, why = other.open_entry(a)
    assert entry is not None and {rel for rel, _ in entry.files} == {"k/x.so", "shared.py"}
    assert remote.fetch(key_of("nope"), other) == "not on the remote"


def test_a_tampered_remote_blob_is_refused_and_nothing_is_stored(tmp_path):
    """Two blobs, the second (in fetch order) tampered: the first is stored before the second is
    refused, so "nothing is stored" checks that the refused pull removed it."""
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a", "y.so": b"kernel-b"})
    remote = parse_remote(f"file://{tmp_path / 'remote'}")
    remote.push(entries(local, a))
    listed = listed_blobs(remote.store, a)
    assert len(listed) == 2 and blob_names(remote.store) == listed  # the remote's blobs are there
    blob = remote.store.layout.blob(max(listed))  # fetched last: blobs are fetched in digest order
    blob.chmod(0o644)
    blob.write_bytes(b"kernel-X")  # same size, other bytes
    other = Store(tmp_path / "other")
    why = remote.fetch(a, other)
    assert why.startswith("refused") and "does not match its content" in why and max(listed)[:12] in why
    assert not other.layout.manifest(a).is_file()
    # Nothing anywhere in the store but its lock: no blob, no manifest, no temp file.
    assert [p for p in other.root.rglob("*") if p.is_file() and p.suffix != ".lock"] == []


def test_a_missing_remote_folder_is_an_error_not_an_empty_remote(tmp_path):
    """A typo or an unmounted share: reads say so instead of "not on the remote", and a push does
    not create a whole tree (it creates the remote folder itself only inside an existing parent)."""
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    gone = parse_remote(f"file://{tmp_path / 'unmounted' / 'cache'}")
    with pytest.raises(RemoteError, match="no such folder"):
        gone.keys()
    with pytest.raises(RemoteError, match="no such folder"):
        gone.fetch(a, Store(tmp_path / "other"))
    with pytest.raises(RemoteError, match="does not exist"):
        gone.push(entries(local, a))
    assert not (tmp_path / "unmounted").exists()


def test_pushing_to_an_unwritable_folder_is_one_clear_error(tmp_path, monkeypatch):
    """A folder we may not write in (faked: this suite runs as root, which writes anywhere): creating
    anything in it is denied, as the kernel denies it in a 0555 folder of another user."""
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    target = tmp_path / "ro"
    target.mkdir()
    denied: list[str] = []
    real_mkdir, real_open = os.mkdir, os.open

    def refuse(path) -> None:
        denied.append(os.fspath(path))
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))

    def mkdir(path, *args, **kwargs):
        if Path(path).parent == target:
            refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if flags & os.O_CREAT and Path(path).parent == target:
            refuse(path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "open", open_)
    with pytest.raises(RemoteError, match="cannot write to file://"):
        parse_remote(f"file://{target}").push(entries(local, a))
    assert denied  # the push did try to write there, and was refused


PUSHER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from aotbuild.remote.schemes import parse_remote
    from aotbuild.cache.store import Store
    local, url, delay = Store(Path(sys.argv[1])), sys.argv[2], float(sys.argv[3])
    remote = parse_remote(url)
    if delay:  # slow every blob write down, so the parent can kill the push midway
        put = remote.store.put_blob
        def slow(*a, **k):
            out = put(*a, **k)
            print("blob", flush=True)
            time.sleep(delay)
            return out
        remote.store.put_blob = slow
    keys = [m.key for m in local.iter_manifests()]
    found = [local.open_entry(k)[0] for k in keys]
    print("RESULT", len(remote.push(found).sent), flush=True)
""")


def _spawn(tmp_path: Path, local: Path, remote: str, delay: float = 0.0) -> subprocess.Popen:
    script = tmp_path / "pusher.py"
    script.write_text(PUSHER)
    return subprocess.Popen([sys.executable, str(script), str(local), remote, str(delay)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_two_concurrent_pushers_both_succeed(tmp_path):
    local = Store(tmp_path / "local")
    keys = [add_entry(local, tmp_path, f"e{i}", {f"f{j}.so": os.urandom(20_000) for j in range(5)})
            for i in range(8)]
    url = f"file://{tmp_path / 'remote'}"
    procs = [_spawn(tmp_path, local.root, url) for _ in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    remote = parse_remote(url)
    assert remote.keys() == set(keys)
    for key in keys:  # every entry whole and hash-correct
        assert remote.store.open_entry(key)[0] is not None


def test_a_killed_push_leaves_no_manifest_without_its_blobs(tmp_path):
    local = Store(tmp_path / "local")
    keys = [add_entry(local, tmp_path, f"e{i}", {f"f{j}.so": os.urandom(1000) for j in range(3)}) for i in range(4)]
    url = f"file://{tmp_path / 'remote'}"
    proc = _spawn(tmp_path, local.root, url, delay=0.5)
    assert proc.stdout is not None
    lines = 0
    while lines < 4:  # the first entry is whole and pushed, the second half-way
        if proc.stdout.readline().startswith("blob"):
            lines += 1
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    remote = parse_remote(url)
    present = remote.keys()
    assert 0 < len(present) < len(keys)
    for key in present:  # whatever manifest is there points at whole blobs
        assert remote.store.open_entry(key)[0] is not None
    # the next push completes the job
    assert _spawn(tmp_path, local.root, url).wait(timeout=120) == 0
    assert remote.keys() == set(keys)


def _job(name: str, key: str | None) -> Job:
    recipe = parse_recipe({"model": "builtin:tiny-sd", "device": "cpu", "shapes": [{"height": 64, "width": 64}]},
                          f"{name}.yaml")
    return Job(recipe, "unet", recipe.shapes[0], key, {} if key else None, JobStatus.MISS if key else "unavailable", "")


def test_shards_split_every_job_once_whatever_is_cached():
    """Shards are dealt by job identity (recipe, component, shape), never by key (tests/test_shards.py)."""
    jobs = [_job(f"r{i}", key_of(f"k{i}")) for i in range(10)] + [_job("twin", key_of("k3")), _job("gone", None)]
    shards = [shard_jobs(jobs, i, 3) for i in (1, 2, 3)]
    names = [[j.recipe.name for j in s] for s in shards]
    assert sorted(sum(names, [])) == sorted(j.recipe.name for j in jobs)  # each job in exactly one shard
    assert max(map(len, names)) - min(map(len, names)) <= 1  # balanced
    hit = [Job(j.recipe, j.component, j.shape, j.key, j.factors, "hit", "") if j.key == key_of("k0") else j
           for j in jobs]
    assert [j.recipe.name for j in shard_jobs(hit, 2, 3)] == names[1]  # status does not matter


@pytest.mark.parametrize("text", ["0/3", "4/3", "1/0", "a/b", "2"])
def test_bad_shard_specs(text):
    with pytest.raises(UsageError, match="--shard"):
        parse_shard(text)


def test_parse_shard():
    assert parse_shard("2/4") == (2, 4)


def test_the_planner_alone_decides_what_a_remote_holds_whole_rank_groups_only(tmp_path):
    """planner.mark_remote is what plan --remote, plan(remote=) and a build's --push skip read: a
    tensor-parallel job counts as on the remote only when every rank's entry is there (a build used
    to apply that rule and plan --remote did not: it showed rank 0 on the remote, rank 1 a miss)."""
    from dataclasses import replace

    from aotbuild.planner import mark_remote

    local, folder = Store(tmp_path / "local"), tmp_path / "remote"
    a, r0, r1 = (add_entry(local, tmp_path, n, {"x.bin": n.encode()}) for n in ("a", "r0", "r1"))
    remote = parse_remote(f"file://{folder}")
    remote.push(entries(local, a, r0))  # rank 1 of the two-rank job never arrived
    plain = _job("plain", a)
    ranks = [replace(_job("tp", k), rank=i, siblings=(r0, r1)) for i, k in enumerate((r0, r1))]
    absent = _job("absent", key_of("absent"))
    marked = mark_remote([plain, *ranks, absent], f"file://{folder}")
    assert [j.status for j in marked] == [JobStatus.REMOTE, JobStatus.MISS, JobStatus.MISS, JobStatus.MISS]
    assert all("not every rank" in j.reason and "rank 1's entry" in j.reason for j in marked[1:3])
    assert marked[3].reason == "" and [j.on_remote for j in marked] == ["entry", "partial", "partial", "absent"]
    remote.push(entries(local, r1))
    assert [j.status for j in mark_remote([*ranks], f"file://{folder}")] == [JobStatus.REMOTE] * 2
    # A rank the local cache has counts as there: pull fetches only the other one.
    have_one = [replace(ranks[0], status=JobStatus.HIT), ranks[1]]
    remote.store.remove_manifest(r0)
    assert [j.status for j in mark_remote(have_one, f"file://{folder}")] == [JobStatus.HIT, JobStatus.REMOTE]
