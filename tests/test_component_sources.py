"""``model.components``: a component from another repository or folder than the pipeline's model (a
ControlNet beside an SD repository), loaded by its class's ``from_pretrained`` and handed to the
pipeline's, in every build job, proof and ``load_compiled`` (aotbuild/pipeline/models.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import aotbuild
from aotbuild.errors import RecipeError
from aotbuild.recipe.rules import parse_recipe
from tests.conftest import TINY_DICT as TINY
from tests.conftest import invoke_cli


def _recipe(sources, **model) -> dict:
    return {**TINY, "model": {**TINY["model"], "pipeline": "StableDiffusionControlNetPipeline",
                              "components": sources, **model}}


@pytest.mark.parametrize("sources,key,says", [
    ({}, "model.components", "is empty"),
    ({"1x": "a/b"}, "model.components", "is not a component name"),
    ({"_class_name": "a/b"}, "model.components", "is not a component name"),
    ({"controlnet": 5}, "model.components.controlnet", "expected a Hub id or a folder"),
    ({"controlnet": {"id": "a/b", "branch": "x"}}, "model.components.controlnet.branch", "unknown key"),
    ({"controlnet": {"subfolder": "x"}}, "model.components.controlnet.id", "is required"),
    ({"controlnet": {"id": "a/b", "subfolder": "../x"}}, "model.components.controlnet.subfolder", "no '..'"),
    ({"controlnet": {"id": "a/b", "subfolder": "/etc"}}, "model.components.controlnet.subfolder", "no '..'"),
    ({"controlnet": "builtin:tiny-sd"}, "model.components.controlnet.id", "a built-in model is a whole pipeline"),
    ({"controlnet": "a/b\n::error::x"}, "model.components.controlnet.id", "printable"),
    ({f"c{i}": "a/b" for i in range(17)}, "model.components", "more than 16"),
])
def test_a_bad_component_source_is_refused_naming_its_key(sources, key, says):
    with pytest.raises(RecipeError) as info:
        parse_recipe(_recipe(sources))
    assert info.value.key == key and says in info.value.message, info.value


def test_a_recipe_without_components_reads_as_before():
    """The section appears in a recipe's data (manifests, build --json) only when set."""
    from aotbuild.recipe.schema import recipe_to_dict

    assert "components" not in recipe_to_dict(parse_recipe(TINY))["model"]
    recipe = parse_recipe(_recipe({"controlnet": "org/controlnet", "vae": {"id": "./vae", "subfolder": "x"}}))
    assert recipe_to_dict(recipe)["model"]["components"] == {"controlnet": {"id": "org/controlnet"},
                                                             "vae": {"id": "./vae", "subfolder": "x"}}


def _controlnet_folder(models_dir: Path, folder: Path) -> Path:
    """A ControlNet made from tiny-sd's UNet (diffusers' ``ControlNetModel.from_unet``), its zeroed output
    convolutions filled, so that its residuals change what the UNet computes; saved as its own model."""
    import torch
    from diffusers import ControlNetModel, UNet2DConditionModel

    from aotbuild.builtin import folder_of

    unet = UNet2DConditionModel.from_pretrained(folder_of("builtin:tiny-sd", models_dir / "models") / "unet")
    torch.manual_seed(2)
    controlnet = ControlNetModel.from_unet(unet)
    with torch.no_grad():
        for p in controlnet.parameters():
            if p.dim() > 1 and not p.abs().sum():
                p.normal_(0, 0.05)
    controlnet.save_pretrained(folder)
    return folder


def test_plan_reads_a_component_from_its_own_folder_and_refuses_what_is_not_a_diffusers_model(models_dir,
                                                                                             tmp_path):
    """Planned without loading a weight: the ControlNet's class and config from its folder's config.json,
    each compiled component keyed by its own config; a folder that is no diffusers model, a link out of
    it, a missing folder are recipe errors naming the key (exit 2)."""
    _controlnet_folder(models_dir, tmp_path / "controlnet")
    recipe = tmp_path / "cn.yaml"
    recipe.write_text(json.dumps({**_recipe({"controlnet": "./controlnet"}),
                                  "compile": {"components": ["unet", "controlnet"]}}))
    jobs = {j.component: j for j in aotbuild.plan(str(recipe), cache=models_dir)}
    assert {c: j.status for c, j in jobs.items()} == {"unet": "miss", "controlnet": "miss"}
    assert jobs["controlnet"].factors["component"]["class"] == "ControlNetModel"
    assert jobs["controlnet"].factors["component"]["config"]["conditioning_embedding_out_channels"]

    # one the model has, named again from a folder (a subfolder of it): the same component, the same key
    from aotbuild.builtin import folder_of

    unet = {"id": str(folder_of("builtin:tiny-sd", models_dir / "models")), "subfolder": "unet"}
    again = {**TINY, "model": {**TINY["model"], "components": {"unet": unet}}}
    assert [j.key for j in aotbuild.plan(again, cache=models_dir)] == [j.key for j in aotbuild.plan(TINY,
                                                                                                     cache=models_dir)]

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "config.json").write_text(json.dumps({"architectures": ["CLIPTextModel"]}))
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "config.json").symlink_to(tmp_path / "controlnet" / "config.json")
    for sources, says in (({"controlnet": "./text"}, "names a transformers model: model.components takes diffusers"),
                          ({"controlnet": "./nowhere"}, "no such folder: ./nowhere"),
                          # a name is a keyword of the pipeline's from_pretrained: only its components
                          ({"controlnet": "./controlnet", "trust_remote_code": "./controlnet"},
                           "'trust_remote_code' is not a component of StableDiffusionControlNetPipeline")):
        recipe.write_text(json.dumps(_recipe(sources)))
        proc = invoke_cli("plan", "--cache", str(models_dir), str(recipe))
        assert proc.returncode == 2 and "model.components" in proc.stderr and says in proc.stderr, proc.stderr
    # a model_index.json naming the ControlNet null: diffusers drops it, and the pipeline cannot be made
    import shutil

    model = shutil.copytree(folder_of("builtin:tiny-sd", models_dir / "models"), tmp_path / "null-controlnet")
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "controlnet": [None, None]}))
    recipe.write_text(json.dumps({**_recipe(None), "model": {"id": str(model),
                                                             "pipeline": "StableDiffusionControlNetPipeline"}}))
    proc = invoke_cli("plan", "--cache", str(models_dir), str(recipe))
    assert proc.returncode == 2 and "needs controlnet" in proc.stderr, proc.stderr
    # a folder's content is the model's, not the recipe's: unavailable, as a link out of model.id's folder is
    recipe.write_text(json.dumps(_recipe({"controlnet": "./linked"})))
    (job,) = aotbuild.plan(str(recipe), cache=models_dir)
    assert job.status == "unavailable" and "links outside the model folder" in job.reason, job.reason


@pytest.mark.slow  # one build of tiny-sd's UNet and its proof, then a fresh replica (~1.5 min on 2 cores)
def test_a_controlnet_named_by_the_recipe_builds_and_a_fresh_replica_serves_it_with_0_compiles(models_dir,
                                                                                              tmp_path):
    """``aotbuild build`` alone builds a ControlNet pipeline whose ControlNet is in a folder of its own,
    and a fresh process's ``load_compiled(recipe)`` (which loads that ControlNet too) serves the warmup
    (a conditioning image made at the shape's size) with nothing compiled, equal to eager."""
    import shutil

    from tests.serving import assert_served, serve_fresh

    _controlnet_folder(models_dir, tmp_path / "controlnet")
    recipe = tmp_path / "cn.yaml"
    recipe.write_text(json.dumps(_recipe({"controlnet": "./controlnet"})))
    cache = tmp_path / "cache"
    shutil.copytree(models_dir, cache)
    build = invoke_cli("build", "--json", "--cache", str(cache), str(recipe))
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    (job,) = json.loads(build.stdout)["jobs"]
    assert job["status"] == "built", job
    result = serve_fresh(recipe, cache, tmp_path)
    assert_served(result)
