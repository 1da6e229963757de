"""Every read from a remote has bounds (issue 53, aotbuild/remote/bounds.py): an S3 endpoint written
here, on the loopback, that accepts and never answers, drips a byte at a time, lists forever, or
answers a ranged GET with a huge body. ``pull`` and ``plan --remote`` (the CLI, in a subprocess) and
``load_compiled(remote=...)`` end within deadline x tries + backoff (+5 s of slack, past the same
command's run against a closed port), with one line naming the remote; each elapsed time is printed."""

from __future__ import annotations

import contextlib
import http.server
import re
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

pytest.importorskip("s3fs")

from aotbuild.cache.store import Store  # noqa: E402
from aotbuild.errors import RemoteError, UsageError  # noqa: E402
from aotbuild.remote import bounds  # noqa: E402
from aotbuild.remote.schemes import parse_remote, pull_entry  # noqa: E402
from tests.conftest import TINY_RECIPE, run_cli  # noqa: E402
from tests.standins import add_entry, key_of  # noqa: E402

DEADLINE, TRIES, BACKOFF = 1.5, 2, 0.0
#: What the bounds allow a command that meets a misbehaving endpoint, before the slack.
BOUND = DEADLINE * TRIES + BACKOFF
URL = "s3://bkt/ci"


class _Handler(http.server.BaseHTTPRequestHandler):
    """One S3 endpoint's misbehaviour, chosen by ``server.mode``; the objects it holds in
    ``server.objects`` (key -> bytes) for the modes that answer."""

    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, *args):
        pass

    def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for name, value in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _drip(self, length: int, head: bytes = b"", every: float = 0.5) -> None:
        """200, ``length`` bytes declared: ``head`` at once, then one byte every ``every`` seconds."""
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        self.wfile.write(head)
        self.wfile.flush()
        try:
            for _ in range(length - len(head)):
                if self.server.stopping.wait(every):
                    return
                self.wfile.write(b"<")
                self.wfile.flush()
        except OSError:  # the reader gave up on it: what these tests want
            pass

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        mode = self.server.mode
        self.server.requests += 1
        if mode == "blackhole":  # accepted, read, never answered
            self.server.stopping.wait(120)
            return
        path, _, query = self.path.partition("?")
        key = path.split("/", 2)[2] if path.count("/") >= 2 else ""
        if "list-type=2" in query:
            return self._list(query)
        if mode == "drip":
            return self._drip(100_000)
        body = self.server.objects.get(key)
        if body is None:
            return self._send(404, b"<Error><Code>NoSuchKey</Code><Message>no</Message></Error>")
        get = self.command == "GET"
        if mode == "blob-drip" and "/blobs/" in key and get:
            return self._drip(len(body), every=0.4)
        if mode == "blob-stall" and "/blobs/" in key and get:
            return self._drip(len(body), body[:1], every=600)
        if mode == "ignore-range" and key.endswith(".json") and get:
            return self._huge(self.server.huge)
        asked = re.match(r"bytes=(\d+)-(\d+)", self.headers.get("Range", ""))
        if asked and self.command == "GET":
            start, end = int(asked[1]), min(int(asked[2]), len(body) - 1)
            return self._send(206, body[start:end + 1], {"Content-Range": f"bytes {start}-{end}/{len(body)}",
                                                         "ETag": '"e"'})
        return self._send(200, body, {"ETag": '"e"', "Last-Modified": "Mon, 01 Jan 2024 00:00:00 GMT"})

    def _huge(self, length: int) -> None:
        """The whole of a ``length``-byte object, whatever Range asked: counted as it is sent."""
        self.send_response(200)
        self.send_header("Content-Length", str(length))
        self.end_headers()
        chunk = b" " * (1 << 20)
        try:
            while self.server.sent < length:
                self.wfile.write(chunk)
                self.server.sent += len(chunk)
        except OSError:  # the reader dropped the connection: what it did not want was never sent
            pass

    def _list(self, query: str) -> None:
        prefix = re.search(r"prefix=([^&]*)", query)[1].replace("%2F", "/")
        if self.server.mode == "drip":
            return self._drip(100_000, b'<?xml version="1.0" encoding="UTF-8"?>')
        if self.server.mode == "endless":  # 1,000 new keys a page, truncated forever
            page = self.server.pages = self.server.pages + 1
            keys = [f"{prefix}{key_of(f'{page}-{i}')}.json" for i in range(1000)]
            more = f"<IsTruncated>true</IsTruncated><NextContinuationToken>t{page}</NextContinuationToken>"
        else:
            keys = [k for k in self.server.objects if k.startswith(prefix)]
            more = "<IsTruncated>false</IsTruncated>"
        contents = "".join(f"<Contents><Key>{k}</Key><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
                           f"<ETag>&quot;e&quot;</ETag><Size>2</Size></Contents>" for k in keys)
        body = (f'<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/'
                f'2006-03-01/"><Name>bkt</Name><Prefix>{prefix}</Prefix><KeyCount>{len(keys)}</KeyCount>'
                f"<MaxKeys>1000</MaxKeys>{more}{contents}</ListBucketResult>").encode()
        self._send(200, body, {"Content-Type": "application/xml"})


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a reader that drops a connection mid-answer is what these tests make happen

    def __init__(self, mode: str):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.mode, self.objects, self.huge = mode, {}, 0
        self.requests = self.pages = self.sent = 0
        self.stopping = threading.Event()


@contextlib.contextmanager
def _endpoint(mode: str, monkeypatch) -> Iterator[_Server]:
    """The misbehaving endpoint, with the S3 variables and tight bounds pointing there (in this process
    and, through os.environ, in the CLI's)."""
    server = _Server(mode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    for name, value in {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_port}", "AWS_ACCESS_KEY_ID": "AKIAX",
                        "AWS_SECRET_ACCESS_KEY": "bounds-test-secret", "AWS_DEFAULT_REGION": "us-east-1",
                        "AOTBUILD_REMOTE_RETRIES": str(TRIES), "AOTBUILD_REMOTE_BACKOFF": str(BACKOFF),
                        "AOTBUILD_REMOTE_DEADLINE": str(DEADLINE), "AOTBUILD_REMOTE_STALL": "1"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AOTBUILD_REMOTE_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    try:
        yield server
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def baseline(models_dir) -> float:
    """Seconds ``aotbuild pull`` takes against a closed port (the interpreter's start, the plan): the
    commands below are held to this plus their bounds."""
    env = {"AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "AKIAX", "AWS_SECRET_ACCESS_KEY": "s",
           "AWS_DEFAULT_REGION": "us-east-1", "AOTBUILD_REMOTE_RETRIES": "1"}
    start = time.monotonic()
    proc = run_cli("pull", str(TINY_RECIPE), "--cache", str(models_dir), "--remote", URL, env=env)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0 and URL in proc.stderr, proc.stderr[-2000:]
    print(f"baseline (closed port): {elapsed:.1f} s")
    return elapsed


def _one_line_naming_the_remote(stderr: str, *words: str) -> None:
    lines = [x for x in stderr.splitlines() if URL in x]
    assert len(lines) == 1 and all(w in lines[0] for w in words), stderr[-3000:]
    assert "bounds-test-secret" not in stderr and "Traceback" not in stderr


@pytest.mark.parametrize("mode,command", [("blackhole", "pull"), ("drip", "pull"), ("drip", "plan")])
def test_a_black_hole_or_a_drip_ends_the_cli_within_its_deadlines(mode, command, baseline, models_dir,
                                                                  monkeypatch):
    """Before: botocore's 60 s read timeout, per socket read, never fired on a drip; past 7 minutes."""
    with _endpoint(mode, monkeypatch) as server:
        args = ["--remote", URL] if command == "pull" else ["--remote", URL, "--json"]
        start = time.monotonic()
        proc = run_cli(command, str(TINY_RECIPE), "--cache", str(models_dir), *args)
        elapsed = time.monotonic() - start
    print(f"{mode} {command}: {elapsed:.1f} s (bound {BOUND:g} s past the baseline's {baseline:.1f} s)")
    assert proc.returncode != 0
    _one_line_naming_the_remote(proc.stderr, f"failed after {TRIES} tries", "AOTBUILD_REMOTE_DEADLINE")
    assert server.requests == TRIES
    assert elapsed <= baseline + BOUND + 5


def test_a_listing_that_never_ends_stops_at_the_key_cap(baseline, models_dir, monkeypatch):
    """Before: ``plan --remote`` read 406,000 keys (611 MiB) in 90 s and went on. Not retried: the
    store is that big, or hostile, either way another try lists as much."""
    with _endpoint("endless", monkeypatch) as server:
        start = time.monotonic()
        proc = run_cli("plan", str(TINY_RECIPE), "--cache", str(models_dir), "--remote", URL,
                       env={"AOTBUILD_REMOTE_MAX_KEYS": "3000"})
        elapsed = time.monotonic() - start
    print(f"endless listing: {elapsed:.1f} s, {server.pages} pages")
    assert proc.returncode != 0 and server.pages == 4  # 4,000 keys listed > 3,000: stopped there
    _one_line_naming_the_remote(proc.stderr, "passed 3000 keys (AOTBUILD_REMOTE_MAX_KEYS)")
    assert elapsed <= baseline + BOUND + 5


@pytest.fixture(scope="module")
def tiny_pipe(models_dir):
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.recipe.rules import load_recipe

    recipe = load_recipe(TINY_RECIPE)
    return load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")


@pytest.mark.parametrize("mode", ["blackhole", "drip"])
def test_load_compiled_from_a_black_hole_or_a_drip_is_a_miss_within_its_deadlines(mode, tiny_pipe, models_dir,
                                                                                   monkeypatch):
    """A replica's start: the manifest's read is abandoned at its deadline, tried TRIES times, and the
    other entries do not wait for it again (runtime._pull_missing)."""
    from aotbuild import CacheMiss, load_compiled

    with _endpoint(mode, monkeypatch):
        start = time.monotonic()
        with pytest.raises(CacheMiss) as info:
            load_compiled(TINY_RECIPE, tiny_pipe, cache=models_dir, remote=URL, on_miss="error")
        elapsed = time.monotonic() - start
    print(f"load_compiled, {mode}: {elapsed:.1f} s (bound {BOUND:g} s)")
    message = str(info.value)
    assert f"{URL}: reading " in message and f"failed after {TRIES} tries" in message, message
    assert "AOTBUILD_REMOTE_DEADLINE" in message and "bounds-test-secret" not in message
    assert elapsed <= BOUND + 5


def _served_entry(server: _Server, tmp_path, size: int = 1000) -> str:
    """An entry put on ``server`` as a push would lay it out; its key."""
    local = Store(tmp_path / "local")
    key = add_entry(local, tmp_path, "a", {"x.so": b"k" * size})
    manifest = local.read_manifest(key)
    server.objects[f"ci/manifests/{key[:2]}/{key}.json"] = manifest.to_json().encode()
    for item in manifest.files:
        server.objects[f"ci/blobs/{item.sha256[:2]}/{item.sha256}"] = local.layout.blob(item.sha256).read_bytes()
    return key


def test_a_blob_that_drips_fails_at_its_range_s_deadline_and_one_that_stalls_at_the_stall(tmp_path,
                                                                                         monkeypatch):
    """A byte every 0.4 s is progress (the 1 s stall never fires), but no 1,000-byte range may take
    longer than the deadline plus its length at AOTBUILD_REMOTE_MIN_RATE (here 2 + 1 s); a body that
    stops after its first byte fails at AOTBUILD_REMOTE_STALL."""
    monkeypatch.setenv("AOTBUILD_REMOTE_MIN_RATE", "1000")
    for mode, words, allowed in (("blob-drip", "slower than AOTBUILD_REMOTE_MIN_RATE=1000", DEADLINE + 1),
                                 ("blob-stall", "no byte received for 1 s (AOTBUILD_REMOTE_STALL)", 1)):
        with _endpoint(mode, monkeypatch) as server:
            key = _served_entry(server, tmp_path / mode)
            other = Store(tmp_path / mode / "other")
            start = time.monotonic()
            with pytest.raises(RemoteError) as info:
                pull_entry(parse_remote(URL), key, other)
            elapsed = time.monotonic() - start
        print(f"{mode}: {elapsed:.1f} s (bound {allowed * TRIES:g} s)")
        message = str(info.value)
        assert message.startswith(f"{URL}: reading ") and "/blobs/" in message and words in message, message
        assert elapsed <= allowed * TRIES + BACKOFF + 5
        assert not other.layout.manifest(key).is_file()


def test_a_manifest_get_that_ignores_range_is_never_read_past_the_cap(tmp_path, monkeypatch):
    """Before: a 1.36 GiB answer was read whole into memory. The body is read up to the manifest's
    16 MiB + 1 byte and the connection dropped: the server could not send the rest."""
    from aotbuild.cache import manifest as codec

    with _endpoint("ignore-range", monkeypatch) as server:
        server.huge = 1 << 30
        key = _served_entry(server, tmp_path)
        why = parse_remote(URL).fetch(key, Store(tmp_path / "other"))
    print(f"ignored Range: {server.sent >> 20} MiB sent of {server.huge >> 20} MiB")
    assert why.startswith("refused: the remote's manifest is malformed"), why
    assert server.sent <= codec.MAX_BYTES + (32 << 20)  # what was read, and the sockets' buffers


def test_the_bounds_defaults_and_a_bad_value_is_one_line_naming_its_variable(monkeypatch):
    for name in ("AOTBUILD_REMOTE_DEADLINE", "AOTBUILD_REMOTE_STALL", "AOTBUILD_REMOTE_MIN_RATE",
                 "AOTBUILD_REMOTE_MAX_KEYS"):
        monkeypatch.delenv(name, raising=False)
    limits = bounds.limits()
    assert (limits.deadline, limits.stall, limits.min_rate, limits.max_keys) == (60, 60, 256 * 1024, 1_000_000)
    assert limits.transfer(8 << 20) == 60 + 32  # an 8 MiB range: the deadline plus 32 s at 256 KiB/s
    assert limits.listing(1_000_000) == pytest.approx(60 + 1_000_000 * 256 / (256 * 1024))
    for name, value in (("AOTBUILD_REMOTE_DEADLINE", "inf"), ("AOTBUILD_REMOTE_STALL", "0"),
                        ("AOTBUILD_REMOTE_MIN_RATE", "-1"), ("AOTBUILD_REMOTE_MAX_KEYS", "1e6")):
        monkeypatch.setenv(name, value)
        with pytest.raises(UsageError, match=name):
            bounds.limits()
        monkeypatch.delenv(name)


def test_a_hub_endpoint_that_never_answers_is_one_line_within_the_deadline(tmp_path, monkeypatch):
    """The Hub's listing (paged, lazy) and its downloads run on a worker thread abandoned at the
    deadline: huggingface_hub's httpx timeouts are per read, and a drip never trips them. The Hub
    remote is tried once (huggingface_hub retries on its own)."""
    from aotbuild.pipeline import hub

    monkeypatch.setattr(hub, "_seen", {})
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with _endpoint("blackhole", monkeypatch) as server:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{server.server_port}")
        remote = parse_remote("hf://org/cache")
        for what, call in (("listing manifests/", remote.keys),
                           ("downloading manifests/", lambda: remote.fetch(key_of("a"), Store(tmp_path / "o")))):
            start = time.monotonic()
            with pytest.raises(RemoteError) as info:
                call()
            elapsed = time.monotonic() - start
            print(f"hub, {what}: {elapsed:.1f} s (bound {DEADLINE:g} s)")
            message = str(info.value)
            # the deadline, or the stall (1 s here) where httpx's own read timeout, set to it, came first
            assert message.startswith(f"hf://org/cache: {what}") and re.search(r"AOTBUILD_REMOTE_(DEADLINE|STALL)",
                                                                                message), message
            assert elapsed <= DEADLINE + 5
