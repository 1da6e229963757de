"""Recipes as users give them: files, folders of files, dicts, Recipe objects, validated in full.

:func:`parse_recipe` is the one entry point for recipe data: the structural checks of
aotbuild/recipe.py (keys, types, allowed values: target and strategy names from the registries),
then the rules that need more than the data: a built-in model that exists, the cross-key rules, and
what the recipe's target and strategy accept (``Target.validate``, ``Strategy.validate``, which
include whether this torch can run the strategy). Every problem is a :class:`RecipeError` naming the
file and the key. :func:`load_recipe` reads a file (aotbuild/recipe_file.py, bounded),
:func:`resolve_recipes` turns what ``plan``, ``build`` and ``load_compiled`` accept into Recipes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aotbuild import builtin
from aotbuild.errors import RecipeError, UsageError
from aotbuild.recipe import DATA_SOURCE, Recipe, check_structure_rules, describe_value, parse_structure
from aotbuild.recipe_file import find_recipes, read_recipe_data
from aotbuild.strategies import get_strategy, strategy_names
from aotbuild.suggest import suggest
from aotbuild.targets import get_target, target_names

__all__ = ["parse_recipe", "load_recipe", "as_recipe", "recipe_from_spec", "load_recipes", "resolve_recipes",
           "registry_choices", "Recipes", "find_recipes"]


def registry_choices() -> dict[str, tuple[str, ...]]:
    """The names a recipe's ``target:`` and ``strategy:`` may take: those registered."""
    return {"target": target_names(), "strategy": strategy_names()}


def parse_recipe(data: Any, source: str = DATA_SOURCE, name: str | None = None, *,
                 folder: str | None = None) -> Recipe:
    """Validate recipe data (a YAML file's structure, e.g. a plain dict) into a :class:`Recipe`.

    Validated exactly like a file: every error is a :class:`RecipeError` naming the key. ``name``
    defaults to the file's stem, or for data without a file to ``recipe-<12 hex>``, derived from
    the content (the same data always gets the same name). ``folder``: where a relative
    ``model.id`` folder is resolved (default: the file's folder; for data, the working directory)."""
    recipe = parse_structure(data, source, name, folder=folder, choices=registry_choices())
    _check_combinations(recipe)
    return recipe


def _check_combinations(recipe: Recipe) -> None:
    """Rules that span keys, then what the target and the strategy accept."""
    if builtin.is_builtin(recipe.model.id):
        name = recipe.model.id[len(builtin.PREFIX):]
        if name not in builtin.BUILTINS:
            known = [builtin.PREFIX + n for n in sorted(builtin.BUILTINS)]
            raise recipe.error("model.id", f"unknown built-in model {recipe.model.id!r}"
                                           f"{suggest(recipe.model.id, known)} (known: {', '.join(known)})")
        if recipe.model.revision:
            raise recipe.error("model.revision", "a built-in model has no revisions (it is created locally): "
                                                 "remove model.revision")
    check_structure_rules(recipe)
    _check_bounds(recipe)
    target = get_target(recipe.target)
    target.validate(recipe)
    get_strategy(recipe.strategy).validate(recipe, target)


def _check_bounds(recipe: Recipe) -> None:
    """The work a recipe asks for is bounded (docs/recipes.md, "Limits"); the operator raises a bound
    with its environment variable, a pull request cannot. Every list and size that multiplies the work
    is measured: steps (a count or a custom schedule), prompts, the batch and pixels of each warmup
    call, shapes, and the jobs (processes) of the whole recipe (issue 32)."""
    from aotbuild.constants import PROMPT_ARGUMENTS
    from aotbuild.recipe import MAX_FRAMES, prompt_count

    def over(name: str, key: str, value: int, what: str) -> None:
        _over(recipe, name, key, value, what)

    warmup = recipe.warmup
    for name in ("num_inference_steps", "max_sequence_length", "num_frames"):  # counts: whole numbers
        value = warmup.get(name)  # (a float slipped past the bounds: PNDM runs 100000.0 steps)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise recipe.error(f"warmup.{name}", f"expected a whole number from 1, got {describe_value(value)}")
    steps = warmup.get("num_inference_steps")
    if steps is not None:
        over("steps", "warmup.num_inference_steps", steps, "warmup steps")
    for name in ("timesteps", "sigmas"):  # a custom schedule: one step per item
        if isinstance(warmup.get(name), (list, tuple)):
            over("steps", f"warmup.{name}", len(warmup[name]), f"warmup steps (items of {name})")
    for name in sorted(PROMPT_ARGUMENTS & set(warmup)):
        over("prompts", f"warmup.{name}", prompt_count(warmup[name]), "prompts")
    sequence = warmup.get("max_sequence_length")
    if isinstance(sequence, int) and not isinstance(sequence, bool):
        over("sequence", "warmup.max_sequence_length", sequence, "tokens per prompt")
    frames = warmup.get("num_frames")  # where no shape sets them (aotbuild/pipecall.py refuses both)
    if isinstance(frames, int) and not isinstance(frames, bool) and not 1 <= frames <= MAX_FRAMES:
        raise recipe.error("warmup.num_frames", f"{frames} is not allowed: 1 to {MAX_FRAMES}")
    options = recipe.compile.options
    for key, what in (("compile_threads", "compile processes"), ("compile-threads", "compile processes"),
                      ("cpp.threads", "threads per CPU kernel")):  # a pool of processes; OpenMP's num_threads
        threads = options.get(key)
        if isinstance(threads, int) and not isinstance(threads, bool):
            over("compile_threads", f"compile.options.{key}", threads, what)
    over("shapes", "shapes", len(recipe.shapes), "shapes")
    check_pixels(recipe)
    over("jobs", "compile.components", job_count(recipe), "jobs (components x shapes x tensor-parallel ranks)")


def job_count(recipe: Recipe) -> int:
    """The jobs (processes) a recipe makes: components x shapes x tensor-parallel ranks."""
    return len(recipe.compile.components) * len(recipe.shapes) * recipe.tensor_parallel


def check_total_jobs(recipes: Sequence[Recipe], files: int = 0) -> None:
    """The jobs of one command (``plan``/``build`` of many files, each within its own bound) are bounded
    too (AOTBUILD_MAX_TOTAL_JOBS). ``files``: recipe files about to be read, refused before any is read
    when there are more than the bound (each makes at least one job)."""
    from aotbuild.constants import LIMITS, limit

    bound, variable = limit("total_jobs"), LIMITS["total_jobs"][0]
    if files > bound:
        raise UsageError(f"{files} recipe files in one command: at most {bound} jobs per command, so at most "
                         f"{bound} files (raise it with {variable}, or name fewer recipes)")
    total = sum(job_count(r) for r in recipes)
    if total > bound:
        raise UsageError(f"{total} jobs across {len(recipes)} recipes in one command: at most {bound} (raise it "
                         f"with {variable}, or name fewer recipes)")


def _over(recipe: Recipe, name: str, key: str, value: int, what: str) -> None:
    from aotbuild.constants import LIMITS, limit

    if value > limit(name):
        raise recipe.error(key, f"{value} {what}: at most {limit(name)} (raise it with {LIMITS[name][0]})")


def check_pixels(recipe: Recipe, default_frames: int = 1) -> None:
    """The images and pixels of each shape's warmup call (docs/recipes.md, "Limits"): images of all its
    prompts. ``default_frames``: what a video pipeline makes where neither the shape nor the warmup
    sets ``num_frames`` (its ``__call__``'s default, 81 for Wan), known once the pipeline is
    (aotbuild/pipecall.py); counting 1 there let a 16384x8192 shape make 81 times the bound."""
    from aotbuild.constants import PROMPT_ARGUMENTS
    from aotbuild.recipe import prompt_count

    warmup = recipe.warmup
    texts = max([1, *(prompt_count(warmup[name]) for name in PROMPT_ARGUMENTS & set(warmup))])
    frames = warmup.get("num_frames")  # a whole number or absent (_check_bounds)
    for i, shape in enumerate(recipe.shapes):
        batch = shape.batch_size * texts
        _over(recipe, "batch", f"shapes[{i}].batch_size", batch, f"images per warmup call (batch_size "
                                                                 f"{shape.batch_size} x {texts} prompts)")
        count = shape.num_frames or frames or default_frames
        unset = " (num_frames unset: the pipeline's default)" if not (shape.num_frames or frames) and count > 1 else ""
        _over(recipe, "pixels", f"shapes[{i}]", shape.height * shape.width * count * batch,
              f"pixels per warmup call ({shape.height}x{shape.width}, {count} frames{unset}, {batch} images)")


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate one recipe file. Every problem is a :class:`RecipeError`."""
    source = str(path)
    return parse_recipe(read_recipe_data(source), source)


def as_recipe(value: Any) -> Recipe:
    """A :class:`Recipe` from a Recipe, a path to a recipe file, or recipe data (a mapping)."""
    if isinstance(value, Recipe):
        return value
    if isinstance(value, Mapping):
        return parse_recipe(dict(value))
    if isinstance(value, (str, Path)):
        return load_recipe(value)
    raise RecipeError(DATA_SOURCE, None, f"expected a recipe file's path, a dict of recipe keys or a Recipe, got "
                                         f"{describe_value(value)}")


def recipe_from_spec(spec: Mapping[str, Any]) -> Recipe:
    """The :class:`Recipe` that :func:`aotbuild.recipe.recipe_spec` wrote, validated again."""
    recipe = parse_recipe(spec["data"], spec["source"], spec["name"], folder=spec["folder"])
    if spec.get("pipeline_folder"):
        from dataclasses import replace

        recipe = replace(recipe, pipeline_folder=str(spec["pipeline_folder"]))
    return recipe


def load_recipes(paths: list[str] | tuple[str, ...], errors: list[RecipeError] | None = None) -> list[Recipe]:
    """Every recipe the paths name or hold. With ``errors``, a bad recipe is appended there and the
    others are still loaded (``plan DIR`` reports every bad one); without, the first raises."""
    files = find_recipes(paths)
    if not files:
        raise UsageError(f"no recipes (*.yaml) found in {', '.join(map(str, paths))}")
    check_total_jobs([], len(files))
    loaded = []
    for path in files:
        try:
            loaded.append(load_recipe(path))
        except RecipeError as exc:
            if errors is None:
                raise
            errors.append(exc)
    return _unique_names(loaded)


def _unique_names(recipes: list[Recipe]) -> list[Recipe]:
    """``recipes`` (every recipe of one command): names differ, and their jobs are within the bound."""
    check_total_jobs(recipes)
    names: dict[str, str] = {}
    for r in recipes:
        if r.name in names:
            raise UsageError(f"two recipes are named {r.name!r}: {names[r.name]} and {r.source}; rename one")
        names[r.name] = r.source
    return recipes


#: What ``plan`` and ``build`` accept: recipe files or folders, recipe data (dicts), Recipe objects,
#: one of them or a list of them.
Recipes = str | Path | Recipe | Mapping[str, Any] | Sequence[str | Path | Recipe | Mapping[str, Any]]


def resolve_recipes(recipes: Recipes) -> list[Recipe]:
    """Recipe objects for ``recipes``: paths are read (folders searched), dicts validated
    (:func:`parse_recipe`), Recipes taken as they are; names must differ."""
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
            as_recipe(item)  # raises, naming what was given
    return _unique_names(out)
