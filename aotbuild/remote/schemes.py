"""Remote caches: where CI pushes built entries and where serving machines pull them from.

    file:///shared/aotbuild            a folder with the local store's own layout (blobs/, manifests/)
    hf://owner/repo[@revision]         a Hugging Face Hub model repo, through huggingface_hub
    hf://datasets/owner/repo[@revision]  the same on a dataset repo

One rule holds for both: a reader never sees a manifest whose blobs are missing. A folder remote
writes each blob to a temporary file and renames it into place, then the manifest the same way.
The Hub gets the packs in one commit, then the manifests in a second one. An interrupted push leaves
at most unreferenced blobs or packs, never an entry that points at nothing.

Content addressing makes pushes incremental. A folder remote receives only the blobs it lacks; the
Hub receives one pack per entry it lacks. The Hub limits files per repo and per folder, and one job
can leave hundreds of small files, so there each entry travels as one uncompressed tar of its
blobs, named by the tar's own sha256 (two pushers of one key never overwrite each other's pack).

Pulls verify before anything is used: a pulled blob is hashed as it is written and refused when it
does not match its name; a pack is hashed before it is opened, and its members must be plain files
named by the digests its manifest lists. Nothing is deserialised before that (manifests are JSON).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from aotbuild.cache import manifest as codec
from aotbuild.cache.layout import HEX64
from aotbuild.cache.locks import flocked, store_lock
from aotbuild.cache.manifest import Manifest, ManifestError, StaleManifest
from aotbuild.cache.store import Entry, Store, sha256_file
from aotbuild.errors import RemoteError, StoreError, UsageError
from aotbuild.remote import bounds
from aotbuild.remote.base import Meter, PushResult, Remote, TransferProgress, ingest
from aotbuild.utils import secrets
from aotbuild.utils.safeio import atomic_write, open_regular

#: The schemes of a remote URL that are not an object store's (``objectstore.SCHEMES`` holds those):
#: a folder's and the Hub's. :func:`scheme_names` is every scheme :func:`parse_remote` takes.
FOLDER, HUB = "file", "hf"
_HF = re.compile(r"^hf://(?:(?P<kind>datasets|models)/)?(?P<repo>[\w.-]+/[\w.-]+)(?:@(?P<rev>[\w./-]+))?/?$")
#: Operations per Hub commit: big pushes go in several pack commits, all before the manifest commits.
HUB_COMMIT_BATCH = 100


def untrusted_on_remote(remote: Remote, keys: list[str], trusted: dict[str, bytes]) -> dict[str, str]:
    """key -> why the remote's entry of it is not one a trusted key signed, for each of ``keys`` (the
    remote's manifests only, each read bounded; no blob or pack is fetched)."""
    from aotbuild.cache.signing import check

    out = {}
    for key in keys:
        manifest = remote.read_manifest(key)
        why = "its manifest there cannot be read" if manifest is None else check(manifest, trusted)
        if why:
            out[key] = why
    return out


@secrets.scrubbed  # its exceptions leave it scrubbed of secrets (issue 53)
def parse_remote(url: str) -> Remote:
    """``file:///abs/path``, ``hf://owner/repo[@rev]``, ``hf://datasets/owner/repo[@rev]`` or an object
    store's ``s3://``, ``gs://``, ``az://``/``abfs://``, ``memory://`` (aotbuild/remote/objectstore.py)."""
    url = url.strip()
    if url.startswith("hf://buckets/") or url == "hf://buckets":
        raise UsageError(f"remote {url!r}: hf://buckets/ is reserved for the Hub's storage buckets, which aotbuild "
                         "does not read yet: use their S3 gateway as s3://bucket with AWS_ENDPOINT_URL")
    from aotbuild.remote.objectstore import parse as parse_object_store

    remote = parse_object_store(url)  # s3://, gs://, az://, abfs://, memory://
    if remote is not None:
        return remote
    if url.startswith(f"{FOLDER}://"):
        path = url[len(f"{FOLDER}://"):]
        if not path.startswith("/"):
            raise UsageError(f"remote {url!r}: a folder remote is file:///absolute/path (three slashes)")
        return FolderRemote(url, Path(path))
    match = _HF.match(url)
    if match:
        repo_type = "dataset" if match["kind"] == "datasets" else "model"
        return HubRemote(url, match["repo"], repo_type, match["rev"])
    if url.startswith(f"{HUB}://"):
        raise UsageError(f"remote {url!r}: expected hf://owner/repo[@revision] or hf://datasets/owner/repo[@revision]")
    raise UsageError(f"{url!r} is not a remote: use file:///shared/folder, hf://owner/repo (hf://datasets/owner/repo "
                     f"for a dataset repo), s3://bucket/prefix, gs://bucket/prefix or az://container/prefix")


def scheme_names() -> tuple[str, ...]:
    """Every scheme of a remote URL, in the order the docs list them: a folder's, the Hub's, then the
    object stores' (s3, gs and its alias gcs, az and abfs, memory). README.md, docs/cli.md, docs/ci.md
    and ``load_compiled``'s docstring name each one (tests/test_docs.py)."""
    from aotbuild.remote.objectstore import SCHEMES

    return (FOLDER, HUB, *SCHEMES)


def as_remote(remote: str | Remote) -> Remote:
    """What every public function that takes a remote accepts: a URL (:func:`parse_remote`) or a Remote."""
    return parse_remote(remote) if isinstance(remote, str) else remote


def pull_entry(remote: Remote, key: str, store: Store, progress: TransferProgress | None = None) -> str:
    """Fetch one entry into ``store``: "" or why not (the download takes no lock; storing it does);
    ``progress`` hears of its bytes (base.Transfer).

    RemoteError (the remote failed) propagates; a local store that cannot be written is a reason."""
    try:
        return remote.fetch(key, store, progress) if progress is not None else remote.fetch(key, store)
    except RemoteError:
        raise
    except OSError as exc:  # a read-only store, a lock timeout
        return f"cannot write to the local cache {store.root}: {exc}"


class FolderRemote(Remote):
    """A shared folder laid out like a local store: it can also be used directly as ``--cache``."""

    def __init__(self, url: str, path: Path):
        self.url = url
        self.store = Store(path)

    def _check_root(self) -> None:
        """A remote folder that does not exist is a typo or an unmounted share, not an empty remote."""
        if not self.store.root.is_dir():
            raise RemoteError(f"{self.url}: no such folder (not mounted? a push creates it; its parent must exist)")

    def keys(self) -> set[str]:
        self._check_root()
        folder = self.store.layout.manifests
        if not folder.is_dir():
            return set()
        return {p.stem for p in folder.glob("*/*.json") if HEX64.match(p.stem)}

    def fetch(self, key: str, store: Store, progress: TransferProgress | None = None) -> str:
        self._check_root()
        try:
            manifest = self.store.load_manifest(key)
        except StaleManifest as exc:
            return f"refused: the remote's entry is stale ({exc})"
        except ValueError as exc:
            return f"refused: the remote's manifest is malformed ({exc})"
        except OSError as exc:
            raise RemoteError(f"{self.url}: cannot read the manifest of {key[:12]}: {exc}") from None
        if manifest is None:
            return "not on the remote"

        def blobs(wanted: list[tuple[str, int]]) -> Iterator[tuple[str, BinaryIO]]:
            for digest, _ in wanted:
                try:  # a regular file only, opened without blocking (a FIFO there must not hang a pull)
                    f = open_regular(self.store.layout.blob(digest))
                except FileNotFoundError:
                    raise StoreError(f"blob {digest[:12]} is missing on the remote") from None
                except OSError as exc:
                    raise StoreError(f"blob {digest[:12]} on the remote is not a regular file ({exc})") from None
                with f:
                    yield digest, f

        return ingest(store, key, manifest, blobs, Meter(progress, key))

    def read_manifest(self, key: str) -> Manifest | None:
        self._check_root()
        return self.store.read_manifest(key)

    def push(self, entries: list[Entry], progress: TransferProgress | None = None,
             workdir: Path | None = None, trusted: dict[str, bytes] | None = None) -> PushResult:
        result = PushResult()
        if not self.store.root.parent.is_dir():  # never create a whole tree from a typo
            raise RemoteError(f"{self.url}: {self.store.root.parent} does not exist (not mounted?); create the "
                              "remote folder's parent first")
        try:
            with store_lock(self.store.root, exclusive=False):  # the folder may be gc'd as a --cache
                self._push(entries, result, progress, trusted or {})
        except OSError as exc:
            raise RemoteError(f"cannot write to {self.url}: {exc}") from None
        return result

    def _push(self, entries: list[Entry], result: PushResult, progress: TransferProgress | None,
              trusted: dict[str, bytes]) -> None:
        from aotbuild.cache.signing import supersedes

        todo = []
        for entry in entries:
            there = self.store.check_entry(entry.key)[0]
            if there and trusted and supersedes(entry.manifest, self.store.read_manifest(entry.key), trusted):
                result.superseded.append(entry.key)
            elif there:
                result.present.append(entry.key)
                if self._add_signatures(entry.manifest):
                    result.signed.append(entry.key)
                continue
            todo.append(entry)
        for n, entry in enumerate(todo, 1):
            by_path = {item.path: item for item in entry.manifest.files}
            missing = {by_path[rel].sha256: (blob, by_path[rel].size) for rel, blob in entry.files
                       if not self.store.has_blob(by_path[rel].sha256, by_path[rel].size, verify=True)}
            meter = Meter(progress, entry.key, n, len(todo))
            meter.start(sum(size for _, size in missing.values()))
            for digest, (blob, size) in missing.items():
                with open_regular(blob) as f:
                    self.store.put_blob(meter.reading(f), expect=digest)
                result.bytes_sent += size
            self.store.put_manifest(entry.manifest)
            result.sent.append(entry.key)
            meter.end()

    def failure_times(self) -> dict[str, float]:
        if not self.store.root.is_dir():  # a build's push target before its first push: no records yet
            return {}
        times = {}
        for key in self.store.failure_keys():
            try:  # the record itself, never a link's target
                times[key] = self.store.layout.failure(key).lstat().st_mtime
            except OSError:  # removed since the listing: not there
                continue
        return times

    def read_failure(self, key: str) -> dict | None:
        self._check_root()
        return self.store.failure(key)

    def put_failure(self, key: str, record: dict) -> bool:
        if not self.store.root.parent.is_dir():  # as a push: never create a whole tree from a typo
            raise RemoteError(f"{self.url}: {self.store.root.parent} does not exist (not mounted?)")
        try:
            self.store.put_failure(key, record, strict=True)
        except OSError as exc:
            raise RemoteError(f"cannot write to {self.url}: {exc}") from None
        return True

    def remove_failure(self, key: str) -> None:
        self.store.remove_failure(key)

    def _add_signatures(self, manifest: Manifest) -> bool:
        """An entry the remote has gets the signatures pushed with it (key rotation: sign with the new
        key beside the old), where it is the same entry (the signatures cover its content)."""
        from aotbuild.cache.signing import merge_signatures

        there = self.store.read_manifest(manifest.key)
        merged = merge_signatures(there, manifest) if there is not None else None
        if merged is not None:
            self.store.put_manifest(merged)
        return merged is not None


class HubRemote(Remote):
    """A Hugging Face Hub repo: ``manifests/<2 hex>/<key>.json`` and ``packs/<2 hex>/<sha256>.tar``.

    Credentials are huggingface_hub's own (``HF_TOKEN``, ``hf auth login``); reading a public repo
    needs none. ``HF_ENDPOINT`` is read when the remote is used, not when huggingface_hub is imported."""

    def __init__(self, url: str, repo_id: str, repo_type: str, revision: str | None):
        self.url = url
        self.repo_id = repo_id
        self.repo_type = repo_type
        self.revision = revision
        self.endpoint = os.environ.get("HF_ENDPOINT") or None

    @staticmethod
    def manifest_path(key: str) -> str:
        return f"manifests/{key[:2]}/{key}.json"

    @staticmethod
    def pack_path(digest: str) -> str:
        return f"packs/{digest[:2]}/{digest}.tar"

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        """Run a huggingface_hub call; its failures become one RemoteError naming the next step."""
        from huggingface_hub import errors

        from aotbuild.pipeline import hub

        down = "" if hub.offline_mode() else hub.unreachable(self.endpoint)
        if down:
            raise RemoteError(f"{self.url}: {what} failed: the Hub cannot be reached: {down} (network, "
                              f"HF_ENDPOINT)")
        try:
            return fn()
        except (StoreError, RemoteError):  # ours: a refused download (too big), a local disk that cannot be
            raise  # written, a listing past AOTBUILD_REMOTE_MAX_KEYS
        except errors.LocalEntryNotFoundError:  # huggingface_hub's word for "could not reach the Hub"
            raise RemoteError(f"{self.url}: {what} failed: the Hub cannot be reached (network, HF_ENDPOINT, "
                              f"HF_HUB_OFFLINE)") from None
        except errors.EntryNotFoundError:  # the file or folder is not there: the caller decides what it means
            raise
        except errors.RepositoryNotFoundError:
            raise RemoteError(f"{self.url}: the repo does not exist or this token cannot see it (create it with "
                              f"`hf repos create {self.repo_id} --repo-type {self.repo_type}`, or set HF_TOKEN)") \
                from None
        except errors.RevisionNotFoundError:
            raise RemoteError(f"{self.url}: no revision {self.revision!r} in the repo") from None
        except errors.HfHubHTTPError as exc:
            status = getattr(exc.response, "status_code", None)
            hint = " (writing needs a token with write access: set HF_TOKEN)" if status in (401, 403) else ""
            raise RemoteError(f"{self.url}: {what} failed: {str(exc).splitlines()[0]}{hint}") from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EROFS):  # ours, not the Hub's
                raise StoreError(f"{what} from {self.url}: cannot write here: {exc}") from None
            raise RemoteError(f"{self.url}: {what} failed: {type(exc).__name__}: {exc}") from None
        except Exception as exc:  # network errors come from httpx and the OS: name them, no traceback
            raise RemoteError(f"{self.url}: {what} failed: {type(exc).__name__}: {exc}") from None

    def _api(self) -> Any:
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint)

    def _list(self, folder: str) -> list[str]:
        from huggingface_hub import errors
        from huggingface_hub.hf_api import RepoFile

        api = self._api()
        what = f"listing {folder}/"
        limits, listed = bounds.limits(), [0]

        def listing(cancelled: Any) -> list[str]:
            # The Hub's tree is paged (list_repo_tree is lazy): one page at a time, stopped past the
            # key cap or once the listing's deadline passed (issue 53: a listing that never ends).
            out = []
            for item in bounds.capped(api.list_repo_tree(self.repo_id, path_in_repo=folder, recursive=True,
                                                         repo_type=self.repo_type, revision=self.revision),
                                      limits, self.url, what, cancelled):
                listed[0] += 1
                if isinstance(item, RepoFile):
                    out.append(item.path)
            return out

        try:
            return self._call(what, lambda: bounds.within(listing, lambda: limits.listing(listed[0])))
        except errors.EntryNotFoundError:
            return []

    def keys(self) -> set[str]:
        return {Path(p).stem for p in self._list("manifests") if p.endswith(".json") and HEX64.match(Path(p).stem)}

    def _download(self, filename: str, folder: Path, limit: int, total: float | None = None,
                  meter: Meter | None = None) -> Path | None:
        """``filename`` (a path aotbuild made: manifests/... or packs/...) into ``folder``, streamed and
        refused as soon as it passes ``limit`` bytes (a manifest's 16 MiB, a pack's recorded size): a
        remote cannot fill the disk by sending more than it declared. None when it is not there.
        Bounded in time (issue 53): no byte for AOTBUILD_REMOTE_STALL fails, and all of it within
        ``total`` seconds (default AOTBUILD_REMOTE_DEADLINE: a manifest; a pack passes its length at
        AOTBUILD_REMOTE_MIN_RATE), so a drip fails too. ``meter`` counts the bytes as they arrive."""
        from huggingface_hub import constants as hf_constants
        from huggingface_hub import errors, hf_hub_url
        from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

        from aotbuild.pipeline import hub

        if hub.offline_mode():
            raise RemoteError(f"{self.url}: downloading {filename} failed: HF_HUB_OFFLINE is set")
        url = hf_hub_url(self.repo_id, filename, repo_type=self.repo_type, revision=self.revision,
                         endpoint=self.endpoint)
        dest = folder.joinpath(*Path(filename).parts)
        limits = bounds.limits()
        total = limits.deadline if total is None else total

        def fetch(cancelled: Any) -> Path:
            dest.parent.mkdir(parents=True, exist_ok=True)
            with get_session().stream("GET", url, headers=build_hf_headers(), follow_redirects=True,
                                      timeout=min(hf_constants.HF_HUB_DOWNLOAD_TIMEOUT, limits.stall)) as response:
                if response.status_code >= 400:
                    response.read()
                    hf_raise_for_status(response)
                declared = response.headers.get("Content-Length", "")
                if declared.isdigit() and int(declared) > limit:
                    raise StoreError(f"{filename} on {self.url} is {declared} bytes, more than the {limit} it may "
                                     f"have: refused before downloading")
                received = 0
                with atomic_write(dest) as out:  # a download cut short leaves no partial file
                    for chunk in response.iter_bytes():  # as it arrives: a drip is seen, byte by byte
                        if cancelled.is_set():  # past its deadline: the caller has moved on
                            raise bounds.DeadlineExceeded(f"{filename}: abandoned past its deadline")
                        received += len(chunk)
                        if received > limit:
                            raise StoreError(f"{filename} on {self.url} sent more than the {limit} bytes it may "
                                             f"have: refused while downloading")
                        out.file.write(chunk)
                        if meter is not None:
                            meter.moved(len(chunk))
            return dest

        def bounded(cancelled: Any) -> Path:
            try:
                return fetch(cancelled)
            except Exception as exc:  # the HTTP client's ReadTimeout & co: its timeout is AOTBUILD_REMOTE_STALL
                if type(exc).__name__.endswith(("Timeout", "TimeoutException")):  # at most (no import of it here)
                    raise limits.stalled() from None
                raise

        try:
            return self._call(f"downloading {filename}", lambda: bounds.within(bounded, lambda: total))
        except errors.EntryNotFoundError:
            return None

    def read_manifest(self, key: str) -> Manifest | None:
        with tempfile.TemporaryDirectory(prefix="aotbuild-sig.") as folder:
            try:
                path = self._download(self.manifest_path(key), Path(folder), codec.MAX_BYTES)
                return codec.read(path, key) if path is not None else None
            except (ValueError, OSError, StoreError):
                return None  # malformed or too big there: pull and verify decide about it, a push does not

    def _resigned(self, entry: Entry) -> Manifest | None:
        """The remote's manifest of ``entry`` with the signatures pushed beside its own, where it is the
        same manifest (a signature covers its content) and they add one; else None."""
        from aotbuild.cache.signing import merge_signatures

        there = self.read_manifest(entry.key)
        return merge_signatures(there, entry.manifest) if there is not None else None

    def fetch(self, key: str, store: Store, progress: TransferProgress | None = None) -> str:
        try:
            store.layout.tmp.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix="pull.", dir=store.layout.tmp))
        except OSError as exc:
            return f"could not write to the local cache {store.root}: {exc}"
        try:  # the folder's lock tells `aotbuild verify` that a download is alive in it
            with flocked(folder / ".lock", exclusive=True, timeout=0):
                return self._fetch(key, store, folder, Meter(progress, key))
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def _fetch(self, key: str, store: Store, folder: Path, meter: Meter) -> str:
        try:
            path = self._download(self.manifest_path(key), folder, codec.MAX_BYTES)
        except StoreError as exc:
            return f"refused: {exc}"
        if path is None:
            return "not on the remote"
        try:
            manifest = codec.read(path, key)
            if manifest is None or manifest.pack is None:
                raise ManifestError("no pack")
            pack_digest, pack_size = manifest.pack["sha256"], manifest.pack["size"]
            wanted = manifest.blobs()
        except StaleManifest as exc:
            return f"refused: the remote's entry for {key[:12]} is stale ({exc})"
        except (ValueError, OSError) as exc:
            return f"refused: the remote's manifest for {key[:12]} is malformed ({exc})"
        why = store.untrusted(manifest)  # before the pack is downloaded
        if why:
            return f"refused: {why}"
        tar_path = None
        needed = any(not store.has_blob(d, size, verify=True) for d, size in wanted)
        meter.start(pack_size if needed else 0)  # what travels is the pack, whole
        if needed:
            # Downloaded and verified before any lock is taken: a long download holds up no one.
            try:
                tar_path = self._download(self.pack_path(pack_digest), folder, pack_size,
                                          bounds.limits().transfer(pack_size), meter)
            except StoreError as exc:
                return f"refused: {exc}"
            if tar_path is None:
                return f"refused: pack {pack_digest[:12]} of {key[:12]} is missing on the remote"
            if tar_path.stat().st_size != pack_size or sha256_file(tar_path) != pack_digest:
                return f"refused: pack {pack_digest[:12]} of {key[:12]} does not match its hash"

        def blobs(missing: list[tuple[str, int]]) -> Iterator[tuple[str, BinaryIO]]:
            assert tar_path is not None
            yield from _read_pack(tar_path, {d for d, _ in missing})

        why = ingest(store, key, manifest, blobs)
        if not why:
            meter.end()
        return why

    def push(self, entries: list[Entry], progress: TransferProgress | None = None,
             workdir: Path | None = None, trusted: dict[str, bytes] | None = None) -> PushResult:
        """Packs are written under ``workdir`` (the local store's ``tmp/``, so a big push does not
        fill a small system /tmp), committed and deleted batch by batch; the manifests go last.
        ``progress`` hears of each entry's pack when it is written and when its commit has landed:
        huggingface_hub's commit takes no byte callback, so the bytes within one are not counted."""
        from huggingface_hub import CommitOperationAdd

        from aotbuild.cache.signing import supersedes

        result = PushResult()
        on_remote = self.keys()
        if trusted:  # a manifest there no trusted key signed gives way to a pushed one a trusted key signed
            result.superseded = [e.key for e in entries if e.key in on_remote
                                 and supersedes(e.manifest, self.read_manifest(e.key), trusted)]
            on_remote -= set(result.superseded)
        todo = [e for e in entries if e.key not in on_remote]
        present = [e for e in entries if e.key in on_remote]
        result.present = [e.key for e in present]
        resigned = [m for m in map(self._resigned, (e for e in present if e.manifest.signed_by)) if m]
        result.signed = [m.key for m in resigned]
        if not todo and not resigned:
            return result
        packs_there = set(self._list("packs"))
        api = self._api()

        def commit(ops: list[Any], what: str) -> None:
            self._call(f"committing {what}", lambda: api.create_commit(
                self.repo_id, operations=ops, commit_message=f"aotbuild: {len(ops)} {what}",
                repo_type=self.repo_type, revision=self.revision))

        # Signatures added to entries the remote has: the same manifest, its pack already there.
        manifest_ops = [CommitOperationAdd(self.manifest_path(m.key), m.to_json().encode()) for m in resigned]
        try:
            if workdir is not None:
                workdir.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix="push.", dir=workdir))
        except OSError as exc:
            raise StoreError(f"cannot stage packs for {self.url}: {exc}") from None
        try:
            with flocked(staging / ".lock", exclusive=True, timeout=0):
                for i in range(0, len(todo), HUB_COMMIT_BATCH):
                    pack_ops, meters = [], []
                    for n, entry in enumerate(todo[i:i + HUB_COMMIT_BATCH], i + 1):
                        try:
                            pack, digest, size = _write_pack(entry, staging)
                        except OSError as exc:
                            raise StoreError(f"cannot write the pack of {entry.key[:12]} in {staging}: "
                                             f"{exc}") from None
                        meters.append(Meter(progress, entry.key, n, len(todo)))
                        if self.pack_path(digest) not in packs_there:
                            pack_ops.append(CommitOperationAdd(self.pack_path(digest), str(pack)))
                            packs_there.add(self.pack_path(digest))
                            result.bytes_sent += size
                            meters[-1].start(size)
                        else:
                            meters[-1].start(0)
                        text = replace(entry.manifest, pack={"sha256": digest, "size": size,
                                                             "path": self.pack_path(digest)}).to_json()
                        manifest_ops.append(CommitOperationAdd(self.manifest_path(entry.key), text.encode()))
                    if pack_ops:
                        commit(pack_ops, "packs")
                    for leftover in staging.glob("*.tar"):
                        leftover.unlink()
                    for meter in meters:
                        meter.end()
                # Only once every pack has landed: the manifests that name them.
                for i in range(0, len(manifest_ops), HUB_COMMIT_BATCH):
                    commit(manifest_ops[i:i + HUB_COMMIT_BATCH], "manifests")
            result.sent = [e.key for e in todo]
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return result


def _write_pack(entry: Entry, folder: Path) -> tuple[Path, str, int]:
    """One uncompressed tar of the entry's blobs, each named by its digest; reproducible bytes."""
    digests = {item.path: item.sha256 for item in entry.manifest.files}
    members = sorted({digests[rel]: blob for rel, blob in entry.files}.items())
    path = folder / f"{entry.key}.tar"
    with atomic_write(path) as out, tarfile.open(fileobj=out.file, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for digest, blob in members:
            info = tarfile.TarInfo(digest)
            info.size, info.mode, info.mtime = blob.stat().st_size, 0o444, 0
            with open_regular(blob) as f:
                tar.addfile(info, f)
    return path, sha256_file(path), path.stat().st_size


def _read_pack(path: Path, wanted: set[str]) -> Iterator[tuple[str, BinaryIO]]:
    """The wanted members of a verified pack: plain files named by a digest, nothing else is read."""
    with open_regular(path) as f, tarfile.open(fileobj=f, mode="r:") as tar:
        for member in tar:
            if not member.isreg() or not HEX64.match(member.name):
                raise StoreError(f"pack member {member.name!r} is not a plain file named by its sha256")
            if member.name not in wanted:
                continue
            stream = tar.extractfile(member)
            assert stream is not None
            with contextlib.closing(stream):
                yield member.name, stream


__all__ = ["Remote", "FolderRemote", "HubRemote", "PushResult", "parse_remote", "pull_entry", "untrusted_on_remote",
           "scheme_names", "FOLDER", "HUB"]
