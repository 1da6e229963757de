"""The on-disk layout of a cache root. Every path under the root is built here and nowhere else.

    <root>/blobs/sha256/<2 hex>/<64 hex>     content-addressed artifact files
    <root>/manifests/<2 hex>/<key>.json      one JSON manifest per job key, written after its blobs
    <root>/models/<name>-v<N>/               built-in models, created on first use
    <root>/tmp/                              staging for atomic writes (same filesystem as blobs)

It also owns the cache-root rule (``--cache`` > ``AOTBUILD_CACHE`` > ``[tool.aotbuild] cache`` in
the nearest ``pyproject.toml`` > ``~/.cache/aotbuild``) and rejects relative paths that would
escape a folder (huggingface_hub's ``_get_pointer_path`` does the same for its snapshots).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from aotbuild import constants
from aotbuild.errors import StoreError, UsageError

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def resolve_cache_root(cli_value: str | os.PathLike | None = None, start: Path | None = None) -> Path:
    if cli_value:
        return Path(cli_value).expanduser().absolute()
    env = constants.env_cache_root()
    if env:
        return Path(env).expanduser().absolute()
    configured = _pyproject_cache(start or Path.cwd())
    if configured is not None:
        return configured
    return Path(constants.DEFAULT_CACHE_ROOT).expanduser().absolute()


def _pyproject_cache(start: Path) -> Path | None:
    """``[tool.aotbuild] cache`` of the nearest ``pyproject.toml``, relative to that file's folder."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    for folder in (start.absolute(), *start.absolute().parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            try:
                data = tomllib.loads(candidate.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise UsageError(f"{candidate}: cannot read [tool.aotbuild]: {exc}") from None
            value = data.get("tool", {}).get("aotbuild", {}).get("cache")
            if value is None:
                return None  # the nearest pyproject.toml decides, even by saying nothing
            if not isinstance(value, str) or not value:
                raise UsageError(f"{candidate}: [tool.aotbuild] cache must be a folder path")
            return (folder / Path(value).expanduser()).absolute()
    return None


def safe_relpath(rel: str) -> PurePosixPath:
    """A relative POSIX path that stays inside its folder, or a StoreError."""
    p = PurePosixPath(rel)
    if not rel or p.is_absolute() or "\\" in rel or any(part in ("", ".", "..") for part in rel.split("/")):
        raise StoreError(f"unsafe artifact path {rel!r}: must be relative and stay inside its folder")
    return p


@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def blobs(self) -> Path:
        return self.root / "blobs" / "sha256"

    @property
    def manifests(self) -> Path:
        return self.root / "manifests"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    def blob(self, digest: str) -> Path:
        if not _HEX64.match(digest):
            raise StoreError(f"not a sha256 digest: {digest!r}")
        return self.blobs / digest[:2] / digest

    def manifest(self, key: str) -> Path:
        if not _HEX64.match(key):
            raise StoreError(f"not a cache key: {key!r}")
        return self.manifests / key[:2] / f"{key}.json"

    def under(self, folder: Path, rel: str) -> Path:
        return folder.joinpath(*safe_relpath(rel).parts)
