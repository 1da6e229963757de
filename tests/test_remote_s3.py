"""Object-store remotes against a real S3 API server on the loopback: moto's ThreadedMotoServer, which
s3fs speaks HTTP to as to AWS (and which enforces ``If-None-Match``/``If-Match`` and, when asked,
credentials). Entries are small stand-ins (tests/standins.py): no compiles."""

from __future__ import annotations

import contextlib
import textwrap
import uuid

import pytest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from aotbuild.cache.store import Store  # noqa: E402
from aotbuild.errors import RemoteError, UsageError  # noqa: E402
from aotbuild.remote.objectstore import FsspecRemote, storage_options  # noqa: E402
from aotbuild.remote.schemes import parse_remote  # noqa: E402
from tests import objectstore as flows  # noqa: E402
from tests.conftest import invoke_cli  # noqa: E402
from tests.standins import add_entry, entries, key_of  # noqa: E402

SECRET = "wJalrXUtnFEMI-sekrit-K7MDENG"
ACCESS = "AKIAH9TESTACCESS"


@contextlib.contextmanager
def _moto():
    """moto's S3 server on a free port of the loopback: (its endpoint, how to stop it); stopped after."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}", server.stop
    finally:
        server.stop()


@pytest.fixture(scope="module")
def s3_server():
    with _moto() as (endpoint, _):
        yield endpoint


def _new_bucket(monkeypatch, endpoint: str) -> str:
    """A fresh bucket at ``endpoint``, with the S3 variables pointing there; its name."""
    import boto3

    for name, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET,
                        "AWS_DEFAULT_REGION": "us-east-1", "AOTBUILD_REMOTE_RETRIES": "2",
                        "AOTBUILD_REMOTE_BACKOFF": "0"}.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AOTBUILD_REMOTE_OPTIONS"):
        monkeypatch.delenv(name, raising=False)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return bucket


@pytest.fixture
def s3(s3_server, monkeypatch):
    """A fresh bucket on the module's server, with the S3 variables pointing there; its name."""
    return _new_bucket(monkeypatch, s3_server)


def _objects(remote: FsspecRemote, folder: str) -> list[str]:
    return remote.fs.find(f"{remote.root}/{folder}")


def test_urls_parse_to_object_stores_and_hf_buckets_is_reserved(monkeypatch):
    for url, protocol, root in [("s3://bkt/a/b", "s3", "bkt/a/b"), ("memory://m", "memory", "m")]:
        remote = parse_remote(url)
        assert isinstance(remote, FsspecRemote) and (remote.protocol, remote.root) == (protocol, root)
    with pytest.raises(UsageError, match="reserved for the Hub's storage buckets"):
        parse_remote("hf://buckets/org/cache")
    with pytest.raises(UsageError, match="no credentials"):
        parse_remote(f"s3://{ACCESS}:{SECRET}@bkt/x")


@pytest.mark.parametrize("url,package,extra", [("gs://b/p", "gcsfs", "gcs"), ("az://c/p", "adlfs", "azure"),
                                               ("abfs://c/p", "adlfs", "azure"), ("s3://b/p", "s3fs", "s3")])
def test_a_missing_extra_is_one_line_naming_it(url, package, extra, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == package else real(name, *a))
    with pytest.raises(UsageError) as info:
        parse_remote(url)
    assert str(info.value) == f"remote {url}: {package} is not installed: pip install 'aotbuild[{extra}]'"


def test_memory_remote_round_trip(tmp_path):
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    remote = parse_remote(f"memory://t-{uuid.uuid4().hex[:8]}/cache")
    assert remote.push(entries(local, a)).sent == [a] and remote.keys() == {a}
    other = Store(tmp_path / "other")
    assert remote.fetch(a, other) == "" and other.open_entry(a)[0] is not None


def test_push_is_incremental_and_pull_fetches_only_what_is_missing(s3, tmp_path):
    flows.push_is_incremental_and_pull_fetches_only_what_is_missing(f"s3://{s3}/ci", tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "replaced", "longer"])
def test_a_damaged_blob_on_the_server_is_refused_and_nothing_is_stored(s3, tmp_path, damage):
    flows.a_damaged_blob_is_refused_and_nothing_is_stored(f"s3://{s3}/ci", tmp_path, damage)


def test_an_empty_blob_and_one_of_an_exact_multiple_of_the_range_are_pulled(s3, tmp_path, monkeypatch):
    """A range that would start at the object's end is never asked for: S3 answers it 416 InvalidRange
    (``Range: bytes=8-8`` of an 8-byte object, ``bytes=0-0`` of an empty one)."""
    flows.an_empty_blob_and_one_of_an_exact_multiple_of_the_range_are_pulled(f"s3://{s3}/ci", tmp_path, monkeypatch)


@pytest.mark.parametrize("blob", [b"", b"kernel-a"])
def test_a_blob_made_longer_on_the_server_is_refused_at_any_size(s3, tmp_path, monkeypatch, blob):
    from aotbuild.remote import objectstore as remote_fsspec

    monkeypatch.setattr(remote_fsspec, "RANGE", 4)
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": blob})
    remote = parse_remote(f"s3://{s3}/ci")
    remote.push(entries(local, a))
    [victim] = _objects(remote, "blobs")
    remote.fs.pipe_file(victim, blob + b"X")
    other = Store(tmp_path / "other")
    why = remote.fetch(a, other)
    assert why.startswith("refused") and victim.rsplit("/", 1)[1][:12] in why and "bytes" in why, why
    assert not other.layout.manifest(a).is_file()


def test_a_pull_racing_a_push_sees_no_entry_until_its_blobs_are_there(s3, tmp_path):
    flows.a_pull_racing_a_push_sees_no_entry_until_its_blobs_are_there(f"s3://{s3}/ci", tmp_path)


def test_two_concurrent_pushers_of_the_same_keys_both_succeed(s3, tmp_path):
    flows.two_concurrent_pushers_of_the_same_keys_both_succeed(f"s3://{s3}/ci", tmp_path)


def test_a_manifest_is_written_create_only(s3, tmp_path):
    """Two pushers that both saw no manifest: the S3 server refuses it (If-None-Match)."""
    flows.a_manifest_is_written_create_only(f"s3://{s3}/ci", tmp_path, "ETag")


def test_a_store_without_conditional_writes_gets_ordinary_writes(s3, tmp_path):
    """An S3-compatible store that does not implement ``If-None-Match`` answers 501 NotImplemented,
    which s3fs raises as OSError(ENOSYS): the push falls back to ordinary writes (safe by ordering and
    content addressing) instead of failing. The fault is injected where the store would answer it."""
    from botocore.exceptions import ClientError
    from s3fs.errors import translate_boto_error

    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a", "y.so": b"kernel-b"})
    remote = parse_remote(f"s3://{s3}/ci")
    real, refused, plain = remote.fs._call_s3, [], []

    async def no_conditional_writes(method, *args, **kwargs):
        if "IfNoneMatch" in kwargs:
            refused.append(kwargs["Key"])
            raise translate_boto_error(ClientError({"Error": {"Code": "NotImplemented", "Message": "A header you "
                                                              "provided implies functionality that is not implemented"},
                                                    "ResponseMetadata": {"HTTPStatusCode": 501}}, method))
        if method == "put_object":
            plain.append(kwargs["Key"])
        return await real(method, *args, **kwargs)

    remote.fs._call_s3 = no_conditional_writes
    result = remote.push(entries(local, a))
    assert result.sent == [a] and result.bytes_sent == len(b"kernel-a") + len(b"kernel-b")
    assert len(refused) == 3 and sorted(plain) == sorted(refused)  # two blobs and the manifest, each once
    other = Store(tmp_path / "other")
    assert parse_remote(f"s3://{s3}/ci").fetch(a, other) == "" and other.open_entry(a)[0] is not None


def test_a_trusted_signed_manifest_is_never_overwritten_and_an_unsigned_one_gives_way(s3, tmp_path):
    flows.a_trusted_signed_manifest_is_never_overwritten_and_an_unsigned_one_gives_way(f"s3://{s3}/ci", tmp_path)


def test_a_replace_is_conditional_on_the_version_read(s3, tmp_path):
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    remote = parse_remote(f"s3://{s3}/ci")
    remote.push(entries(local, a))
    _, version = remote._manifest(a)
    remote.fs.pipe_file(remote.manifest_path(a), remote.read_manifest(a).to_json().encode() + b" ")  # changed since
    assert remote._replace(a, b"{}", version) is False
    assert remote.read_manifest(a) is not None


@pytest.mark.slow  # seconds of subprocesses or server traffic: the full suite runs it
def test_a_listing_of_10000_keys_is_paged(s3, tmp_path):
    """Seeded on the server side (moto's backend, in this process): one listing, in pages of 1000."""
    from moto.s3.models import s3_backends

    backend = next(b for account in s3_backends.values() for b in account.values() if s3 in b.buckets)
    keys = {key_of(f"k{i}") for i in range(10_000)}
    for key in keys:
        backend.put_object(s3, f"ci/manifests/{key[:2]}/{key}.json", b"{}")
    remote = parse_remote(f"s3://{s3}/ci")
    calls: list[str] = []
    real = remote.fs._call_s3

    async def counted(method, *args, **kwargs):
        calls.append(method if isinstance(method, str) else method.__name__)
        return await real(method, *args, **kwargs)

    remote.fs._call_s3 = counted
    assert remote.keys() == keys
    assert calls.count("list_objects_v2") <= 11 and len(calls) <= 12, calls[:20]


def test_a_server_that_stops_mid_pull_is_a_remote_error_naming_it(tmp_path, monkeypatch):
    """A moto server of its own, stopped as the first blob is asked for."""
    flows.a_server_that_stops_mid_pull_is_a_remote_error_naming_it(
        _moto(), lambda endpoint: f"s3://{_new_bucket(monkeypatch, endpoint)}/ci", tmp_path, (SECRET, ACCESS))


def test_failure_records_are_listed_read_replaced_and_removed(s3):
    flows.failure_records_are_listed_read_replaced_and_removed(f"s3://{s3}/ci")


def test_a_pushed_entry_clears_its_failure_record_and_a_pull_forgets_its_copy(s3, tmp_path):
    flows.a_pushed_entry_clears_its_failure_record_and_a_pull_forgets_its_copy(f"s3://{s3}/ci", tmp_path)


def test_a_wrong_endpoint_and_denied_credentials_are_one_line_without_secrets(s3, tmp_path, monkeypatch):
    import moto.settings

    remote = parse_remote(f"s3://{s3}/ci")
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks credentials now
    with pytest.raises(RemoteError) as denied:
        remote.keys()
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # the discard port: nothing listens
    with pytest.raises(RemoteError) as unreachable:
        parse_remote(f"s3://{s3}/ci").keys()
    for info, words in ((denied, "denied"), (unreachable, "failed after 2 tries")):
        message = str(info.value)
        assert message.startswith(f"s3://{s3}/ci: ") and words in message, message
        assert "\n" not in message and SECRET not in message and ACCESS not in message


def test_a_failed_push_fails_the_command_naming_the_remote_and_no_secret_is_printed(s3, tmp_path, monkeypatch):
    """Through the CLI (in this process: a fresh one pushes in the real-build test), in a project whose
    pyproject.toml tries to name another endpoint and bucket: it cannot (only the environment and the
    command line do), and a push to a dead endpoint is exit 1."""
    local = Store(tmp_path / "cache")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    project = tmp_path / "project"
    project.mkdir()
    (project / "pyproject.toml").write_text(textwrap.dedent("""
        [tool.aotbuild]
        remote = "s3://attacker/x"
        endpoint_url = "http://127.0.0.1:9"
        remote_options = {client_kwargs = {endpoint_url = "http://127.0.0.1:9"}}
    """))
    monkeypatch.chdir(project)
    ok = invoke_cli("push", "--cache", str(local.root), env={"AOTBUILD_REMOTE": f"s3://{s3}/ci"})
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert parse_remote(f"s3://{s3}/ci").keys() == {a}  # the environment's endpoint and bucket, not the file's
    dead = invoke_cli("push", "--cache", str(local.root), "--remote", f"s3://{s3}/other",
                      env={"AWS_ENDPOINT_URL": "http://127.0.0.1:9"})
    assert dead.returncode == 1, (dead.stdout, dead.stderr)
    assert f"s3://{s3}/other" in dead.stderr and "failed after 2 tries" in dead.stderr
    for proc in (ok, dead):
        assert SECRET not in proc.stdout + proc.stderr and ACCESS not in proc.stdout + proc.stderr


def test_storage_options_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1234")
    monkeypatch.setenv("AOTBUILD_REMOTE_OPTIONS", '{"anon": true}')
    options = storage_options("s3")
    assert options["anon"] is True and options["client_kwargs"]["endpoint_url"] == "http://127.0.0.1:1234"
    monkeypatch.setenv("AOTBUILD_REMOTE_OPTIONS", '{"client_kwargs": {"endpoint_url": "http://x:1"}}')
    assert storage_options("s3")["client_kwargs"]["endpoint_url"] == "http://x:1"
    monkeypatch.setenv("AOTBUILD_REMOTE_OPTIONS", "[1]")
    with pytest.raises(UsageError, match="AOTBUILD_REMOTE_OPTIONS"):
        storage_options("s3")


def test_a_secret_in_the_options_never_reaches_a_message(monkeypatch):
    from aotbuild.remote.objectstore import _scrub

    monkeypatch.setenv("AOTBUILD_REMOTE_OPTIONS", '{"secret": "opt-secret-123", "key": "opt-key-456"}')
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    text = _scrub(f"boom opt-secret-123 opt-key-456 {SECRET} https://u:p@h/x?X-Amz-Signature=abc&b=1")
    assert not any(s in text for s in ("opt-secret-123", "opt-key-456", SECRET, "u:p@", "abc"))


def test_a_store_throttling_is_retried_then_served(s3, tmp_path, monkeypatch):
    """S3's SlowDown (503) and a cut connection are transient: retried with backoff, and the pull succeeds."""
    local = Store(tmp_path / "local")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    remote = parse_remote(f"s3://{s3}/ci")
    remote.push(entries(local, a))
    real, failed = remote._read, []

    def flaky(path, *args, **kw):
        if "/blobs/" in path and not failed:
            failed.append(path)
            raise OSError("SlowDown: Please reduce your request rate.")
        return real(path, *args, **kw)

    remote._read = flaky
    other = Store(tmp_path / "other")
    assert remote.fetch(a, other) == "" and failed and other.open_entry(a)[0] is not None
    monkeypatch.setenv("AOTBUILD_REMOTE_RETRIES", "1")  # no second try: the same failure is the error
    failed.clear()
    with pytest.raises(RemoteError, match="failed after 1 tries: OSError: SlowDown"):
        remote.fetch(a, Store(tmp_path / "third"))


@pytest.mark.slow
def test_a_real_build_pushed_to_s3_is_pulled_and_served_fresh_with_0_compiles(built_cache, s3, tmp_path):
    """One shape of the build, as for GCS and Azure: one real serve per store, at half the cost. Both
    shapes, every kernel checked as it was installed, are served through the folder remote
    (tests/test_e2e_remote.py): what differs between stores is how the bytes travel."""
    flows.a_real_build_is_pulled_by_a_fresh_process_and_served_with_0_compiles(built_cache, f"s3://{s3}/ci", tmp_path,
                                                                               one_shape=True)
