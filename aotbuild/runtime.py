"""``load_compiled``: install a recipe's cached artifacts and return its pipeline, compiled.

The runtime imports what loading needs (torch, diffusers when it loads the pipeline) and nothing
else: no click, no YAML writer, no rich, no Hub client unless the model itself comes from the Hub.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import keys, models
from aotbuild.dispatch import install_dispatcher
from aotbuild.errors import CacheMiss, RemoteError, TargetUnavailable, UsageError
from aotbuild.layout import resolve_cache_root
from aotbuild.locks import store_lock
from aotbuild.manifest import Manifest
from aotbuild.planner import Context, explain_miss
from aotbuild.recipe import Recipe, Shape, as_recipe, build_hint
from aotbuild.store import Entry, Store

if TYPE_CHECKING:
    from aotbuild.remote import Remote

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

    @property
    def hits(self) -> list[ReportEntry]:
        return [e for e in self.entries if e.hit]

    @property
    def misses(self) -> list[ReportEntry]:
        return [e for e in self.entries if not e.hit]

    def as_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe, "cache": self.cache, "installed_files": self.installed_files,
                "present_files": self.present_files, "install_folder": self.install_folder,
                "remote": self.remote, "entries": [
                    {"component": e.component, "shape": e.shape.as_dict(), "key": e.key, "hit": e.hit,
                     "pulled": e.pulled, "reason": e.reason} for e in self.entries]}

    def __str__(self) -> str:
        pulled = sum(e.pulled for e in self.entries)
        lines = [f"aotbuild: {self.recipe}: {len(self.hits)} hit, {len(self.misses)} miss "
                 + (f"({pulled} pulled from {self.remote}) " if pulled else "")
                 + f"(cache {self.cache}; {self.installed_files} files installed into the compiler's cache "
                 f"{self.install_folder or 'folder'}, {self.present_files} were already there)"]
        for e in self.entries:
            status = "hit " if e.hit else "MISS"
            line = f"  {status} {e.component:<14} {str(e.shape):<12} {e.key[:12]}" + ("  pulled" if e.pulled else "")
            if not e.hit:
                line += f"  {e.reason}"
                if self.on_miss != "error":
                    line += f" -> {'compiles on first call' if self.on_miss == 'compile' else 'runs eager'}"
            lines.append(line)
        return "\n".join(lines)


def load_compiled(recipe: str | Path | Recipe | Mapping[str, Any], pipe: Any = None, *, cache: str | Path | None = None,
                  remote: str | Remote | None = None, on_miss: str = "compile", strict_shapes: bool = False) -> Any:
    """Load ``recipe``'s pipeline (or take ``pipe``), install its cached artifacts, compile it.

    ``recipe``: a recipe file's path, recipe data as a dict (the YAML's structure, validated like a
    file: :func:`aotbuild.parse_recipe`) or a :class:`aotbuild.Recipe`.

    ``on_miss`` acts at load when a component x shape has no usable entry: ``"compile"`` (warn, then
    compile on first call as torch.compile would), ``"eager"`` (warn, run that shape eagerly) or
    ``"error"`` (raise :class:`aotbuild.CacheMiss`). ``strict_shapes=True`` acts at call time: a call
    at a shape that was not built raises :class:`aotbuild.ShapeNotBuilt` instead of compiling.
    ``remote`` (``"file:///shared/cache"``, ``"hf://org/cache"``) fetches only the entries this load
    needs and the local store lacks, verified, into the local store first; without it there is no
    network access at all.
    The report is ``pipe.aotbuild_report`` and is logged at INFO.
    """
    if remote is not None:
        from aotbuild.remote import parse_remote

        remote = parse_remote(remote) if isinstance(remote, str) else remote
    if on_miss not in ON_MISS:
        raise UsageError(f"on_miss={on_miss!r} is not allowed (allowed: {', '.join(ON_MISS)})")
    recipe = as_recipe(recipe)
    root = resolve_cache_root(cache)
    store = Store(root)
    ctx = Context.create(recipe, root, resolve_model=pipe is None)
    if ctx.problem:
        raise TargetUnavailable(f"{recipe.source}: {ctx.problem}")
    if pipe is None:
        assert ctx.model is not None
        pipe = models.load_pipeline(recipe, ctx.model, ctx.dtype)
        models.place_pipeline(pipe, recipe, ctx.device)
    else:
        _check_pipe(pipe, ctx)

    blocker = ctx.target.install_blocker()
    wanted = []  # (component, module, shape, factors, key)
    for component in recipe.compile.components:
        module = getattr(pipe, component, None)
        if module is None:
            raise recipe.error("compile.components", f"the pipeline has no component {component!r}")
        cls_name, config = models.module_config(module)
        for shape in recipe.shapes:
            factors = ctx.factors(component, cls_name, config, shape, type(pipe).__name__)
            wanted.append((component, module, shape, factors, keys.key_of(factors)))
    pulled, remote_notes = _pull_missing(store, remote, [w[4] for w in wanted]) if remote and not blocker \
        else (set(), {})

    # As a reader of the store (its shared lock) from the hash check to the last file installed,
    # so gc or rm cannot remove an entry in between. A read-only store needs no lock.
    with store_lock(root, exclusive=False):
        report = LoadReport(recipe.name, str(root), on_miss=on_miss, remote=remote.url if remote else "")
        plans = []  # (component, module, verified entries)
        manifests: list[Manifest] | None = None  # read once, on the first miss to explain
        for component in recipe.compile.components:
            module = getattr(pipe, component)
            entries: list[Entry] = []
            for _, _, shape, factors, key in (w for w in wanted if w[0] == component):
                entry, why = store.open_entry(key) if not blocker else (None, blocker)
                if entry is not None and recipe.strategy == "aot-package":
                    from aotbuild.targets import aoti

                    why = aoti.check_baked(module, component, entry.manifest.packages)
                    entry = None if why else entry
                if entry is not None:
                    store.touch(key)  # recency for gc; skipped where the store is read-only
                    entries.append(entry)
                    report.entries.append(ReportEntry(component, shape, key, True, pulled=key in pulled))
                else:
                    if why == "not built":
                        manifests = list(store.iter_manifests()) if manifests is None else manifests
                        why = explain_miss(manifests, recipe.name, component, factors, root)
                    reason = why
                    reason += remote_notes.get(key, "")
                    report.entries.append(ReportEntry(component, shape, key, False, reason))
            plans.append((component, module, entries))

        if report.misses and on_miss == "error":
            nxt = "" if blocker else (f"\n  next: {build_hint(recipe)} builds them here"
                                      + (" (or load with remote=URL to fetch CI-built entries)" if remote is None
                                         else ""))
            raise CacheMiss(f"{report}{nxt}")
        aot = recipe.strategy == "aot-package"
        files = [f for _, _, entries in plans for e in entries for f in e.files]
        if aot:  # only the loader's probe files go to Inductor's cache; packages are loaded below
            from aotbuild.targets import aoti

            files = [(rel.split("/", 1)[1], p) for rel, p in files if rel.startswith(aoti.PROBE_DIR + "/")]
        if files:
            result = ctx.target.install(files, ctx.device)
            report.installed_files, report.present_files = result.installed, result.present
            report.install_folder = result.folder
        # A call at an unbuilt shape: strict_shapes raises; on_miss="eager" keeps such calls eager; otherwise
        # (on_miss "compile" or "error", which acted at load) it compiles, as plain torch.compile would.
        policy = "error" if strict_shapes else ("eager" if on_miss == "eager" else "compile")
        for component, module, entries in plans:
            if aot:  # no torch.compile unless a call needs it: importing Dynamo alone costs ~0.7 s here
                fallback = _lazy_compile(ctx, module) if policy == "compile" else None
            elif entries or policy == "compile":
                fallback = ctx.target.compile(module, recipe, ctx.device)
            else:
                fallback = None
            if aot:
                packages = [(package, dict(e.files)[package["path"]]) for e in entries
                            for package in e.manifest.packages]
                routes = aoti.load_packages(module, component, packages, ctx.device)
                if recipe.compile.scope == "regional":  # the component runs eagerly, its blocks dispatch
                    for name, block in aoti.repeated_blocks(module, recipe.compile.blocks, recipe):
                        block_fallback = _lazy_compile(ctx, block, scope="full") if policy == "compile" else None
                        install_dispatcher(block, f"{component}.{name}", routes.get(name, {}), block_fallback, policy)
                    continue
                install_dispatcher(module, component, routes.get("", {}), fallback, policy)
                continue
            routes = {sig: fallback for e in entries for sig in e.manifest.signatures}
            install_dispatcher(module, component, routes, fallback, policy)

    pipe.aotbuild_report = report
    log.info("%s", report)
    if report.misses:
        then = "compiles on first call" if on_miss == "compile" else "runs eagerly"
        misses = "; ".join(f"{e.component} {e.shape} ({e.key[:12]}): {e.reason}" for e in report.misses[:3])
        more = f"; and {len(report.misses) - 3} more" if len(report.misses) > 3 else ""
        build = "" if blocker else f"; {build_hint(recipe)} builds them"
        warnings.warn(f"aotbuild: {recipe.name}: {len(report.misses)} of {len(report.entries)} entries missed, each "
                      f"{then}: {misses}{more} (pipe.aotbuild_report has them all{build})", stacklevel=2)
    return pipe


def _pull_missing(store: Store, remote: Remote, wanted: list[str]) -> tuple[set[str], dict[str, str]]:
    """Fetch the keys the local store lacks (before the load takes its lock: a download may be long).

    Returns (keys pulled, key -> why not, as a note for the miss). A remote that is down is tried
    once: huggingface_hub already retried for ~20 s, so the other keys do not pay that again."""
    from aotbuild.remote import pull_entry

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


def _lazy_compile(ctx: Context, module: Any, scope: str | None = None) -> Any:
    """A fallback that compiles the module's own forward on its first use, not at load.

    ``scope="full"`` compiles ``module`` whole whatever the recipe says (a regional recipe's block)."""
    eager_forward = module.forward
    compiled: list[Any] = []
    recipe = ctx.recipe
    if scope is not None:
        recipe = replace(recipe, compile=replace(recipe.compile, scope=scope))

    def run(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            dispatcher, module.forward = module.forward, eager_forward
            try:
                compiled.append(ctx.target.compile(module, recipe, ctx.device))
            finally:
                module.forward = dispatcher
        return compiled[0](*args, **kwargs)

    return run


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
