"""Bounds on every read from a remote (issue 53): what a black hole, a drip, an endless listing or a
server that ignores ``Range`` can cost a pull, a plan or a replica's start.

    AOTBUILD_REMOTE_DEADLINE   60 s     a metadata request in all, per try: a listing's first page, a
                                        manifest, a failure record, an info/exists
    AOTBUILD_REMOTE_STALL      60 s     a blob transfer with no byte received for this long fails
    AOTBUILD_REMOTE_MIN_RATE   256 KiB/s  each ranged read of a blob must end within the deadline plus
                                        its length at this rate; a listing within the deadline plus
                                        KEY_BYTES per key listed at this rate
    AOTBUILD_REMOTE_MAX_KEYS   1,000,000  keys one listing may return, then one line naming it

A progress deadline alone never fires on a drip (a byte every 5 s is progress), and a total one would
fail a multi-GB entry on a slow link: so a transfer is bounded both ways, per range, with a total that
grows with what it asked for. Bytes are capped on what is RECEIVED: a body is read in chunks of at
most what is still wanted, and the connection dropped there, whatever the server sends.

Each bound is per try: a timed-out request is retried like any transient failure
(``AOTBUILD_REMOTE_RETRIES``, ``AOTBUILD_REMOTE_BACKOFF``), so an operation ends within deadline x
tries + backoff. A listing past its key cap is not retried: the store is too big, or hostile.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from aotbuild import constants
from aotbuild.errors import RemoteError

T = TypeVar("T")
#: What one listed key may cost in bytes on the wire (an S3 ListObjectsV2 entry is ~250 bytes of XML):
#: a listing's deadline grows by this per key at AOTBUILD_REMOTE_MIN_RATE (1,024 keys/s at 256 KiB/s).
KEY_BYTES = 256
#: Bytes asked of a body per read: the most held in memory past what was wanted is one chunk's buffer.
CHUNK = 1 << 16


class DeadlineExceeded(OSError):
    """A remote took longer than a bound allows (transient: retried). An OSError, never a TimeoutError:
    fsspec's sync() turns any TimeoutError into a bare FSTimeoutError, losing the message."""


@dataclass(frozen=True)
class Limits:
    """The bounds of this process's environment (:func:`limits`)."""

    deadline: float = constants.DEFAULT_REMOTE_DEADLINE
    stall: float = constants.DEFAULT_REMOTE_STALL
    min_rate: float = constants.DEFAULT_REMOTE_MIN_RATE
    max_keys: int = constants.DEFAULT_REMOTE_MAX_KEYS

    def transfer(self, length: int) -> float:
        """The total deadline of one ranged read of ``length`` bytes."""
        return self.deadline + length / self.min_rate

    def listing(self, listed: int) -> float:
        """The total deadline of a listing that has returned ``listed`` keys so far."""
        return self.deadline + listed * KEY_BYTES / self.min_rate

    def missed(self, seconds: float) -> DeadlineExceeded:
        return DeadlineExceeded(f"no answer within {seconds:.3g} s ({constants.ENV_REMOTE_DEADLINE}={self.deadline:g})")

    def stalled(self) -> DeadlineExceeded:
        return DeadlineExceeded(f"no byte received for {self.stall:g} s ({constants.ENV_REMOTE_STALL})")

    def too_slow(self, seconds: float) -> DeadlineExceeded:
        return DeadlineExceeded(f"slower than {constants.ENV_REMOTE_MIN_RATE}={self.min_rate:g} bytes/s: not done "
                                f"within {seconds:.3g} s ({constants.ENV_REMOTE_DEADLINE}={self.deadline:g} plus the "
                                "length at that rate)")

    def too_many(self, url: str, what: str) -> RemoteError:
        return RemoteError(f"{url}: {what} passed {self.max_keys} keys ({constants.ENV_REMOTE_MAX_KEYS}): "
                           "stopped there (a store that big, or a listing that never ends: raise the variable "
                           "only for the former)")


def limits() -> Limits:
    """The bounds from the environment (each checked by constants.env_number: a bad value is one line
    naming its variable, exit 2)."""
    number = constants.env_number
    return Limits(deadline=number(constants.ENV_REMOTE_DEADLINE, constants.DEFAULT_REMOTE_DEADLINE, 0.1, 86400),
                  stall=number(constants.ENV_REMOTE_STALL, constants.DEFAULT_REMOTE_STALL, 0.1, 86400),
                  min_rate=number(constants.ENV_REMOTE_MIN_RATE, constants.DEFAULT_REMOTE_MIN_RATE, 1, 2 ** 40),
                  max_keys=int(number(constants.ENV_REMOTE_MAX_KEYS, constants.DEFAULT_REMOTE_MAX_KEYS, 1,
                                      constants.MAX_LIMIT, integer=True)))


async def drain(read: Callable[[int], Awaitable[bytes]], length: int, bounds: Limits, total: float,
                late: Exception) -> bytes:
    """At most ``length`` bytes of a body, read ``read(n)`` by ``read(n)`` (n never more than what is
    still wanted, so a server that sends more, ignoring ``Range``, is never read past it): each read
    within the stall deadline, all of them within ``total`` seconds (else ``late`` is raised)."""
    parts: list[bytes] = []
    got = 0
    end = time.monotonic() + total
    while got < length:
        left = end - time.monotonic()
        if left <= 0:
            raise late
        try:
            chunk = await asyncio.wait_for(read(min(CHUNK, length - got)), min(bounds.stall, left))
        except asyncio.TimeoutError:
            raise (bounds.stalled() if bounds.stall < left else late) from None
        if not chunk:
            break
        parts.append(chunk[:length - got])
        got += len(parts[-1])
    return b"".join(parts)


async def bounded(awaitable: Awaitable[T], seconds: float, late: Exception) -> T:
    """``awaitable`` cancelled after ``seconds`` (its connection closed), raising ``late``."""
    try:
        return await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        raise late from None


async def collect(pages: AsyncIterator[list[tuple[str, Any]]], keep: Callable[[str, Any], T | None],
                  bounds: Limits, url: str, what: str) -> list[T]:
    """What ``keep`` keeps of each listed (path, info) of ``pages`` (a store's paged listing, one page
    per request), stopping with one RemoteError past ``bounds.max_keys`` listed (kept or not), and
    with DeadlineExceeded when a page does not come within the listing's deadline."""
    out: list[T] = []
    listed = 0
    start = time.monotonic()
    try:
        while True:
            allowed = bounds.listing(listed)
            left = allowed - (time.monotonic() - start)
            if left <= 0:
                raise bounds.too_slow(allowed)
            try:
                page = await asyncio.wait_for(pages.__anext__(), left)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise bounds.missed(allowed) from None
            listed += len(page)
            if listed > bounds.max_keys:
                raise bounds.too_many(url, what)
            out += [k for k in (keep(path, info) for path, info in page) if k is not None]
    finally:
        aclose = getattr(pages, "aclose", None)
        if aclose is not None:
            await aclose()
    return out


def capped(items: Iterable[T], bounds: Limits, url: str, what: str, cancelled: threading.Event) -> Iterable[T]:
    """``items`` (a synchronous paged listing, e.g. the Hub's) stopped past ``bounds.max_keys``, or as
    soon as ``cancelled`` is set (its deadline passed: :func:`within`)."""
    for n, item in enumerate(items, 1):
        if cancelled.is_set():
            raise bounds.missed(bounds.deadline)
        if n > bounds.max_keys:
            raise bounds.too_many(url, what)
        yield item


def within(fn: Callable[[threading.Event], T], seconds: Callable[[], float]) -> T:
    """``fn(cancelled)`` on a worker thread, abandoned (``cancelled`` set: ``fn`` should stop at its next
    step) once it has run longer than ``seconds()`` (asked again as it runs: a deadline may grow with
    progress). For clients without a total deadline of their own (huggingface_hub's httpx calls): a
    thread blocked in a read cannot be stopped, only left, and it is a daemon."""
    result: list[Any] = []
    cancelled = threading.Event()

    def run() -> None:
        try:
            result.append((True, fn(cancelled)))
        except BaseException as exc:  # handed to the caller's thread
            result.append((False, exc))

    worker = threading.Thread(target=run, daemon=True, name="aotbuild-remote")
    start = time.monotonic()
    worker.start()
    while True:
        allowed = seconds()
        worker.join(max(0.0, min(0.25, allowed - (time.monotonic() - start))))
        if result:
            ok, value = result[0]
            if ok:
                return value
            raise value
        if time.monotonic() - start >= allowed:
            cancelled.set()
            raise DeadlineExceeded(f"no answer within {allowed:.3g} s ({constants.ENV_REMOTE_DEADLINE}, "
                                   f"{constants.ENV_REMOTE_MIN_RATE})")


__all__ = ["CHUNK", "KEY_BYTES", "DeadlineExceeded", "Limits", "bounded", "capped", "collect", "drain", "limits",
           "within"]
