"""Recipes as users give them: files, folders of files, dicts, Recipe objects, validated in full.

:func:`parse_recipe` is the one entry point for recipe data: the structural checks of
aotbuild/recipe/schema.py (keys, types, allowed values: target and strategy names from the registries),
then the rules that need more than the data: a built-in model that exists, the cross-key rules, and
what the recipe's target and strategy accept (``Target.validate``, ``Strategy.validate``, which
include whether this torch can run the strategy). Every problem is a :class:`RecipeError` naming the
file and the key. :func:`load_recipe` reads a file (aotbuild/recipe/files.py, bounded),
:func:`resolve_recipes` turns what ``plan``, ``build``, ``push``, ``pull`` and ``sign`` accept into
Recipes (:func:`recipe_items`: the one rule of what they take), :func:`as_recipe` the one recipe
``load_compiled`` takes.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from aotbuild import builtin
from aotbuild.errors import RecipeError, UsageError
from aotbuild.recipe.files import find_recipes, read_recipe_data
from aotbuild.recipe.schema import DATA_SOURCE, Recipe, check_structure_rules, describe_value, parse_structure
from aotbuild.strategies.registry import get_strategy, strategy_names
from aotbuild.targets.registry import get_target, target_names
from aotbuild.utils.deprecated import positional_shim
from aotbuild.utils.suggest import suggest

__all__ = ["parse_recipe", "load_recipe", "as_recipe", "recipe_from_spec", "load_recipes", "resolve_recipes",
           "recipe_items", "registry_choices", "Recipes", "RecipeLike", "find_recipes"]


def registry_choices() -> dict[str, tuple[str, ...]]:
    """The names a recipe's ``target:`` and ``strategy:`` may take: those registered."""
    return {"target": target_names(), "strategy": strategy_names()}


@positional_shim("source", "name")
def parse_recipe(data: Any, *, source: str = DATA_SOURCE, name: str | None = None,
                 folder: str | None = None) -> Recipe:
    """Validate recipe data (a YAML file's structure, e.g. a plain dict) into a :class:`Recipe`.

    Validated exactly like a file: every error is a :class:`RecipeError` naming the key. ``source``:
    the file it came from, if any (what errors and ``build`` hints name). ``name``
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
    if recipe.schedulers is not None:  # diffusers' classes, "did you mean" (issue 56)
        from aotbuild.pipeline.schedulers import check_names

        check_names(recipe)
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
    from aotbuild.recipe.schema import prompt_count

    def over(name: str, key: str, value: int, what: str) -> None:
        _over(recipe, name, key, value, what)

    warmup = recipe.warmup
    for name in ("num_inference_steps", "max_sequence_length", "num_frames"):  # counts: whole numbers
        value = warmup.get(name)  # (a float slipped past the bounds: PNDM runs 100000.0 steps)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise recipe.error(f"warmup.{name}", f"expected a whole number from 1, got {describe_value(value)}")
    for name in sorted(PROMPT_ARGUMENTS & set(warmup)):
        over("prompts", f"warmup.{name}", prompt_count(warmup[name]), "prompts")
    _check_warmup_values(recipe)
    options = recipe.compile.options
    for key, what in (("compile_threads", "compile processes"), ("compile-threads", "compile processes"),
                      ("cpp.threads", "threads per CPU kernel")):  # a pool of processes; OpenMP's num_threads
        threads = options.get(key)
        if isinstance(threads, int) and not isinstance(threads, bool):
            over("compile_threads", f"compile.options.{key}", threads, what)
    over("shapes", "shapes", len(recipe.shapes), "shapes")
    if recipe.lora is not None and recipe.lora.target_modules is not None:  # a key factor (aotbuild/features/lora.py)
        over("lora_targets", "lora.target_modules", len(set(recipe.lora.target_modules)), "target modules")
    check_pixels(recipe)
    over("jobs", "compile.components", job_count(recipe), "jobs (components x shapes x tensor-parallel ranks)")


#: What a warmup argument's numbers measure, by its name (the warmup key, or for a nested value the
#: nearest mapping key), the first pattern that matches: ``pipeline-specific arguments`` are bounded by
#: what they are, not by a list of names (docs/recipes.md, "Limits"). A list under a count's name holds
#: counts run one after another (``pyramid_num_inference_steps_list``): their sum is the count.
WARMUP_CLASSES = (
    (re.compile(r"seed"), "seed"),  # picks noise, no work: any whole number a generator takes
    (re.compile(r"(^|_)(timesteps|sigmas)$"), "schedule"),  # a custom schedule: one step per item
    (re.compile(r"steps"), "steps"),  # prior_num_inference_steps, num_warmup_steps, ..._steps_list
    (re.compile(r"frames$|video_length$"), "frames"),  # num_frames, video_length (Latte)
    (re.compile(r"per_prompt$|batch"), "batch"),  # num_waveforms_per_prompt: images (outputs) per call
    (re.compile(r"_in_s$|seconds|duration"), "seconds"),  # audio_length_in_s, audio_end_in_s
    (re.compile(r"length|sequence|tokens"), "sequence"),  # max_sequence_length, ..._length
    (re.compile(r"scale|strength|guidance|weight|eta$"), "weight"),  # a factor on a tensor
    (re.compile(r"^num_|count|size|chunk|_len$|window|stride|overlap"), "count"),
)
#: The bound (a LIMITS name) and the words of each class whose numbers are counts of work.
_COUNTS = {"steps": ("steps", "warmup steps"), "batch": ("batch", "outputs per prompt"),
           "seconds": ("warmup_seconds", "seconds of output"), "sequence": ("sequence", "tokens per prompt"),
           "count": ("warmup_number", "(a count)")}


def warmup_class(name: str) -> str:
    """What the numbers of warmup argument ``name`` measure (:data:`WARMUP_CLASSES`); ``number`` when
    nothing matches: any other number is held to AOTBUILD_MAX_WARMUP_NUMBER, in case it is a size."""
    return next((kind for pattern, kind in WARMUP_CLASSES if pattern.search(name.lower())), "number")


def _check_warmup_values(recipe: Recipe) -> None:
    """Every value of the warmup, nested or not, by its name's class: the values in all (list items
    and mapping values, however nested, counted as the walk goes, so an alias is never expanded past
    the bound), each list's length, and each number (int or float; bool is not a number here)."""
    import math

    from aotbuild.constants import LIMITS, limit

    items, seen = limit("warmup_items"), 0
    stack: list[tuple[str, str, Any]] = [(f"warmup.{k}", k, v) for k, v in recipe.warmup.items()]
    while stack:
        key, name, value = stack.pop()
        seen += 1
        if seen > items:
            raise recipe.error(key, f"more than {items} values in the warmup, nested lists and mappings counted "
                                    f"item by item: at most {items} (raise it with {LIMITS['warmup_items'][0]})")
        kind = warmup_class(name)
        if isinstance(value, Mapping):
            stack += [(f"{key}.{k}", str(k), v) for k, v in value.items()]
        elif isinstance(value, (list, tuple)):
            if kind == "schedule":
                _over(recipe, "steps", key, len(value), f"warmup steps (items of {name})")
            elif kind in _COUNTS or kind == "frames":  # counts run one after another: their sum
                numbers = [v for v in value if isinstance(v, (int, float)) and not isinstance(v, bool)]
                total = sum(v for v in numbers if math.isfinite(v))
                _check_number(recipe, key, name, kind, total if len(numbers) == len(value) else 0, what="sum of ")
            stack += [(f"{key}[{i}]", name, v) for i, v in enumerate(value)]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            _check_number(recipe, key, name, kind, value)


def _check_number(recipe: Recipe, key: str, name: str, kind: str, value: float, what: str = "") -> None:
    import math

    from aotbuild.constants import LIMITS, limit
    from aotbuild.recipe.schema import MAX_FRAMES

    if not math.isfinite(value):
        raise recipe.error(key, f"expected a finite number, got {describe_value(value)}")
    whole = isinstance(value, int) or bool(what)
    if kind == "seed":
        if not whole or not 0 <= value < 2 ** 64:
            raise recipe.error(key, f"a seed is a whole number from 0 to 2^64-1, got {describe_value(value)}")
    elif kind in ("weight", "schedule"):  # a factor on a tensor (guidance_scale: 1e6 costs nothing more), a
        return  # noise level or timestep of a custom schedule (its length is the steps): finite is enough
    elif kind == "frames":
        if not whole or not 1 <= value <= MAX_FRAMES:
            raise recipe.error(key, f"{what}{value} is not allowed: 1 to {MAX_FRAMES} (whole frames)")
    elif kind in _COUNTS:
        bound, words = _COUNTS[kind]
        if kind != "seconds" and not whole:
            raise recipe.error(key, f"expected a whole number ({name} is a count), got {describe_value(value)}")
        if value < 0:
            raise recipe.error(key, f"expected a number from 0, got {describe_value(value)}")
        if value > limit(bound):
            raise recipe.error(key, f"{what}{value} {words}: at most {limit(bound)} (raise it with "
                                    f"{LIMITS[bound][0]})")
    elif abs(value) > limit("warmup_number"):  # an argument no pattern knows: it may be a size
        raise recipe.error(key, f"{value}: at most {limit('warmup_number')} in size for an argument aotbuild "
                                f"cannot tell from a size (raise it with {LIMITS['warmup_number'][0]})")


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


#: The frames the pixel bound counts for a video pipeline whose ``num_frames`` default is None: it
#: computes its own from the model's config (CogVideoX 49, SVD 14 or 25, Allegro 88, LTX-2 121), which
#: plan does not load, so the largest whole default among diffusers' video pipelines (LTX's) stands in;
#: a recipe that sets ``num_frames`` is counted exactly.
UNKNOWN_DEFAULT_FRAMES = 161


def check_pixels(recipe: Recipe, default_frames: int | None = 1) -> None:
    """The images and pixels of each shape's warmup call (docs/recipes.md, "Limits"): images of all its
    prompts. ``default_frames``: what a video pipeline makes where neither the shape nor the warmup
    sets ``num_frames`` (its ``__call__``'s default, 81 for Wan), known once the pipeline is
    (aotbuild/pipeline/pipecall.py); counting 1 there let a 16384x8192 shape make 81 times the bound."""
    from aotbuild.constants import PROMPT_ARGUMENTS
    from aotbuild.recipe.schema import prompt_count

    warmup = recipe.warmup
    texts = max([1, *(prompt_count(warmup[name]) for name in PROMPT_ARGUMENTS & set(warmup))])
    counts = {k: v for k, v in warmup.items() if isinstance(v, int) and not isinstance(v, bool) and v > 0}
    # the warmup's frames: num_frames, or what a pipeline calls them (Latte's video_length); whole numbers
    frames = max([0, *(v for k, v in counts.items() if warmup_class(k) == "frames")]) or None
    per_prompt = sorted((k, v) for k, v in counts.items() if warmup_class(k) == "batch")  # num_waveforms_per_prompt
    outputs = math.prod(v for _, v in per_prompt)
    more = "".join(f" x {v} {k}" for k, v in per_prompt)
    for i, shape in enumerate(recipe.shapes):
        batch = shape.batch_size * texts * outputs
        _over(recipe, "batch", f"{recipe.shape_key(i)}.batch_size", batch,
              f"images per warmup call (batch_size {shape.batch_size} x {texts} prompts{more})")
        count = shape.num_frames or frames or default_frames or UNKNOWN_DEFAULT_FRAMES
        unset = "" if shape.num_frames or frames or count == 1 else \
            " (num_frames unset: the pipeline's default)" if default_frames else \
            " (num_frames unset: the pipeline computes its own, counted as the largest default; set num_frames)"
        _over(recipe, "pixels", recipe.shape_key(i), shape.height * shape.width * count * batch,
              f"pixels per warmup call ({shape.height}x{shape.width}, {count} frames{unset}, {batch} images)")


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate one recipe file. Every problem is a :class:`RecipeError`."""
    source = str(path)
    return parse_recipe(read_recipe_data(source), source=source)


def as_recipe(value: Any, function: str = "load_compiled") -> Recipe:
    """The one :class:`Recipe` that ``function`` (a public function's name) takes: a Recipe, a recipe
    file's path (str or os.PathLike) or recipe data (a mapping). A folder or a list is refused by name:
    ``function`` serves one recipe (plan and build take several)."""
    if isinstance(value, Recipe):
        return value
    if isinstance(value, Mapping):
        return parse_recipe(dict(value))
    if isinstance(value, (str, os.PathLike)):
        path = os.fspath(value)
        if isinstance(path, str) and os.path.isdir(path):
            raise UsageError(f"{function}() takes one recipe file, and {path} is a folder: name one of its .yaml "
                             f"files (plan and build take a folder)")
        if isinstance(path, str):
            return load_recipe(path)
    if isinstance(value, (list, tuple)):
        raise UsageError(f"{function}() takes one recipe (a file, a dict or a Recipe), not a "
                         f"{type(value).__name__}: call it once per recipe (plan and build take a list)")
    raise RecipeError(DATA_SOURCE, None, f"expected a recipe file's path, a dict of recipe keys or a Recipe, got "
                                         f"{describe_value(value)}")


def recipe_from_spec(spec: Mapping[str, Any]) -> Recipe:
    """The :class:`Recipe` that :func:`aotbuild.recipe.schema.recipe_spec` wrote, validated again."""
    recipe = parse_recipe(spec["data"], source=spec["source"], name=spec["name"], folder=spec["folder"])
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


#: One recipe as the Python API takes it: a file's path (str or os.PathLike), recipe data (a mapping) or a Recipe.
RecipeLike = str | os.PathLike | Recipe | Mapping[str, Any]
#: What ``plan``, ``build``, ``push``, ``pull`` and ``sign`` take (:func:`recipe_items`): one RecipeLike (the
#: path of a folder: every recipe in it), or a list or tuple of them.
Recipes = RecipeLike | list[RecipeLike] | tuple[RecipeLike, ...]


def recipe_items(recipes: Any, function: str, keys: bool = False) -> list[str | Recipe | Mapping[str, Any]]:
    """The items of what ``function`` (a public function's name) was given, paths as str: one str,
    os.PathLike, mapping or Recipe is one item, a list or a tuple gives its items, and anything else is
    refused naming ``function``. The one rule of the Python API (issue 55): a str is never iterated
    (``push("recipes/x.yaml", remote)`` once walked the file system from ``/``, one character a path).
    ``keys``: the function takes entry keys too (push, sign), which are str items as well."""
    one = (str, os.PathLike, Recipe, Mapping)
    items = [recipes] if isinstance(recipes, one) else recipes
    if not isinstance(items, (list, tuple)) or not all(isinstance(item, one) for item in items):
        bad = recipes if not isinstance(items, (list, tuple)) else next(i for i in items if not isinstance(i, one))
        what = "entry keys, recipe files or folders" if keys else "recipe files or folders"
        raise UsageError(f"{function}() takes {what} (str or os.PathLike), dicts of recipe keys or Recipes: one, or "
                         f"a list or tuple of them; got {describe_value(bad)}")
    out: list[str | Recipe | Mapping[str, Any]] = []
    for item in items:
        path = os.fspath(item) if isinstance(item, os.PathLike) else item
        if isinstance(path, bytes):
            raise UsageError(f"{function}() takes a path as str or os.PathLike of str, got {describe_value(item)}")
        out.append(path)
    return out


def resolve_recipes(recipes: Recipes, function: str = "plan") -> list[Recipe]:
    """Recipe objects for ``recipes`` (:func:`recipe_items`): paths are read (folders searched), dicts
    validated (:func:`parse_recipe`), Recipes taken as they are; names must differ."""
    items = recipe_items(recipes, function)
    paths = [item for item in items if isinstance(item, str)]
    loaded = iter(load_recipes(paths) if paths else [])
    out: list[Recipe] = []
    for item in items:
        if isinstance(item, Recipe):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(parse_recipe(dict(item)))
        else:
            out.extend(loaded)  # every file found, once, where the first path stood
    return _unique_names(out)
