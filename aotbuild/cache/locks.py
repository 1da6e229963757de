"""Locks between aotbuild processes sharing one store, with a timeout that names the lock file.

Three uses, all ``fcntl.flock`` (released by the kernel when the holder dies, even by ``kill -9``,
so a crash never leaves a lock behind):

* The store lock ``<root>/locks/store.lock``: writers (a build storing a job, a pull, a push into a
  folder remote) and loads (from the hash check to the last file installed) hold it *shared*;
  ``gc``, ``rm`` and ``verify --fix`` hold it *exclusive*, so they never delete a blob that a writer
  is about to reference or a load is about to install.
* Each temp file is locked by the writer that has it open (:func:`locked_tempfile`: a blob's
  ``Store._tempfile``, an entry's journal).
* A build job or a download locks its staging folder (``<root>/tmp/*/.lock``).
  ``verify`` reports a temp file or folder only when it can take its lock: its owner is dead.

Why not a library: filelock's reader/writer lock is built on SQLite, which its authors say is not
safe on network filesystems, and shared caches live on NFS. ``flock`` is in the standard library.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from collections.abc import Iterator
from pathlib import Path

from aotbuild.cache.layout import Layout, shared_dirs
from aotbuild.constants import lock_timeout
from aotbuild.errors import LockUnavailable, StoreError

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: no inter-process locking
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def flocked(path: Path, *, exclusive: bool, timeout: float | None = None, holder: str = "") -> Iterator[bool]:
    """Hold ``path`` locked; yields False when the lock file cannot be created (a read-only store).

    Waits at most ``timeout`` seconds (default: ``AOTBUILD_LOCK_TIMEOUT``, 60 s), then raises a
    StoreError naming the file and who usually holds it."""
    timeout = lock_timeout() if timeout is None else timeout
    try:
        fd = _open(path)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EROFS, errno.EPERM) and not exclusive:
            yield False  # nobody can write this store, so there is nothing to coordinate
            return
        raise LockUnavailable(f"cannot open the lock file {path}: {exc}") from None
    try:
        if fcntl is not None:
            mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StoreError(
                            f"timed out after {timeout:g} s waiting for the lock {path}, held by another "
                            f"aotbuild process ({holder or 'a build, pull, gc or verify --fix'}); wait for it "
                            f"to finish, or set AOTBUILD_LOCK_TIMEOUT to wait longer") from None
                    time.sleep(0.05)
        yield True
    finally:
        os.close(fd)


def _open(path: Path) -> int:
    """An fd to lock: created readable and writable by everyone who shares the store (``flock``
    works on a read-only fd too, so a lock file created by another user still locks)."""
    try:
        return os.open(path, os.O_RDWR)
    except FileNotFoundError:
        shared_dirs(path.parent)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:  # another process created it first
            return os.open(path, os.O_RDWR)
        with contextlib.suppress(OSError):
            os.fchmod(fd, 0o666)  # despite the umask: other users of a shared store must lock it too
        return fd
    except PermissionError:
        return os.open(path, os.O_RDONLY)


def store_lock(root: Path, *, exclusive: bool, timeout: float | None = None) -> contextlib.AbstractContextManager[bool]:
    holder = "a build or pull writing to the store" if exclusive else "gc, rm or verify --fix"
    return flocked(Layout(Path(root)).store_lock, exclusive=exclusive, timeout=timeout, holder=holder)


def locked_tempfile(folder: Path, prefix: str) -> tuple[int, str]:
    """A new temp file in ``folder`` (created shared, as the store's folders are), locked exclusively
    by its writer for as long as the file descriptor is open: ``verify`` takes a temp file for a dead
    writer's only when it can lock it (:func:`is_unlocked`). Returns (fd, path) as ``mkstemp`` does."""
    import tempfile

    shared_dirs(folder)
    fd, path = tempfile.mkstemp(prefix=prefix, dir=folder)
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd, path


def is_unlocked(path: Path) -> bool:
    """True when nobody holds ``path`` locked (its owner died) or it does not exist."""
    if fcntl is None:  # pragma: no cover
        return False
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
