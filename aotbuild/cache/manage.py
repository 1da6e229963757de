"""Cache management: ``verify [--fix]``, ``gc`` (size limit, stale entries), ``rm``.

Every change holds the store lock exclusively (aotbuild/cache/locks.py), so no writer is midway, and
removes manifests *before* the blobs they name: at every instant, including after a crash or an
error halfway through, each manifest on disk points at blobs that exist.

Recency is the manifest's mtime, refreshed by each load and each build that finds the entry
(``Store.touch``). It needs no index to keep consistent, works on a read-only store (the touch is
skipped) and on NFS; diskcache's SQLite index, the other candidate, is not safe on network
filesystems, where shared caches live (docs/cache.md).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotbuild.cache.layout import HEX64
from aotbuild.cache.locks import is_unlocked, store_lock
from aotbuild.cache.manifest import Manifest, StaleManifest
from aotbuild.cache.store import Store, sha256_file
from aotbuild.constants import VERSION, Vocabulary
from aotbuild.errors import LockUnavailable, StoreError


class Finding(Vocabulary):
    """What ``verify`` found wrong with a path (``Problem.kind``; ``verify --json``'s ``kind``)."""

    CORRUPT = "corrupt"
    MISSING = "missing"
    MALFORMED = "malformed"
    UNREADABLE = "unreadable"
    ORPHAN = "orphan"
    TEMP = "temp"
    #: in the store's folders, but not a name aotbuild writes: --fix leaves it
    FOREIGN = "foreign"
    #: with trusted keys: no trusted key signed it (reported; --fix never deletes it)
    UNTRUSTED = "untrusted"


#: What ``verify --fix`` repairs; every other kind is left for its owner, who alone may remove or fix it.
FIXABLE = frozenset({Finding.CORRUPT, Finding.MISSING, Finding.MALFORMED, Finding.ORPHAN, Finding.TEMP})
#: What the owner of a finding ``--fix`` leaves does about it.
OWNER_ACTION = {Finding.UNREADABLE: "its owner fixes its permissions",
                Finding.FOREIGN: "aotbuild did not write it: its owner removes it, or points the cache elsewhere",
                Finding.UNTRUSTED: "no trusted key signed it: rebuild it with `build --sign-key`, vouch for it with "
                           "`aotbuild sign` (docs/security.md), or remove it (aotbuild rm KEY)"}


@dataclass
class Problem:
    kind: Finding
    path: Path
    detail: str
    key: str | None = None
    blob: str | None = None  # the digest a "missing" problem is about

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": str(self.path), "detail": self.detail, "key": self.key,
                "fixable": self.fixable}

    @property
    def fixable(self) -> bool:
        """Does ``verify --fix`` repair it? (Else it is left for its owner: :data:`OWNER_ACTION`.)"""
        return self.kind in FIXABLE

    def remains(self) -> bool:
        """After ``verify --fix``: is this problem still there? (An unreadable manifest always is, and so is
        what aotbuild did not write: ``--fix`` never deletes it.)"""
        if self.kind in (Finding.UNREADABLE, Finding.UNTRUSTED):
            return True
        return os.path.lexists(self.path)

    @property
    def foreign(self) -> bool:
        """A path aotbuild's naming scheme did not give: reported, never removed."""
        return self.kind == Finding.FOREIGN


@contextlib.contextmanager
def _exclusive(store: Store, *, required: bool) -> Iterator[None]:
    """The store lock, exclusively. A read-only store (no lock file possible) has no writers to
    wait for: a check proceeds unlocked, a change fails anyway."""
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(store_lock(store.root, exclusive=True))
        except LockUnavailable:
            if required:
                raise
        yield


def _scan(store: Store) -> list[Problem]:
    """Every problem, with every blob hashed once. Takes no lock: ``verify`` confirms what it found
    under the lock afterwards, so writers are not held up while a large store is hashed."""
    problems: list[Problem] = []
    named: dict[str, list[str]] = {}
    checked: dict[str, str] = {}  # digest -> "" if good, else why not
    for path in store.manifest_files():
        manifest, problem = _read(store, path)
        if problem is not None:
            problems.append(problem)
            continue
        if manifest is None:  # removed since it was listed
            continue
        key = path.stem
        why = store.untrusted(manifest) if not isinstance(manifest, StaleManifest) else ""
        if why:
            problems.append(Problem(Finding.UNTRUSTED, path, why, key))
        for item in manifest.files:
            digest, rel = item.sha256, item.path
            named.setdefault(digest, []).append(key)
            if digest not in checked:
                checked[digest] = _blob_problem(store, digest, item.size)
            if checked[digest] == Finding.MISSING:
                problems.append(Problem(Finding.MISSING, path, f"blob {digest[:12]} of {rel} is missing", key, digest))
            elif checked[digest]:
                problems.append(Problem(Finding.CORRUPT, store.layout.blob(digest), f"{checked[digest]} ({rel})", key))
    if not any(p.kind == Finding.UNREADABLE for p in problems):  # else an unreadable manifest's blobs look orphaned
        for blob in store.blob_files():
            if blob.name not in named:
                what = f"{blob.lstat().st_size} bytes" if stat.S_ISREG(blob.lstat().st_mode) else "not a regular file"
                problems.append(Problem(Finding.ORPHAN, blob, f"{what} that no manifest names"))
        if store.layout.blobs.is_dir():  # a folder where a blob belongs, which no manifest names
            problems += [Problem(Finding.ORPHAN, p, "a folder that no manifest names") for p in
                         sorted(store.layout.blobs.glob("*/*")) if p.is_dir() and not p.is_symlink()
                         and p.name not in named]
    problems += [Problem(Finding.TEMP, p, "left by a writer that died (killed, out of space)")
                 for p in _leftovers(store)]
    from aotbuild.builtin import dead_staging

    problems += [Problem(Finding.TEMP, p, "a built-in model whose creation was killed midway")
                 for p in dead_staging(store.layout.models)]
    # What aotbuild's naming scheme did not give is reported and never deleted, wherever the root
    # points (a pyproject.toml once made it "/" and --fix deleted files in /tmp).
    return [p if p.kind in (Finding.MISSING, Finding.UNREADABLE) or store.layout.wrote(p.path)
            else Problem(Finding.FOREIGN, p.path, f"not a name aotbuild writes ({p.detail}): left as it is", p.key)
            for p in problems]


def _read(store: Store, path: Path) -> tuple[Manifest | StaleManifest | None, Problem | None]:
    """The manifest at ``path`` (a StaleManifest for another format: its blobs are still named),
    or the problem that makes it no entry."""
    if not HEX64.match(path.stem) or path.parent.name != path.stem[:2]:
        return None, Problem(Finding.MALFORMED, path, "not named by a key in its key's folder")
    try:
        manifest = store.load_manifest(path.stem)
    except OSError as exc:
        return None, Problem(Finding.UNREADABLE, path,
                             f"cannot be read ({exc.strerror or exc}): its entry's owner must fix permissions",
                             path.stem)
    except StaleManifest as exc:
        return exc, None
    except ValueError as exc:
        return None, Problem(Finding.MALFORMED, path, str(exc).replace(f"{path}: ", ""))
    return manifest, None


def _blob_problem(store: Store, digest: str, size: int) -> str:
    blob = store.layout.blob(digest)
    try:
        if not stat.S_ISREG(blob.lstat().st_mode):
            return "not a regular file"
        if blob.stat().st_size != size:
            return f"has {blob.stat().st_size} bytes, expected {size}"
        if sha256_file(blob) != digest:
            return "content does not match its name (hash mismatch)"
    except FileNotFoundError:
        return Finding.MISSING
    return ""


def _leftovers(store: Store) -> list[Path]:
    """Temp files and folders in ``tmp/`` whose writer is gone (nobody holds their lock)."""
    if not store.layout.tmp.is_dir():
        return []
    out = []
    for item in sorted(store.layout.tmp.iterdir()):
        if not store.layout.wrote(item):
            out.append(item)  # reported as foreign (_scan), its lock never opened
            continue
        lock = item / ".lock" if item.is_dir() else item
        if is_unlocked(lock):
            out.append(item)
    return out


def _named(store: Store, *, strict: bool = True) -> tuple[dict[str, list[str]], dict[str, Manifest | StaleManifest]]:
    """(digest -> keys that name it, key -> manifest), without hashing.

    ``strict`` (gc, rm) refuses to go on when a manifest cannot be read or parsed: its blobs would
    look unreferenced, and deleting them would leave that manifest pointing at nothing. Otherwise
    (verify) such manifests are skipped; verify then lists no orphans while one is unreadable."""
    named: dict[str, list[str]] = {}
    manifests: dict[str, Manifest | StaleManifest] = {}
    for path in store.manifest_files():
        manifest, problem = _read(store, path)
        if problem is not None and strict:
            raise StoreError(f"{path}: {problem.detail}; run `aotbuild verify` (and `--fix` for a malformed one) "
                             f"before collecting")
        if manifest is not None:
            manifests[path.stem] = manifest
            for digest, _ in _items(manifest):
                named.setdefault(digest, []).append(path.stem)
    return named, manifests


def _confirmed(store: Store, problem: Problem, named: dict[str, list[str]]) -> bool:
    """Does a problem found without the lock still hold, now that no writer is midway?"""
    path = problem.path
    if problem.kind == Finding.MISSING:
        return path.exists() and problem.blob is not None and not store.layout.blob(problem.blob).exists()
    if not os.path.lexists(path):
        return False
    if problem.kind in (Finding.FOREIGN, Finding.UNTRUSTED):
        return True
    if problem.kind == Finding.CORRUPT:
        return bool(_blob_problem(store, path.name, path.stat().st_size if path.is_file() else -1))
    if problem.kind == Finding.ORPHAN:
        return path.name not in named and os.path.lexists(path)
    if problem.kind == Finding.TEMP:
        from aotbuild.builtin import STAGING_LOCK

        lock = path / STAGING_LOCK if (path / STAGING_LOCK).exists() else path / ".lock" if path.is_dir() else path
        return is_unlocked(lock)
    return _read(store, path)[1] is not None


def verify(store: Store, *, fix: bool = False) -> list[Problem]:
    """Every problem in the store (bad hash, missing blob, malformed manifest, orphan, stale temp).

    The hashing runs without a lock; what it found is then confirmed under the exclusive store lock
    (held briefly), so a writer midway is never reported. With ``fix``, still under the lock:
    entries whose blobs are missing or corrupt lose their manifest first, then corrupt and orphan
    blobs, malformed manifests and temp leftovers are deleted; the next build rebuilds those entries.
    An unreadable manifest (permissions) is reported, never deleted."""
    found = _scan(store)
    if not found:
        return []
    with _exclusive(store, required=fix):
        named, _ = _named(store, strict=False)
        problems = [p for p in found if _confirmed(store, p, named)]
        if fix:
            bad = {p.path.name for p in problems if p.kind == Finding.CORRUPT}
            broken = {p.key for p in problems if p.kind in (Finding.CORRUPT, Finding.MISSING) and p.key}
            broken |= {k for d in bad for k in named.get(d, [])}
            for key in sorted(broken):  # manifests first
                store.remove_manifest(key)
            for p in problems:
                if p.kind == Finding.MALFORMED:
                    _remove(p.path)
            for p in problems:
                if p.kind in (Finding.CORRUPT, Finding.ORPHAN, Finding.TEMP):
                    _remove(p.path)
            for digest, keys in named.items():  # blobs only the removed manifests named
                if all(k in broken for k in keys):
                    store.remove_blob(digest)
    return problems


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def store_size(store: Store) -> int:
    """Bytes of every blob on disk (shared blobs count once), named by an entry or not."""
    return sum(p.lstat().st_size for p in store.blob_files())


def entries_size(manifests: Iterable[Manifest | StaleManifest]) -> int:
    """Bytes of the blobs these entries name, each blob once (two shapes of a component share
    kernels): the one entries figure ``gc``, ``doctor`` and ``ls`` print. Summing each entry's own
    size counted a shared blob once per entry: ``doctor`` said 18.6 MB where ``gc`` said 17.1 MB of
    one store, and a dry run printed ``17.1 MB -> -1484685 B`` (issue 55)."""
    return sum({d: s for m in manifests for d, s in _items(m)}.values())


def other_folders(store: Store) -> list[tuple[str, Path, int]]:
    """(name, folder, bytes) of each folder of the store beside its entries that exists (built-in
    models, staging, locks, logs, failure records), for ``doctor``, which lists each on its own line."""
    layout = store.layout
    out = []
    for name, folder in (("models", layout.models), ("tmp", layout.tmp), ("locks", layout.locks),
                         ("logs", layout.logs), ("failures", layout.failures)):
        if folder.is_dir() and not folder.is_symlink():
            out.append((name, folder, _bytes_under(folder)))
    return out


def _bytes_under(folder: Path) -> int:
    """Bytes of the files under ``folder`` (links not followed; what cannot be read counts 0)."""
    total = 0
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


@dataclass
class GcReport:
    removed: list[tuple[str, str, int]] = field(default_factory=list)  # (key, why, bytes it frees)
    size_before: int = 0  # the entries' blobs, each once (entries_size), before and after
    size_after: int = 0
    dry_run: bool = False

    def text(self, root: str) -> str:
        from aotbuild.cache.layout import format_size
        from aotbuild.utils.text import printable

        lines = [f"{'would remove' if self.dry_run else 'removed'} {key[:12]}  {format_size(size):>9}  "
                 f"{printable(why)}" for key, why, size in self.removed]
        lines.append(f"{root}: entries {format_size(self.size_before)} -> {format_size(self.size_after)}"
                     + (" (dry run)" if self.dry_run else ""))
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"removed": [{"key": k, "reason": r, "size": s} for k, r, s in self.removed],
                "size_before": self.size_before, "size_after": self.size_after, "dry_run": self.dry_run}


def stale_reasons(manifests: dict[str, Manifest | StaleManifest]) -> dict[str, str]:
    """Entries that can never match this environment again, and why (another torch, ISA, ...)."""
    from aotbuild import keys
    from aotbuild.context import environment_factors
    from aotbuild.targets.registry import get_target, target_names

    env = environment_factors()
    fingerprints: dict[tuple[str, str], dict[str, Any] | None] = {}
    out = {}
    for key, manifest in manifests.items():
        if isinstance(manifest, StaleManifest):
            out[key] = str(manifest)
            continue
        factors = manifest.factors
        diff = keys.differences({"env": factors["env"]}, {"env": env})
        device = factors["device"]
        kind = device.get("device_kind") if isinstance(device.get("device_kind"), str) else None
        target = manifest.target
        if not diff and target in target_names() and kind:
            if (target, kind) not in fingerprints:  # compare only where this machine can say
                fingerprints[(target, kind)] = None
                with contextlib.suppress(Exception):
                    t = get_target(target)
                    if t.availability(kind).ok:
                        fingerprints[(target, kind)] = t.fingerprint(kind)
            here = fingerprints[(target, kind)]
            if here is not None:
                diff = keys.differences({"device": device}, {"device": here})
        if diff:
            out[key] = "; ".join(diff[:2])
    return out


def gc(store: Store, *, max_size: int | None = None, stale: bool = False, dry_run: bool = False,
       keep: frozenset[str] = frozenset()) -> GcReport:
    """Remove entries until the blobs of the rest fit in ``max_size`` (least recently used first),
    and/or entries that are ``stale``. ``keep`` (the keys a build just needed) are never removed for
    size, even if the rest cannot fit without them. A dry run takes no lock and changes nothing."""
    with contextlib.ExitStack() as stack:
        if not dry_run:
            stack.enter_context(store_lock(store.root, exclusive=True))
        named, manifests = _named(store)
        sizes = {d: s for m in manifests.values() for d, s in _items(m)}
        report = GcReport(size_before=sum(sizes.values()), dry_run=dry_run)  # entries_size: each blob once
        victims: dict[str, str] = dict(stale_reasons(manifests)) if stale else {}
        if max_size is not None:
            def recency(key: str) -> float:
                with contextlib.suppress(OSError):
                    return store.layout.manifest(key).stat().st_mtime
                return 0.0

            refs = {d: {k for k in keys if k not in victims} for d, keys in named.items()}
            total = sum(s for d, s in sizes.items() if refs.get(d))
            for key in sorted((k for k in manifests if k not in victims and k not in keep), key=recency):
                if total <= max_size:
                    break
                victims[key] = "least recently used"
                for digest, size in _items(manifests[key]):
                    refs[digest].discard(key)
                    if not refs[digest]:
                        total -= size
        freed: set[str] = set()  # a blob only victims name is freed once, by the first of them listed
        for key, why in victims.items():
            only = {d for d, _ in _items(manifests[key]) if d not in freed and set(named.get(d, [])) <= set(victims)}
            freed |= only
            report.removed.append((key, why, sum(sizes[d] for d in only)))
        report.size_after = report.size_before - sum(sizes[d] for d in freed)
        if dry_run:
            return report
        for key in victims:  # manifests first: no manifest ever points at a deleted blob
            store.remove_manifest(key)
        live = {d for d, keys in named.items() if any(k not in victims for k in keys)}
        for blob in store.blob_files():
            if blob.name not in live:
                blob.unlink(missing_ok=True)
        if stale:  # a failure recorded by another aotbuild says nothing about this one
            for path in store.failure_files():
                record = store.failure(path.stem) if store.layout.wrote(path) else None
                if record is not None and record.get("aotbuild") != VERSION:
                    path.unlink(missing_ok=True)
    return report


def _items(manifest: Manifest | StaleManifest) -> Iterator[tuple[str, int]]:
    """(digest, size) of each distinct blob a (validated, or stale) manifest names."""
    seen = set()
    for item in manifest.files:
        if item.sha256 not in seen:
            seen.add(item.sha256)
            yield item.sha256, item.size


def rm(store: Store, keys: list[str]) -> list[tuple[str, int]]:
    """Remove these entries: manifests, then the blobs no other entry names. (key, bytes freed)."""
    with store_lock(store.root, exclusive=True):
        named, manifests = _named(store)
        gone = set(keys) & set(manifests)
        for key in sorted(set(keys)):
            store.remove_failure(key)
        for key in sorted(gone):
            store.remove_manifest(key)
        freed = dict.fromkeys(gone, 0)
        removed: set[str] = set()
        for key in sorted(gone):
            for digest, size in _items(manifests[key]):
                if digest not in removed and all(k in gone for k in named.get(digest, [])):
                    store.remove_blob(digest)
                    removed.add(digest)
                    freed[key] += size
        return sorted(freed.items())
