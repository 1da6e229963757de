"""The content-addressed store: blobs named by their sha256 and one JSON manifest per key.

Writes go to a temporary file in ``tmp/`` and are renamed into place, blobs before the manifest
that names them, so a reader sees either no entry or a whole one. Reads never write: a store baked
into a read-only image, or owned by another user, loads fine. Every blob is hash-verified before
it is handed out; a corrupt or missing blob makes its entry a miss, never a load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from aotbuild.errors import StoreError, UsageError
from aotbuild.layout import Layout, safe_relpath

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@dataclass(frozen=True)
class Entry:
    """A manifest whose blobs all verified: ``files`` maps each relative path to its blob."""

    key: str
    manifest: dict[str, Any]
    files: tuple[tuple[str, Path], ...]


@contextlib.contextmanager
def _open_source(source: Path | BinaryIO) -> Iterator[BinaryIO]:
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            yield f
    else:
        yield source


class Store:
    def __init__(self, root: Path):
        self.layout = Layout(Path(root))

    @property
    def root(self) -> Path:
        return self.layout.root

    # -- writing ------------------------------------------------------------------------------

    def _tempfile(self) -> tuple[int, str]:
        self.layout.tmp.mkdir(parents=True, exist_ok=True)
        return tempfile.mkstemp(prefix="w.", dir=self.layout.tmp)

    def put_blob(self, source: Path | BinaryIO, expect: str | None = None) -> tuple[str, int]:
        """Copy ``source`` (a path or a binary stream) into the store; return (sha256, size).

        Existing blobs are kept. With ``expect``, content whose hash differs is refused with a
        StoreError and nothing is stored (a pulled blob that does not match its name)."""
        fd, tmp = self._tempfile()
        h = hashlib.sha256()
        size = 0
        try:
            with os.fdopen(fd, "wb") as out, _open_source(source) as src:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    size += len(chunk)
                out.flush()
                os.fsync(out.fileno())
            digest = h.hexdigest()
            if expect is not None and digest != expect:
                raise StoreError(f"blob {expect[:12]} does not match its content (sha256 {digest[:12]}): refused")
            final = self.layout.blob(digest)
            if final.is_file() and final.stat().st_size == size:
                os.unlink(tmp)
            else:
                final.parent.mkdir(parents=True, exist_ok=True)
                os.chmod(tmp, 0o444)
                os.replace(tmp, final)
            return digest, size
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def has_blob(self, digest: str, size: int) -> bool:
        """A blob of that name and size is stored (its hash is checked when an entry is opened)."""
        try:
            return self.layout.blob(digest).stat().st_size == size
        except FileNotFoundError:
            return False

    def put_manifest(self, key: str, manifest: dict[str, Any]) -> Path:
        """Write the manifest last, atomically; every blob it names must already be stored."""
        for item in manifest.get("files", []):
            if not self.layout.blob(item["sha256"]).is_file():
                raise StoreError(f"refusing to write manifest {key[:12]}: blob {item['sha256'][:12]} is missing")
        final = self.layout.manifest(key)
        fd, tmp = self._tempfile()
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(manifest, out, indent=1, sort_keys=True)
                out.write("\n")
                out.flush()
                os.fsync(out.fileno())
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return final

    # -- reading ------------------------------------------------------------------------------

    def read_manifest(self, key: str) -> dict[str, Any] | None:
        """The manifest for ``key``, or None when there is none or it is not valid JSON."""
        path = self.layout.manifest(key)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("key") != key:
            return None
        return data

    def has(self, key: str) -> bool:
        return self.layout.manifest(key).is_file()

    def open_entry(self, key: str) -> tuple[Entry | None, str]:
        """A verified entry, or (None, why not). Every blob is hashed before it is handed out."""
        return self._entry(key, verify_hashes=True)

    def check_entry(self, key: str) -> tuple[bool, str]:
        """Cheap presence check for planning: manifest readable, every blob there with its size."""
        entry, why = self._entry(key, verify_hashes=False)
        return entry is not None, why

    def _entry(self, key: str, verify_hashes: bool) -> tuple[Entry | None, str]:
        manifest = self.read_manifest(key)
        if manifest is None:
            if self.layout.manifest(key).is_file():
                return None, "manifest is unreadable or malformed"
            return None, "not built"
        files = []
        try:
            for item in manifest["files"]:
                rel, digest, size = item["path"], item["sha256"], int(item["size"])
                safe_relpath(rel)  # a path that would escape its folder makes the entry unusable
                blob = self.layout.blob(digest)
                try:
                    actual_size = blob.stat().st_size
                except FileNotFoundError:
                    return None, f"blob {digest[:12]} of {rel} is missing"
                if actual_size != size:
                    return None, f"blob {digest[:12]} of {rel} has {actual_size} bytes, expected {size}"
                if verify_hashes and sha256_file(blob) != digest:
                    return None, f"blob {digest[:12]} of {rel} is corrupt (hash mismatch)"
                files.append((rel, blob))
        except (KeyError, TypeError, ValueError, StoreError) as exc:
            return None, f"manifest is malformed: {exc}"
        return Entry(key, manifest, tuple(files)), ""

    def iter_manifests(self) -> Iterator[dict[str, Any]]:
        if not self.layout.manifests.is_dir():
            return
        for path in sorted(self.layout.manifests.glob("*/*.json")):
            data = self.read_manifest(path.stem) if len(path.stem) == 64 else None
            if data is not None:
                yield data

    def resolve_prefix(self, prefix: str) -> str:
        prefix = prefix.lower()
        if len(prefix) < 8 or any(c not in "0123456789abcdef" for c in prefix):
            raise UsageError(f"{prefix!r} is not a key: give at least 8 hex characters")
        folder = self.layout.manifests / prefix[:2]
        matches = sorted(p.stem for p in folder.glob(f"{prefix}*.json")) if folder.is_dir() else []
        if not matches:
            raise UsageError(f"no cache entry has a key starting with {prefix}; `aotbuild ls` lists them")
        if len(matches) > 1:
            raise UsageError(f"{prefix} matches {len(matches)} keys; give more characters")
        return matches[0]

    def blob_size(self, manifest: dict[str, Any]) -> int:
        return sum(int(item.get("size", 0)) for item in manifest.get("files", []))

    def clean_staging(self, path: Path) -> None:
        shutil.rmtree(path, ignore_errors=True)

