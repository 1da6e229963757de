"""What every remote is (the ``Remote`` interface, a push's result) and how a pulled entry is stored.

Apart from aotbuild/remote/schemes.py (the folder and Hub remotes, and the URL grammar that picks a remote) so
that a remote in its own module (aotbuild/remote/objectstore.py) imports what it shares with them from
below, never from the module that imports it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from aotbuild.cache.journal import entry_writer
from aotbuild.cache.locks import store_lock
from aotbuild.cache.manifest import Manifest
from aotbuild.cache.store import Entry, Store
from aotbuild.errors import RemoteError, StoreError


@dataclass(frozen=True)
class Transfer:
    """One entry on its way to a remote (a push) or from one (a pull), as a progress callback sees it."""

    key: str
    #: bytes of it moved so far, and in all: what the other side lacks (the blobs; on the Hub, its pack)
    done: int
    size: int
    #: which of the command's entries it is, from 1, and of how many
    n: int = 1
    count: int = 1


#: ``progress(event, transfer)``: "start" (its size known), "tick" (bytes moved), "end" (its bytes are there).
#: As a build's progress (builder/build.py ``Progress``), so the CLI shows both one way: a bar on a
#: terminal, a line a minute in a log (issue 55: a multi-GB push was silent for minutes).
TransferProgress = Callable[[str, Transfer], None]


class Meter:
    """One entry's transfer told to ``progress`` (None: to no one): :meth:`start` with its size, bytes
    as they move (:meth:`moved`, or read through :meth:`reading`), :meth:`end`."""

    def __init__(self, progress: TransferProgress | None, key: str, n: int = 1, count: int = 1):
        self.progress, self.key, self.n, self.count = progress, key, n, count
        self.done = self.size = 0

    def _tell(self, event: str) -> None:
        if self.progress is not None:
            self.progress(event, Transfer(self.key, min(self.done, self.size), self.size, self.n, self.count))

    def start(self, size: int) -> None:
        self.done, self.size = 0, size
        self._tell("start")

    def moved(self, nbytes: int) -> None:
        if nbytes:
            self.done += nbytes
            self._tell("tick")

    def reached(self, done: int) -> None:
        """``done`` bytes moved in all (a client that counts them itself: fsspec's callbacks)."""
        if done != self.done:
            self.done = done
            self._tell("tick")

    def end(self) -> None:
        self.done = self.size
        self._tell("end")

    def reading(self, stream: BinaryIO) -> BinaryIO:
        """``stream``, each read counted as moved."""
        return _Counted(stream, self)  # type: ignore[return-value]


class _Counted:
    def __init__(self, stream: BinaryIO, meter: Meter):
        self.stream, self.meter = stream, meter

    def read(self, n: int = -1) -> bytes:
        data = self.stream.read(n)
        self.meter.moved(len(data))
        return data


@dataclass
class PushResult:
    sent: list[str] = field(default_factory=list)  # keys whose entry the remote did not have
    present: list[str] = field(default_factory=list)  # keys the remote already had
    signed: list[str] = field(default_factory=list)  # of those, the ones given a pushed signature
    #: of ``sent``, the keys whose manifest there no trusted key signed, replaced by one a trusted key did
    superseded: list[str] = field(default_factory=list)
    bytes_sent: int = 0


class Remote:
    """Where entries are pushed and pulled. Subclasses: FolderRemote, HubRemote."""

    url: str

    def keys(self) -> set[str]:
        """Every key with a manifest on the remote (one listing, for plans and pushes)."""
        raise NotImplementedError

    def fetch(self, key: str, store: Store, progress: TransferProgress | None = None) -> str:
        """Copy the entry ``key`` into ``store``, verified. "" when pulled, else why not. ``progress``
        hears of its bytes (:class:`Transfer`)."""
        raise NotImplementedError

    def read_manifest(self, key: str) -> Manifest | None:
        """The remote's manifest of ``key`` (one bounded read, nothing else is fetched); None when it is
        not there or cannot be read as a manifest (malformed, stale): either way, not an entry."""
        raise NotImplementedError

    def push(self, entries: list[Entry], progress: TransferProgress | None = None,
             workdir: Path | None = None, trusted: dict[str, bytes] | None = None) -> PushResult:
        """Send every entry the remote lacks: blobs (or packs) first, manifests last; ``progress`` hears
        of each one sent, its bytes as they go (:class:`Transfer`, ``n`` of the ``count`` sent). ``workdir``:
        where a remote that packs entries may stage them (the local store's ``tmp/``). With
        ``trusted`` keys, a remote manifest none of them signed is replaced by a pushed one that one
        of them did (signing.supersedes); one they signed is never overwritten."""
        raise NotImplementedError

    # -- failure records: the store's one rule for failures, shared by every shard and rerun ------
    # A job that failed is recorded where every builder looks (issue 35): its key, its toolchain and
    # the first line of why. A remote that keeps none (the Hub's) answers none and keeps nothing.

    def failure_keys(self) -> set[str]:
        """The keys with a failure record on the remote (one listing)."""
        return set(self.failure_times())

    def failure_times(self) -> dict[str, float]:
        """key -> when its failure record was last written (the store's own modification time, in
        seconds since the epoch; 0.0 where the store gives none), from the same one listing: which
        records are the newest, without reading any."""
        return {}

    def read_failure(self, key: str) -> dict | None:
        """The remote's failure record of ``key`` (one bounded read, store.failure_record's checks),
        or None: not there, or not a record."""
        return None

    def put_failure(self, key: str, record: dict) -> bool:
        """Record (or replace) the failure of ``key``; False where this remote keeps no records."""
        return False

    def remove_failure(self, key: str) -> None:
        """Forget the failure of ``key`` (its entry was pushed since); nothing if there is none."""


def ingest(store: Store, key: str, manifest: Manifest,
           blobs: Callable[[list[tuple[str, int]]], Iterator[tuple[str, BinaryIO]]], meter: Meter | None = None) -> str:
    """Store every blob ``blobs`` yields (each refused unless it hashes to its name), then the
    manifest, as a writer of ``store`` (its shared lock: gc cannot take a blob from under us).
    ``meter`` (a remote that streams the blobs themselves) counts their bytes as they are read."""
    why = store.untrusted(manifest)  # before any blob is fetched or written
    if why:
        return f"refused: {why}"
    try:
        wanted = manifest.blobs()
        # Journaled: a refused or broken pull removes the blobs it wrote (cache/journal.py).
        with entry_writer(store) as writer, store_lock(store.root, exclusive=False):
            missing = {d: s for d, s in wanted if not store.has_blob(d, s, verify=True)}
            if meter is not None:
                meter.start(sum(missing.values()))
            if missing:
                for digest, stream in blobs(sorted(missing.items())):
                    if digest not in missing:
                        raise StoreError(f"the remote sent {digest[:12]}, which entry {key[:12]} does not name")
                    source = meter.reading(stream) if meter is not None else stream
                    _, size = writer.put_blob(source, expect=digest, max_size=missing[digest])
                    if size != missing[digest]:
                        raise StoreError(f"blob {digest[:12]} has {size} bytes, the manifest says "
                                         f"{missing[digest]}")
            writer.put_manifest(manifest.without_pack())  # refuses if any blob is still missing
        if meter is not None:
            meter.end()
    except RemoteError:  # the remote failed midway (network, auth): the caller reports it
        raise
    except StoreError as exc:
        return f"refused: {exc}"
    except OSError as exc:
        return f"could not write to the local cache {store.root}: {exc}"
    return ""
