"""The push/pull/verify/race flows every object-store remote runs against its real API server on the
loopback (tests/test_remote_s3.py, tests/test_remote_gcs.py, tests/test_remote_azure.py). Each takes
the remote's URL in a fresh bucket; entries are small stand-ins (tests/standins.py), but for one real
build per store (``built_cache``, the session's), served by a fresh process."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from aotbuild.cache import signing
from aotbuild.cache.store import Store
from aotbuild.errors import RemoteError
from aotbuild.remote.objectstore import FsspecRemote
from aotbuild.remote.schemes import parse_remote, pull_entry
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
    real = remote._read  # every bounded read of an object's bytes (aotbuild/remote/bounds.py)
    remote._read = lambda path, *a, **kw: read.append(path) or real(path, *a, **kw)
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
    assert not other.layout.manifest(a).is_file()
    assert [p for p in other.root.rglob("*") if p.is_file() and p.suffix != ".lock"] == []


def an_empty_blob_and_one_of_an_exact_multiple_of_the_range_are_pulled(url: str, tmp_path: Path,
                                                                         monkeypatch) -> None:
    from aotbuild.cache import store
    from aotbuild.remote import objectstore as remote_fsspec

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
    from aotbuild.remote.schemes import parse_remote
    from aotbuild.cache.store import Store
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


def a_real_build_is_pulled_by_a_fresh_process_and_served_with_0_compiles(built_cache, url: str, tmp_path: Path,
                                                                         one_shape: bool = False) -> None:
    """The session's real build, pushed with the CLI, pulled by a fresh process on another cache (only
    the built-in model, which any machine can create), served with 0 compiles and output equal to
    eager (tests/serving.py). ``one_shape``: the tiny recipe at its first shape only, one entry of the
    same build (the same key): a store's serve at half the cost, where another store serves both."""
    import json
    import shutil

    import yaml

    from tests.conftest import TINY_RECIPE, run_cli
    from tests.serving import assert_served, assert_warm, serve_fresh

    cache, _ = built_cache
    recipe = TINY_RECIPE
    if one_shape:
        data = yaml.safe_load(TINY_RECIPE.read_text())
        data["shapes"] = data["shapes"][:1]
        recipe = tmp_path / "tiny_sd_one_shape.yaml"
        recipe.write_text(json.dumps(data))  # JSON is YAML
    pushed = run_cli("push", "--json", "--cache", str(cache), str(recipe), "--remote", url, env=dict(os.environ))
    assert pushed.returncode == 0, pushed.stderr[-3000:]
    entries = 1 if one_shape else 2
    assert len(json.loads(pushed.stdout)["sent"]) == entries  # a hit of the build: its key, not another
    serving = tmp_path / "serving"
    shutil.copytree(cache / "models", serving / "models")
    result = serve_fresh(recipe, serving, tmp_path, remote=url)  # a fresh process: pulls, then loads
    if one_shape:
        assert_served(result)
        assert result["shapes"] == 1 and result["counters"].get("fxgraph_cache_hit", 0) >= 1
    else:
        assert_warm(result)
    assert result["pulled"] == entries


#: A server of a store's own: entered, it starts and yields (its endpoint, how to stop it); left, it stops.
OwnServer = contextlib.AbstractContextManager[tuple[str, Callable[[], None]]]


def a_server_that_stops_mid_pull_is_a_remote_error_naming_it(server: OwnServer, connect: Callable[[str], str],
                                                              tmp_path: Path, secrets: tuple[str, ...] = ()) -> None:
    """A server of the store's own (``server``: started on entry, it yields its endpoint and how to
    stop it; stopped on exit), ``connect(endpoint)`` pointing the environment there and making a
    bucket (its URL returned). The server goes away after the manifest was read, as the first blob is
    asked for: the pull is one RemoteError naming the remote (after AOTBUILD_REMOTE_RETRIES tries, 2
    in these tests), never a partial entry, and no secret in the message."""
    with server as (endpoint, stop):
        url = connect(endpoint)
        local = Store(tmp_path / "local")
        a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a", "y.so": b"kernel-b"})
        remote = parse_remote(url)
        remote.push(entries(local, a))
        real, stopped = remote._read, []

        def read(path, *args, **kw):
            if "/blobs/" in path and not stopped:
                stopped.append(path)
                stop()
            return real(path, *args, **kw)

        remote._read = read
        other = Store(tmp_path / "other")
        with pytest.raises(RemoteError) as info:
            pull_entry(remote, a, other)
    message = str(info.value)
    assert stopped and message.startswith(f"{url}: reading ") and "failed after 2 tries" in message, message
    assert "\n" not in message and not any(s in message for s in secrets)
    assert not other.layout.manifest(a).is_file()
    assert [p for p in other.root.rglob("*") if p.is_file() and p.suffix != ".lock"] == []


@contextlib.contextmanager
def killed_on_stop(server: contextlib.AbstractContextManager[tuple[str, subprocess.Popen]]
                   ) -> Iterator[tuple[str, Callable[[], None]]]:
    """A server that runs as a process of its own (``server`` yields its endpoint and the process), as
    :func:`a_server_that_stops_mid_pull_is_a_remote_error_naming_it` takes one: stopping it kills it."""
    with server as (endpoint, proc):
        def stop() -> None:
            proc.kill()
            proc.wait()

        yield endpoint, stop


def failure_records_are_listed_read_replaced_and_removed(url: str) -> None:
    """The failure records a build pushes (sync.push_failures) on the store itself: listed, read
    bounded (an object bigger than a record may be is not one), replaced by a newer failure, removed."""
    from aotbuild.cache.store import MAX_FAILURE_BYTES
    from tests.standins import key_of

    remote = parse_remote(url)
    a, b = key_of("a"), key_of("b")
    assert remote.failure_keys() == set() and remote.read_failure(a) is None
    assert remote.put_failure(a, {"key": a, "reason": "first", "time": "1"})
    assert remote.put_failure(a, {"key": a, "reason": "again", "time": "2"})  # a newer failure replaces it
    remote.fs.pipe_file(remote.failure_path(b), b'{"reason": "' + b"x" * MAX_FAILURE_BYTES + b'"}')
    assert remote.failure_keys() == {a, b}
    times = remote.failure_times()  # the store's own modification times, from the listing (2020 on)
    assert set(times) == {a, b} and all(t > 1.6e9 for t in times.values()), times
    assert remote.read_failure(a) == {"key": a, "reason": "again", "time": "2"}
    assert remote.read_failure(b) is None  # too big: not a record, and not read whole
    remote.remove_failure(a)
    remote.remove_failure(key_of("never there"))
    assert remote.failure_keys() == {b}


def a_pushed_entry_clears_its_failure_record_and_a_pull_forgets_its_copy(url: str, tmp_path: Path) -> None:
    """The failure records' reconciliation on the store: a record pulled into a runner's cache, the
    key's entry pushed since (a --retry-failed that worked elsewhere): the push removes the record
    there, and the runner's next pull removes its own copy."""
    from aotbuild import constants
    from aotbuild.remote.sync import pull_failures, push

    remote = parse_remote(url)
    builder = Store(tmp_path / "builder")
    a = add_entry(builder, tmp_path, "a", {"x.so": b"kernel-a"})
    remote.put_failure(a, {"key": a, "reason": "boom", "time": "1", "aotbuild": constants.VERSION})
    runner = Store(tmp_path / "runner")
    assert pull_failures(remote, runner) == [a] and runner.failure(a)["remote"] == url
    assert push([a], remote, builder.root).result.sent == [a]
    assert remote.failure_keys() == set()
    assert pull_failures(remote, runner) == [] and runner.failure(a) is None
