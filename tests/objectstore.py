"""The push/pull/verify/race flows every object-store remote runs against its real API server on the
loopback (tests/test_remote_gcs.py, tests/test_remote_azure.py; tests/test_remote_s3.py has its own).
Each takes the remote's URL in a fresh bucket; entries are small stand-ins (tests/standins.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from aotbuild import signing
from aotbuild.remote import parse_remote
from aotbuild.remote_fsspec import FsspecRemote
from aotbuild.store import Store
from tests.conftest import REPO
from tests.standins import add_entry, entries, key_of


def objects(remote: FsspecRemote, folder: str) -> list[str]:
    return remote.fs.find(f"{remote.root}/{folder}")


def push_is_incremental_and_pull_fetches_only_what_is_missing(url: str, tmp_path: Path) -> None:
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"k/x.so": b"kernel-a", "shared.py": b"same in both"})
    b = add_entry(local, tmp_path, "b", {"k/y.so": b"kernel-b", "shared.py": b"same in both"})
    remote = parse_remote(url)
    assert remote.keys() == set()
    first = remote.push(entries(local, a))
    assert first.sent == [a] and first.bytes_sent == len(b"kernel-a") + len(b"same in both")
    second = remote.push(entries(local, a, b))
    assert second.present == [a] and second.sent == [b] and second.bytes_sent == len(b"kernel-b")
    assert remote.keys() == {a, b} and len(objects(remote, "blobs")) == 3

    other = Store(tmp_path / "other")
    assert remote.fetch(a, other) == ""
    read: list[str] = []
    real = remote.fs.cat_file
    remote.fs.cat_file = lambda path, **kw: read.append(path) or real(path, **kw)
    assert remote.fetch(b, other) == ""  # the shared blob is already local: only kernel-b's blob is read
    assert sum("/blobs/" in p for p in read) == 1 and sum("/manifests/" in p for p in read) == 1
    entry, _ = other.open_entry(b)
    assert entry is not None and {rel: blob.read_bytes() for rel, blob in entry.files} == {
        "k/y.so": b"kernel-b", "shared.py": b"same in both"}
    assert remote.fetch(key_of("nope"), other) == "not on the remote"


def a_damaged_blob_is_refused_and_nothing_is_stored(url: str, tmp_path: Path, damage: str) -> None:
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a", "y.so": b"kernel-b"})
    remote = parse_remote(url)
    remote.push(entries(local, a))
    victim = max(objects(remote, "blobs"))  # fetched last: blobs are fetched in digest order
    remote.fs.pipe_file(victim, {"truncated": b"kern", "replaced": b"kernel-X", "longer": b"kernel-XY"}[damage])
    other = Store(tmp_path / "other")
    why = remote.fetch(a, other)
    assert why.startswith("refused") and victim.rsplit("/", 1)[1][:12] in why, why
    assert not other.has(a)
    assert [p for p in other.root.rglob("*") if p.is_file() and p.suffix != ".lock"] == []


def an_empty_blob_and_one_of_an_exact_multiple_of_the_range_are_pulled(url: str, tmp_path: Path,
                                                                         monkeypatch) -> None:
    from aotbuild import remote_fsspec, store

    monkeypatch.setattr(remote_fsspec, "RANGE", 4)  # the 8 MiB range and 1 MiB read, made small
    monkeypatch.setattr(store, "_CHUNK", 4)
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"empty.py": b"", "x.so": b"kernel-a", "y.so": b"kernel-b-12"})
    remote = parse_remote(url)
    assert remote.push(entries(local, a)).sent == [a] and len(objects(remote, "blobs")) == 3
    other = Store(tmp_path / "other")
    assert remote.fetch(a, other) == ""
    entry, _ = other.open_entry(a)
    assert entry is not None and {rel: blob.read_bytes() for rel, blob in entry.files} == {
        "empty.py": b"", "x.so": b"kernel-a", "y.so": b"kernel-b-12"}


def a_pull_racing_a_push_sees_no_entry_until_its_blobs_are_there(url: str, tmp_path: Path) -> None:
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a", "y.so": b"kernel-b"})
    pusher, reader = parse_remote(url), parse_remote(url)
    blobs_up, go_on = threading.Event(), threading.Event()
    real = pusher.fs.pipe_file

    def pipe_file(path, data, **kw):  # the manifest write: hold it until the reader has looked
        blobs_up.set()
        assert go_on.wait(60)
        return real(path, data, **kw)

    pusher.fs.pipe_file = pipe_file
    thread = threading.Thread(target=pusher.push, args=(entries(local, a),))
    thread.start()
    try:
        assert blobs_up.wait(60)
        other = Store(tmp_path / "other")
        assert len(objects(reader, "blobs")) == 2 and reader.keys() == set()
        assert reader.fetch(a, other) == "not on the remote"
    finally:
        go_on.set()
        thread.join(60)
    assert reader.fetch(a, other) == "" and other.open_entry(a)[0] is not None


PUSHER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from aotbuild.remote import parse_remote
    from aotbuild.store import Store
    local = Store(Path(sys.argv[1]))
    found = [local.open_entry(m.key)[0] for m in local.iter_manifests()]
    result = parse_remote(sys.argv[2]).push(found)
    print("RESULT", len(result.sent), len(result.present), flush=True)
""")


def two_concurrent_pushers_of_the_same_keys_both_succeed(url: str, tmp_path: Path) -> None:
    local = Store(tmp_path / "local")
    keys = [add_entry(local, tmp_path, f"e{i}", {f"f{j}.so": os.urandom(5000) for j in range(3)}) for i in range(6)]
    script = tmp_path / "pusher.py"
    script.write_text(PUSHER)
    procs = [subprocess.Popen([sys.executable, str(script), str(local.root), url], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    sent = [int(o[0].split()[1]) for o in outs]
    assert sum(sent) >= len(keys)  # each key sent by one of them at least
    remote = parse_remote(url)
    assert remote.keys() == set(keys)
    other = Store(tmp_path / "other")
    fetched = {k: remote.fetch(k, other) for k in keys}
    assert all(v == "" for v in fetched.values()), fetched


def a_trusted_signed_manifest_is_never_overwritten_and_an_unsigned_one_gives_way(url: str, tmp_path: Path) -> None:
    ci_key, ci_pub = signing.keygen(tmp_path / "keys" / "ci")
    trusted = signing.load_trusted([ci_pub])
    plain = Store(tmp_path / "plain")
    a = add_entry(plain, tmp_path, "a", {"x.so": b"kernel-a"})
    signed = Store(tmp_path / "signed")
    add_entry(signed, tmp_path, "a", {"x.so": b"kernel-a"})
    signed.put_manifest(signing.sign(signed.read_manifest(a), ci_key))
    remote = parse_remote(url)
    assert remote.push(entries(plain, a), trusted=trusted).sent == [a]  # unsigned first
    result = remote.push(entries(signed, a), trusted=trusted)
    assert result.superseded == [a] and signing.check(remote.read_manifest(a), trusted) == ""
    again = remote.push(entries(plain, a), trusted=trusted)  # an unsigned one never replaces it
    assert again.present == [a] and signing.check(remote.read_manifest(a), trusted) == ""


def a_manifest_is_written_create_only(url: str, tmp_path: Path, etag: str) -> None:
    """Two pushers that both saw no manifest: the server refuses the second's create-only write and
    it reports the key present instead of overwriting (``etag``: the store's name for the version)."""
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    first, second = parse_remote(url), parse_remote(url)
    second.keys = lambda: set()  # it listed before the first one's manifest landed
    assert first.push(entries(local, a)).sent == [a]
    before = first.fs.info(first.manifest_path(a))[etag]
    result = second.push(entries(local, a))
    assert result.sent == [] and result.present == [a]
    assert first.fs.info(first.manifest_path(a))[etag] == before
