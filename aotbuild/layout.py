"""The on-disk layout of a cache root. Every path under the root is built here and nowhere else.

    <root>/blobs/sha256/<2 hex>/<64 hex>     content-addressed artifact files
    <root>/manifests/<2 hex>/<key>.json      one JSON manifest per job key, written after its blobs
    <root>/models/<name>-v<N>/               built-in models, created on first use
    <root>/tmp/                              staging for atomic writes (same filesystem as blobs)
    <root>/locks/store.lock                  writers share it, gc/rm/verify --fix take it alone
    <root>/locks/build-<key prefix>.lock      one builder per job key at a time
    <root>/logs/<key prefix>.log              a failed job's (or proof's) log
    <root>/logs/reclaimed.jsonl               what journals reclaimed (``verify --json`` notes)

Inside a job's staging folder (``<root>/tmp/job-*``) the target and the strategy name their own
subfolders: they are the job's, not the store's.

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

HEX64 = re.compile(r"^[0-9a-f]{64}\Z")


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


def _pyproject_setting(start: Path, name: str) -> tuple[Path, object] | None:
    """(folder of the nearest ``pyproject.toml``, its ``[tool.aotbuild] <name>``), or None.

    The nearest pyproject.toml decides, even by saying nothing."""
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
            value = data.get("tool", {}).get("aotbuild", {}).get(name)
            return None if value is None else (folder, value)
    return None


def _pyproject_cache(start: Path) -> Path | None:
    """``[tool.aotbuild] cache`` of the nearest ``pyproject.toml``, relative to that file's folder."""
    found = _pyproject_setting(start, "cache")
    if found is None:
        return None
    folder, value = found
    if not isinstance(value, str) or not value:
        raise UsageError(f"{folder / 'pyproject.toml'}: [tool.aotbuild] cache must be a folder path")
    return (folder / Path(value).expanduser()).absolute()


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def parse_size(text: str | int) -> int:
    """Bytes from ``"20GB"``, ``"500MB"``, ``"1.5GiB"``, ``"4096"`` (decimal units; ``*iB`` binary)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"{text!r} is not a size: use e.g. 20GB, 500MB, 1.5GiB or a number of bytes")
    unit = (match[2] or "").lower().rstrip("b")
    return int(float(match[1]) * _UNITS[unit])


def format_size(n: int) -> str:
    """``4485120`` -> ``"4.5 MB"``: decimal units, as ``parse_size`` reads them (``--max-size 20GB``
    is 20 * 10**9 bytes and is shown back as ``20.0 GB``)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


def resolve_max_size(cli_value: str | None = None, start: Path | None = None) -> int | None:
    """The cache's size limit: ``--max-size`` > ``AOTBUILD_MAX_SIZE`` > ``[tool.aotbuild] max_size``."""
    if cli_value:
        return parse_size(cli_value)
    env = constants.env_max_size()
    if env:
        return parse_size(env)
    found = _pyproject_setting(start or Path.cwd(), "max_size")
    return parse_size(found[1]) if found else None  # type: ignore[arg-type]


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

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    @property
    def store_lock(self) -> Path:
        return self.locks / "store.lock"

    def build_lock(self, key: str) -> Path:
        return self.locks / f"build-{key[:32]}.lock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def job_log(self, key: str) -> Path:
        return self.logs / f"{key[:16]}.log"

    @property
    def reclaimed_log(self) -> Path:
        return self.logs / "reclaimed.jsonl"

    def blob(self, digest: str) -> Path:
        if not HEX64.match(digest):
            raise StoreError(f"not a sha256 digest: {digest!r}")
        return self.blobs / digest[:2] / digest

    def manifest(self, key: str) -> Path:
        if not HEX64.match(key):
            raise StoreError(f"not a cache key: {key!r}")
        return self.manifests / key[:2] / f"{key}.json"


def shared_dirs(path: Path, mode: int = 0o755) -> None:
    """``mkdir -p path``, every folder it creates readable by every user of a shared store
    (``mode`` despite the umask: another account loads from it; docs/security.md)."""
    missing = []
    p = Path(path)
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        try:
            os.chmod(folder, mode)
        except OSError:
            pass
