"""Recipes as plain dicts (the Python API without YAML): validated like a file, planned, built and
loaded, and passed to child processes as data, never by re-reading a path."""

from __future__ import annotations

import json

import pytest

import aotbuild
from aotbuild.errors import RecipeError
from aotbuild.recipe.rules import load_recipe, parse_recipe, recipe_from_spec
from aotbuild.recipe.schema import recipe_spec
from tests.conftest import TINY_DICT, TINY_RECIPE

TINY = TINY_DICT


def test_exported_from_the_package():
    assert aotbuild.parse_recipe is parse_recipe and aotbuild.Recipe.__name__ == "Recipe"
    assert "parse_recipe" in aotbuild.__all__


def test_a_dict_gets_a_stable_name_from_its_content():
    a = parse_recipe(TINY)
    assert a.name == parse_recipe(json.loads(json.dumps(TINY))).name
    assert a.name.startswith("recipe-") and len(a.name) == len("recipe-") + 12
    int(a.name[len("recipe-"):], 16)
    assert parse_recipe({**TINY, "strategy": "aot-package"}).name != a.name
    assert parse_recipe(TINY, name="mine").name == "mine"
    assert parse_recipe(TINY, "r.yaml").name == "r"  # the positional source still names it


@pytest.mark.parametrize(("change", "message"), [
    ({"shapes": [{"height": 60, "width": 64}]}, "shapes[0].height: 60 is not allowed"),
    ({"target": "indcutor"}, "target: 'indcutor' is not allowed; did you mean 'inductor'?"),
    ({"compile": {"fullgraph": "yes"}}, "compile.fullgraph: expected true or false"),
    ({"shape": []}, "shape: unknown key; did you mean 'shapes'?"),
])
def test_dict_errors_name_the_key(change, message):
    with pytest.raises(RecipeError) as info:
        aotbuild.plan({**TINY, **change})
    assert message in str(info.value)
    assert str(info.value).startswith("<recipe>: ")


def test_a_dict_plans_like_its_file(models_dir):
    from_dict = aotbuild.plan(TINY, cache=models_dir)
    file_recipe = load_recipe(TINY_RECIPE)
    from_file = [j for j in aotbuild.plan([TINY_RECIPE], cache=models_dir) if j.shape == file_recipe.shapes[0]]
    assert [j.key for j in from_dict] == [j.key for j in from_file]
    assert [j.status for j in from_dict] == ["miss"]
    assert from_dict[0].recipe.name == parse_recipe(TINY).name
    # a list may mix files, dicts and Recipes
    mixed = aotbuild.plan([str(TINY_RECIPE), {**TINY, "shapes": [{"height": 32, "width": 32}]}], cache=models_dir)
    assert len(mixed) == 3


def test_a_miss_of_a_dict_recipe_says_how_to_build_it_from_python(tiny_pipe_for_dict, models_dir):
    with pytest.raises(aotbuild.CacheMiss) as info:
        aotbuild.load_compiled(TINY, cache=models_dir, on_miss="error")
    text = str(info.value)
    # the Python call, into the cache this load read (issue 55: it named none, so it built into the default)
    assert f"`aotbuild.build(recipe, cache={str(models_dir)!r})` builds them" in text
    assert "aotbuild build <recipe>" not in text
    # a pipe the caller passed may not be the recipe's model: the build for that pipeline object
    with pytest.raises(aotbuild.CacheMiss) as info:
        aotbuild.load_compiled(TINY, pipe=tiny_pipe_for_dict, cache=models_dir, on_miss="error")
    assert f"next: `aotbuild.build(recipe, pipe=pipe, cache={str(models_dir)!r})` builds them for this pipeline" \
        in str(info.value)


@pytest.fixture(scope="module")
def tiny_pipe_for_dict(models_dir):
    from aotbuild.pipeline.models import load_pipeline, resolve_model

    recipe = parse_recipe(TINY)
    return load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")


def test_the_child_spec_carries_data_not_a_path(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(TINY_RECIPE.read_text())
    recipe = load_recipe(path)
    spec = json.loads(json.dumps(recipe_spec(recipe)))
    path.unlink()  # a child never re-reads it
    again = recipe_from_spec(spec)
    assert again == recipe and again.base == tmp_path
    assert spec["folder"] == str(tmp_path)


def test_a_relative_model_folder_of_a_dict_resolves_in_the_callers_directory(tmp_path, monkeypatch):
    from aotbuild.pipeline.models import _local_folder

    (tmp_path / "mymodel").mkdir()
    monkeypatch.chdir(tmp_path)
    recipe = parse_recipe({**TINY, "model": "./mymodel"})
    spec = recipe_spec(recipe)
    monkeypatch.chdir("/")
    assert _local_folder(recipe_from_spec(spec)) == tmp_path / "mymodel"


@pytest.mark.slow  # the session's tiny-sd build (tests/test_e2e.py's), then a load into an existing pipeline
def test_a_dict_hits_what_its_yaml_twin_built_and_loads_into_an_existing_pipe(built_cache, tmp_path):
    """The dict of tests/recipes/tiny_sd_cpu.yaml's settings at one of its shapes has that file's keys:
    `build` finds the entry cached, and `load_compiled` serves it into a pipeline the caller made."""
    import shutil

    import torch

    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs

    cache = tmp_path / "cache"
    shutil.copytree(built_cache[0], cache)
    recipe = dict(TINY)  # 64x64: the YAML's first shape
    report = aotbuild.build(recipe, cache=cache)
    assert [r.status for r in report.results] == ["cached"], report.as_json()
    assert [j.status for j in aotbuild.plan(recipe, cache=cache)] == ["hit"]

    parsed = parse_recipe(recipe)
    pipe = load_pipeline(parsed, resolve_model(parsed, cache), "float32")
    kwargs = warmup_kwargs(parsed, parsed.shapes[0], pipe)
    expected = pipe(**kwargs, output_type="pt").images
    same = aotbuild.load_compiled(recipe, pipe=pipe, cache=cache, on_miss="error", strict_shapes=True)
    assert same is pipe and [e.hit for e in pipe.aotbuild_report.entries] == [True]
    out = pipe(**warmup_kwargs(parsed, parsed.shapes[0], pipe), output_type="pt").images
    assert torch.allclose(out, expected, atol=1e-4)
