"""Recipes fuzzed with hypothesis: whatever the file holds, the answer is a Recipe or one line of
RecipeError naming the file, never a traceback. Bounded (max_examples) to keep CI's budget."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotbuild.errors import RecipeError
from aotbuild.recipe import SCHEMA, Recipe
from aotbuild.recipes import load_recipe, parse_recipe

KEYS = [k for k in SCHEMA] + ["compile", "shapes", "model", "warmup", "nonsense", "ünïcode", ""]
SUBKEYS = ["id", "revision", "dtype", "variant", "pipeline", "components", "scope", "fullgraph", "dynamic",
           "mode", "options", "height", "width", "batch_size", "num_inference_steps", "guidance_scale", "prompt"]

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["builtin:tiny-sd", "inductor", "neuron", "tpu", "cpu", "cuda:0", "float16", "regional",
                     "aot-package", "64", "1e309", "-0", "NaN"]),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(SUBKEYS) | st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)
recipes = st.dictionaries(st.sampled_from(KEYS), values, max_size=8)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _only_recipe_errors(call) -> Recipe | RecipeError:
    """A Recipe, or a one-line RecipeError naming the file; any other exception fails the test."""
    try:
        result = call()
    except RecipeError as exc:
        text = str(exc)
        assert "\n" not in text and exc.source == "fuzz.yaml" and text.startswith("fuzz.yaml: "), text
        return exc
    assert isinstance(result, Recipe), result
    return result


@FUZZ
@given(recipes)
def test_random_structures_give_a_recipe_or_one_line_error(data):
    _only_recipe_errors(lambda: parse_recipe(data, "fuzz.yaml"))


@FUZZ
@given(st.one_of(values, recipes))
def test_random_top_level_values(data):
    _only_recipe_errors(lambda: parse_recipe(data, "fuzz.yaml"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.text(max_size=200), recipes.map(lambda d: yaml.safe_dump(d, allow_unicode=True)),
                 st.binary(max_size=100).map(lambda b: b.decode("latin-1"))))
def test_random_files(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        result = load_recipe(path)
    except RecipeError as exc:
        assert "\n" not in str(exc) and exc.source == str(path) and str(exc).startswith(f"{path}: "), str(exc)
        return
    assert isinstance(result, Recipe), result


# Random structures almost never make a valid recipe: the two strategies below start from valid ones, so
# the accepting path is fuzzed too, and a rejection can be held to naming the one key that was broken.
sides = st.integers(min_value=1, max_value=64).map(lambda n: n * 8)
shapes = st.lists(st.builds(lambda h, w, b: {"height": h, "width": w, "batch_size": b},
                            sides, sides, st.integers(min_value=1, max_value=1024)),
                  min_size=1, max_size=4, unique_by=lambda s: (s["height"], s["width"], s["batch_size"]))
valid_recipes = st.fixed_dictionaries({
    "model": st.fixed_dictionaries({"id": st.sampled_from(["builtin:tiny-sd", "builtin:tiny-flux", "org/model"]),
                                    "dtype": st.sampled_from(["float32", "float16", "bfloat16"])}),
    "target": st.just("inductor"),
    "device": st.just("cpu"),
    "compile": st.fixed_dictionaries({"scope": st.sampled_from(["full", "regional"]),
                                      "mode": st.sampled_from(["default", "max-autotune"]),
                                      "fullgraph": st.booleans()}),
    "shapes": shapes,
    "warmup": st.fixed_dictionaries({"num_inference_steps": st.integers(min_value=1, max_value=50),
                                     "guidance_scale": st.floats(min_value=0, max_value=20)}),
})
#: Every key a recipe can hold, as a path into the data (shapes: the first shape's keys).
KEY_PATHS = ([(k,) for k in SCHEMA] + [(section, k) for section in ("model", "compile") for k in SCHEMA[section]]
             + [("shapes", 0, k) for k in ("height", "width", "batch_size")])


def _path_name(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


@FUZZ
@given(valid_recipes)
def test_valid_recipes_are_accepted_as_written(data):
    recipe = parse_recipe(data, "fuzz.yaml")
    assert [s.as_dict() for s in recipe.shapes] == data["shapes"]
    assert (recipe.model.id, recipe.model.dtype) == (data["model"]["id"], data["model"]["dtype"])
    assert (recipe.compile.scope, recipe.compile.mode, recipe.compile.fullgraph) == \
        (data["compile"]["scope"], data["compile"]["mode"], data["compile"]["fullgraph"])
    assert dict(recipe.warmup) == data["warmup"]


@FUZZ
@given(valid_recipes, st.sampled_from(KEY_PATHS), values)
def test_one_broken_key_is_the_key_the_error_names(data, path, value):
    """A valid recipe with one key set to anything: accepted, or refused naming that key (or a key
    inside it), never another key and never another exception."""
    where = data
    for part in path[:-1]:
        where = where.setdefault(part, {}) if isinstance(where, dict) else where[part]
    where[path[-1]] = value
    outcome = _only_recipe_errors(lambda: parse_recipe(data, "fuzz.yaml"))
    if isinstance(outcome, RecipeError):
        name = _path_name(path)
        assert outcome.key == name or str(outcome.key).startswith((name + ".", name + "[")), (name, str(outcome))
