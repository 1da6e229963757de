"""Plans: one job per (recipe, component, shape), each with its key and whether the cache has it.

``Context`` gathers what every job of one recipe shares (target, device, dtype, model, environment);
``plan`` is the Python API behind ``aotbuild plan`` and the first half of ``aotbuild build``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aotbuild import keys, models
from aotbuild.layout import resolve_cache_root
from aotbuild.manifest import Manifest
from aotbuild.recipe import Recipe, Shape, find_recipes, load_recipe
from aotbuild.store import Store
from aotbuild.strategies import Strategy, get_strategy
from aotbuild.targets import Target, get_target

HIT, MISS, UNAVAILABLE = "hit", "miss", "unavailable"


@dataclass
class Context:
    """What the jobs of one recipe share (its target and strategy objects among them). ``problem`` says
    why none of them can be keyed here."""

    recipe: Recipe
    target: Target
    strategy: Strategy
    device: str = ""
    dtype: str = ""
    model: models.ResolvedModel | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    problem: str = ""

    @classmethod
    def create(cls, recipe: Recipe, cache_root: Path, *, resolve_model: bool = True) -> Context:
        target = get_target(recipe.target)
        ctx = cls(recipe, target, get_strategy(recipe.strategy))
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
            compile_settings={**self.target.compile_settings(self.recipe, self.device),
                              **self.strategy.compile_factors(self.target, self.device)},
            environment=self.environment, device_fingerprint=self.fingerprint,
            warmup_defaults=self.target.warmup_defaults,
        )


def job_pipeline(recipe: Recipe, cache_root: Path) -> tuple[Context, Any]:
    """For a build job, a proof or a benchmark child: the recipe's context and its pipeline, loaded
    (progress bar off) and placed on the recipe's device; RuntimeError when it cannot be."""
    ctx = Context.create(recipe, cache_root)
    if ctx.problem:
        raise RuntimeError(ctx.problem)
    assert ctx.model is not None
    pipe = models.load_pipeline(recipe, ctx.model, ctx.dtype, quiet=True)
    models.place_pipeline(pipe, recipe, ctx.device)
    return ctx, pipe


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
    #: A miss's expected build time and entry size, from the nearest cached entry (estimate()).
    estimated_build_s: float | None = None
    estimated_size: int | None = None

    @property
    def label(self) -> str:
        return f"{self.recipe.name}:{self.component}@{self.shape}"

    def as_json(self) -> dict[str, Any]:
        data = {"recipe": self.recipe.name, "source": self.recipe.source, "component": self.component,
                "shape": self.shape.as_dict(), "key": self.key, "status": self.status, "reason": self.reason}
        if self.status == MISS:
            data.update(estimated_build_s=self.estimated_build_s, estimated_size=self.estimated_size)
        return data


#: The factors an entry must share with a job to estimate its cost: the same kind of compile of the
#: same kind of module on the same kind of device (differing shapes, dtypes, versions are fine).
ESTIMATE_SAME = (("component", "class"), ("target", "name"), ("target", "strategy"), ("compile", "scope"),
                 ("device",))


def _factor(factors: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        factors = factors.get(part) if isinstance(factors, dict) else None
    return factors


def estimate(manifests: Iterable[Manifest], factors: dict[str, Any],
             recipe_name: str = "") -> tuple[float, int] | None:
    """(build seconds, entry bytes) of the nearest cached entry: the same component class, target,
    strategy, scope and device fingerprint, then the fewest differing factors (an entry of the same
    recipe, then the smaller key, wins a tie); None when no entry qualifies."""
    best: tuple[tuple[int, bool, str], float, int] | None = None
    for manifest in manifests:
        cached = dict(manifest.factors)
        if any(_factor(cached, p) != _factor(factors, p) for p in ESTIMATE_SAME):
            continue
        seconds = manifest.build.get("seconds") if isinstance(manifest.build, Mapping) else None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            continue  # an entry without a recorded build time cannot estimate one
        rank = (len(keys.differences(cached, factors)), manifest.recipe != recipe_name, manifest.key)
        if best is None or rank < best[0]:
            best = (rank, float(seconds), manifest.size)
    return None if best is None else (best[1], best[2])


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
            cost = None
            if not ok:
                manifests = list(store.iter_manifests()) if manifests is None else manifests
                cost = estimate(manifests, factors, recipe.name)
            if why == "not built":
                assert manifests is not None
                why = explain_miss(manifests, recipe.name, component, factors, store.root)
            jobs.append(Job(recipe, component, shape, key, factors, HIT if ok else MISS, why,
                            *(cost or (None, None))))
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
    return _unique_names([load_recipe(p) for p in files])


def _unique_names(recipes: list[Recipe]) -> list[Recipe]:
    names: dict[str, str] = {}
    for r in recipes:
        if r.name in names:
            from aotbuild.errors import UsageError

            raise UsageError(f"two recipes are named {r.name!r}: {names[r.name]} and {r.source}; rename one")
        names[r.name] = r.source
    return recipes


#: What ``plan`` and ``build`` accept: recipe files or folders, recipe data (dicts), Recipe objects,
#: one of them or a list of them.
Recipes = str | Path | Recipe | Mapping[str, Any] | Sequence[str | Path | Recipe | Mapping[str, Any]]


def resolve_recipes(recipes: Recipes) -> list[Recipe]:
    """Recipe objects for ``recipes``: paths are read (folders searched), dicts validated
    (:func:`aotbuild.recipe.parse_recipe`), Recipes taken as they are; names must differ."""
    from aotbuild.recipe import parse_recipe

    items = [recipes] if isinstance(recipes, (str, Path, Recipe, Mapping)) else list(recipes)
    paths = [str(r) for r in items if isinstance(r, (str, Path))]
    loaded = iter(load_recipes(paths) if paths else [])
    out: list[Recipe] = []
    for item in items:
        if isinstance(item, Recipe):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(parse_recipe(dict(item)))
        elif isinstance(item, (str, Path)):
            out.extend(loaded)  # every file found, once, where the first path stood
        else:
            from aotbuild.recipe import as_recipe

            as_recipe(item)  # raises, naming what was given
    return _unique_names(out)


def plan(recipes: Recipes, cache: str | Path | None = None) -> list[Job]:
    """Every job of every recipe, sorted by key (jobs without a key last), with hit/miss status.

    ``recipes``: recipe files or folders, recipe data as dicts (validated like a file), Recipe
    objects, or a list mixing them."""
    root = resolve_cache_root(cache)
    store = Store(root)
    loaded = resolve_recipes(recipes)
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


__all__ = ["Context", "Job", "plan", "jobs_for", "explain_miss", "estimate", "load_recipes", "resolve_recipes",
           "parse_shard", "shard_jobs", "HIT", "MISS", "UNAVAILABLE"]
