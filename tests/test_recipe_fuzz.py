"""Recipes fuzzed with hypothesis: whatever the file holds, the answer is a Recipe or one line of
RecipeError naming the file, never a traceback. Bounded (max_examples) to keep CI's budget.

Every key and value below is derived from the schema (aotbuild/recipe/schema.py: SCHEMA and the schemas of
its nested types), so a new key or section is fuzzed without editing this file; a new field *type*
fails here (NESTED, _valid) until it is given its nested schema or its valid values (issue 30: the
hand-written key lists never reached lora, parallel, model.quantization nor num_frames)."""

from __future__ import annotations

import copy
import functools
import re
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aotbuild.errors import RecipeError
from aotbuild.recipe.rules import load_recipe, parse_recipe, registry_choices
from aotbuild.recipe.schema import ADAPTER_SCHEMA, QUANT_SCHEMA, SCHEMA, SHAPE_SCHEMA, Field, Recipe

#: Field types that hold a schema of their own: (that schema, whether it is a list of such mappings).
NESTED: dict[str, tuple[dict[str, Field], bool]] = {
    "quantization": (QUANT_SCHEMA, False), "adapters": (ADAPTER_SCHEMA, True), "shapes": (SHAPE_SCHEMA, True)}


def _walk(schema: dict[str, Any], prefix: tuple = ()) -> list[tuple[tuple, Field]]:
    """Every field of ``schema`` as (its path into recipe data, the Field); a list type's items at index 0."""
    out = []
    for name, spec in schema.items():
        path = prefix + (name,)
        if isinstance(spec, dict):  # a section
            out += _walk(spec, path)
            continue
        out.append((path, spec))
        if spec.type in NESTED:
            nested, is_list = NESTED[spec.type]
            out += _walk(nested, path + ((0,) if is_list else ()))
    return out


FIELDS = _walk(SCHEMA)
SPECS = dict(FIELDS)
#: Every key a recipe can hold, as a path into the data (a list's keys: its first item's).
KEY_PATHS = [path for path, _ in FIELDS] + [(name,) for name, spec in SCHEMA.items() if isinstance(spec, dict)]
#: Every key name at any level, and names that are no key.
NAMES = sorted({p for path, _ in FIELDS for p in path if isinstance(p, str)})
assert {"lora", "parallel", "quantization", "num_frames", "adapters", "quant_type"} <= set(NAMES)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
    st.sampled_from(["builtin:tiny-sd", "inductor", "neuron", "tpu", "cpu", "cuda:0", "float16", "regional",
                     "aot-package", "64", "1e309", "-0", "NaN", "torchao", "int8wo"]),
)
values = st.recursive(
    scalars,
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=8), children, max_size=4)),
    max_leaves=12,
)


def _shaped(schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy:
    """A mapping of some of ``schema``'s keys (and now and then an unknown one), each holding either a
    random value or, for a section or nested type, data shaped like it: validation is reached below
    the first level, where random keys alone almost never get."""
    def value(spec: Any) -> st.SearchStrategy:
        if isinstance(spec, dict):
            return values | _shaped(spec, depth + 1)
        if spec.type in NESTED and depth < 2:
            nested, is_list = NESTED[spec.type]
            inner = _shaped(nested, depth + 1)
            return values | (st.lists(inner, min_size=1, max_size=2) if is_list else inner)
        return values

    known = st.one_of(*[st.tuples(st.just(k), value(spec)) for k, spec in schema.items()])
    unknown = st.tuples(st.sampled_from(["nonsense", "ünïcode", "", "shape"]), values)
    return st.lists(known | unknown, max_size=len(schema) + 1).map(dict)


recipes = _shaped(SCHEMA)
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


def test_the_fuzz_reaches_every_key_of_the_schema():
    """The fuzz's keys are the schema's: each section and each nested type's fields are among them."""
    paths = set(KEY_PATHS)
    assert {("lora", "rank"), ("lora", "adapters", 0, "path"), ("parallel", "tensor"),
            ("model", "quantization", "quant_type"), ("shapes", 0, "num_frames")} <= paths
    for name, spec in SCHEMA.items():
        assert (name,) in paths and all((name, k) in paths for k in (spec if isinstance(spec, dict) else ()))


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


# Random structures almost never make a valid recipe: the strategies below build valid ones from the
# schema, so the accepting path is fuzzed too, and a rejection can be held to naming the key that was broken.
names = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True)
#: Valid values that the field's type alone does not say: a rule of the target, the model or the data.
VALID = {
    ("model", "id"): st.sampled_from(["builtin:tiny-sd", "builtin:tiny-flux", "org/model"]),
    ("model", "revision"): st.none(),  # a Hub id's only: a built-in model has none (set by the broken-key test)
    ("device",): st.sampled_from(["cpu", None]),
    ("compile", "blocks"): st.none(),  # scope: regional's only (set by the broken-key test)
    ("compile", "options"): st.sampled_from([{}, {"max_autotune": False}, {"cpp.simdlen": 8}]),  # Inductor's names
    ("shapes", 0, "height"): st.integers(min_value=1, max_value=64).map(lambda n: n * 8),
    ("shapes", 0, "width"): st.integers(min_value=1, max_value=64).map(lambda n: n * 8),
    ("lora", "adapters", 0, "path"): st.sampled_from(["lora.safetensors", "adapters/style"]),
    ("changes", "freeu"): st.fixed_dictionaries({k: st.floats(0, 2) for k in ("s1", "s2", "b1", "b2")}),
    ("changes", "cache"): st.sampled_from([{"config": "FirstBlockCacheConfig"}, {"config": "X", "threshold": 0.1}]),
    # diffusers' scheduler classes (checked by name when the recipe is read: aotbuild/pipeline/schedulers.py)
    ("schedulers",): st.lists(st.sampled_from(["DDIMScheduler", "EulerDiscreteScheduler",
                                               "DPMSolverMultistepScheduler", "UniPCMultistepScheduler"]),
                              min_size=1, max_size=3, unique=True),
}


@functools.cache
def _valid(path: tuple) -> st.SearchStrategy:
    """A value the field at ``path`` accepts on its own, derived from its type and choices (made once
    per field: building strategies inside every draw tripled the fuzz's time)."""
    spec = SPECS[path]
    if path in VALID:
        return VALID[path]
    kind = spec.type.rstrip("?")
    if spec.registry:
        return st.sampled_from(registry_choices()[spec.registry])
    if kind == "str":
        return st.sampled_from(spec.choices) if spec.choices else names
    if kind == "int":
        return st.integers(min_value=1, max_value=8)
    if kind == "batches":  # a shape's batch_size: one size, or a list of them (issue 56)
        return st.integers(min_value=1, max_value=8) | st.lists(st.integers(1, 8), min_size=1, max_size=3, unique=True)
    if kind == "float":
        return st.floats(min_value=-4, max_value=4)
    if kind == "bool":
        return st.booleans()
    if kind == "list[str]":
        return st.lists(names, min_size=1, max_size=3, unique=True)
    if kind == "mapping":
        return st.dictionaries(names, st.integers(0, 9) | st.booleans() | names, max_size=2)
    if kind in NESTED:
        nested, is_list = NESTED[kind]
        item = _valid_mapping(nested, path + ((0,) if is_list else ()), frozenset())
        # one adapter: hot-swap is verified with one (recipe.py refuses more); shapes: up to 3
        return st.lists(item, min_size=1, max_size=1 if kind == "adapters" else 3) if is_list else item
    raise AssertionError(f"fuzz: no valid values for field type {spec.type!r} ({'.'.join(map(str, path))}): "
                         "add them to _valid (or its nested schema to NESTED)")


_MAPPINGS: dict[tuple, st.SearchStrategy] = {}
_SOMETIMES = st.integers(0, 3)


def _valid_mapping(schema: dict[str, Any], prefix: tuple, forced: frozenset) -> st.SearchStrategy:
    """Mappings of ``schema``'s keys with valid values: required keys always, the others now and then,
    and every key on a ``forced`` path (so that the key a test breaks has its section around it)."""
    if (prefix, forced) in _MAPPINGS:
        return _MAPPINGS[prefix, forced]
    parts = []
    for name, spec in schema.items():
        path = prefix + (name,)
        wanted = any(f[:len(path)] == path for f in forced)
        if isinstance(spec, dict):
            parts.append((name, wanted or name == "model", _valid_mapping(spec, path, forced)))
        else:
            parts.append((name, spec.required or wanted, _valid(path)))

    @st.composite
    def mapping(draw) -> dict:
        out: dict[str, Any] = {}
        for name, always, values_of in parts:
            if always or draw(_SOMETIMES) == 0:
                value = draw(values_of)
                if value is not None:
                    out[name] = value
        return out

    _MAPPINGS[prefix, forced] = mapping()
    return _MAPPINGS[prefix, forced]


def _repaired(data: dict, forced: frozenset) -> dict | None:
    """``data`` once the parser accepts it: each optional key a refusal names is dropped (the rules
    across keys, lora with quantization, a strategy's limits, ..., are the parser's, not this file's);
    None when a refusal names a required or a forced key."""
    for _ in range(len(KEY_PATHS)):
        try:
            parse_recipe(data, "fuzz.yaml")
            return data
        except RecipeError as exc:
            path = _held(data, str(exc.key))
        general = tuple(0 if isinstance(p, int) else p for p in (path or ()))
        if not path or getattr(SPECS.get(general), "required", False) or \
                any(f[:len(general)] == general or general[:len(f)] == f for f in forced):
            return None
        _remove(data, path)
    return None


def valid_recipes(forced: set = frozenset()) -> st.SearchStrategy:
    """Recipes built from the schema that parse (repaired by the parser's refusals)."""
    forced = frozenset(forced)
    return _valid_mapping(SCHEMA, (), forced).map(lambda d: _repaired(d, forced)).filter(lambda d: d is not None)


@settings(FUZZ, max_examples=100)  # each example holds many fields; the broken-key test draws 300 more
@given(valid_recipes())
def test_valid_recipes_are_accepted_as_written(data):
    recipe = parse_recipe(data, "fuzz.yaml")
    sizes = [(w, w.get("batch_size", 1)) for w in data["shapes"]]  # a list of sizes is one shape per size
    expanded = [{**w, "batch_size": b} for w, listed in sizes for b in (listed if isinstance(listed, list) else
                                                                         [listed])]
    assert [shape.as_dict() for shape in recipe.shapes] == expanded
    assert recipe.model.id == data["model"]["id"] and recipe.model.dtype == data["model"].get("dtype")
    quant = data["model"].get("quantization")
    assert (recipe.model.quantization is None) == (quant is None)
    if quant is not None:
        assert (recipe.model.quantization.backend, recipe.model.quantization.quant_type) == \
            (quant["backend"], quant["quant_type"])
    for section in ("compile", "parallel"):
        for key, value in data.get(section, {}).items():
            got = getattr(getattr(recipe, section), key)
            assert got == (tuple(value) if isinstance(value, list) else value), (section, key)
    if "lora" in data:
        assert recipe.lora.rank == data["lora"]["rank"]
        assert [(a.path, a.adapter_name) for a in recipe.lora.adapters] == \
            [(a["path"], a["adapter_name"]) for a in data["lora"]["adapters"]]
    assert dict(recipe.warmup) == data.get("warmup", {})


def _path_name(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else p) for i, p in enumerate(path))


def _held(data: Any, key: str) -> tuple | None:
    """The path of the key an error names (``lora.adapters[0].path``, ``compile.options.cpp.simdlen``)
    if ``data`` holds it, else None."""
    path: list = []
    rest = key
    while rest:
        if isinstance(data, list):
            m = re.match(r"\[(\d+)\]\.?", rest)
            if not m or int(m.group(1)) >= len(data):
                return None
            path.append(int(m.group(1)))
            data, rest = data[int(m.group(1))], rest[m.end():]
        elif isinstance(data, dict):  # the longest key that starts the rest (option names hold dots)
            found = max((k for k in data if isinstance(k, str) and re.match(re.escape(k) + r"(\.|\[|$)", rest)),
                        key=len, default=None)
            if found is None:
                return None
            path.append(found)
            data, rest = data[found], rest[len(found):].lstrip(".")
        else:
            return None
    return tuple(path)


def _remove(data: dict, path: tuple) -> None:
    where = data
    for part in path[:-1]:
        where = where[part]
    del where[path[-1]]


def _broken(data: dict, path: tuple, value: Any) -> None:
    """Set ``path`` in ``data`` to ``value``; then the refusal, if any, must be about ``path``."""
    where = data
    for part in path[:-1]:
        where = where[part]
    where[path[-1]] = value
    name = _path_name(path)
    for _ in range(len(KEY_PATHS)):
        outcome = _only_recipe_errors(lambda: parse_recipe(data, "fuzz.yaml"))
        if not isinstance(outcome, RecipeError):
            return
        key = str(outcome.key)
        if key == name or key.startswith((name + ".", name + "[")) or name.startswith((key + ".", key + "[")):
            return
        other = _held(data, key)
        assert other is not None and other[:len(path)] != path, (name, str(outcome))
        _remove(data, other)  # the other side of a rule across keys: the refusal must move on
    raise AssertionError(f"{name}: refusals never reached the broken key")


@pytest.mark.parametrize("path", KEY_PATHS, ids=_path_name)  # every key, each tried: not 1 in 40 draws
@settings(FUZZ, max_examples=12)
@given(data=st.data())
def test_one_broken_key_is_the_key_the_error_names(path, data):
    """A valid recipe with one key set to anything: accepted, or refused naming that key, a key inside
    it or the section holding it, never an unrelated key and never another exception. A rule across
    keys may name the other key: the recipe must hold it, and without it the refusal moves on to
    the broken key (or the recipe is accepted). Several values per valid recipe: drawing a valid
    recipe is the costly part (the parser filters)."""
    recipe = data.draw(valid_recipes({path}))
    for value in data.draw(st.lists(scalars | values, min_size=4, max_size=4)):
        _broken(copy.deepcopy(recipe), path, value)
