"""Nothing left behind: every writer of an entry keeps a journal of the blobs it touches.

A build or a pull writes an entry's blobs, then its manifest. If it fails in between (no space
left, a refused pull, an error) or is killed, the blobs it wrote are orphans: they fill the disk and
make ``verify`` fail until ``--fix``. So each writer first records, in a journal locked for its
lifetime (``<cache>/tmp/j.*``), every digest it is about to store, before storing it:

* on success (the manifest is written) the journal is deleted;
* on failure the writer reclaims at once: under the exclusive store lock, each digest it created
  that no manifest names and no other live journal lists is removed;
* a writer killed with -9 leaves its journal unlocked; the next writer reclaims it the same way
  before it starts, and records what it removed in ``<cache>/logs/reclaimed.jsonl``, which
  ``aotbuild verify --json`` lists under ``notes``.

A build killed with -9 also leaves its staging folders (``tmp/job-*``, ``tmp/load.*``: its children
die with it, aotbuild/builder/child.py; a killed pull's ``tmp/pull.*`` too): the next build, and the next
writer, removes each one whose ``.lock`` nobody holds (and is older than STAGING_GRACE), under that
lock, and notes it in the same log, so ``verify`` is clean after the next command, without ``--fix``.

A digest listed in a live journal is never removed: that writer may be about to name it, even if
it found the blob already stored (content addressing shares blobs between entries).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from aotbuild.cache.layout import HEX64
from aotbuild.cache.locks import is_unlocked, locked_tempfile, store_lock
from aotbuild.errors import StoreError
from aotbuild.utils import safeio

if TYPE_CHECKING:
    from aotbuild.cache.manifest import Manifest
    from aotbuild.cache.store import Store

PREFIX = "j."
#: How long a failed writer or the next one waits for the exclusive lock to reclaim (seconds);
#: past it the journal stays for the writer after.
RECLAIM_TIMEOUT = 10.0
#: Bounds on what is read back (aotbuild.utils.safeio): a journal lists one 65-byte line per blob; the
#: reclaimed log only grows, so only its tail is read, each note a small, shallow JSON object.
MAX_JOURNAL_BYTES = 64 << 20
NOTES_TAIL_BYTES = 1 << 20
MAX_NOTE_DEPTH = 8


class EntryWriter:
    """Writes one entry's blobs and manifest through the store, journaled."""

    def __init__(self, store: Store):
        self.store = store
        fd, path = locked_tempfile(store.layout.tmp, PREFIX)
        self.fd, self.path = fd, Path(path)
        self.created: set[str] = set()
        self.committed = False

    def _intend(self, digest: str) -> None:
        os.write(self.fd, f"{digest}\n".encode())
        os.fsync(self.fd)

    def put_blob(self, source: Path | BinaryIO, expect: str | None = None,
                 max_size: int | None = None) -> tuple[str, int]:
        from aotbuild.cache.store import sha256_file

        digest = expect or sha256_file(Path(source))  # type: ignore[arg-type]
        self._intend(digest)
        existed = self.store.layout.blob(digest).is_file()
        stored, size = self.store.put_blob(source, expect=digest, max_size=max_size)
        if not existed:
            self.created.add(stored)
        return stored, size

    def put_manifest(self, manifest: Manifest) -> Path:
        path = self.store.put_manifest(manifest)
        self.committed = True
        return path

    def close(self) -> list[str]:
        """Delete the journal; after a failure, first remove what this writer created and no one
        names. Returns the digests removed. Must be called without holding the store lock."""
        removed: list[str] = []
        try:
            if not self.committed and self.created:
                try:
                    removed = reclaim(self.store, self.created, exclude=self.path)
                except StoreError:  # no exclusive lock in time: the next writer reclaims the journal
                    os.close(self.fd)
                    self.fd = -1
                    return []
            self.path.unlink(missing_ok=True)
        finally:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        return removed


@contextlib.contextmanager
def entry_writer(store: Store) -> Iterator[EntryWriter]:
    """``with entry_writer(store) as w:`` then ``w.put_blob(...)``, ``w.put_manifest(...)`` (inside
    the shared store lock); leaving the block without a manifest reclaims the blobs at once."""
    reclaim_dead(store)
    writer = EntryWriter(store)
    try:
        yield writer
    finally:
        writer.close()


def _journal_digests(path: Path) -> set[str]:
    try:  # a journal that cannot be read (a link, a FIFO, too big) lists nothing
        text = safeio.read_bytes(path, MAX_JOURNAL_BYTES, follow_symlinks=False).decode("utf-8", "replace")
    except OSError:
        return set()
    return {line for line in text.split() if HEX64.match(line)}


def _live_journals(store: Store, exclude: Path | None = None) -> set[str]:
    out: set[str] = set()
    for path in store.layout.tmp.glob(f"{PREFIX}*") if store.layout.tmp.is_dir() else ():
        if path != exclude and not is_unlocked(path):
            out |= _journal_digests(path)
    return out


def _named(store: Store) -> set[str] | None:
    """Every digest a manifest names (stale manifests too); None when a manifest cannot be read
    (its blobs could look unnamed: then nothing is removed)."""
    from aotbuild.cache import manifest as codec

    named: set[str] = set()
    for path in store.manifest_files():
        try:
            m = codec.read(path, path.stem)
        except codec.StaleManifest as exc:
            named |= {f.sha256 for f in exc.files}
            continue
        except codec.ManifestError:
            continue  # malformed: verify reports it; what it names is no entry
        except OSError:
            return None
        if m is not None:
            named |= {f.sha256 for f in m.files}
    return named


def reclaim(store: Store, digests: set[str], exclude: Path | None = None) -> list[str]:
    """Remove the blobs of ``digests`` that no manifest names and no live journal lists, under the
    exclusive store lock (so no writer is between its blobs and its manifest)."""
    with store_lock(store.root, exclusive=True, timeout=RECLAIM_TIMEOUT):
        named = _named(store)
        if named is None:
            return []
        busy = _live_journals(store, exclude)
        removed = sorted(d for d in digests if d not in named and d not in busy
                         and store.layout.blob(d).exists())
        for digest in removed:
            store.remove_blob(digest)
        return removed


#: Staging folders a build (or a pull) makes in ``tmp/``, each locked by its ``.lock`` while it lives.
STAGING_PREFIXES = ("job-", "load.", "pull.")
#: Seconds a staging folder's ``.lock`` must have existed before it is taken for dead (its build
#: creates the file, then locks it: a few microseconds in which it looks unlocked).
STAGING_GRACE = 2.0


def reclaim_staging(store: Store) -> list[str]:
    """Remove the staging folders of builds that died (their ``.lock`` exists and nobody holds it),
    each under its own lock, taken without waiting; returns their names. A folder without a
    ``.lock``, or whose ``.lock`` is younger than STAGING_GRACE, is left alone: its build may be
    between creating it and locking it."""
    import shutil

    from aotbuild.cache.locks import flocked

    removed = []
    for folder in sorted(store.layout.tmp.iterdir()):
        if not folder.name.startswith(STAGING_PREFIXES) or not store.layout.wrote(folder) or folder.is_symlink() \
                or not folder.is_dir() or not (folder / ".lock").is_file() or not is_unlocked(folder / ".lock") \
                or time.time() - (folder / ".lock").stat().st_mtime < STAGING_GRACE:
            continue
        try:
            with flocked(folder / ".lock", exclusive=True, timeout=0):
                shutil.rmtree(folder, ignore_errors=True)
        except StoreError:  # taken meanwhile: not dead
            continue
        removed.append(folder.name)
    return removed


def reclaim_dead(store: Store) -> None:
    """Reclaim the journals, temp files and staging folders of writers that died (nobody holds
    their lock)."""
    tmp = store.layout.tmp
    if not tmp.is_dir():
        return
    with contextlib.suppress(OSError):
        folders = reclaim_staging(store)
        if folders:
            _note(store, {"staging_folders": folders})
    dead = [p for p in tmp.glob(f"{PREFIX}*") if p.is_file() and is_unlocked(p)]
    stale_temp = [p for p in tmp.glob("w.*") if p.is_file() and is_unlocked(p)]
    if not dead and not stale_temp:
        return
    try:
        digests = set().union(*(_journal_digests(p) for p in dead)) if dead else set()
        removed = reclaim(store, digests) if digests else []
    except StoreError:
        return  # busy: a later writer tries again
    for p in (*dead, *stale_temp):
        if is_unlocked(p):
            p.unlink(missing_ok=True)
    _note(store, {"reclaimed_blobs": removed, "journals": [p.name for p in dead],
                  "temp_files": [p.name for p in stale_temp]})


def _note(store: Store, record: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):  # a FIFO or a link planted at the log's name is not written to
        log = store.layout.reclaimed_log
        log.parent.mkdir(parents=True, exist_ok=True)
        safeio.append_line(log, json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **record}))


def notes(store: Store, last: int = 20) -> list[dict[str, Any]]:
    """What writers reclaimed from dead ones, most recent last (for ``verify --json``): the log's
    tail, read without blocking and never through a link (a FIFO there cannot hang ``verify``);
    a line that is not a small, shallow JSON object is skipped."""
    try:
        tail = safeio.read_tail(store.layout.reclaimed_log, NOTES_TAIL_BYTES, follow_symlinks=False)
    except OSError:
        return []
    out = []
    for line in tail.decode("utf-8", "replace").splitlines()[-last:]:
        with contextlib.suppress(ValueError):
            data = safeio.loads_json(line, max_bytes=NOTES_TAIL_BYTES, max_depth=MAX_NOTE_DEPTH)
            if isinstance(data, dict):
                out.append(data)
    return out
