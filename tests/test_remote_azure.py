"""az:// remotes against a real Azure Blob API server on the loopback: Azurite (an npm package),
started on a free port by the fixture, in memory, telemetry off, and stopped after. adlfs speaks HTTP
to it as to Azure, with Azurite's well-known development account. Entries are small stand-ins
(tests/standins.py): no compiles.

Azurite is found as ``$AZURITE_BLOB`` (the path of its ``azurite-blob``), on ``PATH``, or under the
repository's git-ignored ``.cache/azurite`` (``npm install --prefix .cache/azurite azurite``); the
tests skip, saying so, when it or ``node`` is absent. CI does not install it (.ci/run): the install
takes about 30 s and needs the npm registry."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

pytest.importorskip("adlfs")

from aotbuild.cache.store import Store  # noqa: E402
from aotbuild.errors import RemoteError  # noqa: E402
from aotbuild.remote.schemes import parse_remote, pull_entry  # noqa: E402
from tests import objectstore as flows  # noqa: E402
from tests.conftest import REPO, invoke_cli  # noqa: E402
from tests.standins import add_entry, entries, key_of  # noqa: E402

#: Azurite's documented development account (public, the same in every Azurite).
ACCOUNT = "devstoreaccount1"
KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


def _azurite() -> str | None:
    for candidate in (os.environ.get("AZURITE_BLOB"), shutil.which("azurite-blob"),
                      str(REPO / ".cache/azurite/node_modules/.bin/azurite-blob")):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def _connection(endpoint: str, key: str = KEY) -> str:
    return (f"DefaultEndpointsProtocol=http;AccountName={ACCOUNT};AccountKey={key};"
            f"BlobEndpoint={endpoint}/{ACCOUNT};")


@contextlib.contextmanager
def _server(folder: Path, on_disk: bool = False):
    """Azurite's blob service in memory (``on_disk``: its store in ``folder``, written when it stops)
    on a free port: (its endpoint, the process); stopped after."""
    if shutil.which("node") is None:
        pytest.skip("node is not installed: Azurite (the Azure Blob API server these tests use) needs it")
    binary = _azurite()
    if binary is None:
        pytest.skip("Azurite is not installed: npm install --prefix .cache/azurite azurite (or set AZURITE_BLOB)")
    log = folder / "azurite.out"
    with open(log, "w") as out:
        store = ["--location", str(folder)] if on_disk else ["--inMemoryPersistence"]
        proc = subprocess.Popen([binary, "--blobHost", "127.0.0.1", "--blobPort", "0", *store,
                                 "--disableTelemetry", "--skipApiVersionCheck", "--loose"],
                                cwd=folder, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"listens on (http://127\.0\.0\.1:\d+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
        yield found[1], proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def azurite(tmp_path_factory):
    with _server(tmp_path_factory.mktemp("azurite")) as (endpoint, _):
        yield endpoint


def _azure_env(monkeypatch, connection: str) -> None:
    for name, value in {"AZURE_STORAGE_CONNECTION_STRING": connection, "AOTBUILD_REMOTE_RETRIES": "2",
                        "AOTBUILD_REMOTE_BACKOFF": "0"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AOTBUILD_REMOTE_OPTIONS", "AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY",
                 "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_ANON"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def az(azurite, monkeypatch):
    """A fresh container on the module's Azurite, with the variables pointing there; its name."""
    _azure_env(monkeypatch, _connection(azurite))
    return _new_container(azurite)


def _new_container(endpoint: str) -> str:
    from azure.storage.blob import BlobServiceClient

    container = f"c-{uuid.uuid4().hex[:12]}"
    with BlobServiceClient.from_connection_string(_connection(endpoint)) as client:
        client.create_container(container)
    return container


def test_push_is_incremental_and_pull_fetches_only_what_is_missing(az, tmp_path):
    flows.push_is_incremental_and_pull_fetches_only_what_is_missing(f"az://{az}/ci", tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "replaced", "longer"])
def test_a_damaged_blob_on_the_server_is_refused_and_nothing_is_stored(az, tmp_path, damage):
    flows.a_damaged_blob_is_refused_and_nothing_is_stored(f"az://{az}/ci", tmp_path, damage)


def test_an_empty_blob_and_one_of_an_exact_multiple_of_the_range_are_pulled(az, tmp_path, monkeypatch):
    flows.an_empty_blob_and_one_of_an_exact_multiple_of_the_range_are_pulled(f"az://{az}/ci", tmp_path,
                                                                              monkeypatch)


def test_a_pull_racing_a_push_sees_no_entry_until_its_blobs_are_there(az, tmp_path):
    flows.a_pull_racing_a_push_sees_no_entry_until_its_blobs_are_there(f"az://{az}/ci", tmp_path)


def test_two_concurrent_pushers_of_the_same_keys_both_succeed(az, tmp_path):
    flows.two_concurrent_pushers_of_the_same_keys_both_succeed(f"az://{az}/ci", tmp_path)


def test_a_trusted_signed_manifest_is_never_overwritten_and_an_unsigned_one_gives_way(az, tmp_path):
    flows.a_trusted_signed_manifest_is_never_overwritten_and_an_unsigned_one_gives_way(f"abfs://{az}/ci", tmp_path)


def test_a_manifest_is_written_create_only(az, tmp_path):
    """Two pushers that both saw no manifest: Azurite refuses it (If-None-Match: *, 409 BlobAlreadyExists)."""
    flows.a_manifest_is_written_create_only(f"az://{az}/ci", tmp_path, "etag")


def test_a_replace_is_conditional_on_the_version_read(az, tmp_path):
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    remote = parse_remote(f"az://{az}/ci")
    remote.push(entries(local, a))
    _, version = remote._manifest(a)
    assert version
    remote.fs.pipe_file(remote.manifest_path(a), remote.read_manifest(a).to_json().encode() + b" ")  # changed since
    assert remote._replace(a, b"{}", version) is False
    assert remote.read_manifest(a) is not None
    _, current = remote._manifest(a)
    assert remote._replace(a, remote.read_manifest(a).to_json().encode(), current) is True


def test_a_missing_container_is_one_clear_line(az, tmp_path):
    url = f"az://no-{az}/ci"
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    for attempt in (lambda r: r.keys(), lambda r: r.push(entries(local, a)),
                    lambda r: pull_entry(r, a, Store(tmp_path / "other"))):
        with pytest.raises(RemoteError) as info:
            attempt(parse_remote(url))
        assert str(info.value) == f"{url}: no bucket 'no-{az}' there (or these credentials cannot see it)"


def test_denied_credentials_are_one_line_without_secrets(az, azurite, monkeypatch, tmp_path):
    """A wrong account key: Azurite answers 403 AuthorizationFailure. One request, one line, 'denied',
    and neither key nor connection string in it."""
    wrong = "V3JvbmdLZXlXcm9uZ0tleVdyb25nS2V5V3JvbmdLZXk="
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", _connection(azurite, wrong))
    with pytest.raises(RemoteError) as info:
        parse_remote(f"az://{az}/ci").keys()
    message = str(info.value)
    assert message.startswith(f"az://{az}/ci: listing {az}/ci/manifests was denied ("), message
    assert "\n" not in message and wrong not in message and KEY not in message
    local = Store(tmp_path / "cache")  # through the command line: exit 1, naming the remote, no secret
    add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    pushed = invoke_cli("push", "--cache", str(local.root), "--remote", f"az://{az}/ci")
    assert pushed.returncode == 1 and f"az://{az}/ci" in pushed.stderr and "denied" in pushed.stderr, pushed.stderr
    assert wrong not in pushed.stdout + pushed.stderr


def test_a_failing_endpoint_is_tried_as_often_as_we_say_and_no_more(monkeypatch, tmp_path):
    """A 503 on every request: the miss comes after AOTBUILD_REMOTE_RETRIES requests. The Azure SDK's
    own loop (4 tries, backoff from 15 s) is off: nested in ours, a dead endpoint took minutes."""
    import http.server
    import threading

    seen: list[str] = []

    class Busy(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen.append(self.path)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        do_HEAD = do_GET

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _azure_env(monkeypatch, _connection(f"http://127.0.0.1:{server.server_address[1]}"))
        with pytest.raises(RemoteError) as info:
            pull_entry(parse_remote("az://c/ci"), key_of("a"), Store(tmp_path / "other"))
    finally:
        server.shutdown()
        server.server_close()
    assert "failed after 2 tries" in str(info.value) and len(seen) == 2, (str(info.value), seen)
    assert KEY not in str(info.value)


@pytest.mark.slow  # seconds of subprocesses or server traffic: the full suite runs it
def test_a_listing_of_10000_keys_seeded_on_the_server(tmp_path, monkeypatch):
    """Seeded on the server side, through Azurite's own store on disk: one blob written through the
    API, Azurite stopped (it saves its LokiJS database), the blob's record copied under 10,000 names,
    Azurite started again on it. (Through the API, 10,000 writes took 140 s on 2 cores, and under load
    one timed out.) The listing crosses Azure's page limit (5000) twice."""
    from azure.storage.blob import BlobServiceClient

    keys = sorted(key_of(f"k{i}") for i in range(10_000))
    with _server(tmp_path, on_disk=True) as (endpoint, _):
        with BlobServiceClient.from_connection_string(_connection(endpoint)) as client:
            client.create_container("seeded")
            client.get_blob_client("seeded", f"ci/manifests/{keys[0][:2]}/{keys[0]}.json").upload_blob(b"{}")
    database = tmp_path / "__azurite_db_blob__.json"
    data = json.loads(database.read_text())
    blobs = next(c for c in data["collections"] if c["name"] == "$BLOBS_COLLECTION$")
    [record] = blobs["data"]  # Azurite's record of the one blob (its format: LokiJS's, Azurite 3's)
    blobs["data"] = [{**record, "name": f"ci/manifests/{k[:2]}/{k}.json", "$loki": n} for n, k in enumerate(keys, 1)]
    blobs["maxId"] = len(keys)
    for index in blobs["binaryIndices"].values():  # rebuilt by Azurite's database on first use
        index.update(dirty=True, values=[])
    database.write_text(json.dumps(data))
    with _server(tmp_path, on_disk=True) as (endpoint, _):
        _azure_env(monkeypatch, _connection(endpoint))
        assert parse_remote("az://seeded/ci").keys() == set(keys)


def test_a_push_through_the_cli(az, tmp_path):
    """In this process: the real build's test pushes with a fresh one."""
    local = Store(tmp_path / "cache")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    pushed = invoke_cli("push", "--json", "--cache", str(local.root), "--remote", f"az://{az}/ci")
    assert pushed.returncode == 0, pushed.stderr[-2000:]
    assert json.loads(pushed.stdout)["sent"] == [a] and parse_remote(f"az://{az}/ci").keys() == {a}


def test_azure_secrets_never_reach_a_message(monkeypatch):
    """adlfs's own variables (AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_CLIENT_SECRET) and the key or
    signature inside any connection string a store echoes are scrubbed."""
    from aotbuild.remote.objectstore import _scrub

    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_KEY", "acct-key-7890")
    monkeypatch.setenv("AZURE_STORAGE_CLIENT_SECRET", "client-secret-4567")
    text = _scrub(f"boom acct-key-7890 client-secret-4567 {_connection('http://h:1', 'echoed-key-1234')} "
                  "SharedAccessSignature=sv=2020&sig=abc;")
    assert not any(s in text for s in ("acct-key-7890", "client-secret-4567", "echoed-key-1234", "sig=abc")), text
    assert f"AccountName={ACCOUNT}" in text  # the account's name is no secret


def test_a_server_that_stops_mid_pull_is_a_remote_error_naming_it(tmp_path, monkeypatch):
    """An Azurite of its own, killed as the first blob is asked for."""

    def connect(endpoint: str) -> str:
        _azure_env(monkeypatch, _connection(endpoint))
        return f"az://{_new_container(endpoint)}/ci"

    flows.a_server_that_stops_mid_pull_is_a_remote_error_naming_it(flows.killed_on_stop(_server(tmp_path)), connect,
                                                                   tmp_path, (KEY,))


def test_failure_records_are_listed_read_replaced_and_removed(az):
    flows.failure_records_are_listed_read_replaced_and_removed(f"az://{az}/ci")


@pytest.mark.slow
def test_a_real_build_pushed_to_azure_is_pulled_and_served_fresh_with_0_compiles(built_cache, az, tmp_path):
    """One shape of the build (the folder remote's test serves both): one real serve per store, at half the cost."""
    flows.a_real_build_is_pulled_by_a_fresh_process_and_served_with_0_compiles(built_cache, f"az://{az}/ci",
                                                                               tmp_path, one_shape=True)
