"""Recipes fuzzed with hypothesis: whatever the file holds, the answer is a Recipe or one line of
RecipeError naming the file, never a traceback. Bounded (max_examples) to keep CI's budget."""

from __future__ import annotations

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotbuild.errors import RecipeError
from aotbuild.recipe import SCHEMA, Recipe, load_recipe, parse_recipe

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


def _only_recipe_errors(call) -> None:
    try:
        result = call()
    except RecipeError as exc:
        text = str(exc)
        assert "\n" not in text and text.startswith("fuzz.yaml"), text
        return
    assert isinstance(result, Recipe)


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
        load_recipe(path)
    except RecipeError as exc:
        assert "\n" not in str(exc) and str(exc).startswith(str(path)), str(exc)


def test_a_valid_shape_survives_the_strategies():
    """The strategies can produce valid recipes too, so the fuzz is not all rejections."""
    recipe = parse_recipe({"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}]}, "fuzz.yaml")
    assert recipe.shapes[0].height == 64
