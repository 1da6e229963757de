"""``load_compiled``: install a recipe's cached artifacts and return its pipeline, compiled.

The runtime imports what loading needs (torch, diffusers when it loads the pipeline) and nothing
else: no click, no YAML writer, no rich, no Hub client unless the model itself comes from the Hub.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import advice, constants, keys
from aotbuild.cache.explain import Entries, explain_miss
from aotbuild.cache.layout import resolve_cache_root
from aotbuild.cache.locks import store_lock
from aotbuild.cache.store import Entry, Store, Unusable
from aotbuild.context import Context, prepare_pipeline, shard_pipeline
from aotbuild.errors import CacheMiss, RemoteError, UsageError
from aotbuild.pipeline import models, pipecall
from aotbuild.recipe.rules import as_recipe
from aotbuild.recipe.schema import DATA_SOURCE, Recipe, Shape
from aotbuild.strategies.base import Planned
from aotbuild.strategies.registry import checked_store
from aotbuild.utils import secrets
from aotbuild.utils.deprecated import positional_shim
from aotbuild.utils.text import printable

if TYPE_CHECKING:
    from aotbuild.remote.schemes import Remote

log = logging.getLogger("aotbuild")
ON_MISS = ("compile", "eager", "error")


@dataclass(frozen=True)
class ReportEntry:
    component: str
    shape: Shape
    key: str
    hit: bool
    reason: str = ""  # why it missed: the factors that differ from the nearest entry, or the store's word
    pulled: bool = False  # fetched from the remote during this load
    strategy: str = ""  # a hit's: the strategy its entry holds (what an auto recipe's build chose)


@dataclass
class LoadReport:
    """What ``load_compiled`` found: one entry per component x shape, plus what it installed."""

    recipe: str
    cache: str
    entries: list[ReportEntry] = field(default_factory=list)
    installed_files: int = 0
    present_files: int = 0
    install_folder: str = ""
    on_miss: str = "compile"
    remote: str = ""
    #: tensor parallelism: this process's rank and the degree (its entries are this rank's)
    rank: int | None = None
    tensor: int = 1
    #: seconds of each load phase: "pipeline" (loading it; ~0 for a pipe passed in), "pull" (with a
    #: remote), "verify" (hashes and checks of every entry), "install" (the compiler's imports, files,
    #: packages)
    timings: dict[str, float] = field(default_factory=dict)
    #: seconds of each component's first compiled call (Dynamo's trace for jit-cache, the first
    #: package call for aot-package), filled in when the pipeline first runs
    first_calls: dict[str, float] = field(default_factory=dict)
    #: what a user of the served pipeline must know (each said once), e.g. which weight writes a prepacked
    #: package needs ``aotbuild.refresh`` after
    notes: list[str] = field(default_factory=list)

    def note(self, text: str) -> None:
        """``text`` added to ``notes`` unless said already: every prepacked shape's route gives the same
        refresh note (the main job's two entries printed it twice, issue 54)."""
        if text not in self.notes:
            self.notes.append(text)

    @property
    def hits(self) -> list[ReportEntry]:
        return [e for e in self.entries if e.hit]

    @property
    def misses(self) -> list[ReportEntry]:
        return [e for e in self.entries if not e.hit]

    def as_json(self) -> dict[str, Any]:
        """The report as JSON data (as ``push``'s, ``pull``'s and ``build``'s reports)."""
        return self.as_dict()

    def text(self) -> str:
        """The report for people: what ``print(pipe.aotbuild_report)`` shows."""
        return str(self)

    def as_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "cache": self.cache, "installed_files": self.installed_files,
                "present_files": self.present_files, "install_folder": self.install_folder,
                "remote": self.remote, **({"rank": self.rank, "tensor": self.tensor} if self.rank is not None else {}),
                "timings": dict(self.timings), "first_calls": dict(self.first_calls), "notes": list(self.notes),
                "entries": [
                    {"component": e.component, "shape": e.shape.as_dict(), "key": e.key, "hit": e.hit,
                     "pulled": e.pulled, "reason": e.reason, **({"strategy": e.strategy} if e.strategy else {})}
                    for e in self.entries]}

    def __str__(self) -> str:
        pulled = sum(e.pulled for e in self.entries)
        rank = f" (rank {self.rank} of {self.tensor})" if self.rank is not None else ""
        lines = [f"aotbuild: {printable(self.recipe)}{rank}: {len(self.hits)} hit, {len(self.misses)} miss "
                 + (f"({pulled} pulled from {self.remote}) " if pulled else "")
                 + f"(cache {self.cache}; {self.installed_files} files installed into the compiler's cache "
                 f"{self.install_folder or 'folder'}, {self.present_files} were already there)"]
        for e in self.entries:
            status = "hit " if e.hit else "MISS"
            line = f"  {status} {e.component:<14} {str(e.shape):<12} {e.key[:12]}" + ("  pulled" if e.pulled else "")
            line += f"  {printable(e.strategy)}" if e.strategy else ""
            if not e.hit:
                line += f"  {printable(e.reason)}"
                if self.on_miss != "error":
                    line += f" -> {'compiles on first call' if self.on_miss == 'compile' else 'runs eager'}"
            lines.append(line)
        if self.timings:
            lines.append("  load: " + ", ".join(f"{phase} {s:.2f} s" for phase, s in self.timings.items())
                         + "".join(f", first {c} call {s:.2f} s" for c, s in self.first_calls.items()))
        lines += [f"  note: {note}" for note in self.notes]
        return "\n".join(lines)


@secrets.scrubbed  # its exceptions leave it scrubbed of secrets (issue 53)
@positional_shim("pipe")
def load_compiled(recipe: str | os.PathLike | Recipe | Mapping[str, Any], *, pipe: Any = None,
                  cache: str | Path | None = None, remote: str | Remote | None = None, on_miss: str = "compile",
                  strict_shapes: bool = False, trusted_keys: list[str | Path] | None = None,
                  discard_weights: bool = False) -> Any:
    """Load ``recipe``'s pipeline (or take ``pipe``), install its cached artifacts, compile it.

    ``recipe``: one recipe: a recipe file's path (str or os.PathLike), recipe data as a dict (the
    YAML's structure, validated like a file: :func:`aotbuild.parse_recipe`) or a
    :class:`aotbuild.Recipe`; a folder or a list is refused (:func:`aotbuild.build` and
    :func:`aotbuild.plan` take several).

    ``on_miss`` acts at load when a component x shape has no usable entry: ``"compile"`` (warn, then
    compile on first call as torch.compile would), ``"eager"`` (warn, run that shape eagerly) or
    ``"error"`` (raise :class:`aotbuild.CacheMiss`). ``strict_shapes=True`` acts at call time: a call
    at a shape that was not built raises :class:`aotbuild.ShapeNotBuilt` instead of compiling.
    ``remote`` fetches only the entries this load needs and the local store lacks, verified, into the
    local store first; without it there is no network access at all. A :class:`aotbuild.Remote` or a
    URL: ``file:///shared/cache`` (a folder), ``hf://owner/repo[@revision]`` or
    ``hf://datasets/owner/repo[@revision]`` (a Hub repo), ``s3://bucket/prefix`` (S3 or a store at
    ``AWS_ENDPOINT_URL``), ``gs://bucket/prefix`` or ``gcs://bucket/prefix`` (Google Cloud Storage),
    ``az://container/prefix`` or ``abfs://container/prefix`` (Azure Blob Storage), ``memory://name``
    (fsspec's in-process store, for tests); docs/ci.md, "Remotes".
    ``trusted_keys`` (``.pub`` paths; default ``AOTBUILD_TRUSTED_KEYS``): accept only entries that
    one of these keys signed, checked before any blob is read (docs/security.md, "Signed entries").
    ``discard_weights=True``: where an entry serves prepacked weights (aot-package with freezing, auto's
    on a CPU), the dense weights only they read are dropped after load (memory close to eager's); they
    can then be changed only with :func:`aotbuild.refit`, and any other use raises
    :class:`aotbuild.WeightsDiscarded` (docs/prepack.md, "Without the dense weights").
    The report is ``pipe.aotbuild_report`` and is logged at INFO.
    """
    constants.check_stack()  # an older torch than supported: one line (issue 54)
    remote = _check_arguments(on_miss, remote)
    recipe = as_recipe(recipe)
    root = resolve_cache_root(cache)
    from aotbuild.cache.signing import trusted_from_env

    store = checked_store(root, trusted_from_env(trusted_keys))
    passed = pipe is not None
    # reading: a built-in model the cache lacks is made outside it until the load has succeeded (issue 55)
    ctx = Context.create(recipe, root, resolve_model=not passed, reading=True)
    if ctx.cause is not None:  # TargetUnavailable, or ModelUnavailable (ModelUnreachable for a Hub model)
        raise ctx.cause.error(f"{recipe.source}: {ctx.problem}")
    from aotbuild.features.registry import used

    features = used(recipe)  # a plain recipe imports none of their modules
    for feature in features:  # before the weights load (a rank: its process group, device and threads)
        feature.before_load(recipe, ctx.device)
    if not passed and ctx.model is not None:  # a component the model lacks: refused before the weights load
        models.check_pipeline_components(recipe, ctx.model, ctx.pipeline_class)
    started = time.perf_counter()
    pipe = _pipeline(ctx, pipe)
    rank = shard_pipeline(pipe, ctx)  # the caller's pipe too, unless it is sharded already
    timings = {"pipeline": time.perf_counter() - started}
    pipecall.check_recipe(recipe, pipecall.CallSignature.of(pipe), files=False)  # a misspelt warmup key
    blocker = ctx.target.install_blocker()
    wanted = _wanted(ctx, pipe, rank)
    pulled, remote_notes = _pull_wanted(store, remote, wanted, timings) if remote and not blocker else (set(), {})
    situation = _situation(recipe, root, remote, passed)
    report = LoadReport(recipe.name, str(root), on_miss=on_miss, remote=remote.url if remote else "", rank=rank,
                        tensor=recipe.tensor_parallel, timings=timings)
    started = time.perf_counter()
    # As a reader of the store (its shared lock) from the hash check to the last file installed,
    # so gc or rm cannot remove an entry in between. A read-only store needs no lock, and a store
    # without entries has nothing to remove: no lock file is made there, so a load that finds nothing
    # writes nothing (a failed load left ~/.cache/aotbuild/locks behind: issue 55).
    with store_lock(root, exclusive=False) if store.layout.manifests.is_dir() else contextlib.nullcontext():
        with store.hash_once():
            planned = _open_entries(ctx, store, pipe, wanted, report, blocker, pulled, remote_notes)
        timings["verify"] = time.perf_counter() - started
        if report.misses and on_miss == "error":
            raise CacheMiss(f"{report}{_next_step(recipe, blocker, situation, pipe if passed else None)}")
        from aotbuild.strategies.discard import DISCARDING

        discarding = DISCARDING.set(discard_weights)
        try:
            _install(ctx, planned, report, _call_policy(on_miss, strict_shapes))
        finally:
            DISCARDING.reset(discarding)
        _watch(planned, on_miss, ctx.recipe.offload == "none", situation)
        _callers(ctx, pipe, planned, on_miss, strict_shapes)
        if discard_weights:
            _discarded(planned, report)
    for feature in features:  # guards on what the served pipe may change (a LoRA hot-swap's checks)
        feature.after_load(pipe, recipe)
    pipe.aotbuild_report = report
    _announce(report, recipe, on_miss, blocker, situation)
    if ctx.model is not None:  # it served: a built-in model made outside the cache is kept there
        with contextlib.suppress(OSError):  # (a read-only cache still served: StoreError is an OSError)
            models.store_builtin(recipe, root)
    return pipe


def _pull_wanted(store: Store, remote: Remote, wanted: list[_Wanted],
                 timings: dict[str, float]) -> tuple[set[str], dict[str, str]]:
    """:func:`_pull_missing` for the keys this load wants, timed as the load's ``pull`` phase."""
    started = time.perf_counter()
    try:
        return _pull_missing(store, remote, [w.key for w in wanted])
    finally:
        timings["pull"] = time.perf_counter() - started


def _install(ctx: Context, planned: list[Planned], report: LoadReport, policy: str) -> None:
    """Every planned entry installed by its strategy (a dispatcher per module, put in anew), the install
    counted in ``report``, and each dispatcher told how to time its first call and name the prompt's
    length in a refusal."""
    from aotbuild.dispatch import dispatchers, uninstall_dispatchers

    started = time.perf_counter()
    for p in planned:  # loaded before into this pipe: install on the module, not around that install
        uninstall_dispatchers(p.module)
    ctx.target.before_install([e.manifest.build for p in planned for e in p.entries], ctx.device)
    for serving, serves in _by_strategy(ctx, planned):
        installed = serving.strategy.install(serving, serves, policy)
        if installed is not None:
            report.installed_files += installed.installed
            report.present_files += installed.present
            report.install_folder = report.install_folder or installed.folder
    report.timings["install"] = time.perf_counter() - started
    from aotbuild.pipeline.textlen import static_patterns

    prompts = ctx.recipe.warmup_factors(ctx.target.warmup_defaults)["prompt"]["texts"]
    for p in planned:
        _batches(p, ctx.recipe.pad_batch, report, prompts)
        measured = [e.manifest.build.get("text") for e in p.entries]
        for d in dispatchers(p.module):
            d.on_first_call = lambda s, c=p.component: report.first_calls.setdefault(c, round(s, 4))
            d.static_text = static_patterns(d.routes, measured)  # a refusal names the prompt's length
            for route in d.routes.values():
                for note in getattr(route, "notes", ()):
                    report.note(note)


def _batches(p: Planned, pad_batch: bool, report: LoadReport, prompts: int = 1) -> None:
    """The component's dispatcher told its built batches (aotbuild/pipeline/batch.py): with ``pad_batch``, a
    call between two is padded to the next where that entry's proof showed padding exact; otherwise, or
    above the largest, refused by name. What an entry refuses is noted in the report once. ``prompts``: the
    warmup's, so that a refusal counts a call's images (prompts times the shape's batch_size)."""
    from aotbuild import forwards
    from aotbuild.pipeline.batch import Padding

    entries = [(e.key, str(Shape(**e.manifest.shape)), e.manifest.shape["batch_size"] * prompts,
                e.manifest.signatures,
                e.manifest.proof.padding if e.manifest.proof is not None else None) for e in p.entries]
    padding = Padding.of(p.component, entries, pad_batch)
    for d in forwards.layers(p.module, forwards.DISPATCH):  # the component's own: a regional block's is not padded
        d.padding = padding
    if pad_batch:
        for b in padding.built:
            if b.refused and b.batch >= 2:
                report.note(f"{p.component} {b.label}: no call is padded to it (pad_batch): {b.refused}")


def _discarded(planned: list[Planned], report: LoadReport) -> None:
    """``discard_weights=True``: each served component's runners dropped the dense weights only prepacked
    constants read while they derived them (aotbuild/strategies/discard.py); a component with none is an
    error naming why. Noted in the report; runners bound at their first call (offload) drop them then."""
    from aotbuild.dispatch import dispatchers

    for p in planned:
        runners = [r for d in dispatchers(p.module) for route in d.routes.values()
                   if (r := getattr(route, "runner", None)) is not None and getattr(r, "derived", None)]
        if not runners:
            raise UsageError(f"discard_weights=True: {p.component} is not served with prepacked weights (only an "
                             f"aot-package entry built with freezing is: auto's first try on a CPU), so its dense "
                             f"weights are what it runs with")
        dropped = sum(r.dropped for r in runners)
        report.notes.append(f"{p.component}: {dropped / 2**20:.0f} MB of dense weights discarded (discard_weights="
                            f"True); change them with aotbuild.refit(pipe.{p.component}, state_dict), any other use "
                            f"raises WeightsDiscarded")


def refit(module: Any, state_dict: Any) -> int:
    """Change the weights of a served component (``pipe.unet``) to ``state_dict``'s, whatever was
    discarded (aotbuild/strategies/discard.py :func:`~aotbuild.strategies.discard.refit`); how many
    prepacked constants were replayed."""
    from aotbuild.strategies.discard import refit as refit_module

    return refit_module(module, state_dict)


def refresh(pipe: Any) -> int:
    """Make every served component of ``pipe`` (a pipeline, or one module) compute with its weights as
    they are now: each AOT package built with freezing replays every recipe of its prepacked constants
    and is handed every weight again. Needed only after a write the per-call check cannot see: a partial
    write that bypasses autograd's version counter (``w.data[...] = ...``, through numpy, in place on an
    inference tensor) and changes no sampled element (docs/prepack.md lists them). Returns how many
    packages were refreshed."""
    import torch

    from aotbuild.dispatch import dispatchers

    modules = [pipe] if isinstance(pipe, torch.nn.Module) else [
        m for m in getattr(pipe, "components", {}).values() if isinstance(m, torch.nn.Module)]
    refreshed = 0
    for module in modules:
        for d in dispatchers(module):
            for route in d.routes.values():
                runner = getattr(route, "runner", None)
                if callable(getattr(runner, "refresh", None)):
                    runner.refresh()
                    refreshed += 1
    return refreshed


@dataclass(frozen=True)
class _Wanted:
    component: str
    shape: Shape
    factors: dict[str, Any]
    key: str
    rank: int | None = None


def _by_strategy(ctx: Context, planned: list[Planned]) -> list[tuple[Context, list[Planned]]]:
    """What installs each component: the recipe's strategy; for ``strategy: auto``, the strategy its
    entries hold (one per component, :func:`_one_strategy`), and for a component without entries the
    last auto tries here (it compiles on first use, as every strategy's fallback does)."""
    from aotbuild.strategies import order as auto

    if not auto.is_auto(ctx.recipe):
        return [(ctx, planned)]
    groups: dict[str, list[Planned]] = {}
    for p in planned:
        # The fallback only for a component without entries: asking what auto would try imports and
        # validates every strategy (aot-compile's API check imports Dynamo), which a hit never needs.
        name = p.entries[0].manifest.strategy if p.entries else _fallback(ctx)
        groups.setdefault(name, []).append(p)
    return [(auto.concrete(ctx, name), group) for name, group in groups.items()]


def _fallback(ctx: Context) -> str:
    """What compiles an auto recipe's component that has no entry: the last strategy auto tries here."""
    from aotbuild.strategies import order as auto

    return (auto.choice(ctx.recipe, ctx.target, ctx.device).tries[-1:] or auto.order(ctx.device)[-1:])[0]


def _auto_problem(ctx: Context, entry: Entry, w: _Wanted) -> str:
    """Why an auto recipe's entry cannot serve here (then a miss), or "": its strategy must be one this
    aotbuild serves and what that strategy adds to the key (its ``compile_factors``, recorded in
    ``Manifest.auto``'s ``factors``) must be this process's: aot-package+freezing's ``compute_dtype``
    (float32 where a bfloat16 recipe's CPU has no native bfloat16), so an entry built on such a CPU is
    a miss on one that has it, and the reverse."""
    from aotbuild.strategies import order as auto

    manifest = entry.manifest
    if manifest.auto is None:
        return "not an auto entry"
    try:
        serving = auto.concrete(ctx, auto.held_by(manifest))  # the try that built it (a variant's options too)
    except UsageError:
        return f"its strategy {printable(manifest.strategy)} is not one this aotbuild serves"
    component = w.factors["component"]
    here = serving.factors(w.component, component["class"], component["config"], w.shape,
                           w.factors["model"]["pipeline"], w.rank)["compile"]
    recorded = dict(manifest.auto.get("factors") or {})
    wanted = {k: here.get(k) for k in auto.strategy_factors(serving)}
    return "; ".join(f"compile.{line} (what {manifest.strategy}, chosen by auto, keys)"
                     for line in keys.differences(recorded, wanted))


def _check_arguments(on_miss: str, remote: str | Remote | None) -> Remote | None:
    if on_miss not in ON_MISS:
        raise UsageError(f"on_miss={on_miss!r} is not allowed (allowed: {', '.join(ON_MISS)})")
    if isinstance(remote, str):
        from aotbuild.remote.schemes import parse_remote

        return parse_remote(remote)
    return remote


def _pipeline(ctx: Context, pipe: Any) -> Any:
    """The caller's pipeline, checked against the recipe's dtype and device; else the recipe's, loaded
    (with its declared ``changes``: models.load_pipeline). A caller's pipeline with changes a recipe can
    declare (FreeU's factors, an attention processor, a cache hook, a memory format) is keyed with them
    when the recipe declares none, as ``build(recipe, pipe=pipe)`` builds it."""
    if pipe is not None:
        _check_pipe(pipe, ctx)
        if ctx.recipe.changes is None:  # keyed as build(recipe, pipe=pipe) keys it (aotbuild/pipeline/changes.py)
            from aotbuild.features.registry import detect_changes

            found = detect_changes(pipe, ctx.recipe)
            if found.changes is not None:
                ctx.recipe = replace(ctx.recipe, changes=found.changes)
        return pipe
    assert ctx.model is not None
    pipe = models.load_pipeline(ctx.recipe, ctx.model, ctx.dtype)
    models.place_pipeline(pipe, ctx.recipe, ctx.device)
    prepare_pipeline(pipe, ctx.recipe)  # quantized, adapters loaded: as the build served it
    return pipe


def _wanted(ctx: Context, pipe: Any, rank: int | None = None) -> list[_Wanted]:
    """Every component x shape of the recipe, keyed from the live modules (so another checkpoint of
    another architecture gets other keys); of a tensor-parallel recipe, this rank's entries."""
    wanted = []
    for component in ctx.recipe.compile.components:
        module = getattr(pipe, component, None)
        if module is None:
            raise ctx.recipe.error("compile.components", f"the pipeline has no component {component!r}")
        cls_name, config = models.module_config(module)
        for shape in ctx.recipe.shapes:
            factors = ctx.factors(component, cls_name, config, shape, type(pipe).__name__, rank)
            wanted.append(_Wanted(component, shape, factors, keys.key_of(factors), rank))
    return wanted


def _open_entries(ctx: Context, store: Store, pipe: Any, wanted: list[_Wanted], report: LoadReport, blocker: str,
                  pulled: set[str], remote_notes: dict[str, str]) -> list[Planned]:
    """Each wanted entry, hash-verified and checked against the live module by the strategy: a hit,
    or a miss with its reason (the factors that differ from the nearest entry, when not built)."""
    from aotbuild.strategies import order as auto

    planned = []
    manifests: Entries | None = None  # read once, on the first miss to explain
    for component in ctx.recipe.compile.components:
        module = getattr(pipe, component)
        live: dict[str, Any] = {}  # the module's dependency snapshot, taken once (aotbuild/pipeline/dependencies.py)
        entries: list[Entry] = []
        for w in (w for w in wanted if w.component == component):
            entry, reason = store.open_entry(w.key) if not blocker else (None, None)
            why = blocker or str(reason)
            if entry is not None and auto.is_auto(ctx.recipe):
                why = _auto_problem(ctx, entry, w) or _one_strategy(entries, entry)
                serving = ctx if why else auto.concrete(ctx, entry.manifest.strategy)
                entry = None if why else entry
            else:
                serving = ctx
            if entry is not None:
                why = (_structure_problem(module, component, entry)
                       or _dependency_problem(module, component, entry, live, ctx.recipe.offload == "none",
                                              _compiled_paths(module, ctx.recipe))
                       or serving.strategy.check(serving, module, component, entry))
                entry = None if why else entry
            if entry is not None:
                store.touch(w.key)  # recency for gc; skipped where the store is read-only
                entries.append(entry)
                report.entries.append(ReportEntry(component, w.shape, w.key, True, pulled=w.key in pulled,
                                                  strategy=entry.manifest.strategy))
                continue
            if reason is not None and reason.kind is Unusable.NOT_BUILT:
                manifests = manifests if manifests is not None else Entries(store.iter_manifests())
                why = explain_miss(manifests, ctx.recipe.name, component, w.factors, store.root)
            report.entries.append(ReportEntry(component, w.shape, w.key, False, why + remote_notes.get(w.key, "")))
        planned.append(Planned(component, module, entries))
    return planned


def _one_strategy(entries: list[Entry], entry: Entry) -> str:
    """One strategy serves a component (its dispatcher is that strategy's): an auto entry of another
    shape of it, built with another strategy than the entries already taken, misses, saying so."""
    taken = entries[0].manifest.strategy if entries else entry.manifest.strategy
    if taken == entry.manifest.strategy:
        return ""
    return (f"auto chose {printable(entry.manifest.strategy)} for this shape and {printable(taken)} for another "
            f"of this component, and one strategy serves a component: build with strategy: {printable(taken)}")


def _structure_problem(module: Any, component: str, entry: Entry) -> str:
    """Whether the live module is the one the entry was built for, before any call (aotbuild/pipeline/structure.py)."""
    from aotbuild.pipeline.structure import mismatch

    return mismatch(module, entry.manifest.structure or {}, component)


def _compiled_paths(module: Any, recipe: Recipe) -> list[str]:
    """The module paths whose graphs an entry holds: the component itself (""), or a regional recipe's
    blocks (the rest of the component runs eagerly)."""
    if recipe.compile.scope != "regional":
        return [""]
    from aotbuild.pipeline.blocks import select_blocks

    return [name for name, _ in select_blocks(module, recipe.compile.blocks, recipe)]


def _dependency_problem(module: Any, component: str, entry: Entry, live: dict[str, Any], devices: bool,
                        paths: list[str] | None = None) -> str:
    """Whether what the entry's graphs depend on beyond their inputs (attributes, processors, hooks,
    weights' layout: aotbuild/pipeline/dependencies.py) is what the live module has; an entry without that
    record (an older aotbuild) misses: nothing proves it computes what this module does (issue 31).
    ``paths``: the compiled modules (a regional recipe's blocks: each compared as the per-call check
    compares it, what is outside them runs eagerly); default: the component."""
    from aotbuild.pipeline import dependencies

    recorded = (entry.manifest.structure or {}).get("dependencies")
    if not live:
        live.update(dependencies.snapshot(module))
    for path in paths if paths is not None else [""]:
        why = dependencies.diff(recorded, live, component, under=path, ignore=dependencies.ROOT_OUTSIDE)
        if why and not devices and recorded and recorded.get("version") == dependencies.VERSION \
                and dependencies.only_devices(recorded, live, path, dependencies.ROOT_OUTSIDE):
            continue  # offload: the weights move between the CPU and the device between calls
        if why:
            return why
    return ""


def _callers(ctx: Context, pipe: Any, planned: list[Planned], on_miss: str, strict_shapes: bool) -> None:
    """Each dispatcher told who calls it, so that a refusal speaks the caller's terms (issue 55): the
    pipeline, the policy in the user's words, and each built signature's shape as the pipeline takes it;
    and the component's own (full scope) the timestep conversions its entries proved (issue 56)."""
    from aotbuild import forwards
    from aotbuild.dispatch import dispatchers
    from aotbuild.pipeline import callterms, timesteps

    policy = callterms.policy_words(on_miss, strict_shapes)
    prompts = ctx.recipe.warmup_factors(ctx.target.warmup_defaults)["prompt"]["texts"]
    guidance = _built_guidance(ctx, pipe)
    for p in planned:
        built: dict[str, callterms.Terms] = {}
        text: dict[str, int] = {}
        for e in p.entries:
            terms = callterms.built_terms(e.manifest.shape, prompts, guidance)
            measured = e.manifest.build.get("text")
            length = measured.get("warmup_length") if isinstance(measured, dict) else None
            for sig in (*e.manifest.signatures, *(r["signature"] for r in e.manifest.packages)):
                built.setdefault(sig, terms)
                if isinstance(length, int) and not isinstance(length, bool):
                    text.setdefault(sig, length)
        for d in dispatchers(p.module):
            own = built if all(sig in built for sig in d.routes) or len(p.entries) != 1 else \
                {**{sig: next(iter(built.values())) for sig in d.routes}, **built}  # a regional block's calls
            d.caller = callterms.Caller(pipe, policy, own, text)
        if ctx.recipe.compile.scope == "full":
            # each entry's proof with its own signatures: it decides the calls it serves (issue 56)
            conversions = timesteps.Conversions.of(p.module, [
                (e.manifest.build.get("timestep"),
                 (*e.manifest.signatures, *(r["signature"] for r in e.manifest.packages))) for e in p.entries])
            for d in forwards.layers(p.module, forwards.DISPATCH):
                d.timesteps = conversions


def _built_guidance(ctx: Context, pipe: Any) -> bool | None:
    """Whether the recipe's warmup ran with classifier-free guidance, for a pipeline that says so
    (``do_classifier_free_guidance``: SD, SDXL, Wan); None for any other."""
    import inspect

    if not isinstance(getattr(type(pipe), "do_classifier_free_guidance", None), property):
        return None
    scale = ctx.recipe.warmup_arguments(ctx.target.warmup_defaults).get("guidance_scale")
    if scale is None:
        try:
            scale = inspect.signature(type(pipe).__call__).parameters["guidance_scale"].default
        except (KeyError, TypeError, ValueError):
            return None
    return scale > 1 if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None


def _watch(planned: list[Planned], on_miss: str, devices: bool, situation: advice.Situation) -> None:
    """Each compiled module's dispatcher re-checks, once per call, what its graphs depend on (armed
    from the module, which matched the entry at load); a change follows ``on_miss``, and a refusal's
    advice names the cache this load read (``situation``)."""
    from aotbuild.dispatch import Dispatcher
    from aotbuild.pipeline import dependencies

    for p in planned:
        records = [r for e in p.entries if (r := (e.manifest.structure or {}).get("dependencies"))]
        if not records:
            continue
        # One module, so one snapshot; the global states seen are every shape's build's.
        states = [s for r in records for s in r.get("globals") or []]
        # Compared with what the module held at its first call at build (a pipeline may set a processor
        # for its calls: diffusers' PAG), not before the warmup as the load-time check is.
        recorded = {**dependencies.at_call(records[0]),
                    "globals": [s for i, s in enumerate(states) if s not in states[:i]]}
        for path, sub in p.module.named_modules():
            d = vars(sub).get("forward")
            if isinstance(d, Dispatcher) and d.routes:
                d.watch = dependencies.Watch(sub, recorded, p.component, path, devices=devices)
                d.on_stale = on_miss
                d.situation = situation


def _situation(recipe: Recipe, root: Path, remote: Remote | None, passed: bool) -> advice.Situation:
    """Where this load missed, for its advice (aotbuild/advice.py): the recipe's file (none for data),
    the cache it read, the remote it asked, and whether the caller passed its pipeline."""
    files = (recipe.source,) if recipe.source != DATA_SOURCE else ()
    return advice.Situation(files, root, remote.url if remote is not None else "", passed)


def _next_step(recipe: Recipe, blocker: str, situation: advice.Situation, passed: Any = None) -> str:
    """What builds the misses (into the cache this load read, aotbuild/advice.py): for a pipe the
    caller passed (maybe not the recipe's model), the build for that pipeline object, with the
    ``changes`` it re-creates (or why it cannot)."""
    if blocker:
        return ""
    line = advice.build_line(situation)
    if passed is not None:
        from aotbuild.features.registry import detect_changes
        from aotbuild.pipeline import changes

        found = detect_changes(passed, recipe)
        declared = recipe.changes is not None
        if declared and (found.refused or not changes.same_keys(recipe, found.changes)):
            # build(recipe, pipe=pipe) builds the recipe's changes: entries this pipe misses again
            held = changes.as_recipe_text(found.changes) if found.changes else "none of them"
            return (f"\n  next: {printable(recipe.source)} declares {changes.as_recipe_text(recipe.changes)} and this "
                    f"pipeline holds {held}{': ' + found.refused if found.refused else ''}; make the pipeline's "
                    f"changes the recipe's, or load without pipe= (the recipe's load applies them)")
        if declared:
            found = changes.Detected(None)
        if found.refused:
            return (f"\n  next: this pipeline cannot be built for: {found.refused}; undo that change, or load with "
                    f"on_miss=\"eager\"")
        if found.changes is not None:
            line += f" (it re-applies the pipeline's {changes.as_recipe_text(found.changes)}: declare that in the " \
                    f"recipe and CI can pre-build it)"
    return f"\n  {line}" + (" (or load with remote=URL to fetch CI-built entries)" if not situation.remote else "")


def _call_policy(on_miss: str, strict_shapes: bool) -> str:
    """What a call at an unbuilt shape does: on_miss="error" means this pipeline never compiles, so
    it raises (strict_shapes is implied); strict_shapes=True raises under the other policies too;
    otherwise on_miss="eager" keeps such calls eager and "compile" compiles, as torch.compile would."""
    return "error" if strict_shapes or on_miss == "error" else on_miss


def _announce(report: LoadReport, recipe: Recipe, on_miss: str, blocker: str, situation: advice.Situation) -> None:
    """The report at INFO; a warning naming the misses, if any, and what builds them."""
    log.info("%s", report)
    if not report.misses:
        return
    then = "compiles on first call" if on_miss == "compile" else "runs eagerly"
    misses = "; ".join(f"{e.component} {e.shape} ({e.key[:12]}): {printable(e.reason)}" for e in report.misses[:3])
    more = f"; and {len(report.misses) - 3} more" if len(report.misses) > 3 else ""
    build = "" if blocker else f"; `{advice.build_command(situation)}` builds them"
    warnings.warn(f"aotbuild: {recipe.name}: {len(report.misses)} of {len(report.entries)} entries missed, each "
                  f"{then}: {misses}{more} (pipe.aotbuild_report has them all{build})", stacklevel=3)


def _pull_missing(store: Store, remote: Remote, wanted: list[str]) -> tuple[set[str], dict[str, str]]:
    """Fetch the keys the local store lacks (before the load takes its lock: a download may be long).

    Returns (keys pulled, key -> why not, as a note for the miss). A remote that is down is tried
    once: huggingface_hub already retried for ~20 s, so the other keys do not pay that again."""
    from aotbuild.remote.schemes import pull_entry

    pulled, notes = set(), {}
    down = ""
    for key in dict.fromkeys(wanted):
        if store.check_entry(key)[0]:
            continue
        try:
            why = down or pull_entry(remote, key, store)  # "" when it is now in the local store
        except RemoteError as exc:
            why = down = f"{exc} (not retried for the other entries)"
        if why:
            notes[key] = f" ({remote.url}: {why})"
        else:
            pulled.add(key)
    return pulled, notes


def _check_pipe(pipe: Any, ctx: Context) -> None:
    import torch

    want_dtype = getattr(torch, ctx.dtype)
    want_kind, _, want_index = ctx.device.partition(":")
    for component in ctx.recipe.compile.components:
        module = getattr(pipe, component, None)
        if module is None:
            raise ctx.recipe.error("compile.components", f"the pipeline passed has no component {component!r}")
        param = next(module.parameters(), None)
        if param is None:
            continue
        if param.dtype != want_dtype:
            raise UsageError(f"the pipeline's {component} is {str(param.dtype).replace('torch.', '')} but "
                             f"{ctx.recipe.source} says {ctx.dtype}: convert it, or fix model.dtype")
        if param.device.type != want_kind or (want_index and str(param.device.index) != want_index):
            raise UsageError(f"the pipeline's {component} is on {param.device} but {ctx.recipe.source} says "
                             f"{ctx.device}: move it with pipe.to({ctx.device!r}), or fix device")
