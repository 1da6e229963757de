"""``aotbuild push`` and ``aotbuild pull``: which entries move between the local store and a remote.

The transports live in :mod:`aotbuild.remote.schemes`; this module decides what to send or fetch. A push
takes keys (hex prefixes of at least 8 characters) or recipes (the jobs they plan in this
environment); a pull takes recipes, because only a recipe says which keys *this* machine needs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotbuild.cache.layout import resolve_cache_root
from aotbuild.cache.store import DAMAGED, Entry, Store
from aotbuild.constants import Vocabulary
from aotbuild.errors import UsageError
from aotbuild.planner import Job, JobStatus, OnRemote, mark_remote, plan
from aotbuild.recipe.rules import Recipes, recipe_items
from aotbuild.remote.base import Transfer, TransferProgress
from aotbuild.remote.schemes import PushResult, Remote, as_remote, pull_entry
from aotbuild.strategies.registry import checked_store
from aotbuild.utils import secrets
from aotbuild.utils.deprecated import positional_shim


class PullStatus(Vocabulary):
    """What a pull did with a job (``PullItem.status``; ``pull --json``'s ``status``)."""

    PULLED = "pulled"
    #: already in the local cache
    CACHED = "cached"
    #: not on the remote
    MISSING = "missing"
    #: on the remote, but not stored: a blob's hash, a record or a signature did not check
    REFUSED = "refused"
    #: the recipe cannot be keyed here (planner.JobStatus.UNAVAILABLE)
    UNAVAILABLE = "unavailable"



def is_key_prefix(text: str) -> bool:
    return len(text) >= 8 and all(c in "0123456789abcdef" for c in text.lower()) and not Path(text).exists()


def split_keys(items: list[Any]) -> tuple[list[Any], list[str]]:
    """(the recipes, the entry keys) of push's or sign's items (:func:`recipe_items`'s list)."""
    keys = [i for i in items if isinstance(i, str) and is_key_prefix(i)]
    return [i for i in items if not (isinstance(i, str) and i in keys)], keys


@dataclass
class PushReport:
    remote: str
    result: PushResult
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (what, why not pushed)
    damaged: list[str] = field(default_factory=list)  # what was skipped because its entry is damaged
    failures: list[str] = field(default_factory=list)  # keys whose failure record was written there

    def text(self) -> str:
        from aotbuild.cache.layout import format_size
        from aotbuild.utils.text import printable

        r = self.result
        signed = f" ({len(r.signed)} given the new signature)" if r.signed else ""
        superseded = (f"; {len(r.superseded)} replaced an entry there that no trusted key signed"
                      if r.superseded else "")
        lines = [f"pushed {len(r.sent)} entries ({format_size(r.bytes_sent)}) to {self.remote}; "
                 f"{len(r.present)} already there{signed}{superseded}"]
        lines += [f"not pushed: {printable(what)}: {printable(why)}" for what, why in self.skipped]
        if self.failures:
            lines.append(f"recorded {len(self.failures)} failed job(s) on {self.remote}: other shards and reruns "
                         f"skip them until --retry-failed")
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"remote": self.remote, "sent": self.result.sent, "present": self.result.present,
                "signed": self.result.signed, "superseded": self.result.superseded,
                "bytes_sent": self.result.bytes_sent, "skipped": [{"what": w, "reason": r} for w, r in self.skipped],
                "failures": self.failures}


@secrets.scrubbed  # its exceptions leave it scrubbed of secrets (issue 53)
@positional_shim("cache", "progress", "trusted", "failed")
def push(items: Recipes, remote: str | Remote, *, cache: str | Path | None = None,
         progress: TransferProgress | None = None, trusted: dict[str, bytes] | None = None,
         failed: list[Job | str] | None = None) -> PushReport:
    """Push KEYS or RECIPES to ``remote`` (a URL or a Remote): an entry key (a hex prefix), a recipe
    file or folder (str or os.PathLike), a dict or a Recipe, or a list or tuple of them (a str is one
    item); none (``[]``) means every entry of the local store, unless ``failed`` is given (a build's
    push: then ``items`` are exactly what is pushed).

    Every entry is hash-verified locally before it is sent: a corrupt entry is skipped, named, and
    never pushed. A push never signs: each entry travels with the signatures it has (:func:`sign`
    adds one, knowingly). With ``trusted`` keys (name -> public key, signing.trusted_from_env), a
    remote manifest none of them signed is replaced by a pushed one that one of them did.

    ``failed``: the jobs (or record keys) a build found failed; their failure records go to the remote
    (:func:`push_failures`). A pushed entry clears the remote's record of its key.

    ``progress(event, transfer)`` hears of each entry sent: "start", "tick" as its bytes go, "end"
    (``aotbuild.remote.base.Transfer``: key, bytes done and in all, which of how many)."""
    items = recipe_items(items, "push", keys=True)
    remote = as_remote(remote)
    store = checked_store(resolve_cache_root(cache))
    if failed is not None and not items:
        return PushReport(remote.url, PushResult(), failures=push_failures(remote, store, failed))
    keys: list[str] = []
    skipped: list[tuple[str, str]] = []
    damaged: list[str] = []
    recipes, prefixes = split_keys(items)
    keys += [store.resolve_prefix(i) for i in prefixes]
    if recipes:
        for job in plan(recipes, cache=store.root):
            if job.status == JobStatus.HIT and job.key:
                keys.append(job.key)
            else:
                skipped.append((job.label, job.reason or job.status))
                if job.unusable in DAMAGED:
                    damaged.append(job.label)
    if not items:
        keys = [m.key for m in store.iter_manifests()]
    keys = _with_ranks(store, keys, skipped)
    entries: list[Entry] = []
    for key in dict.fromkeys(keys):
        entry, why = store.open_entry(key)
        if entry is None:
            skipped.append((key[:12], why))
            if why.kind in DAMAGED:
                damaged.append(key[:12])
        else:
            entries.append(entry)
    result = remote.push(entries, progress, workdir=store.layout.tmp, trusted=trusted)
    there = set(result.sent + result.present)
    clear_failures(remote, store, [k for e in entries if e.key in there for k in (e.key, *_built_attempt(e))])
    return PushReport(remote.url, result, skipped, damaged, push_failures(remote, store, failed or []))


def clear_failures(remote: Remote, store: Store, keys: list[str]) -> None:
    """Forget the failure of each of ``keys``, whose entry is now on ``remote`` (or, for an auto job's
    attempt, the entry that attempt built): the job builds (a --retry-failed that worked, or a new
    build of it), so no shard or rerun may skip it as failed.
    Removed on the remote (one listing, then one request per record there) and in ``store``."""
    if not keys:
        return
    for key in remote.failure_keys() & set(keys):
        remote.remove_failure(key)
    for key in keys:
        store.remove_failure(key)


def _built_attempt(entry: Entry) -> list[str]:
    """An auto job's entry: the key of the attempt that built it (its strategy's concrete key, where
    that strategy's failure was recorded: aotbuild/strategies/order.py), a record of which it makes stale."""
    from aotbuild.cache.layout import HEX64
    from aotbuild.strategies import order as auto

    attempts = (entry.manifest.auto or {}).get("attempts", ())
    return [a["key"] for a in attempts if isinstance(a, dict) and a.get("outcome") == auto.Outcome.BUILT
            and isinstance(a.get("key"), str) and HEX64.match(a["key"])]


#: Failure records one build reads from a remote at most (each one small request). The newest are
#: read (by the store's modification time of each record, from the one listing): the failures of
#: jobs that still fail; a remote past this is one whose failures/ gc should prune.
MAX_PULLED_FAILURES = 1000


def push_failures(remote: Remote, store: Store, failed: list[Job | str]) -> list[str]:
    """Record on ``remote`` the failure of each of ``failed`` (jobs, or keys of failure records) that
    the local store has a record of (the store's one rule for failures, issue 35): its key, its
    toolchain and the first line of why. A record pulled from a remote, or one the remote has already
    (the same failure) is not written again; a newer failure of a key (a --retry-failed that failed
    again) replaces it. Returns the keys recorded."""
    from aotbuild.context import environment_factors
    from aotbuild.recipe.frozen import thaw

    there: set[str] | None = None
    recorded = []
    for item in failed:
        key = item if isinstance(item, str) else item.key
        local = store.failure(key) if key else None
        if local is None or "remote" in local:  # none, or pulled from a remote: not this build's to record
            continue
        if there is None:
            there = remote.failure_keys()
        if key in there:
            theirs = remote.read_failure(key)
            if theirs is not None and theirs.get("time") == local.get("time"):
                continue
        # The toolchain: the job's own factors, else this process's (the build's, which pushes).
        factors = thaw(item.factors) if not isinstance(item, str) and item.factors is not None else {}
        toolchain = local.get("toolchain") or {name: factors[name] for name in ("env", "target", "device")
                                               if name in factors} or {"env": environment_factors()}
        record = {**local, "key": key, "reason": _first_line(local["reason"]), "toolchain": toolchain}
        if remote.put_failure(key, record):
            recorded.append(key)
    return recorded


def pull_failures(remote: Remote, cache: str | Path | Store | None = None) -> list[str]:
    """Copy into the local store the remote's failure records, so that plan and build see them as
    the store's own (planner.JobStatus.FAILED_BEFORE): a job another shard or an earlier run found failing is
    not built again until --retry-failed, and keeps this shard red. Skipped: a key the remote has an
    entry of (it was built since), one the local store already records a failure of for this
    aotbuild, and a record that is not one (store.failure_record). At most MAX_PULLED_FAILURES are
    read, the newest first (by the store's modification time); a warning says when some were not.

    Reconciled first: a record pulled from this remote before whose key the remote no longer records
    as failed, or now holds an entry of (a --retry-failed that worked, on any runner), is removed
    from the local store. Returns the keys pulled."""
    import logging

    from aotbuild import constants

    store = cache if isinstance(cache, Store) else checked_store(resolve_cache_root(cache))
    times = remote.failure_times()
    built = remote.keys() if times else set()
    for key in _pulled_from(store, remote.url):
        if key not in times or key in built:
            store.remove_failure(key)
    todo = sorted(set(times) - built, key=lambda k: (-times[k], k))
    if len(todo) > MAX_PULLED_FAILURES:
        logging.getLogger("aotbuild").warning(
            "%s holds %d failure records of jobs it has no entry of: only the newest %d were read (prune its "
            "failures/ folder of old ones)", remote.url, len(todo), MAX_PULLED_FAILURES)
    pulled = []
    for key in todo[:MAX_PULLED_FAILURES]:
        mine = store.failure(key)
        if (mine is not None and mine.get("aotbuild") == constants.VERSION) or store.check_entry(key)[0]:
            continue
        record = _remote_record(remote, key)
        if record is not None:
            store.put_failure(key, record)
            pulled.append(key)
    return pulled


def remote_failures(remote: Remote) -> Callable[[str], dict | None]:
    """A lookup of the remote's failure record of a key, as :func:`pull_failures` would store it
    (None: none there, or not a record of that key), for ``plan --remote``, which writes nothing
    locally: the remote's records are listed once, on the first lookup, and only a listed one is read."""
    listed: list[set[str]] = []

    def lookup(key: str) -> dict | None:
        if not listed:
            listed.append(remote.failure_keys())
        return _remote_record(remote, key) if key in listed[0] else None

    return lookup


def _remote_record(remote: Remote, key: str) -> dict | None:
    """The remote's failure record of ``key`` as the local store keeps a pulled one: the first line
    of why, saying where it was recorded, and the remote's URL (:func:`pull_failures` reconciles by it)."""
    record = remote.read_failure(key)
    if record is None or record.get("key") != key:  # a record names its own key (docs/security.md)
        return None
    why = f"{_first_line(record['reason'])} (recorded on {remote.url})"
    return {**record, "key": key, "reason": why, "remote": remote.url}


def _pulled_from(store: Store, url: str) -> list[str]:
    """The keys of the local failure records pulled from the remote ``url``."""
    keys = []
    for key in store.failure_keys():
        record = store.failure(key)
        if record is not None and record.get("remote") == url:
            keys.append(key)
    return keys


def _nth(progress: TransferProgress | None, n: int, count: int) -> TransferProgress | None:
    """``progress`` told that each transfer it hears of is the ``n``-th of ``count``."""
    if progress is None:
        return None
    return lambda event, transfer: progress(event, Transfer(transfer.key, transfer.done, transfer.size, n, count))


def _first_line(reason: str) -> str:
    lines = reason.strip().splitlines()
    return lines[0][:500] if lines else ""


@secrets.scrubbed  # its exceptions leave it scrubbed of secrets (issue 53)
@positional_shim("cache")
def sign(items: Recipes, sign_key: str | Path, *, cache: str | Path | None = None) -> list[str]:
    """Sign, with ``sign_key``, the local entries of KEYS (hex prefixes) or RECIPES (their cached jobs;
    one or a list or tuple, as :func:`push` takes them):
    the signer VOUCHES for entries it did not build (docs/security.md), so nothing is signed unless
    named: no items is an error, not "all". Each entry is hash-checked first; a damaged or missing one
    is an error and nothing is signed. Returns the keys signed (an entry this key signed already is
    left as it is)."""
    from aotbuild.cache.locks import store_lock
    from aotbuild.cache.signing import load_private, public_of, signer
    from aotbuild.cache.signing import sign as sign_manifest

    items = recipe_items(items, "sign", keys=True)
    if not items:
        raise UsageError("name the entries to sign (keys or recipes): `aotbuild sign` vouches for each one, "
                         "so it never signs a whole cache by default")
    name, _ = load_private(sign_key)
    own = public_of(sign_key)
    store = checked_store(resolve_cache_root(cache))
    recipes, prefixes = split_keys(items)
    keys = [store.resolve_prefix(i) for i in prefixes]
    for job in plan(recipes, cache=store.root, signatures=False) if recipes else []:
        if job.status != JobStatus.HIT or not job.key:
            raise UsageError(f"{job.label}: not in the local cache ({job.reason or job.status}): nothing signed")
        keys.append(job.key)
    keys = list(dict.fromkeys(keys))
    signed = []
    with store_lock(store.root, exclusive=False):  # gc cannot take a blob from under a signature
        entries = []
        for key in keys:
            entry, why = store.open_entry(key)  # hash-checked: a signature covers the blobs' hashes
            if entry is None:
                raise UsageError(f"{key[:12]}: {why}: nothing signed")
            entries.append(entry)
        for entry in entries:  # the manifest that was checked, not one read again
            if signer(entry.manifest, own) != name:
                store.put_manifest(sign_manifest(entry.manifest, sign_key))
                signed.append(entry.key)
    return signed


def rank_keys(factors: Any) -> list[str]:
    """Every rank's key of the tensor-parallel job one rank's factors belong to ([] if unsharded)."""
    from aotbuild.keys import key_of
    from aotbuild.recipe.frozen import thaw

    factors = thaw(factors)
    sharded = factors.get("parallel") if isinstance(factors, dict) else None
    if not isinstance(sharded, dict) or not isinstance(sharded.get("tensor"), int):
        return []
    return [key_of({**factors, "parallel": {**sharded, "rank": r}}) for r in range(sharded["tensor"])]


def _with_ranks(store: Store, keys: list[str], skipped: list[tuple[str, str]]) -> list[str]:
    """``keys`` with every other rank of each tensor-parallel job among them (pushed together); a job
    one of whose ranks the local store lacks is not pushed at all."""
    out: list[str] = []
    for key in dict.fromkeys(keys):
        manifest = store.read_manifest(key) if store.check_entry(key)[0] else None
        ranks = rank_keys(manifest.factors) if manifest is not None else []
        if not ranks:
            out.append(key)
            continue
        lacking = [r for r, k in enumerate(ranks) if not store.check_entry(k)[0]]
        if lacking:
            skipped.append((key[:12], f"rank {lacking[0]} of its {len(ranks)} ranks is not in the local cache: "
                                      f"a tensor-parallel job's entries travel together"))
        else:
            out.extend(ranks)
    return list(dict.fromkeys(out))


@dataclass
class PullItem:
    job: Job
    status: PullStatus
    reason: str = ""

    def as_json(self) -> dict[str, Any]:
        return {**self.job.as_json(), "status": self.status, "reason": self.reason}


@dataclass
class PullReport:
    """What :func:`pull` did: one :class:`PullItem` per job, in plan order. It iterates, indexes and
    counts as that list (``for item in pull(...)``, ``report[0]``, ``len(report)``)."""

    remote: str
    items: list[PullItem] = field(default_factory=list)

    def __iter__(self) -> Iterator[PullItem]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PullItem:
        return self.items[index]

    @property
    def refused(self) -> list[PullItem]:
        """Entries fetched that failed verification (``pull`` exits 1)."""
        return [i for i in self.items if i.status == PullStatus.REFUSED]

    @property
    def missing(self) -> list[PullItem]:
        """Jobs on neither side: not on the remote, or not keyable here (``--fail-on-miss`` exits 3)."""
        return [i for i in self.items if i.status in (PullStatus.MISSING, PullStatus.UNAVAILABLE)]

    def text(self) -> str:
        from aotbuild.utils.text import table

        rows = [[i.job.label, i.job.key[:12] if i.job.key else "-", i.status, i.reason] for i in self.items]
        return table(rows, ["job", "key", "status", "reason"])

    def as_json(self) -> dict[str, Any]:
        return {"remote": self.remote, "jobs": [i.as_json() for i in self.items]}


@secrets.scrubbed  # its exceptions leave it scrubbed of secrets (issue 53)
@positional_shim("cache", "trusted_keys")
def pull(recipes: Recipes, remote: str | Remote, *, cache: str | Path | None = None,
         trusted_keys: list[str | Path] | None = None, progress: TransferProgress | None = None) -> PullReport:
    """Fetch, verified, every job of RECIPES (a recipe file or folder, a dict or a Recipe, or a list or
    tuple of them: as :func:`aotbuild.plan` takes them) that the local store lacks and ``remote`` (a URL
    or a Remote) has. With trusted keys (default ``AOTBUILD_TRUSTED_KEYS``) an entry no trusted key signed
    is refused before any of its blobs is fetched. ``progress`` hears of each entry fetched, as
    :func:`push`'s does."""
    from aotbuild.cache.signing import trusted_from_env

    recipes = recipe_items(recipes, "pull")
    if not recipes:
        raise UsageError("name the recipes to pull: only a recipe says which keys this machine needs")
    remote = as_remote(remote)
    trusted = trusted_from_env(trusted_keys)
    store = checked_store(resolve_cache_root(cache), trusted)
    # What the remote holds is the planner's to decide (planner.mark_remote, as for plan --remote and a
    # build's --push): trusted keys, whole tensor-parallel jobs (a rank the local cache has counts).
    jobs = mark_remote(plan(recipes, cache=store.root, trusted_keys=trusted_keys), remote,
                       trusted=trusted)
    out: list[PullItem] = []
    fetched = [j for j in jobs if j.status == JobStatus.REMOTE]
    for job in jobs:
        if job.status == JobStatus.HIT:
            out.append(PullItem(job, PullStatus.CACHED))
        elif job.status == JobStatus.REMOTE:
            assert job.key is not None
            why = pull_entry(remote, job.key, store, _nth(progress, fetched.index(job) + 1, len(fetched)))
            out.append(PullItem(job, PullStatus.REFUSED if why else PullStatus.PULLED, why))
        elif job.on_remote == OnRemote.REFUSED:
            out.append(PullItem(job, PullStatus.REFUSED, job.reason))
        elif job.on_remote in (OnRemote.ABSENT, OnRemote.PARTIAL):
            out.append(PullItem(job, PullStatus.MISSING, job.reason if job.on_remote == OnRemote.PARTIAL
                                else f"not on {remote.url}"))
        else:
            out.append(PullItem(job, PullStatus.UNAVAILABLE, job.reason))
    return PullReport(remote.url, out)

