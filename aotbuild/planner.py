"""Plans: one job per (recipe, component, shape), each with its key and whether the cache has it.

``Context`` gathers what every job of one recipe shares (target, device, dtype, model, environment);
``plan`` is the Python API behind ``aotbuild plan`` and the first half of ``aotbuild build``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotbuild import keys, models
from aotbuild.layout import resolve_cache_root
from aotbuild.manifest import Manifest
from aotbuild.recipe import Recipe, Shape, find_recipes, load_recipe
from aotbuild.store import Store
from aotbuild.targets import Target, get_target

HIT, MISS, UNAVAILABLE = "hit", "miss", "unavailable"


@dataclass
class Context:
    """What the jobs of one recipe share. ``problem`` says why none of them can be keyed here."""

    recipe: Recipe
    target: Target
    device: str = ""
    dtype: str = ""
    model: models.ResolvedModel | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    problem: str = ""

    @classmethod
    def create(cls, recipe: Recipe, cache_root: Path, *, resolve_model: bool = True) -> Context:
        target = get_target(recipe.target)
        ctx = cls(recipe, target)
        available = target.availability(recipe.device)
        if not available.ok:
            ctx.problem = f"target unavailable: {available.reason}"
            return ctx
        ctx.device = recipe.device or target.default_device()
        ctx.dtype = recipe.model.dtype or target.default_dtype
        ctx.environment = keys.environment_factors()
        ctx.fingerprint = target.fingerprint(ctx.device)
        if resolve_model:
            try:
                ctx.model = models.resolve_model(recipe, cache_root)
            except models.ModelUnavailable as exc:
                ctx.problem = f"model unavailable: {exc}"
                return ctx
            models.check_components(recipe, ctx.model)
        return ctx

    def factors(self, component: str, component_class: str, config: dict[str, Any], shape: Shape,
                pipeline_class: str) -> dict[str, Any]:
        return keys.job_factors(
            self.recipe, component, component_class, config, shape, pipeline_class=pipeline_class,
            builtin_version=_builtin_version(self.recipe), dtype=self.dtype,
            compile_settings=self.target.compile_settings(self.recipe, self.device),
            environment=self.environment, device_fingerprint=self.fingerprint,
            warmup_defaults=self.target.warmup_defaults,
        )


def _builtin_version(recipe: Recipe) -> int | None:
    """Known from the id alone, so a caller that passes its own pipeline gets the same key."""
    from aotbuild import builtin

    return builtin.lookup(recipe.model.id).version if builtin.is_builtin(recipe.model.id) else None


@dataclass
class Job:
    recipe: Recipe
    component: str
    shape: Shape
    key: str | None
    factors: dict[str, Any] | None
    status: str  # hit | miss | unavailable
    reason: str = ""

    @property
    def label(self) -> str:
        return f"{self.recipe.name}:{self.component}@{self.shape}"

    def as_json(self) -> dict[str, Any]:
        return {"recipe": self.recipe.name, "source": self.recipe.source, "component": self.component,
                "shape": self.shape.as_dict(), "key": self.key, "status": self.status, "reason": self.reason}


def explain_miss(manifests: Iterable[Manifest], recipe_name: str, component: str,
                 factors: dict[str, Any], root: Path | None = None) -> str:
    """Why a job is not built: the factors that differ from the nearest entry for the same component
    (an entry of the same recipe wins a tie; a renamed or copied recipe still finds its entries)."""
    best: tuple[int, int, list[str]] | None = None
    seen = 0
    for manifest in manifests:
        seen += 1
        if manifest.component != component:
            continue
        diff = keys.differences(dict(manifest.factors), factors)
        rank = (len(diff), manifest.recipe != recipe_name)
        if best is None or rank < best[:2]:
            best = (*rank, diff)
    if best is None and not seen and root is not None:  # the classic: built into another cache root
        return f"not built: the cache at {root} is empty (built into another? pass --cache or set AOTBUILD_CACHE)"
    if best is None:
        return f"not built: the cache has no entry for a {component}"
    diff = best[2]
    if not diff:  # same factors, another key: an entry written by another aotbuild key format
        return "not built: an entry with these factors has another key (written by another aotbuild version?)"
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    return f"not built: {shown}"


def jobs_for(ctx: Context, store: Store) -> list[Job]:
    recipe = ctx.recipe
    jobs = []
    manifests: list[Manifest] | None = None  # read once, on the first miss to explain
    for component in recipe.compile.components:
        config: tuple[str, dict[str, Any]] | None = None
        problem = ctx.problem
        if not problem:
            assert ctx.model is not None
            try:
                config = models.component_config(ctx.model, component, recipe.model.revision)
            except models.ModelUnavailable as exc:
                problem = f"model unavailable: {exc}"
        for shape in recipe.shapes:
            if problem or config is None:
                jobs.append(Job(recipe, component, shape, None, None, UNAVAILABLE, problem))
                continue
            factors = ctx.factors(component, config[0], config[1], shape, _pipeline_class(ctx))
            key = keys.key_of(factors)
            ok, why = store.check_entry(key)
            if why == "not built":
                manifests = list(store.iter_manifests()) if manifests is None else manifests
                why = explain_miss(manifests, recipe.name, component, factors, store.root)
            jobs.append(Job(recipe, component, shape, key, factors, HIT if ok else MISS, why))
    return jobs


def _pipeline_class(ctx: Context) -> str:
    """The class ``from_pretrained`` will return: the loaded pipeline's type name is the factor."""
    assert ctx.model is not None
    named = ctx.recipe.model.pipeline
    # AutoPipeline* classes return the model's own pipeline class (model_index.json's _class_name).
    return named if named and not named.startswith("AutoPipeline") else ctx.model.pipeline_class


def load_recipes(paths: list[str] | tuple[str, ...]) -> list[Recipe]:
    files = find_recipes(paths)
    if not files:
        from aotbuild.errors import UsageError

        raise UsageError(f"no recipes (*.yaml) found in {', '.join(map(str, paths))}")
    recipes = [load_recipe(p) for p in files]
    names: dict[str, str] = {}
    for r in recipes:
        if r.name in names:
            from aotbuild.errors import UsageError

            raise UsageError(f"two recipes are named {r.name!r}: {names[r.name]} and {r.source}; rename one")
        names[r.name] = r.source
    return recipes


def plan(recipes: list[str] | tuple[str, ...] | list[Recipe], cache: str | Path | None = None) -> list[Job]:
    """Every job of every recipe, sorted by key (jobs without a key last), with hit/miss status."""
    root = resolve_cache_root(cache)
    store = Store(root)
    loaded = [r for r in recipes if isinstance(r, Recipe)] or load_recipes([str(r) for r in recipes])
    jobs: list[Job] = []
    for recipe in loaded:
        ctx = Context.create(recipe, root)
        if ctx.model is not None and not ctx.problem:  # only plan: jobs and loads check the loaded module
            models.check_blocks(recipe, ctx.model)
        jobs.extend(jobs_for(ctx, store))
    return sorted(jobs, key=lambda j: (j.key is None, j.key or "", j.label))


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` (1-based) -> (I, N)."""
    from aotbuild.errors import UsageError

    head, _, tail = text.partition("/")
    try:
        index, count = int(head), int(tail)
    except ValueError:
        raise UsageError(f"--shard {text!r}: expected I/N, e.g. 2/4") from None
    if count < 1 or not 1 <= index <= count:
        raise UsageError(f"--shard {text!r}: I must be between 1 and N")
    return index, count


def shard_jobs(jobs: list[Job], index: int, count: int) -> list[Job]:
    """The jobs of shard ``index`` of ``count`` (1-based), decided before any job is dropped as a hit.

    The distinct keys of the full job list, sorted, are dealt round-robin: key number k (0-based)
    goes to shard k % count + 1. Every runner of a CI matrix computes the same split whatever its own
    cache holds, each key is built by exactly one shard (two recipes sharing a job share its shard),
    and runners get a balanced count. Jobs without a key (target unavailable) go to shard 1."""
    order = {key: k for k, key in enumerate(sorted({j.key for j in jobs if j.key}))}
    return [j for j in jobs if (order[j.key] % count if j.key else 0) == index - 1]


__all__ = ["Context", "Job", "plan", "jobs_for", "explain_miss", "load_recipes", "parse_shard", "shard_jobs",
           "HIT", "MISS", "UNAVAILABLE"]
