"""Plans: one job per (recipe, component, shape), each with its key and whether the cache has it.

Every job of one recipe shares its :class:`aotbuild.context.Context`; ``plan`` is the Python API
behind ``aotbuild plan`` and the first half of ``aotbuild build``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import advice, constants, keys, shards
from aotbuild.cache.explain import Entries, estimate, explain_miss
from aotbuild.cache.layout import resolve_cache_root
from aotbuild.cache.store import Store, Unusable
from aotbuild.constants import Vocabulary
from aotbuild.context import Context, Unavailable
from aotbuild.features.registry import used
from aotbuild.pipeline import models, pipecall
from aotbuild.recipe.rules import Recipes, resolve_recipes
from aotbuild.recipe.schema import Recipe, Shape
from aotbuild.strategies import order as auto
from aotbuild.strategies.registry import checked_store
from aotbuild.utils import secrets
from aotbuild.utils.deprecated import positional_shim

if TYPE_CHECKING:
    from aotbuild.remote.base import Remote

#: key -> its failure record, or None (Store.failure, or a remote's: sync.remote_failures)
Failures = Callable[[str], "dict | None"]


class JobStatus(Vocabulary):
    """A planned job's status (``Job.status``; ``plan --json``'s ``status``)."""

    HIT = "hit"
    MISS = "miss"
    #: A miss whose last build, by this aotbuild version, failed (its failure record says why): kept out of
    #: estimates, and not built again until ``build --retry-failed`` (the one rule for failures).
    FAILED_BEFORE = "failed"
    #: the recipe cannot be keyed here (its model or target is unavailable): ``reason`` says why
    UNAVAILABLE = "unavailable"
    #: ``plan(remote=...)`` (``plan --remote``): not in the local cache, on the remote.
    REMOTE = "remote"


class OnRemote(Vocabulary):
    """What :func:`mark_remote` found of a job the local cache lacks (``Job.on_remote``)."""

    #: the remote has no entry for it
    ABSENT = "absent"
    #: its entry (every rank's, with the ranks the local cache has) is there and usable
    ENTRY = "entry"
    #: a tensor-parallel job: some rank's entry is neither there nor in the local cache
    PARTIAL = "partial"
    #: its entry is there, but no trusted key signed it
    REFUSED = "refused"


@dataclass
class Job:
    recipe: Recipe
    component: str
    shape: Shape
    key: str | None
    factors: dict[str, Any] | None
    status: JobStatus
    reason: str = ""
    #: A miss's expected build time and entry size, from the nearest cached entry (estimate()).
    estimated_build_s: float | None = None
    estimated_size: int | None = None
    #: why the store could not hand the entry out (a kind, for callers); None for a hit or no key
    unusable: Unusable | None = None
    #: the recipe resolved for this machine (its target and strategy): what builds the job
    ctx: Context | None = field(default=None, compare=False, repr=False)
    #: tensor parallelism: this entry's rank (None: unsharded) and the keys of every rank's entry of
    #: the same component and shape, in rank order (built, proven, pushed and pulled together)
    rank: int | None = None
    siblings: tuple[str, ...] = ()
    #: why an unavailable job cannot be keyed here (a kind, for callers: build skips only TARGET)
    cause: Unavailable | None = None
    #: ``strategy: auto``: what it tries here and excludes (aotbuild/strategies/order.py); None for a named strategy
    choice: auto.Choice | None = field(default=None, compare=False)
    #: ``strategy: auto``: each strategy tried, in order -> its concrete job's key (the recipe naming
    #: it), and the ones that failed before (this aotbuild version's failure record) -> that reason
    attempt_keys: dict[str, str] = field(default_factory=dict, compare=False)
    failed_before: dict[str, str] = field(default_factory=dict, compare=False)
    #: an auto job's hit: the strategy its entry holds and the attempts its build made
    chosen: str = ""
    attempts: tuple[dict[str, Any], ...] = ()
    #: the component's text length: whether it follows the prompt (measured by a build of it), how
    #: the recipe serves it, and a warning with the fix (aotbuild/pipeline/textlen.py ``plan_note``)
    text: dict[str, Any] = field(default_factory=dict)
    #: :func:`mark_remote`: what the remote holds of a job the local cache lacks (None: not asked)
    on_remote: OnRemote | None = None

    @property
    def label(self) -> str:
        rank = f" rank {self.rank}/{self.recipe.tensor_parallel}" if self.rank is not None else ""
        return f"{self.recipe.name}:{self.component}@{self.shape}{rank}"

    @property
    def group(self) -> str | None:
        """What the job is built with: its own key, or its rank 0's (every rank in one launch)."""
        return self.siblings[0] if self.siblings else self.key

    def as_json(self) -> dict[str, Any]:
        data = {"recipe": self.recipe.name, "source": self.recipe.source, "component": self.component,
                "shape": self.shape.as_dict(), "strategy": self.recipe.strategy,
                "key": self.key, "status": self.status, "reason": self.reason}
        if self.rank is not None:
            data.update(rank=self.rank, tensor=self.recipe.tensor_parallel)
        if self.status == JobStatus.MISS:
            data.update(estimated_build_s=self.estimated_build_s, estimated_size=self.estimated_size)
        if self.cause is not None:
            data["unavailable"] = self.cause.value
        if self.choice is not None:
            data["auto"] = {**self.choice.as_json(), "keys": dict(self.attempt_keys),
                            "failed_before": dict(self.failed_before),
                            **({"chosen": self.chosen, "attempts": list(self.attempts)} if self.chosen else {})}
        if self.text:
            data["text_length"] = self.text
        return data


def jobs_for(ctx: Context, store: Store, failures: Failures | None = None) -> list[Job]:
    """The jobs of ``ctx``'s recipe, each a hit, a miss or failed before. ``failures``: where else a
    failure record of a key may be (``plan --remote``: the remote's, sync.remote_failures), read
    where the store has none of this aotbuild version."""
    recipe = ctx.recipe
    failed = _failure_lookup(store, failures)
    jobs = []
    manifests: list[Entries] = []  # read once, on the first miss to explain
    for component in recipe.compile.components:
        config: tuple[str, dict[str, Any]] | None = None
        problem, cause = ctx.problem, ctx.cause
        if not problem:
            assert ctx.model is not None
            try:
                config = models.component_config(ctx.model, component, recipe.model.revision)
            except models.ModelUnavailable as exc:
                problem, cause = f"model unavailable: {exc}", Unavailable.of(exc)
        for shape in recipe.shapes:
            if problem or config is None:
                jobs.extend(Job(recipe, component, shape, None, None, JobStatus.UNAVAILABLE, problem, ctx=ctx,
                                rank=rank,
                                cause=cause)
                            for rank in ctx.ranks)
                continue
            ranked = [(rank, ctx.factors(component, config[0], config[1], shape, ctx.pipeline_class, rank))
                      for rank in ctx.ranks]
            siblings = tuple(keys.key_of(f) for _, f in ranked) if len(ranked) > 1 else ()
            planned = [_job(ctx, store, component, shape, rank, factors, siblings, manifests, failed)
                       for rank, factors in ranked]
            if auto.is_auto(recipe):
                planned = _auto_jobs(ctx, store, planned, failed)
            jobs.extend(planned)
    return jobs


def concrete_job(job: Job, strategy: str) -> Job:
    """``job`` (an auto job) as the recipe naming ``strategy`` plans it: that recipe, context, factors
    and key (an explicit recipe's key exactly); one attempt of the auto job builds it."""
    assert job.ctx is not None and job.factors is not None
    ctx = auto.concrete(job.ctx, strategy)
    component = job.factors["component"]
    factors = ctx.factors(job.component, component["class"], component["config"], job.shape,
                          job.factors["model"]["pipeline"], job.rank)
    return replace(job, recipe=ctx.recipe, ctx=ctx, factors=factors, key=keys.key_of(factors), status=JobStatus.MISS,
                   choice=None, attempt_keys={}, failed_before={}, siblings=())


def concrete_group(jobs: list[Job], strategy: str) -> list[Job]:
    """Every rank of an auto job (in rank order) as :func:`concrete_job`, siblings of one another."""
    group = [concrete_job(j, strategy) for j in jobs]
    if len(group) > 1:
        siblings = tuple(j.key for j in group if j.key)
        group = [replace(j, siblings=siblings) for j in group]
    return group


def _failure_lookup(store: Store, failures: Failures | None) -> Failures:
    """The failure record of a key: the store's, else (where the store has none of this aotbuild
    version) the one ``failures`` gives."""
    if failures is None:
        return store.failure

    def lookup(key: str) -> dict | None:
        own = store.failure(key)
        if own is not None and own.get("aotbuild") == constants.VERSION:
            return own
        return failures(key) or own

    return lookup


def _auto_jobs(ctx: Context, store: Store, jobs: list[Job], failure: Failures) -> list[Job]:
    """An auto job's ranks with what auto tries (aotbuild/strategies/order.py): each strategy's concrete key (its
    rank 0's, where failures are recorded) and which failed before; a miss whose every try failed
    before is JobStatus.FAILED_BEFORE (not retried until ``--retry-failed``, the one rule for failures); a hit
    says what its entry holds and the attempts its build made."""
    choice = auto.choice(ctx.recipe, ctx.target, ctx.device)
    first = jobs[0]
    attempt_keys = {s: str(concrete_job(first, s).key) for s in choice.tries}
    failed: dict[str, str] = {}
    for strategy, key in attempt_keys.items():
        record = failure(key)
        if record is not None and record.get("aotbuild") == constants.VERSION:
            failed[strategy] = str(record.get("reason", "")).partition("\n")[0]
    out = []
    for job in jobs:
        job = replace(job, choice=choice, attempt_keys=attempt_keys, failed_before=failed)
        if job.status == JobStatus.HIT and job.key:
            manifest = store.read_manifest(job.key)
            if manifest is not None and manifest.auto is not None:
                attempts = tuple(manifest.auto.get("attempts", ()))
                job = replace(job, chosen=auto.held_by(manifest), attempts=attempts,
                              reason=f"auto chose {manifest.strategy}: {auto.attempts_text(list(attempts))}")
        elif job.status == JobStatus.MISS and choice.tries and set(choice.tries) <= set(failed):
            why = "; ".join(f"{s} failed before: {failed[s]}" for s in choice.tries)
            job = replace(job, status=JobStatus.FAILED_BEFORE, reason=f"every strategy auto tries failed before: {why}")
        elif job.status == JobStatus.MISS:
            job = replace(job, reason=f"{job.reason}; auto {choice.text()}"
                                      + "".join(f"; skips {s} (failed before)" for s in failed))
        out.append(job)
    return out


def _job(ctx: Context, store: Store, component: str, shape: Shape, rank: int | None, factors: dict[str, Any],
         siblings: tuple[str, ...], manifests: list[Entries], failure: Failures) -> Job:
    """One job (one rank's, for a tensor-parallel recipe): a hit, failed before, or a miss and why.
    ``manifests`` holds the store's manifests once a miss needed them (read once per plan).

    A failure recorded by another aotbuild version says nothing about this one (a fix may have
    landed): that job is a miss, which the next build retries, as a new toolchain's new key is."""
    recipe = ctx.recipe
    key = keys.key_of(factors)
    ok, why = store.check_entry(key)
    failed = failure(key) if not ok and why.kind is Unusable.NOT_BUILT else None
    if failed is not None and failed.get("aotbuild") == constants.VERSION:
        reason = (f"failed before ({failed.get('time', '?')}, aotbuild {failed.get('aotbuild', '?')}): "
                  f"{failed['reason']}")
        return Job(recipe, component, shape, key, factors, JobStatus.FAILED_BEFORE, reason, unusable=why.kind, ctx=ctx,
                   rank=rank, siblings=siblings)
    cost = None
    if not ok:
        if not manifests:
            manifests.append(Entries(store.iter_manifests()))
        cost = estimate(manifests[0].all, factors, recipe.name)
    reason: str = why
    if why.kind is Unusable.NOT_BUILT:
        reason = explain_miss(manifests[0], recipe.name, component, factors, store.root)
        if failed is not None:
            reason += f" (it failed with aotbuild {failed.get('aotbuild', '?')}: this version tries again)"
    status = JobStatus.HIT if ok else JobStatus.MISS
    return Job(recipe, component, shape, key, factors, status, reason, *(cost or (None, None)),
               unusable=why.kind, ctx=ctx, rank=rank, siblings=siblings,
               text=_text_note(store, recipe, component, key if ok else None, factors, manifests))


def _text_note(store: Store, recipe: Recipe, component: str, key: str | None, factors: dict[str, Any],
               manifests: list[Entries]) -> dict[str, Any]:
    """What the job's entry (a hit), or the nearest entry of the same pipeline and component class,
    measured of the component's text length when it was built (issue 34)."""
    from aotbuild.pipeline import textlen

    source = store.read_manifest(key) if key else None
    if source is None and manifests:
        near = manifests[0].nearest(recipe.name, component, factors)
        same = near is not None and near.factors.get("model", {}).get("pipeline") == factors["model"]["pipeline"]
        source = near if same else None
    measured = source.build.get("text") if source is not None else None
    return textlen.plan_note(recipe.text_length, component, measured)


@positional_shim("cache")
@secrets.scrubbed  # its exceptions leave it scrubbed of secrets (issue 53)
def plan(recipes: Recipes, *, cache: str | Path | None = None, remote: str | Remote | None = None,
         trusted_keys: list[str | Path] | None = None, signatures: bool = True,
         failures: Failures | None = None) -> list[Job]:
    """Every job of every recipe, sorted by key (jobs without a key last), with hit/miss status.

    ``recipes``: a recipe file or folder (str or os.PathLike), recipe data as a dict (validated like a
    file), a Recipe, or a list or tuple mixing them; a str is one path (recipe/rules.recipe_items).
    ``remote`` (a URL or a Remote, as ``plan --remote``): a job the local cache lacks and the remote
    has is ``remote`` (:func:`mark_remote`). ``trusted_keys``
    (default ``AOTBUILD_TRUSTED_KEYS``): an entry no trusted key signed is a miss; ``signatures=False``
    (a build) ignores them. ``failures``: a lookup of failure records kept elsewhere (a remote's:
    sync.remote_failures, which ``plan --remote`` passes), read as the store's own, so a job that
    failed there is "failed" here too, nothing written locally."""
    from aotbuild.cache.signing import trusted_from_env

    constants.check_stack()  # an older torch than supported: one line (issue 54)
    root = resolve_cache_root(cache)
    store = checked_store(root, trusted_from_env(trusted_keys) if signatures else None)
    loaded = resolve_recipes(recipes)
    jobs: list[Job] = []
    for recipe in loaded:
        ctx = Context.create(recipe, root, reading=True)  # a plan writes nothing under the cache (issue 55)
        if ctx.model is not None and not ctx.problem:  # only plan: jobs and loads check the loaded pipeline
            models.check_blocks(recipe, ctx.model)
            models.check_pipeline_components(recipe, ctx.model, ctx.pipeline_class)
            call = pipecall.signature_of(ctx.pipeline_class)
            if call is not None:
                pipecall.check_recipe(recipe, call)
            if recipe.schedulers:  # each made from the model's scheduler config, as the build will (issue 56)
                from aotbuild.pipeline.schedulers import check_model

                check_model(recipe, models.scheduler_config(ctx.model, recipe.model.revision))
            for feature in used(recipe):  # LoRA headers, a _tp_plan, FreeU on a model with a unet, ...
                feature.check_recipe(recipe, ctx.model, ctx.pipeline_class)
        jobs.extend(jobs_for(ctx, store, failures))
    jobs.sort(key=lambda j: (j.key is None, j.key or "", j.label))
    return mark_remote(jobs, remote, trusted_keys) if remote is not None else jobs


#: ``mark_remote``'s default trust: the keys ``AOTBUILD_TRUSTED_KEYS`` (or ``trusted_keys``) names.
FROM_ENV: Any = object()


def mark_remote(jobs: list[Job], remote: str | Remote, trusted_keys: list[str | Path] | None = None, *,
                trusted: dict[str, bytes] | None = FROM_ENV) -> list[Job]:
    """``jobs`` with each one the local cache lacks (a miss, or failed before) that ``remote`` has
    marked :data:`JobStatus.REMOTE` ("on URL"): the one place that decides what a remote holds, for
    ``plan --remote``, ``plan(remote=)`` and a build that skips what its ``--push`` remote has. The
    remote's keys are listed once; nothing is downloaded. With trusted keys (``trusted``, a build's own
    signing key; by default ``AOTBUILD_TRUSTED_KEYS`` or ``trusted_keys``) a remote entry counts only
    when a trusted key signed it: its manifest is read (bounded; no blob is fetched), so a
    ``--fail-on-miss`` gate means what a serving machine will load, and an unsigned one stays a miss
    that says why. A tensor-parallel job is on the remote only when every rank's entry is there or in
    the local cache (a hit among ``jobs``). ``Job.on_remote`` says what was found (``pull`` acts on it)."""
    from aotbuild.cache.signing import trusted_from_env
    from aotbuild.remote.schemes import as_remote, untrusted_on_remote

    target = as_remote(remote)
    wanting = (JobStatus.MISS, JobStatus.FAILED_BEFORE)
    if not any(j.status in wanting for j in jobs):
        return jobs
    there = target.keys()
    needed = sorted({k for j in jobs if j.status in wanting and j.key for k in (j.siblings or (j.key,)) if k in there})
    trusted = trusted_from_env(trusted_keys) if trusted is FROM_ENV else trusted
    refused = untrusted_on_remote(target, needed, trusted) if trusted is not None else {}
    usable = set(needed) - set(refused)
    have = {j.key for j in jobs if j.status == JobStatus.HIT}
    out = []
    for j in jobs:
        if j.status not in wanting or j.key is None:
            out.append(j)
        elif j.key in refused:
            out.append(replace(j, reason=f"on {target.url} but refused there: {refused[j.key]}",
                               on_remote=OnRemote.REFUSED))
        elif j.key in usable and set(j.siblings or (j.key,)) <= usable | have:
            out.append(replace(j, status=JobStatus.REMOTE, reason=f"on {target.url}", on_remote=OnRemote.ENTRY))
        elif set(j.siblings) & usable:  # a tensor-parallel job partly there: its ranks are pulled together
            rank = next(r for r, k in enumerate(j.siblings) if k not in usable | have)
            out.append(replace(j, reason=f"on {target.url} in part: not every rank of its tensor-parallel job is "
                                         f"(rank {rank}'s entry is neither there nor in the local cache; its "
                                         f"ranks are pulled together)", on_remote=OnRemote.PARTIAL))
        elif j.status == JobStatus.MISS and j.unusable is Unusable.NOT_BUILT:
            # on neither side: what the local cache's nearest entry lacks is not why a gate fails (it
            # said "the cache at X is empty" where the remote was what it checked: issue 55)
            out.append(replace(j, reason=advice.neither_side(target.url), on_remote=OnRemote.ABSENT))
        else:  # failed before, or a local entry that is damaged or untrusted: its reason says why
            out.append(replace(j, on_remote=OnRemote.ABSENT))
    return out


def recheck_hits(jobs: list[Job], store: Store, own: dict[str, bytes]) -> None:
    """For a build: plan checked a hit's sizes only; a hit whose blobs are damaged becomes a miss to
    rebuild, and so does one the build's signing key (``own``) did not sign."""
    for i, job in enumerate(jobs):
        if job.status != JobStatus.HIT or not job.key:
            continue
        entry, why = store.open_entry(job.key)
        if entry is None:
            jobs[i] = replace(job, status=JobStatus.MISS, reason=f"rebuilt: {why}")
        elif own and not_signed_by(entry.manifest, own):
            # A signature says "built and proven here": an entry this key did not sign was found, not
            # built, so it is built again (and signed), never signed as it is.
            jobs[i] = replace(job, status=JobStatus.MISS, reason=f"rebuilt: {not_signed_by(entry.manifest, own)}")


def whole_groups(jobs: list[Job], known: dict[str | None, str]) -> None:
    """A tensor-parallel job is built whole: when one rank's entry is missing or damaged, every rank of
    it is rebuilt (its ranks' artifacts come from one launch and are proven together); not one that
    failed before (``known``), which is not built at all."""
    todo = {j.group for j in jobs if j.siblings and j.status in (JobStatus.MISS, JobStatus.FAILED_BEFORE)} - set(known)
    for i, job in enumerate(jobs):
        if job.siblings and job.group in todo and job.status == JobStatus.HIT:
            jobs[i] = replace(job, status=JobStatus.MISS, reason="rebuilt with the other ranks of its job")


def not_signed_by(manifest: Any, own: dict[str, bytes]) -> str:
    """Why ``manifest`` carries no valid signature by the signing key ``own`` ("" when it does)."""
    from aotbuild.cache.signing import check

    why = check(manifest, own)
    return f"found in the cache, not signed by {next(iter(own))} ({why.split(':')[0].split(';')[0]})" if why else ""


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` (1-based) -> (I, N) (aotbuild/shards.py; ``--shard auto``: ``shards.resolve``)."""
    return shards.parse_shard(text)


def identity(job: Job) -> str:
    """The job's host-independent identity (shards.job_identity): recipe, component, shape. Under
    ``strategy: auto`` the shape is left out: auto chooses one strategy for every shape of a component
    (builder.build._build_component), which only a runner building all of them can do."""
    shape = "*" if auto.is_auto(job.recipe) else str(job.shape)
    return shards.job_identity(job.recipe.name, job.component, shape)


def shard_jobs(jobs: list[Job], index: int, count: int, source: str = "") -> list[Job]:
    """The jobs of shard ``index`` of ``count`` (1-based), decided before any job is dropped as a hit.

    The distinct job identities of the full job list (recipe, component, shape: never the key, which
    holds host facts such as the CPU's ISA), sorted, are dealt round-robin: identity number k
    (0-based) goes to shard k % count + 1. Every runner of a CI matrix computes the same split
    whatever its own cache holds and whatever its CPU, each job is in exactly one shard (a
    tensor-parallel job's ranks share an identity: one launch, one shard), and runners get a
    balanced count. Logs (logger ``aotbuild``) this shard's count and the digest of the full list,
    so that two shards' logs show whether they split the same list; ``source`` says where
    (index, count) came from."""
    import logging

    names = [identity(j) for j in jobs]
    mine = shards.deal(names, index, count)
    picked = [j for j, name in zip(jobs, names, strict=True) if name in mine]
    logging.getLogger("aotbuild").info(
        "shard %d/%d%s: %d of %d jobs (job list digest %s)", index, count, f" from {source}" if source else "",
        len(picked), len(jobs), shards.list_digest(names))
    return picked


def shard_summary(shard: tuple[int, ...] | shards.Shard, picked: int, everything: list[Job]) -> dict[str, Any]:
    """What ``--json`` says of a shard: index, count, source, its job count and the full list's digest."""
    index, count, *source = shard
    return shards.summary(shards.Shard(index, count, *source), picked, len(everything),
                          shards.list_digest(identity(j) for j in everything))


__all__ = ["Job", "plan", "jobs_for", "concrete_job", "concrete_group", "parse_shard", "shard_jobs", "shard_summary",
           "identity", "JobStatus", "OnRemote", "not_signed_by", "recheck_hits", "whole_groups"]
