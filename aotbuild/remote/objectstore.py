"""Object-store remotes through fsspec: ``s3://``, ``gs://``, ``az://``/``abfs://`` and ``memory://``.

    s3://bucket/prefix         S3 and S3-compatible stores (AWS_ENDPOINT_URL), through s3fs: aotbuild[s3]
    gs://bucket/prefix         Google Cloud Storage, through gcsfs: aotbuild[gcs]
    az://container/prefix      Azure Blob Storage (abfs:// too), through adlfs: aotbuild[azure]
    memory://name/prefix       fsspec's in-process store (tests)

The layout is the folder remote's: ``blobs/<2 hex>/<sha256>`` and ``manifests/<2 hex>/<key>.json``
under the prefix. The same rules hold:

- Blobs are content-addressed and uploaded before the manifest that names them, so a reader never
  sees an entry whose blobs are missing; an interrupted push leaves at most unreferenced blobs. Blobs
  and new manifests are written create-only where the store offers it (S3 ``If-None-Match: *``;
  fsspec's ``mode="create"``); where it does not, the protocol is still safe by ordering and content
  addressing (two pushers of one key write the same blob bytes). No remote locks.
- A manifest a trusted key signed is never overwritten; one no trusted key signed may be replaced by
  one a trusted key did, conditional on the version that was read: S3 ``If-Match`` on its ETag, Azure
  ``If-Match`` on its etag, GCS ``ifGenerationMatch`` on its generation (gcsfs offers no way to
  pass it: the replace is gcsfs's own one-request upload with it added). gcp-storage-emulator, the
  GCS server most tests use, ignores preconditions: there they assert consistency; the refusals are
  tested against fake-gcs-server, which enforces them (docs/ci.md).
- Pulls read the manifest (at most manifest.MAX_BYTES), then only the blobs the local cache lacks, in
  bounded ranges, each hashed as it is written and refused unless it matches its name and size
  (remote_base.ingest). Nothing is deserialised but the JSON manifest.
- Credentials come from each store's own chain (environment, profile, instance metadata); aotbuild
  never reads, writes or prints them, and the text of a store's errors is scrubbed of secrets before
  it is shown. The endpoint and fsspec's storage options come from the environment only
  (``AWS_ENDPOINT_URL``, ``AOTBUILD_REMOTE_OPTIONS``), never from a repository's pyproject.toml.
- A store's failures (unreachable, throttled, a cut connection) are retried
  ``AOTBUILD_REMOTE_RETRIES`` times with doubling backoff, then raise one RemoteError naming the
  remote and why: a pull makes it a miss that says so, a push fails the build. Denied access (a 401
  or 403 from any store) and missing objects are not retried. The stores' own retry loops are
  turned off, so that ours is the only one (gcsfs: 6 tries and 31 s of sleeps per request; the Azure
  SDK: 4 tries and about a minute): nested, a dead endpoint took minutes to become a miss.
- Every read is bounded (aotbuild/remote/bounds.py, issue 53): a metadata request (a listing's page, a
  manifest, a failure record, an info) within ``AOTBUILD_REMOTE_DEADLINE`` in all, through fsspec's own
  ``timeout`` (which cancels the request); a blob's ranged read with no byte for
  ``AOTBUILD_REMOTE_STALL`` and slower than ``AOTBUILD_REMOTE_MIN_RATE`` fails; every body is read in
  chunks of at most what is still wanted, so a server that ignores ``Range`` is never read past it;
  a listing is paged and stops past ``AOTBUILD_REMOTE_MAX_KEYS`` keys. Each timeout is a transient
  failure: retried, then one RemoteError naming the remote and the variable.
- A GCS endpoint (``STORAGE_EMULATOR_HOST``, or ``endpoint_url`` in the options) is spoken to over
  HTTP only: gcsfs's default class first asks the endpoint over gRPC what kind of bucket it is, which
  an HTTP-only endpoint never answers (60 s per bucket, then each request again).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import re
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from aotbuild import constants
from aotbuild.cache import manifest as codec
from aotbuild.cache.layout import HEX64
from aotbuild.cache.manifest import Manifest, StaleManifest
from aotbuild.cache.store import MAX_FAILURE_BYTES, Entry, Store, failure_record
from aotbuild.errors import RemoteError, StoreError, UsageError
from aotbuild.remote import bounds
from aotbuild.remote.base import Meter, PushResult, Remote, TransferProgress, ingest
from aotbuild.utils import secrets

#: scheme -> (fsspec protocol, the package it needs, the extra that installs it)
SCHEMES = {"s3": ("s3", "s3fs", "s3"), "gs": ("gcs", "gcsfs", "gcs"), "gcs": ("gcs", "gcsfs", "gcs"),
           "az": ("az", "adlfs", "azure"), "abfs": ("abfs", "adlfs", "azure"), "memory": ("memory", None, None)}
_URL = re.compile(r"^(?P<scheme>[a-z0-9]+)://(?P<bucket>[\w.-]+)(?P<prefix>(?:/[\w.=+-]+)*)/?$")
#: Bytes fetched per ranged read of a blob.
RANGE = 8 << 20
#: Bytes of a store's error body read (the rest is never received).
_ERROR_BYTES = 64 * 1024


def parse(url: str) -> FsspecRemote | None:
    """The object-store remote ``url`` names; None when its scheme is not an object store's."""
    scheme = url.split("://", 1)[0] if "://" in url else ""
    if scheme not in SCHEMES:
        return None
    match = _URL.match(url)
    if not match or "@" in url or "?" in url:
        raise UsageError(f"remote {_scrub(url)!r}: expected {scheme}://bucket[/prefix] (no credentials, no query: "
                         "credentials come from the store's own chain, the endpoint from AWS_ENDPOINT_URL or "
                         f"{constants.ENV_REMOTE_OPTIONS})")
    protocol, package, extra = SCHEMES[scheme]
    if package is not None and importlib.util.find_spec(package) is None:
        raise UsageError(f"remote {url}: {package} is not installed: pip install 'aotbuild[{extra}]'")
    root = (match["bucket"] + match["prefix"]).rstrip("/")
    return FsspecRemote(url.rstrip("/"), protocol, root)


def storage_options(protocol: str) -> dict[str, Any]:
    """fsspec's options for ``protocol``: ``AOTBUILD_REMOTE_OPTIONS`` (a JSON object), with S3's
    endpoint from ``AWS_ENDPOINT_URL`` when the options name none, and the store's own retries off
    (ours are bounded and reported)."""
    from aotbuild.utils import safeio

    text = constants.env_remote_options()
    try:
        options = safeio.loads_json(text, max_bytes=64 * 1024, max_depth=8) if text.strip() else {}
    except ValueError as exc:
        raise UsageError(f"{constants.ENV_REMOTE_OPTIONS}: not JSON ({_scrub(str(exc))})") from None
    if not isinstance(options, dict):
        raise UsageError(f"{constants.ENV_REMOTE_OPTIONS}: must be a JSON object of fsspec storage options")
    options = dict(options)
    if protocol == "s3":
        client = dict(options.get("client_kwargs") or {})
        endpoint = constants.env_aws_endpoint()
        if endpoint and "endpoint_url" not in client and "endpoint_url" not in options:
            client["endpoint_url"] = endpoint
        options["client_kwargs"] = client
        config = dict(options.get("config_kwargs") or {})
        config.setdefault("retries", {"max_attempts": 1})
        config.setdefault("connect_timeout", 10)
        config.setdefault("read_timeout", 60)
        options["config_kwargs"] = config
    options.setdefault("skip_instance_cache", True)
    options.setdefault("use_listings_cache", False)
    return options


def _filesystem(protocol: str) -> Any:
    """The fsspec filesystem for ``protocol``, with the store's own retries off (see the module docstring)."""
    import fsspec

    options = storage_options(protocol)
    if protocol == "gcs" and (constants.env_gcs_emulator() or options.get("endpoint_url")):
        from gcsfs.core import GCSFileSystem  # HTTP only: no gRPC probe of the bucket's type

        fs = GCSFileSystem(**options)
    else:
        fs = fsspec.filesystem(protocol, **options)
    if protocol == "gcs":
        # gcsfs wraps each request in a fixed 6-try loop (retry.retry_request) with no setting to
        # change it: the request itself, unwrapped, is called once per try of ours.
        inner = getattr(type(fs)._request, "__wrapped__", None)
        if inner is not None:
            fs._request = types.MethodType(inner, fs)
    elif protocol in ("az", "abfs"):
        # adlfs takes no retry settings: the Azure SDK's retry policy on the client's pipeline.
        policy = getattr(getattr(getattr(fs, "service_client", None), "_config", None), "retry_policy", None)
        if policy is not None and hasattr(policy, "total_retries"):
            policy.total_retries = 0
    return fs


def _status(exc: BaseException) -> int | None:
    """The HTTP status a store's exception carries (azure-core: status_code; gcsfs: code), if any."""
    for name in ("status_code", "code", "status"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            return value
    return None


def _denied(exc: BaseException) -> bool:
    # gcsfs raises a bare OSError("Forbidden: <path>...") for a 403.
    return isinstance(exc, PermissionError) or _status(exc) in (401, 403) or str(exc).startswith("Forbidden")


def _scrub(text: str) -> str:
    """``text`` without credentials (aotbuild/utils/secrets.py, the one scrubber)."""
    return secrets.scrub(text)


def _modified(info: dict[str, Any]) -> float:
    """When a listing says an object was last written, in seconds since the epoch (0.0: it does not
    say). Each filesystem names it its own way: gcsfs ``mtime`` (a datetime), s3fs ``LastModified``,
    adlfs ``last_modified``, fsspec's memory store ``created`` (a timestamp)."""
    from datetime import datetime, timezone

    for name in ("mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(name)
        if isinstance(value, str) and value:
            try:
                value = datetime.fromisoformat(value.replace("Z", "+00:00"))
            except ValueError:
                continue
        if isinstance(value, datetime):
            return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return 0.0


def _why(exc: BaseException) -> str:
    """One scrubbed line for ``exc``."""
    lines = str(exc).strip().splitlines()
    return _scrub(f"{type(exc).__name__}: {lines[0] if lines else ''}")[:300]


def _key(path: str, info: Any = None) -> str | None:
    """The key a listed ``.../<key>.json`` names (a manifest or a failure record), or None."""
    name = path.rsplit("/", 1)[-1]
    return name[:-5] if name.endswith(".json") and HEX64.match(name[:-5]) else None


class _Ranges:
    """A blob on the store as a binary stream: ranged reads of at most RANGE bytes, each retried, of
    its first ``limit`` bytes. ``limit`` must not exceed the object's size: a range that starts at
    the object's end is never requested (S3 answers it 416 InvalidRange, not an empty body)."""

    def __init__(self, remote: FsspecRemote, path: str, limit: int):
        self.remote, self.path, self.limit = remote, path, limit
        self.pos, self.buf = 0, b""

    def read(self, n: int = -1) -> bytes:
        if not self.buf and self.pos < self.limit:  # pos >= limit: nothing is left to ask for
            end = min(self.pos + max(n, RANGE), self.limit)
            self.buf = self.remote._call(f"reading {self.path}", lambda: self.remote._read(
                self.path, self.pos, end, blob=True))
            self.pos = end if len(self.buf) == end - self.pos else self.limit  # short: the object ended
        n = len(self.buf) if n < 0 else n
        out, self.buf = self.buf[:n], self.buf[n:]
        return out


class FsspecRemote(Remote):
    """An object store through fsspec (see the module docstring)."""

    def __init__(self, url: str, protocol: str, root: str):
        self.url = url
        self.protocol = protocol
        self.root = root
        self._fs: Any = None
        self._bucket_seen = False

    @property
    def fs(self) -> Any:
        if self._fs is None:
            self._fs = self._call("connecting", lambda: _filesystem(self.protocol))
        return self._fs

    def manifest_path(self, key: str) -> str:
        return f"{self.root}/manifests/{key[:2]}/{key}.json"

    def blob_path(self, digest: str) -> str:
        return f"{self.root}/blobs/{digest[:2]}/{digest}"

    def failure_path(self, key: str) -> str:
        return f"{self.root}/failures/{key}.json"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """``fn()``, retried with backoff on a store's transient failures; FileNotFoundError and
        FileExistsError are the caller's; denied access and everything after the last try are one
        RemoteError naming the remote (scrubbed of credentials)."""
        tries = int(constants.env_number(constants.ENV_REMOTE_RETRIES, 3, 1, 20, integer=True))
        delay = constants.env_number(constants.ENV_REMOTE_BACKOFF, 0.5, 0, 60)
        for attempt in range(1, tries + 1):
            try:
                return fn()
            except (FileNotFoundError, FileExistsError, UsageError, NotImplementedError, RemoteError):
                raise  # NotImplementedError: the store lacks a feature (_put_new falls back), not transient;
                # RemoteError: a listing past its key cap (bounds.collect), which another try would repeat
            except ImportError as exc:
                raise UsageError(f"{self.url}: {_why(exc)}") from None
            except Exception as exc:  # the network, the store's throttling, a cut connection
                if _denied(exc):
                    raise RemoteError(f"{self.url}: {what} was denied ({_why(exc)}): check the credentials the "
                                      "store's own chain provides (environment, profile, instance role)") from None
                if _status(exc) == 404:  # azure-core's ResourceNotFoundError where adlfs does not translate it
                    raise FileNotFoundError(what) from None
                if _status(exc) == 412:  # a precondition (If-Match) failed: someone else wrote it since
                    raise FileExistsError(what) from None
                if attempt == tries:
                    raise RemoteError(f"{self.url}: {what} failed after {tries} tries: {_why(exc)}") from None
                time.sleep(delay * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _ask(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """``self.fs.<name>(...)``, a metadata request or a small write, within AOTBUILD_REMOTE_DEADLINE
        in all: fsspec's own ``timeout`` for an async filesystem (asyncio.wait_for: the request is
        cancelled, its connection closed). memory:// runs in this process, unbounded."""
        method = getattr(self.fs, name)
        if not getattr(self.fs, "async_impl", False):
            return method(*args, **kwargs)
        from fsspec.exceptions import FSTimeoutError

        limits = bounds.limits()
        try:
            return method(*args, timeout=limits.deadline, **kwargs)
        except FSTimeoutError:
            raise limits.missed(limits.deadline) from None

    def _run(self, coroutine: Callable[[], Any], total: float) -> Any:
        """``coroutine()`` on the filesystem's event loop, abandoned (cancelled) after ``total`` seconds."""
        from fsspec.asyn import sync
        from fsspec.exceptions import FSTimeoutError

        try:
            return sync(self.fs.loop, coroutine, timeout=total)
        except FSTimeoutError:
            raise bounds.limits().missed(total) from None

    def _read(self, path: str, start: int, end: int, blob: bool = False) -> bytes:
        """Bytes ``start`` to ``end`` of ``path``: at most ``end - start`` received whatever the server
        sends (a server ignoring ``Range`` sends the whole object: the connection is dropped past what
        was asked for), no byte for AOTBUILD_REMOTE_STALL fails, all within AOTBUILD_REMOTE_DEADLINE
        (a manifest, a record), or a ``blob``'s range within that plus its length at
        AOTBUILD_REMOTE_MIN_RATE: a drip fails, a slow link's GBs arrive."""
        if end <= start:
            return b""
        if not getattr(self.fs, "async_impl", False):
            return self.fs.cat_file(path, start=start, end=end)
        limits = bounds.limits()
        total = limits.transfer(end - start) if blob else limits.deadline
        late = limits.too_slow(total) if blob else limits.missed(total)
        began = time.monotonic()
        return self._run(lambda: bounds.bounded(self._stream(path, start, end, began + total, late), total, late),
                         total + 1)

    async def _stream(self, path: str, start: int, end: int, until: float, late: Exception) -> bytes:
        """:meth:`_read` on the event loop: each store's streaming GET (fsspec's cat_file reads a body
        whole), its body drained by bounds.drain."""
        limits, fs, length = bounds.limits(), self.fs, end - start
        asked = f"bytes={start}-{end - 1}"
        if self.protocol == "s3":
            bucket, key, version = fs.split_path(path)
            response = await fs._call_s3("get_object", Bucket=bucket, Key=key, Range=asked,
                                         **({"VersionId": version} if version else {}))
            body = response["Body"]
            try:
                return await bounds.drain(body.read, length, limits, until - time.monotonic(), late)
            finally:
                body.close()
        if self.protocol == "gcs":
            from gcsfs.retry import validate_response

            await fs._set_session()
            async with fs.session.get(fs.url(path), headers=fs._get_headers({"Range": asked}),
                                      timeout=fs.requests_timeout) as response:
                if response.status >= 400:
                    validate_response(response.status, await response.content.read(_ERROR_BYTES), path)
                return await bounds.drain(response.content.read, length, limits, until - time.monotonic(), late)
        if self.protocol in ("az", "abfs"):
            # The Azure SDK reads its first response whole (up to the length asked, or what a server
            # ignoring the range sends): docs/security.md says so. Its chunks after that are bounded.
            container, blob, version = fs.split_path(path)
            async with fs.service_client.get_blob_client(container=container, blob=blob) as client:
                stream = await client.download_blob(offset=start, length=length, version_id=version,
                                                    max_concurrency=1)
                chunks = stream.chunks()

                async def read(_: int) -> bytes:
                    try:
                        return await chunks.__anext__()
                    except StopAsyncIteration:
                        return b""

                return await bounds.drain(read, length, limits, until - time.monotonic(), late)
        return await fs._cat_file(path, start=start, end=end)

    def _list(self, folder: str, keep: Callable[[str, Any], Any], what: str) -> list[Any]:
        """What ``keep(path, info)`` keeps of each object under ``folder``, listed page by page: no
        page later than the listing's deadline (bounds.Limits.listing), and stopped past
        AOTBUILD_REMOTE_MAX_KEYS objects, kept or not (a listing that never ends: issue 53)."""
        limits = bounds.limits()
        if not getattr(self.fs, "async_impl", False):  # memory://: in this process
            found = self.fs.find(folder, detail=True)
            if len(found) > limits.max_keys:
                raise limits.too_many(self.url, what)
            return [k for k in (keep(p, i) for p, i in found.items()) if k is not None]
        return self._run(lambda: bounds.collect(self._pages(folder), keep, limits, self.url, what),
                         limits.listing(limits.max_keys) + 1)

    async def _pages(self, folder: str) -> Any:
        """The objects under ``folder``, one list of (path, info) per request of the store's own
        paged listing (fsspec's find reads every page before it returns)."""
        fs = self.fs
        bucket, _, rest = folder.partition("/")
        prefix = f"{rest}/" if rest else ""
        if self.protocol == "s3":
            token = None
            while True:
                page = await fs._call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix,
                                         **({"ContinuationToken": token} if token else {}))
                yield [(f"{bucket}/{o['Key']}", o) for o in page.get("Contents", []) if isinstance(o, dict)]
                token = page.get("NextContinuationToken")
                if not page.get("IsTruncated") or not token:
                    return
        elif self.protocol == "gcs":
            token = None
            while True:
                page = await fs._call_list_objects(bucket, prefix=prefix, maxResults=1000,
                                                   **({"pageToken": token} if token else {}))
                yield [(f"{bucket}/{i['name']}", i) for i in page.get("items", []) if isinstance(i, dict)]
                token = page.get("nextPageToken")
                if not token:
                    return
        else:  # az, abfs
            async with fs.service_client.get_container_client(container=bucket) as client:
                async for page in client.list_blobs(name_starts_with=prefix).by_page():
                    yield [(f"{bucket}/{b.name}", {"last_modified": b.last_modified}) async for b in page]

    def _check_bucket(self) -> None:
        """RemoteError unless the bucket (container) is there; once per remote once it is."""
        bucket = self.root.split("/", 1)[0]
        if self._bucket_seen or self.protocol == "memory":
            return
        if not self._call("checking the bucket", lambda: self._ask("exists", bucket)):
            raise RemoteError(f"{self.url}: no bucket {bucket!r} there (or these credentials cannot see it)")
        self._bucket_seen = True

    def keys(self) -> set[str]:
        folder = f"{self.root}/manifests"
        try:
            keys = self._call(f"listing {folder}", lambda: self._list(folder, _key, f"listing {folder}"))
        except FileNotFoundError:
            keys = []
        if not keys:
            self._check_bucket()  # an empty listing of a bucket that is not there is a typo, not an empty remote
        return set(keys)

    def _manifest(self, key: str, versioned: bool = True) -> tuple[Manifest | None, str | None]:
        """(the manifest there, its version for a conditional replace) or (None, None) when it is not
        there. Raises ManifestError/StaleManifest when it cannot be one; at most MAX_BYTES are read.
        ``versioned=False`` (a pull): the version is not asked for (None), one request fewer."""
        path = self.manifest_path(key)
        try:
            version = None
            if versioned and self.protocol != "memory":  # read before the content: a replace conditional
                info = self._call(f"reading {path}", lambda: self._ask("info", path))  # on it is conservative
                found = info.get("generation") if self.protocol == "gcs" else info.get("ETag") or info.get("etag")
                version = str(found) if found is not None else None
            raw = self._call(f"reading {path}", lambda: self._read(path, 0, codec.MAX_BYTES + 1))
        except FileNotFoundError:
            return None, None
        return codec.from_json(raw, key), version

    def read_manifest(self, key: str) -> Manifest | None:
        try:
            return self._manifest(key, versioned=False)[0]
        except ValueError:
            return None

    def fetch(self, key: str, store: Store, progress: TransferProgress | None = None) -> str:
        try:
            manifest, _ = self._manifest(key, versioned=False)
        except StaleManifest as exc:
            return f"refused: the remote's entry is stale ({exc})"
        except ValueError as exc:
            return f"refused: the remote's manifest is malformed ({exc})"
        if manifest is None:
            # As the folder remote's missing root: a bucket that is not there is a typo or a missing
            # grant, never a silent miss (every cold start would compile and nothing would say why).
            self._check_bucket()
            return "not on the remote"

        def blobs(wanted: list[tuple[str, int]]) -> Iterator[tuple[str, BinaryIO]]:
            for digest, size in wanted:
                path = self.blob_path(digest)
                try:
                    info = self._call(f"checking {path}", lambda p=path: self._ask("info", p))
                except FileNotFoundError:
                    info = {}
                if info.get("type", "file") != "file" or not isinstance(info.get("size"), int):
                    raise StoreError(f"blob {digest[:12]} is missing on the remote")
                if info["size"] > size:
                    raise StoreError(f"blob {digest[:12]} has {info['size']} bytes on the remote, more than the "
                                     f"{size} its manifest declares: refused")
                # At most one byte more than declared (a blob that grew since is refused by the reader),
                # and never past the object's end: no range is requested once it is reached.
                yield digest, _Ranges(self, path, min(size + 1, info["size"]))  # type: ignore[misc]

        return ingest(store, key, manifest, blobs, Meter(progress, key))

    def failure_times(self) -> dict[str, float]:
        folder = f"{self.root}/failures"

        def keep(path: str, info: Any) -> tuple[str, float] | None:
            key = _key(path, info)
            return (key, _modified(info)) if key is not None else None

        try:
            return dict(self._call(f"listing {folder}", lambda: self._list(folder, keep, f"listing {folder}")))
        except FileNotFoundError:
            return {}

    def read_failure(self, key: str) -> dict | None:
        path = self.failure_path(key)
        try:  # one byte more than a record may have: a bigger object is refused, not read whole
            raw = self._call(f"reading {path}", lambda: self._read(path, 0, MAX_FAILURE_BYTES + 1))
        except FileNotFoundError:
            return None
        return failure_record(raw)

    def put_failure(self, key: str, record: dict) -> bool:
        """An ordinary write (the newest failure of a key replaces an older one): a record says only
        that a job failed, and what may write it is what may write the bucket (docs/security.md)."""
        path = self.failure_path(key)
        data = json.dumps(record, sort_keys=True).encode("utf-8")
        self._call(f"writing {path}", lambda: self._ask("pipe_file", path, data))
        return True

    def remove_failure(self, key: str) -> None:
        path = self.failure_path(key)
        try:
            self._call(f"removing {path}", lambda: self._ask("rm_file", path))
        except FileNotFoundError:
            pass

    def _put_new(self, what: str, put: Callable[[str], Any]) -> bool:
        """``put(mode)`` create-only where the store offers it; False when the object was already there.
        Where it does not (fsspec's NotImplementedError; s3fs's OSError(ENOSYS) for a 501 NotImplemented
        answer to ``If-None-Match``), an ordinary write: safe by ordering and content addressing."""

        def create() -> Any:
            try:
                return put("create")
            except OSError as exc:
                if exc.errno == errno.ENOSYS:
                    raise NotImplementedError(str(exc)) from exc
                raise

        try:
            self._call(what, create)
        except FileExistsError:
            return False
        except NotImplementedError:
            self._call(what, lambda: put("overwrite"))
        return True

    def _replace(self, key: str, data: bytes, version: str | None) -> bool:
        """Replace the manifest of ``key`` only if it is still ``version`` (S3's and Azure's ETag, GCS's
        generation); False when it changed."""
        path = self.manifest_path(key)
        extra: dict[str, Any] = {}
        if self.protocol == "s3" and version:
            extra = {"IfMatch": version}
        elif self.protocol in ("az", "abfs") and version:
            from azure.core import MatchConditions

            extra = {"etag": version, "match_condition": MatchConditions.IfNotModified}

        def put() -> None:
            try:
                if self.protocol == "gcs" and version:
                    self._gcs_put_if_generation(path, data, version)
                    return
                self._ask("pipe_file", path, data, **extra)
            except OSError as exc:  # s3fs: 412 Precondition Failed, someone else wrote it since
                if "pre-condition" in str(exc) or "PreconditionFailed" in str(exc):
                    raise FileExistsError(path) from None
                raise

        try:
            self._call(f"writing {path}", put)
        except FileExistsError:
            return False
        return True

    def _gcs_put_if_generation(self, path: str, data: bytes, generation: str) -> None:
        """gcsfs's own upload, with ``ifGenerationMatch`` set to the generation read. gcsfs passes no
        precondition of ours (pipe_file's only one is create-only's ``ifGenerationMatch=0``), so this is
        its simple_upload's one multipart request; GCS answers 412 when the object changed since, which
        gcsfs raises as FileExistsError. (gcp-storage-emulator ignores every precondition.)"""
        from urllib.parse import quote

        from fsspec.asyn import sync

        bucket, name, _ = self.fs.split_path(path)
        body = (b"--==0==\nContent-Type: application/json; charset=UTF-8\n\n" + json.dumps({"name": name}).encode()
                + b"\n--==0==\nContent-Type: application/json\n\n" + data + b"\n--==0==--")
        sync(self.fs.loop, self.fs._call, "POST", f"{self.fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
             uploadType="multipart", headers={"Content-Type": 'multipart/related; boundary="==0=="'}, data=body,
             json_out=True, ifGenerationMatch=generation)

    def push(self, entries: list[Entry], progress: TransferProgress | None = None,
             workdir: Path | None = None, trusted: dict[str, bytes] | None = None) -> PushResult:
        from aotbuild.cache.signing import merge_signatures, supersedes

        result = PushResult()
        on_remote = self.keys()
        todo: list[tuple[Entry, str | None]] = []  # what is sent, and the version of a manifest it replaces
        for entry in entries:
            there, version = None, None
            if entry.key in on_remote:
                try:
                    there, version = self._manifest(entry.key)
                except ValueError:
                    there = None  # malformed there: replaced by ours
            if there is not None and not (trusted and supersedes(entry.manifest, there, trusted)):
                result.present.append(entry.key)
                merged = merge_signatures(there, entry.manifest)
                if merged is not None and self._replace(entry.key, merged.to_json().encode(), version):
                    result.signed.append(entry.key)
                continue
            todo.append((entry, version))
        for n, (entry, version) in enumerate(todo, 1):
            meter = Meter(progress, entry.key, n, len(todo))
            result.bytes_sent += self._put_blobs(entry, meter)
            data = entry.manifest.to_json().encode()
            path = self.manifest_path(entry.key)
            if entry.key in on_remote:  # superseded (or malformed there): replace what was read
                if not self._replace(entry.key, data, version):
                    raise RemoteError(f"{self.url}: the manifest of {entry.key[:12]} changed while it was "
                                      "replaced; push again")
                result.superseded.append(entry.key)
            elif not self._put_new(f"writing {path}",
                                   lambda mode, p=path, d=data: self._ask("pipe_file", p, d, mode=mode)):
                result.present.append(entry.key)  # another pusher's manifest landed first: it stays
                continue
            result.sent.append(entry.key)
            meter.end()
        return result

    def _put_blobs(self, entry: Entry, meter: Meter) -> int:
        """Upload the entry's blobs the store lacks, each create-only; the bytes sent. ``meter`` hears
        of them as fsspec's upload callback counts them."""
        by_path = {item.path: item for item in entry.manifest.files}
        missing: dict[str, tuple[Path, int]] = {}
        for rel, blob in entry.files:
            digest, size = by_path[rel].sha256, by_path[rel].size
            target = self.blob_path(digest)
            if digest in missing:
                continue
            try:
                self._call(f"checking {target}", lambda t=target: self._ask("info", t))
                continue
            except FileNotFoundError:
                missing[digest] = (blob, size)
        meter.start(sum(size for _, size in missing.values()))
        sent = done = 0
        for digest, (blob, size) in missing.items():
            target = self.blob_path(digest)
            counted = _counted(meter, done, size)
            if self._put_new(f"uploading {target}", lambda mode, b=blob, t=target, c=counted:
                             self.fs.put_file(str(b), t, mode=mode, callback=c)):
                sent += size
            done += size
            meter.reached(done)
        return sent


def _counted(meter: Meter, base: int, size: int) -> Any:
    """An fsspec callback that tells ``meter`` of one blob's bytes as the store's client uploads them
    (``base`` bytes of the entry before it; a retried upload counts from its start again)."""
    from fsspec.callbacks import Callback

    class Counted(Callback):
        def call(self, *args: Any, **kwargs: Any) -> None:
            meter.reached(base + min(int(self.value or 0), size))

    return Counted()


__all__ = ["FsspecRemote", "SCHEMES", "parse", "storage_options"]
