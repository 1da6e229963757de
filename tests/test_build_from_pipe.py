"""``aotbuild.build(recipe, pipe=pipe)``: building for a pipeline object changed in code, so that
``load_compiled(recipe, pipe=pipe)`` hits where ``aotbuild build RECIPE`` (the recipe's own model)
would miss again."""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

import aotbuild
from aotbuild.errors import UsageError
from tests.conftest import TINY_DICT as TINY
from tests.conftest import invoke_cli


def _changed_pipe(models_dir):
    """The recipe's model with a UNet of another architecture: 4 attention heads, not 2, and one block
    level, not two (no attention but the mid block's): what is built is a UNet that only this code makes,
    and one level has fewer distinct layer shapes for Inductor to compile kernels for."""
    from diffusers import UNet2DConditionModel

    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.recipe.rules import parse_recipe

    recipe = parse_recipe(TINY)
    pipe = load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")
    torch.manual_seed(1)
    pipe.unet = UNet2DConditionModel(**{**pipe.unet.config, "attention_head_dim": 4, "block_out_channels": (8,),
                                        "down_block_types": ("DownBlock2D",), "up_block_types": ("UpBlock2D",)}).eval()
    return pipe


def test_pipe_takes_one_recipe_and_a_pipeline(models_dir):
    with pytest.raises(UsageError, match="builds one recipe for that pipeline; got 2 recipes"):
        aotbuild.build([TINY, {**TINY, "shapes": [{"height": 32, "width": 32}]}], cache=models_dir, pipe=object())
    with pytest.raises(UsageError, match="takes a diffusers pipeline .* got object"):
        aotbuild.build(TINY, cache=models_dir, pipe=object())


@pytest.mark.slow  # one build and its proof (~2 min on 2 cores)
def test_a_pipeline_changed_in_code_is_built_proven_and_then_hits(models_dir, tmp_path, monkeypatch):
    """The build's proof serves the saved pipeline in a fresh process (aotbuild/builder/proof.py): what it
    saw is the entry's ``proof.served``, read here instead of serving it a second time in this
    process (issue 30, item 4). What only this process can show is that the pipeline object itself,
    changed in code, now hits."""
    import shutil

    cache = tmp_path / "cache"
    shutil.copytree(models_dir, cache)
    saved_in = tmp_path / "tmp"
    saved_in.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(saved_in))
    pipe = _changed_pipe(models_dir)
    with pytest.raises(aotbuild.CacheMiss) as info:  # the miss names the difference and the way out
        aotbuild.load_compiled(TINY, pipe=pipe, cache=cache, on_miss="error")
    assert f"next: `aotbuild.build(recipe, pipe=pipe, cache={str(cache)!r})` builds them for this pipeline" \
        in str(info.value)

    report = aotbuild.build(TINY, cache=cache, pipe=pipe)
    assert [r.status for r in report.results] == ["built"], report.as_json()
    from aotbuild.cache.store import Store

    manifest = Store(cache).read_manifest(report.results[0].job.key)
    check_proven(manifest.proof)
    assert "aotbuild-pipe" not in manifest.to_json()  # nothing of the temporary folder in the entry
    assert list(saved_in.iterdir()) == []  # the saved pipeline is removed after the build
    own = aotbuild.plan(TINY, cache=cache)  # the recipe's own model: not built, and the nearest entry says why
    assert [j.status for j in own] == ["miss"] and "attention_head_dim: 4 in the cache, 2 here" in own[0].reason

    loaded = aotbuild.load_compiled(TINY, pipe=pipe, cache=cache, on_miss="error", strict_shapes=True)
    assert loaded is pipe and len(loaded.aotbuild_report.hits) == 1 and not loaded.aotbuild_report.misses


def check_proven(proof) -> None:
    """The build's proof served the pipeline built for in a fresh process: a hit, nothing compiled, no
    FX graph miss, every call of the UNet through the entry, equal to eager's."""
    assert proof is not None and proof.compiles == 0, proof  # proven like any other job
    served = proof.served
    assert served["hits"] == 1 and served["misses"] == 0 and served["fxgraph_cache_miss"] == 0, served
    assert served["fxgraph_cache_hit"] >= 1, served  # jit-cache: the UNet's graph, from the entry
    assert proof.calls >= 1 and served["dispatch"] == {"": {"built": proof.calls, "unbuilt": 0}}, served
    assert proof.max_abs_diff <= 1e-5, proof


CONTROLNET = {**TINY, "model": {**TINY["model"], "pipeline": "StableDiffusionControlNetPipeline"}}


def test_a_pipeline_needing_a_component_the_model_lacks_is_refused_before_any_load(models_dir, tmp_path, monkeypatch):
    """A ControlNet lives in a repository of its own, which a recipe's model does not name: diffusers'
    ``from_pretrained`` fails without it ("expected [...], but only {...} were passed"), and auto tried
    each strategy, loading the pipeline for each, to fail the same way. ``plan``, ``build`` and
    ``load_compiled`` refuse it before a weight is read, naming what is missing and the ways that serve
    it: ``model.components`` (tests/test_component_sources.py) or a build for the pipeline object."""
    from aotbuild.errors import RecipeError
    from aotbuild.pipeline import models

    recipe = tmp_path / "controlnet.yaml"
    recipe.write_text(json.dumps(CONTROLNET))  # JSON is YAML
    for command in ("plan", "build"):
        proc = invoke_cli(command, "--cache", str(models_dir), str(recipe))
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "model.pipeline: StableDiffusionControlNetPipeline needs controlnet, which builtin:tiny-sd does not " \
               "have" in proc.stderr and "model.components ({controlnet: HUB_ID_OR_FOLDER})" in proc.stderr \
               and "aotbuild.build(recipe, pipe=pipe)" in proc.stderr, proc.stderr

    def loaded(*args, **kwargs):
        raise AssertionError("the pipeline was loaded")

    monkeypatch.setattr(models, "load_pipeline", loaded)
    with pytest.raises(RecipeError, match="needs controlnet") as info:
        aotbuild.load_compiled(CONTROLNET, cache=models_dir)
    assert info.value.key == "model.pipeline"
    # the model's own class needs nothing it lacks; an optional component left out (safety_checker) is no refusal
    assert [j.status for j in aotbuild.plan(TINY, cache=models_dir)] == ["miss"]
