"""The on-disk layout of a cache root. Every path under the root is built here and nowhere else.

    <root>/blobs/sha256/<2 hex>/<64 hex>     content-addressed artifact files
    <root>/manifests/<2 hex>/<key>.json      one JSON manifest per job key, written after its blobs
    <root>/models/<name>-v<N>/               built-in models, created by a build or a load that succeeded
    <root>/tmp/                              staging for atomic writes (same filesystem as blobs)
    <root>/locks/store.lock                  writers share it, gc/rm/verify --fix take it alone
    <root>/locks/build-<key prefix>.lock      one builder per job key at a time
    <root>/logs/<key prefix>.log              a failed job's (or proof's) log
    <root>/logs/reclaimed.jsonl               what journals reclaimed (``verify --json`` notes)
    <root>/failures/<key>.json                a job that failed: why, when, which aotbuild (never a manifest)

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
from aotbuild.utils import safeio

HEX64 = re.compile(r"^[0-9a-f]{64}\Z")
_HEX2 = re.compile(r"^[0-9a-f]{2}\Z")
#: What aotbuild writes in tmp/: temp files (w.), journals (j.), a job's staging folder, pulls and pushes.
_TEMP = re.compile(r"^(?:w\.|j\.|job-[0-9a-f]{12}\.|load\.|pull\.|push\.)\w+\Z")
#: A built-in model's staging folder (builtin.ensure): ".<name>-v<N>.<random>".
_MODEL_STAGING = re.compile(r"^\.[a-z0-9][a-z0-9-]*-v\d+\.\w+\Z")


def resolve_cache_root(cli_value: str | os.PathLike | None = None, start: Path | None = None) -> Path:
    return cache_root_origin(cli_value, start)[0]


#: Where a cache root came from: the command line (--cache, or a path in code), the environment
#: (AOTBUILD_CACHE), the nearest pyproject.toml, or the default.
FROM_ARGUMENT, FROM_ENVIRONMENT, FROM_PROJECT, FROM_DEFAULT = "argument", "environment", "project", "default"


def cache_root_origin(cli_value: str | os.PathLike | None = None, start: Path | None = None) -> tuple[Path, str]:
    """The cache root (``--cache`` > ``AOTBUILD_CACHE`` > ``[tool.aotbuild] cache`` > the default)
    and where it came from: a pull request controls ``pyproject.toml``, not the command line."""
    if cli_value:
        return Path(cli_value).expanduser().absolute(), FROM_ARGUMENT
    env = constants.env_cache_root()
    if env:
        return Path(env).expanduser().absolute(), FROM_ENVIRONMENT
    configured = _pyproject_cache(start or Path.cwd())
    if configured is not None:
        return configured, FROM_PROJECT
    return Path(constants.DEFAULT_CACHE_ROOT).expanduser().absolute(), FROM_DEFAULT


#: pyproject.toml is read with bounded work: a pull request writes it.
MAX_PYPROJECT_BYTES = 1 << 20
MAX_PYPROJECT_DEPTH = 64


def _pyproject_setting(start: Path, name: str) -> tuple[Path, object] | None:
    """(folder of the nearest ``pyproject.toml``, its ``[tool.aotbuild] <name>``), or None.

    The nearest pyproject.toml decides, even by saying nothing. It is read as a regular file of at
    most 1 MiB, without blocking, its brackets counted before it is parsed; every problem is one line."""
    for folder in (start.absolute(), *start.absolute().parents):
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            data = _read_pyproject(candidate)
            tool = data.get("tool", {})
            section = tool.get("aotbuild", {}) if isinstance(tool, dict) else {}
            if not isinstance(section, dict):
                raise UsageError(f"{candidate}: [tool.aotbuild] is not a table")
            value = section.get(name)
            return None if value is None else (folder, value)
    return None


def _read_pyproject(path: Path) -> dict:
    try:
        text = safeio.read_text(path, MAX_PYPROJECT_BYTES)
    except (safeio.NotRegularFile, safeio.FileTooLarge):
        raise UsageError(f"{path}: not a regular file of at most {MAX_PYPROJECT_BYTES} bytes") from None
    except (OSError, safeio.BadData) as exc:
        raise UsageError(f"{path}: cannot read [tool.aotbuild]: {exc}") from None
    try:
        return safeio.loads_toml(text, max_depth=MAX_PYPROJECT_DEPTH)
    except safeio.TooDeep:
        raise UsageError(f"{path}: nested more than {MAX_PYPROJECT_DEPTH} levels deep; cannot read "
                         f"[tool.aotbuild]") from None
    except safeio.BadData as exc:
        raise UsageError(f"{path}: cannot read [tool.aotbuild]: {exc}") from None


def _pyproject_cache(start: Path) -> Path | None:
    """``[tool.aotbuild] cache`` of the nearest ``pyproject.toml``, relative to that file's folder and
    inside it: a pull request's pyproject.toml must not point aotbuild's commands (``verify --fix``,
    ``gc``) at another folder. An absolute or escaping root is named with --cache or AOTBUILD_CACHE."""
    found = _pyproject_setting(start, "cache")
    if found is None:
        return None
    folder, value = found
    where = folder / "pyproject.toml"
    if not isinstance(value, str) or not value or not value.isprintable():  # a newline would reach CI's log
        raise UsageError(f"{where}: [tool.aotbuild] cache must be a folder path (no control characters)")
    path = Path(value)
    root = (folder / path).resolve()
    if path.is_absolute() or value.startswith("~") or not root.is_relative_to(folder.resolve()) \
            or root == folder.resolve():
        raise UsageError(f"{where}: [tool.aotbuild] cache = {value!r} is not a folder inside {folder}: a project's "
                         f"cache must stay in the project; name another cache root with --cache or AOTBUILD_CACHE")
    return (folder / path).absolute()


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(b|[kmgt]i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}
#: How a size is written, for the message that refuses one.
SIZE_FORM = "a number and its unit, e.g. 20GB, 500MB, 1.5GiB or 4096B (B, KB, MB, GB, TB; KiB, MiB, GiB, TiB)"


def parse_size(text: str | int, where: str = "") -> int:
    """Bytes from ``"20GB"``, ``"500MB"``, ``"1.5GiB"``, ``"4096B"`` (decimal units; ``*iB`` binary); an
    int (from Python) is bytes. Text needs its unit: ``--max-size 20`` meant 20 bytes, and a gc to it
    emptied the cache (issue 55). ``where`` names the setting in the UsageError (``--max-size``)."""
    shown = f"{where} {str(text)[:40]!r}" if where else repr(str(text)[:40])
    if isinstance(text, bool) or not isinstance(text, (str, int)):
        raise UsageError(f"{shown} is not a size: use {SIZE_FORM}")
    match = _SIZE.match(text) if isinstance(text, str) else None
    if isinstance(text, str) and not match:
        bare = text.strip().replace(".", "", 1).isdigit()
        raise UsageError(f"{shown} {'has no unit' if bare else 'is not a size'}: a size is {SIZE_FORM}")
    unit = match[2].lower().rstrip("b") if match else ""
    size = text if isinstance(text, int) else float(match[1]) * _UNITS[unit]
    if not 0 <= size <= MAX_SIZE:  # 400 digits are inf as a float: an OverflowError's traceback
        raise UsageError(f"{shown} is not a size of 0 to 2^62 bytes")
    return int(size)


#: The largest size a setting may give (as the other numeric settings: aotbuild/constants.py).
MAX_SIZE = 2 ** 62


def format_size(n: int) -> str:
    """``4485120`` -> ``"4.5 MB"``: decimal units, as ``parse_size`` reads them (``--max-size 20GB``
    is 20 * 10**9 bytes and is shown back as ``20.0 GB``)."""
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


def resolve_max_size(cli_value: str | None = None, start: Path | None = None, *,
                     project: bool = False) -> int | None:
    """The cache's size limit: ``--max-size`` > ``AOTBUILD_MAX_SIZE`` > ``[tool.aotbuild] max_size``,
    the last only with ``project=True``: for a build into the cache that pyproject.toml names itself.
    A pull request's pyproject.toml must never shrink a cache named on the command line (``gc
    --stale --cache SHARED`` with ``max_size = "1"`` removed every entry)."""
    if cli_value:
        return parse_size(cli_value, "--max-size")
    env = constants.env_max_size()
    if env:
        return parse_size(env, constants.ENV_MAX_SIZE)
    if not project:
        return None
    found = _pyproject_setting(start or Path.cwd(), "max_size")
    if found is None:
        return None
    if not isinstance(found[1], str):  # a TOML number has no unit either: 20 is not 20GB
        raise UsageError(f"{found[0] / 'pyproject.toml'}: [tool.aotbuild] max_size must be a size with its unit, "
                         f"as a string such as \"20GB\": {SIZE_FORM}")
    return parse_size(found[1], f"{found[0] / 'pyproject.toml'}: [tool.aotbuild] max_size")


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

    @property
    def failures(self) -> Path:
        return self.root / "failures"

    def failure(self, key: str) -> Path:
        if not HEX64.match(key):
            raise StoreError(f"not a cache key: {key!r}")
        return self.failures / f"{key}.json"

    def job_log(self, key: str) -> Path:
        return self.logs / f"{key[:16]}.log"

    @property
    def reclaimed_log(self) -> Path:
        return self.logs / "reclaimed.jsonl"

    def wrote(self, path: Path) -> bool:
        """Whether ``path`` is a name aotbuild's own scheme gives what it writes: a blob, a manifest, a
        temp file, staging folder or journal in ``tmp/``, a built-in model's staging folder. ``verify
        --fix`` removes nothing else, wherever a cache root points."""
        try:
            parts = Path(path).relative_to(self.root).parts
        except ValueError:
            return False
        if len(parts) == 4 and parts[:2] == ("blobs", "sha256"):
            return bool(HEX64.match(parts[3])) and parts[2] == parts[3][:2]
        if len(parts) == 3 and parts[0] == "manifests":
            stem = parts[2][:-5] if parts[2].endswith(".json") else ""
            return bool(HEX64.match(stem)) and bool(_HEX2.match(parts[1]))  # a key's manifest, maybe misfiled
        if len(parts) == 2 and parts[0] == "tmp":
            return bool(_TEMP.match(parts[1]))
        if len(parts) == 2 and parts[0] == "failures":
            return parts[1].endswith(".json") and bool(HEX64.match(parts[1][:-5]))
        if len(parts) == 2 and parts[0] == "models":
            return bool(_MODEL_STAGING.match(parts[1]))
        return False

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
