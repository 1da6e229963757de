"""``aotbuild build``: run every missing job in its own subprocess and store what it compiled.

Order of work per job: plan says miss -> staging folder under ``<cache>/tmp`` -> worker subprocess
with the target's capture environment -> collect files -> blobs -> manifest (last). A failed job is
reported with the end of its log (kept under ``<cache>/logs``) and never stored; the other jobs run.
A failed job is remembered (``<cache>/failures/<key>.json``) and not built again until
``retry_failed``: a job fails the same way until something in its key, or aotbuild, changes.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import advice, constants, planner
from aotbuild.builder import child
from aotbuild.builder.child import Tick
from aotbuild.builder.loader import SharedLoads
from aotbuild.cache.journal import entry_writer
from aotbuild.cache.layout import FROM_PROJECT, cache_root_origin, format_size, resolve_max_size
from aotbuild.cache.locks import flocked, store_lock
from aotbuild.cache.manifest import FileRecord, Manifest, Proof
from aotbuild.cache.store import Store
from aotbuild.cache.trees import lay_tree
from aotbuild.constants import Vocabulary
from aotbuild.context import Unavailable
from aotbuild.errors import ProofFailed, StoreError
from aotbuild.pipeline import models
from aotbuild.planner import (
    Job,
    JobStatus,
    mark_remote,
    not_signed_by,
    plan,
    recheck_hits,
    shard_jobs,
    shard_summary,
    whole_groups,
)
from aotbuild.recipe.rules import Recipes, resolve_recipes
from aotbuild.recipe.schema import Recipe, recipe_spec, recipe_to_dict
from aotbuild.strategies import order as auto
from aotbuild.strategies.registry import checked_store
from aotbuild.utils import secrets
from aotbuild.utils.deprecated import positional_shim

if TYPE_CHECKING:
    from aotbuild.cache.manage import GcReport
    from aotbuild.remote.schemes import Remote



class ResultStatus(Vocabulary):
    """What a build did with a job (``JobResult.status``; ``build --json``'s ``status``)."""

    BUILT = "built"
    #: a hit, its entry re-hashed: nothing built
    CACHED = "cached"
    #: failed now, or failed before and not retried (``JobResult.not_retried``)
    FAILED = "failed"
    #: not built: its target or device is not on this host, and another host can build it
    SKIPPED = "skipped"
    #: on the remote named (``build --push``), not built here
    ON_REMOTE = "remote"
    #: compiled, but the entry could not be written (no space left, read-only store)
    UNCACHED = "uncached"


@dataclass
class JobResult:
    job: Job
    status: ResultStatus
    seconds: float = 0.0
    size: int = 0
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    #: failed before (its failure record says why) and not built this time: nothing new to remember
    not_retried: bool = False
    #: ``strategy: auto``: every strategy tried, in order (aotbuild/strategies/order.py ``Attempt``)
    attempts: list[auto.Attempt] = field(default_factory=list)
    #: the pipeline's own eager warmup call failed (``constants.EAGER_CALL_FAILED``): any strategy would
    eager_call_failed: bool = False
    #: the pipeline did not load (or could not be placed) before any strategy ran (``constants.LOAD_FAILED``):
    #: any strategy would fail so; no failure record is kept (a library, a download or memory: no key factor)
    load_failed: bool = False

    def as_json(self) -> dict[str, Any]:
        return {**self.job.as_json(), "status": self.status, "seconds": round(self.seconds, 3), "size": self.size,
                "reason": self.reason, **({"attempts": [a.as_json() for a in self.attempts]} if self.attempts else {})}


@dataclass
class BuildReport:
    cache: str
    results: list[JobResult]
    gc: GcReport | None = None  # when the build took the cache past its size limit
    note: str = ""
    #: pipeline loads: "build" by the compiling processes (a loader process shared by a recipe's jobs,
    #: or a worker that loaded its own), "proof" by the proofs (a fresh process per entry), for "jobs"
    loads: dict[str, int] = field(default_factory=lambda: {"jobs": 0, "build": 0, "proof": 0})
    #: with ``shard``: this shard's index, count, source, job count and the full list's digest (shards.summary)
    shard: dict[str, Any] | None = None

    @property
    def failed(self) -> list[JobResult]:
        """Jobs that failed (this time, or before and not retried), or compiled but could not be stored,
        or whose model could not be read or fetched."""
        return [r for r in self.results if r.status in (ResultStatus.FAILED, ResultStatus.UNCACHED)]

    @property
    def bad_input(self) -> list[JobResult]:
        """Jobs whose model folder or files could not be read or were refused: the input is at fault,
        as with a bad recipe (``aotbuild build`` exits 2)."""
        return [r for r in self.results if r.job.cause is Unavailable.MODEL]

    @property
    def skipped(self) -> list[JobResult]:
        """Jobs this host cannot build: their target or device is not here (another host builds them)."""
        return [r for r in self.results if r.status == ResultStatus.SKIPPED]

    def text(self, pushed: str = "") -> str:
        """The job table, the cache, then what was pushed (``pushed``: a PushReport's text), a note and gc."""
        from aotbuild.utils.text import printable, table

        rows = [[r.job.label, r.job.key[:12] if r.job.key else "-", r.status, f"{r.seconds:.1f}",
                 format_size(r.size) if r.size else "-", r.reason] for r in self.results]
        lines = [table(rows, ["job", "key", "status", "seconds", "size", "note"]), f"cache: {self.cache}"]
        lines += [pushed] if pushed else []
        if self.skipped:
            why = "; ".join(sorted({printable(r.reason) for r in self.skipped}))  # a target's or device's word
            lines.append(f"skipped: {len(self.skipped)} job(s) this host cannot build (another host builds them): "
                         f"{why}")
        jobs = self.loads["jobs"]
        if jobs:
            lines.append(f"loads: the pipeline was loaded {_times(self.loads['build'])} to compile {jobs} job"
                         f"{'s' if jobs != 1 else ''}, and {_times(self.loads['proof'])} by the proofs "
                         f"(a fresh process per entry)")
        lines += [f"note: {printable(self.note)}"] if self.note else []  # quotes an exception's text
        if self.gc is not None:
            lines.append(f"gc: removed {len(self.gc.removed)} least recently used entries to keep the cache under its "
                         f"size limit ({format_size(self.gc.size_after)} now)")
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.status] = counts.get(r.status, 0) + 1
        return {"cache": self.cache, "jobs": [r.as_json() for r in self.results], "counts": counts,
                "loads": dict(self.loads), **({"shard": self.shard} if self.shard else {}),
                **({"gc": self.gc.as_json()} if self.gc else {}), **({"note": self.note} if self.note else {})}


def _times(n: int) -> str:
    return {1: "once", 2: "twice"}.get(n, f"{n} times")


#: progress(event, n, total, job, result): event is "start", "tick" (result.status holds the worker's
#: phase, result.seconds the time so far; about twice a second) or "end".
Progress = Callable[[str, int, int, Job, "JobResult | None"], None]


@positional_shim("cache")
@secrets.scrubbed  # its exceptions leave it scrubbed of secrets (issue 53)
def build(recipes: Recipes, *, cache: str | Path | None = None,
          progress: Progress | None = None, shard: tuple[int, int] | None = None,
          remote: str | Remote | None = None, max_size: int | None = None,
          sign_key: str | Path | None = None, pipe: Any = None, retry_failed: bool = False) -> BuildReport:
    """Build every missing job of ``recipes``; jobs already cached (and intact) are left alone.

    ``recipes``: a recipe file or folder (str or os.PathLike), recipe data as a dict, a Recipe, or a
    list or tuple of them (as :func:`aotbuild.plan`; a str is one path).

    ``pipe``: build one recipe for this pipeline object instead of the recipe's ``model.id`` (a model
    you changed in code: another config, other weights), so that ``load_compiled(recipe, pipe=pipe)``
    hits. It is saved (``save_pretrained``) to a temporary folder (``TMPDIR``) that the jobs and their
    proofs load from, each in a fresh process as always, and removed afterwards. Pass it as
    ``from_pretrained`` gave it: the recipe's ``lora`` and ``model.quantization`` are applied by the
    jobs, as for any build.

    ``shard=(I, N)`` builds only shard I of N of the full job list (planner.shard). With ``remote``
    (a URL or a Remote), a job the remote already holds is not built ("on remote"): pushing it again
    would send nothing. ``max_size`` (default: ``AOTBUILD_MAX_SIZE``, then ``[tool.aotbuild] max_size``
    when that pyproject.toml also names the cache) is the cache's size limit: an entry bigger than it
    is not stored, and after the build ``gc`` removes the least recently used entries until the cache
    fits (never one this build needs).

    A job that failed before (its failure record, by this aotbuild version) is "failed" again, with
    the recorded reason, not built, until ``retry_failed=True``. A job whose target or device is not
    on this host is "skipped"; one whose model cannot be read or fetched is "failed"
    (``BuildReport.bad_input`` holds those whose model folder or files are at fault)."""
    constants.check_stack()  # an older torch than supported: one line (issue 54)
    if isinstance(remote, str):
        from aotbuild.remote.schemes import as_remote
        remote = as_remote(remote)
    if pipe is not None:
        return _build_for_pipe(recipes, pipe, cache, progress=progress, shard=shard, remote=remote,
                               max_size=max_size, sign_key=sign_key, retry_failed=retry_failed)
    loaded = resolve_recipes(recipes, "build")
    store, limit, own = _open_store(cache, remote, sign_key, max_size)
    # signatures=False: a builder makes entries; whom serving trusts is not its say
    for recipe in loaded:  # a build keeps its built-in models in the cache, where its plan then reads them
        models.store_builtin(recipe, store.root)
    jobs = plan(loaded, cache=store.root, signatures=False)
    _warn_slow_formats(loaded)
    everything, sharded = jobs, None
    if shard is not None:
        jobs = shard_jobs(everything, *shard)
        sharded = shard_summary(shard, len(jobs), everything)
    recheck_hits(jobs, store, own)
    # The one rule for failures: a job (a tensor-parallel job: any of its ranks) that failed before is
    # not built again until retry_failed; its result keeps the build failed (exit 1), never "skipped".
    known = {} if retry_failed else {j.group: j.reason for j in jobs if j.status == JobStatus.FAILED_BEFORE}
    whole_groups(jobs, known)
    # What the --push remote holds, as the planner decides it for plan --remote (whole rank groups; with a
    # signing key, a remote entry this key did not sign is absent: the build builds and signs its own).
    on_remote = {j.key for j in mark_remote(jobs, remote, trusted=own or None)
                 if j.status == JobStatus.REMOTE} if remote is not None else set()
    results = _settled(store, jobs, known, on_remote, remote.url if remote is not None else "")
    todo = [j for i, j in enumerate(jobs) if i not in results]
    loads = SharedLoads(store, todo)
    try:
        report = _run_jobs(store, jobs, todo, results, loads, progress, limit, sign_key, retry_failed)
    finally:
        loads.close()
    report.loads = loads.counts
    report.shard = sharded
    _fit(store, report, limit)
    return report


def _open_store(cache: str | Path | None, remote: Remote | None, sign_key: str | Path | None,
                max_size: int | None) -> tuple[Store, int | None, dict[str, bytes]]:
    """The build's store (what a killed build left in it reclaimed; the remote's failure records
    joined to its own), its size limit and the public half of the signing key."""
    root, origin = cache_root_origin(cache)
    store = checked_store(root)
    from aotbuild.cache.journal import reclaim_dead

    reclaim_dead(store)  # what a build killed with -9 left in tmp/: verify is clean after this one
    if remote is not None:  # the remote's failure records join this cache's: one rule for every shard (issue 35)
        from aotbuild.remote.sync import pull_failures

        pull_failures(remote, store)
    own: dict[str, bytes] = {}
    if sign_key is not None:  # a bad key fails now, not after an hour of compiling
        from aotbuild.cache.signing import public_of

        own = public_of(sign_key)
    # pyproject.toml's max_size applies only to the cache it names itself (a pull request writes it).
    limit = max_size if max_size is not None else resolve_max_size(project=origin == FROM_PROJECT)
    return store, limit, own


def _settled(store: Store, jobs: list[Job], known: dict[str | None, str], on_remote: set[str | None],
             remote_url: str) -> dict[int, JobResult]:
    """The results of the jobs nothing is built for: cached, not buildable here, on the remote, or
    failed before (``known``)."""
    results: dict[int, JobResult] = {}
    for i, job in enumerate(jobs):
        if job.status == JobStatus.HIT:
            assert job.key is not None
            store.touch(job.key)
            results[i] = JobResult(job, ResultStatus.CACHED, size=_entry_size(store, job.key))
        elif job.status == JobStatus.UNAVAILABLE:  # skipped only when another host can build it
            status = ResultStatus.SKIPPED if job.cause is Unavailable.TARGET else ResultStatus.FAILED
            results[i] = JobResult(job, status, reason=job.reason)
        elif job.key in on_remote:
            results[i] = JobResult(job, ResultStatus.ON_REMOTE, reason=f"already on {remote_url}")
        elif job.group in known:
            results[i] = JobResult(job, ResultStatus.FAILED, not_retried=True,
                                   reason=f"{_first_line(known[job.group])}; {advice.retry_failed()}")
    return results


def _fit(store: Store, report: BuildReport, limit: int | None) -> None:
    """Over its size limit after building, the cache drops its least recently used entries (never one
    of this build's jobs)."""
    if limit is None or not any(r.status == ResultStatus.BUILT for r in report.results):
        return
    from aotbuild.cache.manage import gc, store_size

    if store_size(store) > limit:
        needed = frozenset(r.job.key for r in report.results if r.job.key)
        try:
            report.gc = gc(store, max_size=limit, keep=needed)
        except StoreError as exc:  # the entries are stored; only the clean-up could not run
            report.note = f"the cache is over its size limit and gc could not run: {exc}"


def _run_jobs(store: Store, jobs: list[Job], todo: list[Job], results: dict[int, JobResult], loads: SharedLoads,
              progress: Progress | None, limit: int | None, sign_key: str | Path | None,
              retry_failed: bool = False) -> BuildReport:
    """Every job not yet in ``results``, in order: built once per key, all ranks of a job (one, or a
    tensor-parallel job's N) in one launch, an auto job with every shape of its component."""
    done_keys: dict[str, JobResult] = {}
    ready: dict[str, JobResult] = {}  # results of jobs built with an earlier one (its ranks, its shapes)
    for n, (i, job) in enumerate((i, j) for i, j in enumerate(jobs) if i not in results):
        assert job.key is not None
        if progress and job.key not in ready:  # a job built with an earlier one just ends
            progress("start", n + 1, len(todo), job, None)
        if job.key not in ready and job.key in done_keys:  # two recipes with the same job: build once
            prior = done_keys[job.key]
            ready[job.key] = JobResult(job, prior.status if prior.status != ResultStatus.BUILT
                                       else ResultStatus.CACHED, size=prior.size, reason=prior.reason)
        elif job.key not in ready:
            tick = _ticker(progress, n + 1, len(todo), job) if progress else None
            if job.choice is not None:  # strategy: auto, every shape (and rank) of its component at once
                shapes = _component_shapes(jobs, results, todo, job)
                _build_component(store, shapes, tick, limit, sign_key, loads, retry_failed)
                _file_component(shapes, results, done_keys, ready)
            else:
                group = _ranks_of(todo, job)
                built = _locked(store, group, tick, retry_failed,
                                lambda group=group, tick=tick: _build_group(store, group, tick, limit, sign_key, loads))
                for sibling, sibling_result in zip(group, built, strict=True):
                    _remember(store, sibling, sibling_result)
                    done_keys[sibling.key] = ready[sibling.key] = sibling_result  # type: ignore[index]
        results[i] = ready.pop(job.key)
        if progress:
            progress("end", n + 1, len(todo), job, results[i])
    return BuildReport(str(store.root), [results[i] for i in range(len(jobs))])


def _ranks_of(todo: list[Job], job: Job) -> list[Job]:
    """Every rank of ``job`` (itself alone, unsharded) in rank order, each once."""
    ranks: dict[str | None, Job] = {}
    for other in todo:
        if other.group == job.group:
            ranks.setdefault(other.key, other)
    return sorted(ranks.values(), key=lambda j: j.rank or 0)


def _build_for_pipe(recipes: Recipes, pipe: Any, cache: str | Path | None, **options: Any) -> BuildReport:
    """``build(recipe, pipe=pipe)``: the pipeline saved where the jobs load it, for the build only."""
    import logging
    import shutil

    from aotbuild.errors import UsageError

    loaded = resolve_recipes(recipes, "build")
    if len(loaded) != 1:
        raise UsageError(f"build(..., pipe=pipe) builds one recipe for that pipeline; got {len(loaded)} recipes")
    if not hasattr(pipe, "save_pretrained"):
        raise UsageError(f"pipe= takes a diffusers pipeline (it is saved with save_pretrained); got "
                         f"{type(pipe).__name__}")
    recipe = _with_pipe_changes(loaded[0], pipe)
    folder = Path(tempfile.mkdtemp(prefix="aotbuild-pipe-"))
    try:
        logging.getLogger("aotbuild").info("saving the pipeline for the build's jobs in %s", folder)
        pipe.save_pretrained(str(folder))
        return build([replace(recipe, pipeline_folder=str(folder))], cache=cache, **options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _with_pipe_changes(recipe: Recipe, pipe: Any) -> Recipe:
    """The recipe with the pipe's changes that ``save_pretrained`` drops (FreeU's factors, an attention
    processor, a cache hook, a memory format: aotbuild/pipeline/changes.py) declared, so the jobs re-apply them
    and ``load_compiled(recipe, pipe=pipe)`` keys the same; UsageError for a change no other process can
    re-create (a processor class of the caller's script), or one that contradicts the recipe's own."""
    import logging

    from aotbuild.errors import UsageError
    from aotbuild.features.registry import detect_changes
    from aotbuild.pipeline import changes

    found = detect_changes(pipe, recipe)
    if found.refused:
        raise UsageError(f"build(recipe, pipe=pipe) cannot build for this pipeline: {found.refused}. The build's "
                         f"jobs load the pipeline saved with save_pretrained in fresh processes and re-apply only the "
                         f"changes a recipe can declare (docs/recipes.md, \"Declared changes\"): undo that change, "
                         f"or load with on_miss=\"eager\"")
    if found.changes is None:
        return recipe
    if recipe.changes is not None:
        if not changes.same_keys(recipe, found.changes):
            raise UsageError(f"the pipeline's changes ({changes.as_recipe_text(found.changes)}) are not the ones "
                             f"{recipe.source} declares ({changes.as_recipe_text(recipe.changes)}): make them agree")
        return recipe
    logging.getLogger("aotbuild").info("the build's jobs re-apply the pipeline's %s",
                                       changes.as_recipe_text(found.changes))
    return replace(recipe, changes=found.changes)


def _locked(store: Store, jobs: list[Job], tick: Tick | None, retry_failed: bool,
            run: Callable[[], list[JobResult]], *, failures: bool = True) -> list[JobResult]:
    """``run()`` (the build of ``jobs``, one job's ranks) under the job's build lock: a second builder
    of the same job (another CI shard, another terminal) waits for the first, showing that it waits,
    then finds the entries cached, or (with ``failures``, unless ``retry_failed``) the first's
    failure, which it does not retry."""
    first = jobs[0]
    assert first.group is not None
    lock = store.layout.build_lock(first.group)
    started = time.perf_counter()
    try:
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(flocked(lock, exclusive=True, timeout=0))
            except StoreError:
                if tick:
                    tick(0.0, "waiting: another aotbuild process is building this job")
                held.enter_context(flocked(lock, exclusive=True, timeout=float("inf")))
                entries = [store.open_entry(j.key)[0] for j in jobs if j.key]
                if len(entries) == len(jobs) and all(e is not None for e in entries):
                    for j in jobs:
                        store.touch(str(j.key))
                    return [JobResult(j, ResultStatus.CACHED, time.perf_counter() - started, size=e.manifest.size,
                                      reason="built meanwhile by another aotbuild process")
                            for j, e in zip(jobs, entries, strict=True) if e is not None]
                failed = "" if retry_failed or not failures else _failed_meanwhile(store, first.group)
                if failed:
                    return [JobResult(j, ResultStatus.FAILED, time.perf_counter() - started, reason=failed,
                                      not_retried=True) for j in jobs]
            return run()
    except StoreError as exc:  # the lock file cannot be created: a read-only store
        return [JobResult(j, ResultStatus.FAILED, 0.0, reason=f"cannot build into {store.root}: {exc}") for j in jobs]


@dataclass
class _Shape:
    """One shape of an auto component (every rank of it) while :func:`_build_component` runs."""

    jobs: list[Job]
    #: a hit's indices in the build's results (rebuilt only if its component falls back); [] for a miss
    indices: list[int] = field(default_factory=list)
    #: the strategy its stored entry holds ("" while none)
    held: str = ""
    attempts: list[auto.Attempt] = field(default_factory=list)
    #: its latest results (one per rank); [] while nothing ran
    results: list[JobResult] = field(default_factory=list)
    seconds: float = 0.0
    #: whether the build's loader still counts a worker for it (a miss's first; SharedLoads.again)
    counted: bool = True
    #: the component's pipeline did not load (on this shape or another): nothing was tried on it, nor recorded
    unloaded: bool = False

    @property
    def label(self) -> str:
        return str(self.jobs[0].shape)


def _component_shapes(jobs: list[Job], results: dict[int, JobResult], todo: list[Job], job: Job) -> list[_Shape]:
    """Every shape of ``job``'s component (same recipe, same component) that auto builds now: the
    misses of ``todo``, and the hits, which are rebuilt only if the component falls back from their
    strategy. A shape that failed before with every strategy, or is on the remote, is not one of them."""
    def mine(other: Job) -> bool:
        return other.choice is not None and other.ctx is job.ctx and other.component == job.component

    shapes: dict[str | None, _Shape] = {}
    for other in todo:
        if mine(other):
            shapes.setdefault(other.group, _Shape([])).jobs.append(other)
    for i, other in enumerate(jobs):
        if mine(other) and other.status == JobStatus.HIT and other.chosen and results.get(i) is not None \
                and results[i].status == ResultStatus.CACHED:
            shape = shapes.setdefault(other.group, _Shape([], held=other.chosen, counted=False))
            shape.jobs.append(other)
            shape.indices.append(i)
    for shape in shapes.values():  # a rank's result goes back to its own index
        order = sorted(range(len(shape.jobs)), key=lambda k: shape.jobs[k].rank or 0)
        shape.jobs = [shape.jobs[k] for k in order]
        shape.indices = [shape.indices[k] for k in order] if shape.indices else []
    return list(shapes.values())


def _build_component(store: Store, shapes: list[_Shape], tick: Tick | None, limit: int | None,
                     sign_key: str | Path | None, loads: SharedLoads, retry_failed: bool) -> None:
    """Auto for one component: one strategy for all its shapes, since one strategy serves a component
    (its dispatcher is that strategy's: aotbuild/runtime.py misses a shape built with another). The
    strategies are tried in auto's order, starting from the one its stored shapes hold (the fastest
    among them; with ``retry_failed``, the first), each on every shape (the one that failed the last
    strategy first); when a shape fails with a strategy, the component falls back as a whole to the
    next one, its shapes built with the dropped strategy included. A strategy that failed before for
    one shape (its failure record) is skipped for the whole component until ``retry_failed``. Fills
    each shape's ``results``; a shape no strategy left to try builds keeps the entry it has (its
    attempts say so) and the build is red."""
    first = shapes[0].jobs[0]
    assert first.choice is not None
    tries = first.choice.tries
    if not tries:
        for shape in shapes:
            shape.results = _attempts(store, shape.jobs, tick, limit, sign_key, loads, retry_failed)
        return
    # --retry-failed tries every strategy again (a stored shape is built again if a faster one serves all)
    held = [tries.index(s.held) for s in shapes if s.held in tries and not retry_failed]
    last_failed: _Shape | None = None
    for strategy in tries[min(held, default=0):]:
        blocked = None if retry_failed else _failed_with(store, shapes, strategy)
        if blocked is not None:
            culprit, why, key = blocked
            for shape in shapes:
                shape.attempts.append(
                    auto.Attempt(strategy, auto.Outcome.FAILED_BEFORE, why, key=key) if shape is culprit
                    else auto.Attempt(strategy, auto.Outcome.DROPPED, f"it failed before at {culprit.label}: "
                                                                      f"{ONE_STRATEGY}"))
            last_failed = culprit
            continue
        failed = _try_on_shapes(store, shapes, strategy, last_failed, tick, limit, sign_key, loads, retry_failed)
        if failed is None:
            break
        if any(r.eager_call_failed or r.load_failed for r in failed.results):
            reason = failed.attempts[-1].reason if failed.attempts else failed.results[0].reason
            loading = any(r.load_failed for r in failed.results)
            rest = _not_tried(store, failed.jobs, tries[tries.index(strategy) + 1:], strategy, reason,
                              loading=loading)
            for shape in shapes:
                shape.attempts += rest
                shape.unloaded = loading
            break
        last_failed = failed
        dropped = f"{failed.label} failed with it: {ONE_STRATEGY}"
        for shape in shapes:  # built with the strategy another shape failed with: built again with the next
            if shape is failed or shape.held != strategy:
                continue
            if shape.attempts and shape.attempts[-1].strategy == strategy:
                shape.attempts[-1] = replace(shape.attempts[-1], outcome=auto.Outcome.DROPPED, reason=dropped)
            else:  # a hit of an earlier build
                shape.attempts.append(auto.Attempt(strategy, auto.Outcome.DROPPED, dropped))
    _component_results(shapes)


def _try_on_shapes(store: Store, shapes: list[_Shape], strategy: str, last_failed: _Shape | None,
                   tick: Tick | None, limit: int | None, sign_key: str | Path | None, loads: SharedLoads,
                   retry_failed: bool) -> _Shape | None:
    """``strategy`` on each shape of a component that does not hold it yet (the one that failed the
    last strategy first), each under its own build lock (a second builder of it waits, then finds the
    entry cached or tries the strategy itself); the first shape that fails with it, or None."""
    for shape in sorted(shapes, key=lambda s: s is not last_failed):
        if shape.held == strategy:
            continue
        if not shape.counted:
            loads.again(shape.jobs[0])
        shape.counted = False
        built = _locked(store, shape.jobs, tick, retry_failed, lambda shape=shape: _attempts(
            store, shape.jobs, tick, limit, sign_key, loads, retry_failed, tries=(strategy,), before=shape.attempts),
            failures=False)
        shape.results = built
        shape.seconds += max(r.seconds for r in built)
        shape.attempts = list(built[0].attempts) or shape.attempts
        if all(r.status in (ResultStatus.BUILT, ResultStatus.UNCACHED) for r in built):
            shape.held = strategy
        elif all(r.status == ResultStatus.CACHED for r in built):  # built meanwhile by another aotbuild process
            manifest = store.read_manifest(str(shape.jobs[0].key))
            shape.held = auto.held_by(manifest) if manifest is not None else strategy
        else:
            return shape
    return None


def _file_component(shapes: list[_Shape], results: dict[int, JobResult], done_keys: dict[str, JobResult],
                    ready: dict[str, JobResult]) -> None:
    """An auto component's results where the build's loop finds them: a rebuilt hit's at its index,
    a miss's by its key (the loop takes it when it reaches the job)."""
    for shape in (s for s in shapes if s.results):  # a hit not rebuilt has none: it stays cached
        for k, (sibling, sibling_result) in enumerate(zip(shape.jobs, shape.results, strict=True)):
            if shape.indices:  # a hit rebuilt with the strategy its component fell back to
                results[shape.indices[k]] = sibling_result
            else:
                done_keys[sibling.key] = ready[sibling.key] = sibling_result  # type: ignore[index]


#: Why auto drops a strategy one shape of a component failed with (aotbuild/runtime.py serves a
#: component with the strategy of its entries: a shape built with another misses).
ONE_STRATEGY = "one strategy serves every shape of a component"


def _failed_with(store: Store, shapes: list[_Shape], strategy: str) -> tuple[_Shape, str, str] | None:
    """The first shape whose concrete job with ``strategy`` failed before (this aotbuild version's
    record), the first line of why and that job's key; None if none did."""
    for shape in shapes:
        lead = planner.concrete_group(shape.jobs, strategy)[0]
        record = store.failure(lead.group) if lead.group else None
        if record is not None and record.get("aotbuild") == constants.VERSION:
            return shape, _first_line(str(record.get("reason", ""))), str(lead.group)
    return None


def _component_results(shapes: list[_Shape]) -> None:
    """Each shape's final results: its latest build's, with every attempt of the component's loop; a
    hit untouched stays as it was (no results); a shape no strategy was tried on fails with why."""
    for shape in shapes:
        if not shape.results:
            if shape.indices:  # a hit its component never had to rebuild
                continue
            # failed before, or dropped for it: --retry-failed tries again; not after a load failure (nothing recorded)
            known = not shape.unloaded and all(a.outcome in (auto.Outcome.FAILED_BEFORE, auto.Outcome.DROPPED)
                                               for a in shape.attempts)
            reason = f"auto: no strategy built and passed the proof: {auto.attempts_text(shape.attempts)}"
            said = f"{reason}; {advice.retry_failed()}" if known else reason
            shape.results = [JobResult(j, ResultStatus.FAILED, reason=said, not_retried=known,
                                       attempts=list(shape.attempts), load_failed=shape.unloaded) for j in shape.jobs]
            continue
        note = f"auto: {auto.attempts_text(shape.attempts)}"
        failed = f"auto: no strategy built and passed the proof: {auto.attempts_text(shape.attempts)}"
        shape.results = [replace(r, seconds=shape.seconds, attempts=list(shape.attempts),
                                 reason=note if r.status == ResultStatus.BUILT else
                                 failed if r.eager_call_failed or r.load_failed else r.reason) for r in shape.results]


def _attempts(store: Store, jobs: list[Job], tick: Tick | None, limit: int | None, sign_key: str | Path | None,
              loads: SharedLoads, retry_failed: bool, *, tries: tuple[str, ...] | None = None,
              before: list[auto.Attempt] | None = None) -> list[JobResult]:
    """The strategies auto tries for ``jobs`` (one job's ranks), in order, until one builds and passes
    the proof; that entry is stored under the auto key. A strategy that failed before for this job
    (its concrete key's failure record, this aotbuild version's) is skipped until ``retry_failed``; a
    failing attempt is recorded under its concrete key. Never a change of scope or fullgraph.
    ``tries``: only these (:func:`_build_component` tries one strategy at a time on each shape of a
    component), after the attempts ``before``."""
    first = jobs[0]
    assert first.choice is not None
    started = time.perf_counter()
    attempts: list[auto.Attempt] = list(before or ())
    if not first.choice.tries:
        return [JobResult(j, ResultStatus.FAILED,
                          reason=f"auto: no strategy can serve this recipe here; {first.choice.text()}")
                for j in jobs]
    ran = eager_failed = load_failed = False
    for strategy in first.choice.tries if tries is None else tries:
        group = planner.concrete_group(jobs, strategy)
        lead = group[0]
        assert lead.group is not None
        record = None if retry_failed else store.failure(lead.group)
        if record is not None and record.get("aotbuild") == constants.VERSION:
            attempts.append(auto.Attempt(strategy, auto.Outcome.FAILED_BEFORE,
                                         _first_line(str(record.get("reason", ""))), key=lead.group))
            continue
        adopted = _adopt(store, jobs, group, attempts, sign_key, strategy)
        if adopted:
            return adopted
        if ran:
            loads.again(first)
        ran = True
        if tick:
            tick(time.perf_counter() - started, f"auto: trying {strategy}")
        results = _build_group(store, group, tick, limit, sign_key, loads,
                               [Chosen(j, list(attempts), strategy) for j in jobs])
        seconds = max(r.seconds for r in results)  # the attempt's own (its ranks ran side by side)
        # built and proven (stored, or not storable)
        if all(r.status in (ResultStatus.BUILT, ResultStatus.UNCACHED) for r in results):
            store.remove_failure(lead.group)
            attempts.append(auto.Attempt(strategy, auto.Outcome.BUILT, seconds=seconds, key=lead.group))
            note = f"auto: {auto.attempts_text(attempts)}"
            return [replace(r, job=j, seconds=time.perf_counter() - started, attempts=list(attempts),
                            reason=r.reason or note) for j, r in zip(jobs, results, strict=True)]
        reason = next(r.reason for r in results if r.status != ResultStatus.BUILT)
        for job, result in zip(group, results, strict=True):
            if result.status == ResultStatus.FAILED:
                _remember(store, job, result)
        attempts.append(auto.Attempt(strategy, auto.Outcome.FAILED, _first_line(reason), seconds, key=lead.group))
        if any(r.eager_call_failed or r.load_failed for r in results):
            eager_failed = any(r.eager_call_failed for r in results)
            load_failed = not eager_failed
            rest = list(first.choice.tries if tries is None else tries)
            attempts += _not_tried(store, jobs, rest[rest.index(strategy) + 1:], strategy, attempts[-1].reason,
                                   loading=load_failed)
            break
    known = all(a.outcome == auto.Outcome.FAILED_BEFORE for a in attempts)
    reason = f"auto: no strategy built and passed the proof: {auto.attempts_text(attempts)}"
    return [JobResult(j, ResultStatus.FAILED, time.perf_counter() - started,
                      reason=f"{reason}; {advice.retry_failed()}" if known else reason,
                      not_retried=known, attempts=list(attempts), eager_call_failed=eager_failed,
                      load_failed=load_failed) for j in jobs]


def _not_tried(store: Store, jobs: list[Job], strategies: Sequence[str], failed: str,
               reason: str, *, loading: bool = False) -> list[auto.Attempt]:
    """Auto's strategies after ``failed`` when the pipeline's own eager call failed there (no aotbuild code
    below it): each would run that call, so none is tried (each dropped, saying why), and each concrete
    job of ``jobs`` gets a failure record with ``reason`` (``failed``'s): the next build skips them all, as
    it skips ``failed``, until ``--retry-failed`` or a change of a key factor. ``loading``: the pipeline
    did not load there; each would load it the same way, so none is tried, and none gets a record (a
    missing library, a download, memory: the next build loads again)."""
    if loading:
        why = f"not tried: the pipeline did not load (at {failed}, before any compile); every strategy loads it alike"
        return [auto.Attempt(s, auto.Outcome.DROPPED, why) for s in strategies]
    why = (f"not tried: the pipeline's own call failed with {failed}, eagerly, before any compile, as it "
           f"would with any strategy")
    for strategy in strategies:
        for job in planner.concrete_group(jobs, strategy):
            if job.key is not None:
                _remember(store, job, JobResult(job, ResultStatus.FAILED, reason=f"{why}: {reason}"))
    return [auto.Attempt(s, auto.Outcome.DROPPED, why) for s in strategies]


def _adopt(store: Store, jobs: list[Job], group: list[Job], attempts: list[auto.Attempt],
           sign_key: str | Path | None, tried: str) -> list[JobResult]:
    """When the store holds, intact, the entry of this attempt's concrete jobs (the recipe naming the
    strategy: built and proven by an explicit recipe with the same key), the auto jobs take it: their
    manifests name its blobs and proof (nothing compiled, no blob written); else []."""
    entries = [store.open_entry(j.key)[0] for j in group if j.key]
    if len(entries) != len(group) or any(e is None for e in entries):
        return []
    # An explicit freezing recipe's proof is not timed: auto takes its entry only where a proof showed it
    # serving faster than eager (the rule its own prepacked attempt is held to).
    if _prepacked(group[0]) and not all(_proven_faster(e.manifest) for e in entries if e is not None):
        return []
    if sign_key is not None:  # a signed build signs only what it built or what its key signed already
        from aotbuild.cache.signing import public_of

        mine = public_of(sign_key)
        if any(not_signed_by(e.manifest, mine) for e in entries if e is not None):
            return []
    started = time.perf_counter()
    results = []
    for job, attempt_job, entry in zip(jobs, group, entries, strict=True):
        assert entry is not None and job.key is not None and job.factors is not None
        built = entry.manifest
        taken = [*attempts, auto.Attempt(tried, auto.Outcome.BUILT, "its entry was in the cache "
                                         f"(key {attempt_job.key[:12] if attempt_job.key else '-'}): taken as it is",
                                         key=attempt_job.key or "")]
        own = {k: (attempt_job.factors or {})["compile"].get(k) for k in auto.strategy_factors(attempt_job.ctx)}
        manifest = replace(built, key=job.key, recipe=job.recipe.name, factors=job.factors, signed_by=(), pack=None,
                           recipe_data=recipe_to_dict(job.recipe),
                           auto={"attempts": [a.as_json() for a in taken], "factors": own})
        try:
            with entry_writer(store) as writer, store_lock(store.root, exclusive=False):
                if sign_key is not None:
                    from aotbuild.cache.signing import sign

                    manifest = sign(manifest, sign_key)
                writer.put_manifest(manifest)
        except (OSError, StoreError) as exc:
            results.append(JobResult(job, ResultStatus.UNCACHED, time.perf_counter() - started,
                                     reason=f"not stored: {exc}"))
            continue
        results.append(JobResult(job, ResultStatus.BUILT, time.perf_counter() - started, size=manifest.size,
                                 attempts=taken,
                                 reason=f"auto: {auto.attempts_text(taken)}"))
    return results


def _failed_meanwhile(store: Store, key: str) -> str:
    """After waiting for another builder of job ``key``: its failure, as a reason, if it recorded one
    (this aotbuild version's), else ""."""
    record = store.failure(key)
    if record is None or record.get("aotbuild") != constants.VERSION:
        return ""
    return f"failed meanwhile in another aotbuild process: {_first_line(record['reason'])}; {advice.retry_failed()}"


def _build_group(store: Store, jobs: list[Job], tick: Tick | None, limit: int | None,
                 sign_key: str | Path | None, loads: SharedLoads,
                 chosen: list[Chosen] | None = None) -> list[JobResult]:
    """One job, any number of ranks (one; a tensor-parallel job's N): compiled by one launch of a
    worker per rank, which share one compiler cache folder; each rank's entry laid out in its own
    folder; all proven by a fresh launch of as many ranks; then stored (nothing of any rank unless
    every rank passed). With ``chosen`` (one per rank), ``jobs`` are an auto job's attempt."""
    first = jobs[0]
    assert first.group is not None
    started = time.perf_counter()
    log_path = store.layout.job_log(first.group)

    def failed(reason: str, seconds: float, eager: bool = False, load: bool = False) -> list[JobResult]:
        return [JobResult(j, ResultStatus.FAILED, seconds, reason=reason, eager_call_failed=eager, load_failed=load)
                for j in jobs]

    try:
        store.layout.tmp.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f"job-{first.group[:12]}.", dir=store.layout.tmp))
    except OSError as exc:  # a full disk or a read-only store: this job cannot even start
        return failed(f"cannot create the job's folder in {store.layout.tmp}: {exc}", 0.0)
    try:
        # Held while the job runs: `aotbuild verify` leaves a staging folder alone while it is locked.
        with flocked(staging / ".lock", exclusive=True, timeout=0):
            code, outcome = _compile(store, jobs, staging, tick, started, loads)
            seconds = time.perf_counter() - started
            if code != 0 or "error" in outcome:
                _keep_log(staging / "worker.log", log_path)
                return failed(f"{_one_line(outcome['error'])} (log: {log_path})", seconds,
                              eager=outcome.get("eager_call_failed") is True, load=outcome.get("load_failed") is True)
            results = child.per_rank(outcome, len(jobs))
            per_rank = _collect(jobs, staging)
            if not per_rank:
                return failed("the job compiled nothing: no artifact to store", seconds)
            (staging / "phase").write_text(f"proving: {len(jobs)} fresh process(es) serve the entry")
            loads.counts["proof"] += len(jobs)
            t_proof = time.perf_counter()
            try:
                proofs = _prove(jobs, per_rank, results, seconds, staging, store.root, tick, started,
                                faster_than_eager=chosen is not None and _prepacked(first))
            except ProofFailed as exc:
                _keep_log(staging / "proof" / "proof.log", log_path)
                return failed(f"{_one_line(str(exc))} (log: {log_path})", time.perf_counter() - started)
            for result in results:
                result.setdefault("seconds", {})["proof"] = round(time.perf_counter() - t_proof, 3)
            seconds = time.perf_counter() - started
            return [store_job(store, job, files, result, seconds, limit, proof, sign_key, chosen[k] if chosen else None)
                    for k, (job, files, result, proof) in enumerate(zip(jobs, per_rank, results, proofs, strict=True))]
    except (OSError, StoreError) as exc:
        return failed(f"cannot run the job: {exc}", time.perf_counter() - started)
    finally:
        store.clean_staging(staging)


def _compile(store: Store, jobs: list[Job], staging: Path, tick: Tick | None, started: float,
             loads: SharedLoads) -> tuple[int, dict[str, Any]]:
    """The job's workers, one per rank in one launch (or a child forked from its recipe's loader,
    where loads are shared): every rank's compiler writes the one folder ``staging/shared`` (a kernel
    the ranks share compiles once), each rank's strategy its artifacts to ``staging/rank<r>``."""
    first = jobs[0]
    assert first.ctx is not None
    (staging / "cwd").mkdir()
    spec = {"recipe": recipe_spec(first.recipe), "component": first.component,
            "shape": first.shape.as_dict(), "cache_root": str(store.root), "key": first.group,
            "ranks": [{"key": j.key, "factors": j.factors} for j in jobs], "workdir": str(staging)}
    # What a compiler's debug options write (torch_compile_debug/, with real tensors) goes to the
    # job's folder, removed with it, never into the cwd (a pull request's checkout).
    env = {**first.ctx.target.capture_env(staging / "shared"), "TORCH_COMPILE_DEBUG_DIR": str(staging / "debug")}
    try:
        return loads.worker(jobs)("aotbuild.builder.worker", spec, staging / "job.json", staging / "worker.log",
                                  env=env, phase_file=staging / "phase", tick=tick, started=started, name="worker",
                                  timeout=constants.limit("job_seconds"), ranks=len(jobs), cwd=staging / "cwd")
    finally:
        loads.done(first)  # after its recipe's last job, the loader's copy is freed before the proof


def _collect(jobs: list[Job], staging: Path) -> list[list[tuple[str, Path]]]:
    """Each rank's files, as its strategy collects them from its folder once the shared compiler
    folder's files are laid there beside its own artifacts (both ranks' graphs: identical files are
    one blob); [] when a rank has nothing to store."""
    first = jobs[0]
    assert first.ctx is not None
    target, strategy = first.ctx.target, first.ctx.strategy
    shared = staging / "shared"
    compiled = [(path.relative_to(shared).as_posix(), path) for _, path in target.collect(shared)]
    per_rank = []
    for job in jobs:
        folder = staging / f"rank{job.rank or 0}"
        lay_tree(compiled, folder)
        files = strategy.collect(target, folder)
        if not files:
            return []
        per_rank.append(files)
    return per_rank


def _prove(jobs: list[Job], files: list[list[tuple[str, Path]]], results: list[dict[str, Any]], seconds: float,
           staging: Path, cache_root: Path, tick: Tick | None, started: float,
           faster_than_eager: bool = False) -> list[Proof]:
    """Every rank's entry served from a throwaway store by a fresh launch of as many ranks
    (aotbuild/builder/proof.py): each loads its own, compiles nothing and matches the (unsharded) eager
    output; with ``faster_than_eager`` (an auto attempt with prepacked weights) its served call must
    also beat eager's. Raises ProofFailed."""
    from aotbuild.builder.proof import verdict

    first = jobs[0]
    assert first.ctx is not None
    folder = staging / "proof"
    (folder / "cwd").mkdir(parents=True)
    trial = Store(folder / "store")
    for job, rank_files, result in zip(jobs, files, results, strict=True):
        records = [FileRecord(rel, *trial.put_blob(path)) for rel, path in rank_files]
        trial.put_manifest(make_manifest(job, records, result, seconds))
    spec = {"recipe": recipe_spec(first.recipe), "component": first.component,
            "shape": first.shape.as_dict(), "cache_root": str(cache_root), "store": str(trial.root),
            **({"faster_than_eager": True} if faster_than_eager else {})}
    # Every compiler cache empty, no aotbuild cache from the environment, another directory: the
    # process can only use what the entry holds.
    env = {**first.ctx.target.capture_env(folder / "caches"), constants.ENV_CACHE: None,
           constants.ENV_TRUSTED_KEYS: None,  # the proof serves the staged entry it just built, unsigned
           "TORCH_COMPILE_DEBUG_DIR": str(folder / "debug")}
    _, outcome = child.spawn("aotbuild.builder.proof", spec, folder / "proof.json", folder / "proof.log", env=env,
                             cwd=folder / "cwd", phase_file=staging / "phase", tick=tick, started=started,
                             timeout=constants.limit("job_seconds"), ranks=len(jobs))
    if "error" in outcome:
        return [verdict(outcome, first.label)]  # raises
    return [verdict(result, job.label) for job, result in zip(jobs, child.per_rank(outcome, len(jobs)), strict=True)]


def _remember(store: Store, job: Job, result: JobResult) -> None:
    """A failed job leaves a small record (``<cache>/failures/<key>.json``) so ``plan`` says it failed
    (and keeps it out of estimates); a job that then builds clears it."""
    assert job.key is not None
    if result.status == ResultStatus.BUILT:
        store.remove_failure(job.key)
    elif result.status == ResultStatus.FAILED and not result.not_retried and not result.load_failed:
        store.put_failure(job.key, {"key": job.key, "reason": result.reason[:2000], "aotbuild": constants.VERSION,
                                    "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                                    "recipe": job.recipe.name, "component": job.component,
                                    "shape": job.shape.as_dict()})


def _entry_size(store: Store, key: str | None) -> int:
    manifest = store.read_manifest(key) if key else None
    return manifest.size if manifest else 0


def _first_line(reason: str) -> str:
    return reason.partition("\n")[0]


def _one_line(reason: str) -> str:
    reason = " ".join(reason.split())  # one line in the table, whatever the exception said
    return reason[:300] + " ..." if len(reason) > 300 else reason  # the log has it all


def _prepacked(job: Job) -> bool:
    """Whether ``job`` builds with Inductor's freezing (prepacked weights: auto's first try on a CPU)."""
    from aotbuild.strategies.prepack import wanted

    return wanted(dict(job.recipe.compile.options))


def _proven_faster(manifest: Manifest) -> bool:
    """Whether ``manifest``'s proof timed its served call and found it faster than eager's."""
    from aotbuild.builder.proof import faster

    speed = manifest.proof.served.get("speed") if manifest.proof is not None else None
    try:
        return isinstance(speed, dict) and faster(speed)
    except (KeyError, TypeError, ValueError):
        return False


@dataclass
class Chosen:
    """An auto job's entry, built by one attempt (``job``: the concrete job, its recipe naming the
    strategy): stored under the auto job's key and factors, with the attempts before it."""

    job: Job
    attempts: list[auto.Attempt]
    #: the try that builds (auto.PREPACKED or the concrete job's strategy)
    tried: str = ""


def make_manifest(job: Job, records: list[FileRecord], result: dict[str, Any], seconds: float,
                  proof: Proof | None = None, chosen: Chosen | None = None) -> Manifest:
    """``job``'s manifest; with ``chosen`` (``job`` is an attempt of that auto job), stored as the auto
    job: its key and factors, ``strategy`` the one that built, ``auto`` the attempts and what this
    strategy adds to the key (checked at load)."""
    assert job.key is not None and job.factors is not None and job.ctx is not None
    packages = tuple(result.get("packages", ()))
    stored, extra = job, {}
    if chosen is not None:
        stored = chosen.job
        built = auto.Attempt(chosen.tried or job.recipe.strategy, auto.Outcome.BUILT, seconds=seconds, key=job.key)
        own = {k: job.factors["compile"].get(k) for k in auto.strategy_factors(job.ctx)}
        extra = {"auto": {"attempts": [a.as_json() for a in (*chosen.attempts, built)], "factors": own}}
    assert stored.key is not None and stored.factors is not None
    return Manifest(
        format=stored.factors["format"], key=stored.key, recipe=stored.recipe.name, component=job.component,
        shape=job.shape.as_dict(), target=job.recipe.target, strategy=job.recipe.strategy, **extra,
        factors=stored.factors, files=tuple(records), signatures=tuple(result["signatures"]),
        embeds_weights=job.ctx.strategy.embeds_weights(packages),
        packages=packages,
        build={"created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "seconds": round(seconds, 3), "aotbuild": constants.VERSION,
               "phases": result.get("seconds"), "counters": result.get("counters"),
               **({"loaded_by": result["loaded_by"]} if result.get("loaded_by") else {}),
               **(result.get("facts") or {}),  # the target's build_facts: e.g. the vector ISA Inductor picked
               **({"text": result["text"]} if result.get("text") else {}),  # what follows the prompt (textlen)
               # the timestep dtypes and ranks proven alike (aotbuild/pipeline/timesteps.py; issue 56)
               **({"timestep": result["timestep"]} if result.get("timestep") else {})},
        recipe_data=recipe_to_dict(stored.recipe),
        structure=result.get("structure"),
        proof=proof,
    )


def store_job(store: Store, job: Job, files: list[tuple[str, Path]], result: dict[str, Any], seconds: float,
              limit: int | None = None, proof: Proof | None = None, sign_key: str | Path | None = None,
              chosen: Chosen | None = None) -> JobResult:
    """Blobs, then the manifest, under the shared store lock. A failure to write (no space left, a
    read-only store, a lock timeout) loses the cache entry, not the build: status "uncached"."""
    assert job.key is not None and job.factors is not None
    size = sum(path.stat().st_size for _, path in files)
    if limit is not None and size > limit:
        return JobResult(job, ResultStatus.FAILED, seconds, size=size,
                         reason=f"the entry is {format_size(size)}, bigger than the cache's size limit "
                                f"{format_size(limit)}: nothing stored (raise max_size, docs/cache.md)")
    try:
        # Journaled: a failure halfway (no space left) removes the blobs it wrote (cache/journal.py).
        with entry_writer(store) as writer, store_lock(store.root, exclusive=False):
            records = []
            for rel, path in files:
                digest, blob_size = writer.put_blob(path)
                records.append(FileRecord(rel, digest, blob_size))
            manifest = make_manifest(job, records, result, seconds, proof, chosen)
            if sign_key is not None:
                from aotbuild.cache.signing import sign

                manifest = sign(manifest, sign_key)
            writer.put_manifest(manifest)
    except OSError as exc:  # put_blob/put_manifest removed their temp files, the writer its blobs
        return JobResult(job, ResultStatus.UNCACHED, seconds, size=size,
                         reason=f"compiled, but not stored in the cache: {exc}")
    return JobResult(job, ResultStatus.BUILT, seconds, size=manifest.size, details=result)


def _warn_slow_formats(recipes: list[Any]) -> None:
    """A warning for each recipe whose number format its target computes slower than float32 on the
    recipe's device here (Target.slow_format: bfloat16 on a CPU without native bfloat16, issue 57)."""
    import warnings

    from aotbuild.targets.registry import get_target

    for r in recipes:
        target = get_target(r.target)
        why = target.slow_format(r, r.device or target.default_device())
        if why:
            warnings.warn(f"aotbuild: {r.name}: {why}", stacklevel=3)


def _ticker(progress: Progress, n: int, total: int, job: Job) -> Tick:
    def tick(seconds: float, phase: str) -> None:
        progress("tick", n, total, job, JobResult(job, phase or "starting", seconds))

    return tick


def _keep_log(source: Path, dest: Path) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(source.read_bytes())
    except OSError:
        pass


__all__ = ["build", "BuildReport", "JobResult", "ResultStatus"]
