"""``aotbuild.build(recipe, pipe=pipe)``: building for a pipeline object changed in code, so that
``load_compiled(recipe, pipe=pipe)`` hits where ``aotbuild build RECIPE`` (the recipe's own model)
would miss again."""

from __future__ import annotations

import tempfile

import pytest
import torch

import aotbuild
from aotbuild.errors import UsageError
from tests.conftest import TINY_DICT as TINY


def _changed_pipe(models_dir):
    """The recipe's model with a UNet of another architecture (4 attention heads, not 2)."""
    from diffusers import UNet2DConditionModel

    from aotbuild.models import load_pipeline, resolve_model
    from aotbuild.recipes import parse_recipe

    recipe = parse_recipe(TINY)
    pipe = load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")
    torch.manual_seed(1)
    pipe.unet = UNet2DConditionModel(**{**pipe.unet.config, "attention_head_dim": 4}).eval()
    return pipe


def test_pipe_takes_one_recipe_and_a_pipeline(models_dir):
    with pytest.raises(UsageError, match="builds one recipe for that pipeline; got 2 recipes"):
        aotbuild.build([TINY, {**TINY, "shapes": [{"height": 32, "width": 32}]}], cache=models_dir, pipe=object())
    with pytest.raises(UsageError, match="takes a diffusers pipeline .* got object"):
        aotbuild.build(TINY, cache=models_dir, pipe=object())


@pytest.mark.slow  # one build and its proof (~2 min on 2 cores)
def test_a_pipeline_changed_in_code_is_built_proven_and_then_hits(models_dir, tmp_path, monkeypatch):
    import shutil

    from aotbuild.pipecall import warmup_kwargs
    from aotbuild.recipes import parse_recipe
    from aotbuild.strategies import get_strategy
    from aotbuild.targets import get_target

    cache = tmp_path / "cache"
    shutil.copytree(models_dir, cache)
    saved_in = tmp_path / "tmp"
    saved_in.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(saved_in))
    pipe = _changed_pipe(models_dir)
    with pytest.raises(aotbuild.CacheMiss) as info:  # the miss names the difference and the way out
        aotbuild.load_compiled(TINY, pipe=pipe, cache=cache, on_miss="error")
    assert "next: `aotbuild.build(recipe, pipe=pipe)` builds them for this pipeline" in str(info.value)

    report = aotbuild.build(TINY, cache=cache, pipe=pipe)
    assert [r.status for r in report.results] == ["built"], report.as_json()
    from aotbuild.store import Store

    manifest = Store(cache).read_manifest(report.results[0].job.key)
    assert manifest.proof is not None and manifest.proof.compiles == 0  # proven like any other job
    assert "aotbuild-pipe" not in manifest.to_json()  # nothing of the temporary folder in the entry
    assert list(saved_in.iterdir()) == []  # the saved pipeline is removed after the build
    recipe = parse_recipe(TINY)
    own = aotbuild.plan(TINY, cache=cache)  # the recipe's own model: not built, and the nearest entry says why
    assert [j.status for j in own] == ["miss"] and "attention_head_dim: 4 in the cache, 2 here" in own[0].reason

    expected = pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe), output_type="pt").images  # seeded latents
    counter, count = get_strategy(recipe.strategy).compile_counter(get_target(recipe.target))
    loaded = aotbuild.load_compiled(TINY, pipe=pipe, cache=cache, on_miss="error", strict_shapes=True)
    before = count()
    out = loaded(**warmup_kwargs(recipe, recipe.shapes[0], loaded), output_type="pt").images
    assert count() - before == 0, counter
    assert len(loaded.aotbuild_report.hits) == 1
    assert torch.allclose(out, expected, atol=1e-4)
