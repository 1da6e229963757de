"""The content-addressed store: blobs named by their sha256 and one JSON manifest per key.

Writes go to a temporary file in ``tmp/`` and are renamed into place, blobs before the manifest
that names them, so a reader sees either no entry or a whole one. Reads write nothing but a
recency touch (``touch``, skipped where it fails): a store baked into a read-only image, or owned
by another user, loads fine. Every blob is hash-verified before
it is handed out; a corrupt or missing blob makes its entry a miss, never a load.
"""

from __future__ import annotations

import contextlib
import enum
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from aotbuild.cache import manifest as codec
from aotbuild.cache.layout import HEX64, Layout, shared_dirs
from aotbuild.cache.locks import locked_tempfile
from aotbuild.cache.manifest import Manifest
from aotbuild.errors import ManifestError, StaleManifest, StoreError, UsageError
from aotbuild.utils import safeio
from aotbuild.utils.safeio import atomic_write, open_regular

_CHUNK = 1 << 20
#: A failure record is a small JSON object (a reason, a time, a version).
MAX_FAILURE_BYTES = 64 * 1024
MAX_FAILURE_DEPTH = 8


def failure_record(data: bytes) -> dict | None:
    """A failure record's bytes (a local file's, or a remote's object) as the record, or None unless
    they are a small, shallow JSON object with a ``reason`` string: a hostile record is ignored."""
    try:
        record = safeio.loads_json(data, max_bytes=MAX_FAILURE_BYTES, max_depth=MAX_FAILURE_DEPTH)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("reason"), str) else None


def sha256_file(path: Path) -> str:
    """The file's sha256. Opened without blocking and refused unless a regular file (OSError):
    a FIFO planted where a blob belongs must not hang a reader."""
    with open_regular(path) as f:
        h = hashlib.sha256()
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class Unusable(enum.Enum):
    """Why the store cannot hand out an entry: callers branch on these, never on the text."""

    NOT_BUILT = "not built"  # no manifest for the key
    UNREADABLE = "unreadable"  # the manifest exists but cannot be read (permissions)
    STALE = "stale"  # a manifest of another format
    MALFORMED = "malformed"  # a manifest no reader accepts
    BLOB_MISSING = "blob missing"
    BLOB_SIZE = "blob size"  # a blob of another size than its manifest says
    BLOB_CORRUPT = "blob corrupt"  # a blob whose content does not hash to its name
    BLOB_UNREADABLE = "blob unreadable"
    UNTRUSTED = "untrusted"  # trusted keys are set and no trusted key's signature verifies


#: Kinds that mean the store holds a damaged entry (``verify --fix`` repairs it; a push refuses it).
DAMAGED = frozenset({Unusable.MALFORMED, Unusable.BLOB_MISSING, Unusable.BLOB_SIZE, Unusable.BLOB_CORRUPT})


class Reason(str):
    """Why an entry is not usable: the text for people (it is the string), ``kind`` for callers.
    ``Reason.none()`` (empty, ``kind`` None) goes with a usable entry."""

    kind: Unusable | None

    def __new__(cls, kind: Unusable | None, text: str) -> Reason:
        reason = super().__new__(cls, text)
        reason.kind = kind
        return reason

    @classmethod
    def none(cls) -> Reason:
        return cls(None, "")


#: A strategy's check of its own manifest records (``Strategy.check_records``, looked up by the
#: manifest's strategy): why they are malformed, or "". The store takes it as a narrow protocol and
#: knows no strategy.
RecordsCheck = Callable[[Manifest], str]
#: A RecordsCheck's answer that starts so: records an older aotbuild wrote that this one cannot use (a
#: StaleManifest: a miss that ``build`` rebuilds and ``gc --stale`` removes), not damage.
STALE_RECORDS = "stale: "


@dataclass(frozen=True)
class Entry:
    """A manifest whose blobs all verified: ``files`` maps each relative path to its blob."""

    key: str
    manifest: Manifest
    files: tuple[tuple[str, Path], ...]


@contextlib.contextmanager
def _open_source(source: Path | BinaryIO) -> Iterator[BinaryIO]:
    if isinstance(source, (str, os.PathLike)):
        with open_regular(source) as f:
            yield f
    else:
        yield source


class Store:
    """``records``: how the manifests' strategy records are checked before an entry is handed out
    (:data:`RecordsCheck`; aotbuild.strategies.records_problem); without it only the codec's checks apply."""

    def __init__(self, root: Path, records: RecordsCheck | None = None, trusted: dict[str, bytes] | None = None):
        self.layout = Layout(Path(root))
        self.records = records
        #: name -> public key: when set, only entries a trusted key signed are handed out (signing.py)
        self.trusted = trusted
        #: within hash_once(): the blobs hashed and found right, as (digest, inode, size, mtime)
        self._verified: set[tuple[str, int, int, int]] | None = None

    def untrusted(self, manifest: Manifest) -> str:
        """Why ``manifest`` is not signed by a trusted key ("" when it is, or when no key is trusted)."""
        if self.trusted is None:
            return ""
        from aotbuild.cache.signing import check

        return check(manifest, self.trusted)

    @property
    def root(self) -> Path:
        return self.layout.root

    # -- writing ------------------------------------------------------------------------------

    def _tempfile(self) -> tuple[int, str]:
        """A temp file in ``tmp/``, locked while its writer has it open: ``verify`` reports only
        temp files nobody holds (their writer died)."""
        return locked_tempfile(self.layout.tmp, "w.")

    def put_blob(self, source: Path | BinaryIO, expect: str | None = None,
                 max_size: int | None = None) -> tuple[str, int]:
        """Copy ``source`` (a path or a binary stream) into the store; return (sha256, size).

        Existing blobs are kept. With ``expect``, content whose hash differs is refused with a
        StoreError and nothing is stored (a pulled blob that does not match its name). With
        ``max_size`` (a pulled blob's declared size), reading stops one byte past it: a longer
        source is refused without being read to its end."""
        h = hashlib.sha256()
        size = 0
        with atomic_write(None, mode=0o444, make_temp=self._tempfile) as w, _open_source(source) as src:
            while chunk := src.read(_CHUNK if max_size is None else min(_CHUNK, max_size + 1 - size)):
                h.update(chunk)
                w.file.write(chunk)
                size += len(chunk)
                if max_size is not None and size > max_size:
                    raise StoreError(f"blob {(expect or '')[:12]} has more bytes than the {max_size} its manifest "
                                     f"declares: refused")
            digest = h.hexdigest()
            if expect is not None and digest != expect:
                raise StoreError(f"blob {expect[:12]} does not match its content (sha256 {digest[:12]}): refused")
            final = self.layout.blob(digest)
            if final.is_file() and final.stat().st_size == size and sha256_file(final) == digest:
                w.discard()  # already there and intact (a damaged one is replaced)
            else:
                shared_dirs(final.parent)
                w.target = final
        return digest, size

    def has_blob(self, digest: str, size: int, *, verify: bool = False) -> bool:
        """A blob of that name and size is stored (and, with ``verify``, hashes to its name)."""
        blob = self.layout.blob(digest)
        try:
            if blob.stat().st_size != size:
                return False
        except FileNotFoundError:
            return False
        return not verify or sha256_file(blob) == digest

    def put_manifest(self, manifest: Manifest) -> Path:
        """Write the manifest last, atomically; every blob it names must already be stored."""
        key = manifest.key
        for item in manifest.files:
            if not self.layout.blob(item.sha256).is_file():
                raise StoreError(f"refusing to write manifest {key[:12]}: blob {item.sha256[:12]} is missing")
        text = manifest.without_pack().to_json()  # the codec refuses what no reader would accept
        final = self.layout.manifest(key)
        if self.trusted:  # one manifest per key: one a trusted key signed is never overwritten by another
            from aotbuild.cache.signing import check, payload

            old = self.read_manifest(key)
            if old is not None and not check(old, self.trusted) and payload(old.as_json()) != payload(
                    manifest.as_json()):
                raise StoreError(f"refusing to replace manifest {key[:12]}: a trusted key signed the one stored")
        # 0644, not mkstemp's 0600: other users of a shared store must read it
        with atomic_write(final, mode=0o644, make_temp=self._tempfile) as w:
            w.file.write(text.encode("utf-8"))
            shared_dirs(final.parent)
        return final

    # -- reading ------------------------------------------------------------------------------

    def read_manifest(self, key: str) -> Manifest | None:
        """The manifest for ``key``, or None when there is none, it cannot be read, or it is malformed or stale."""
        try:
            return self.load_manifest(key)
        except (OSError, ValueError):
            return None

    def load_manifest(self, key: str) -> Manifest | None:
        """The manifest for ``key``; None when there is none. Raises OSError when it cannot be read
        (permissions), ManifestError when it is malformed and StaleManifest when it is of another
        format (both ValueErrors): ``gc`` must tell those apart from absent."""
        path = self.layout.manifest(key)
        try:
            manifest = codec.read(path, key)
            why = self.records(manifest) if manifest is not None and self.records is not None else ""
            if why.startswith(STALE_RECORDS):  # a strategy's records of an older aotbuild: stale, not damage
                raise StaleManifest(why[len(STALE_RECORDS):], manifest.format, manifest.files)
            if why:
                raise ManifestError(why)
            return manifest
        except ManifestError as exc:
            raise ManifestError(f"{path}: {exc}") from None

    @contextlib.contextmanager
    def hash_once(self) -> Iterator[None]:
        """Within it, a blob several entries share (an aot-package's ISA probe files) is hashed once,
        by the first ``open_entry`` that names it: one load's entries, opened under its store lock."""
        self._verified = set()
        try:
            yield
        finally:
            self._verified = None

    def open_entry(self, key: str) -> tuple[Entry | None, Reason]:
        """A verified entry, or (None, why not). Every blob is hashed before it is handed out."""
        return self._entry(key, verify_hashes=True)

    def check_entry(self, key: str) -> tuple[bool, Reason]:
        """Cheap presence check for planning: manifest readable, every blob there with its size."""
        entry, why = self._entry(key, verify_hashes=False)
        return entry is not None, why

    def _entry(self, key: str, verify_hashes: bool) -> tuple[Entry | None, Reason]:
        try:
            manifest = self.load_manifest(key)
        except OSError as exc:
            return None, Reason(Unusable.UNREADABLE, f"manifest cannot be read: {exc}")
        except StaleManifest as exc:
            return None, Reason(Unusable.STALE, f"stale: the entry is of {exc} (`aotbuild gc --stale` removes it)")
        except ValueError as exc:
            return None, Reason(Unusable.MALFORMED, f"manifest is malformed: {exc}")
        if manifest is None:
            return None, Reason(Unusable.NOT_BUILT, "not built")
        why = self.untrusted(manifest)  # before any blob is read: a blob is code
        if why:
            return None, Reason(Unusable.UNTRUSTED, why)
        files = []
        for item in manifest.files:
            rel, digest, size = item.path, item.sha256, item.size
            blob = self.layout.blob(digest)
            what = f"blob {digest[:12]} of {rel}"
            try:
                st = blob.stat()
                if st.st_size != size:
                    return None, Reason(Unusable.BLOB_SIZE, f"{what} has {st.st_size} bytes, expected {size}")
                seen = (digest, st.st_ino, st.st_size, st.st_mtime_ns)
                if verify_hashes and (self._verified is None or seen not in self._verified):
                    if sha256_file(blob) != digest:
                        return None, Reason(Unusable.BLOB_CORRUPT, f"{what} is corrupt (hash mismatch)")
                    if self._verified is not None:
                        self._verified.add(seen)
            except FileNotFoundError:  # missing, or removed by gc while we read
                return None, Reason(Unusable.BLOB_MISSING, f"{what} is missing")
            except OSError as exc:
                return None, Reason(Unusable.BLOB_UNREADABLE, f"{what} cannot be read: {exc}")
            files.append((rel, blob))
        return Entry(key, manifest, tuple(files)), Reason.none()

    def iter_manifests(self) -> Iterator[Manifest]:
        """Every readable, well-formed manifest of this format, stored under its own name."""
        for path in self.manifest_files():
            data = self.read_manifest(path.stem) if HEX64.match(path.stem) and path.parent.name == path.stem[:2] \
                else None
            if data is not None:
                yield data

    def resolve_prefix(self, prefix: str) -> str:
        prefix = prefix.lower()
        if any(c not in "0123456789abcdef" for c in prefix):
            raise UsageError(f"{prefix!r} is not a key: keys are hex (0-9, a-f); `aotbuild ls` lists them")
        if len(prefix) < 8:
            raise UsageError(f"{prefix!r} is too short for a key: give at least 8 hex characters")
        folder = self.layout.manifests / prefix[:2]
        matches = sorted(p.stem for p in folder.glob(f"{prefix}*.json")) if folder.is_dir() else []
        if not matches:
            raise UsageError(f"no cache entry has a key starting with {prefix}; `aotbuild ls` lists them")
        if len(matches) > 1:
            raise UsageError(f"{prefix} matches {len(matches)} keys; give more characters")
        return matches[0]

    def touch(self, key: str) -> None:
        """Mark ``key`` as used now (the manifest's mtime is its recency for ``gc``); a no-op where
        the store is read-only."""
        with contextlib.suppress(OSError):
            os.utime(self.layout.manifest(key))

    def manifest_files(self) -> Iterator[Path]:
        """Every ``manifests/<2 hex>/<name>.json`` file, well named or not."""
        if self.layout.manifests.is_dir():
            yield from sorted(self.layout.manifests.glob("*/*.json"))

    def blob_files(self) -> Iterator[Path]:
        """Everything under ``blobs/<2 hex>/`` but folders: a FIFO or link there is reported too."""
        if self.layout.blobs.is_dir():
            yield from sorted(p for p in self.layout.blobs.glob("*/*") if p.is_symlink() or not p.is_dir())

    # -- failure records: a job that failed, remembered so plan says so --------------------------

    def put_failure(self, key: str, record: dict, *, strict: bool = False) -> None:
        """Remember why job ``key`` failed (best effort: a read-only store keeps nothing; ``strict``: a
        write that fails raises OSError, for a folder remote, where a lost record must fail the push)."""
        import json

        path = self.layout.failure(key)
        try:
            shared_dirs(path.parent)
            with atomic_write(path, mode=0o644, make_temp=self._tempfile) as w:
                w.file.write(json.dumps(record, sort_keys=True).encode("utf-8"))
        except OSError:
            if strict:
                raise

    def failure(self, key: str) -> dict | None:
        """The failure record of job ``key``, or None (none, unreadable, a link, or not a small, shallow
        JSON object: a hostile store's record is ignored, never a traceback)."""
        try:
            data = safeio.read_bytes(self.layout.failure(key), MAX_FAILURE_BYTES, follow_symlinks=False)
        except OSError:
            return None
        return failure_record(data)

    def failure_keys(self) -> set[str]:
        """The keys with a failure record (by name: each record is read, and checked, when used)."""
        return {p.stem for p in self.failure_files() if p.suffix == ".json" and HEX64.match(p.stem)}

    def remove_failure(self, key: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.layout.failure(key))

    def failure_files(self) -> Iterator[Path]:
        if self.layout.failures.is_dir():
            yield from sorted(self.layout.failures.iterdir())

    def remove_manifest(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.layout.manifest(key))

    def remove_blob(self, digest: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.layout.blob(digest))

    def clean_staging(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

