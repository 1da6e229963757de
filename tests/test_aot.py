"""strategy: aot-package: AOTInductor packages without weights, loaded with no Dynamo at all."""

from __future__ import annotations

import json

import pytest
import torch

from aotbuild import ShapeNotBuilt, load_compiled
from aotbuild.errors import RecipeError, StaleGraph
from aotbuild.recipe.rules import parse_recipe
from tests.conftest import STRATEGY_RECIPE, invoke_cli

AOT_RECIPE = STRATEGY_RECIPE.format(strategy="aot-package")


@pytest.mark.slow
def test_package_is_weightless_and_the_entry_is_the_package(aot_cache):
    recipe, cache, report = aot_cache
    key = report["jobs"][0]["key"]
    manifest = json.loads(invoke_cli("show", "--json", "--cache", str(cache), key[:12]).stdout)
    packages = [f for f in manifest["files"] if f["path"].startswith("aoti/")]
    assert len(packages) == 1 and len(manifest["packages"]) == 1
    params = _tiny_unet_params(cache)
    weights = sum(p.numel() * p.element_size() for p in params)
    assert packages[0]["size"] < weights + 4_000_000  # code only: the weights are not in it
    assert manifest["packages"][0]["constants"]["conv_in.weight"][1] == "float32"
    # Every tensor is supplied at load, none compiled in (Inductor would inline the tiny biases).
    assert len(manifest["packages"][0]["constants"]) == len(params)
    assert manifest["packages"][0]["baked"] == {} and manifest["embeds_weights"] is False
    # The entry is the package alone: not the compile's build folder (its sources and .so again: 5.84 MB
    # for a 2.86 MB .pt2 once), nor the ISA probe files a fresh-process load left, which entries held
    # until a load opened packages with the C++ loader and replayed the probes from the manifest
    # (vec_isa_probes, recorded where Inductor picked a vector ISA: this session build keeps its choice).
    assert [f["path"] for f in manifest["files"]] == [packages[0]["path"]], manifest["files"]
    if manifest["build"]["vec_isa"] != "INVALID_VEC_ISA":
        assert manifest["build"]["vec_isa_probes"], manifest["build"]


def _tiny_unet_params(cache):
    from diffusers import UNet2DConditionModel

    return list(UNet2DConditionModel.from_pretrained(str(cache / "models" / "tiny-sd-v1"), subfolder="unet")
                .parameters())


def captured_call(pipe, recipe):
    from aotbuild.pipeline.pipecall import warmup_kwargs

    seen = {}

    def grab(module, args, kwargs):
        seen.setdefault("call", (args, kwargs))

    handle = pipe.unet.register_forward_pre_hook(grab, with_kwargs=True)
    pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe))
    handle.remove()
    return seen["call"]


@pytest.mark.slow
def test_weights_changed_after_load_are_resupplied_or_refused(aot_cache):
    from aotbuild.recipe.rules import load_recipe
    from aotbuild.strategies.aoti import PackageMismatch

    recipe_path, cache, _ = aot_cache
    recipe = load_recipe(recipe_path)
    pipe = load_compiled(recipe, cache=cache, on_miss="error", strict_shapes=True)
    args, kwargs = captured_call(pipe, recipe)
    unet, dispatcher = pipe.unet, pipe.unet.forward
    runner = next(iter(dispatcher.routes.values())).runner

    def packaged_vs_eager():
        with torch.no_grad():  # as the pipeline calls it: another grad mode is a change the watch refuses
            return (unet(*args, **kwargs)[0] - dispatcher.eager(*args, **kwargs)[0]).abs().max().item()

    assert packaged_vs_eager() <= 1e-4
    with torch.no_grad():  # an in-place update (e.g. a LoRA fused into the same storage): shared
        unet.conv_in.weight.add_(0.5)
        unet.conv_in.bias.add_(0.5)
    assert packaged_vs_eager() <= 1e-4 and runner.rebinds == 0
    unet.conv_in.weight.data = unet.conv_in.weight.data * 2  # a new tensor: re-supplied before the call
    assert packaged_vs_eager() <= 1e-4 and runner.rebinds == 1
    unet.conv_in.bias.data = unet.conv_in.bias.data + 1  # biases too: nothing is compiled in
    assert packaged_vs_eager() <= 1e-4 and runner.rebinds == 2
    unet.to(torch.float64)
    with torch.no_grad(), pytest.raises(StaleGraph, match="float64 .* here, param float32 .* in the entry"):
        unet(*args, **kwargs)  # the per-call check names the dtype before the package is called
    dispatcher.watch = None  # without that check, the package's own bind check refuses the weights
    with torch.no_grad(), pytest.raises(PackageMismatch, match="is now float64 .* built for float32"):
        unet(*args, **kwargs)


@pytest.mark.slow
def test_other_weights_of_the_architecture_hit_and_use_their_own_values(aot_cache, models_dir):
    """A fine-tune of the same architecture runs the same packages with its own weights."""
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from aotbuild.recipe.rules import load_recipe

    recipe_path, cache, _ = aot_cache
    recipe = load_recipe(recipe_path)
    pipe = load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")
    with torch.no_grad():
        for p in pipe.unet.parameters():
            p.mul_(1.01)
    expected = pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe), output_type="pt").images
    load_compiled(recipe, pipe, cache=cache, on_miss="error", strict_shapes=True)
    got = pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe), output_type="pt").images
    assert pipe.unet.forward.calls["built"] >= 1 and (got - expected).abs().max().item() <= 1e-4


def test_tensors_compiled_into_a_package_are_checked():
    """A safety net for a torch that inlines a tensor despite always_keep_tensor_constants: the
    package records its sha256 and other values are a miss, naming the tensor."""
    from aotbuild.strategies.aoti import check_baked, tensor_digest

    module = torch.nn.Linear(2, 2)
    package = {"baked": {"bias": tensor_digest(module.bias)}}
    assert check_baked(module, "unet", [package]) == ""
    with torch.no_grad():
        module.bias.add_(1)
    assert "(e.g. bias)" in check_baked(module, "unet", [package])


@pytest.mark.parametrize("data,expected", [
    ({"target": "neuron", "strategy": "aot-package"}, "strategy aot-package runs on target inductor (not neuron)"),
    ({"strategy": "aot-package", "compile": {"fullgraph": False}}, "fullgraph must be true"),
])
def test_aot_package_validation(data, expected):
    base = {"model": "builtin:tiny-sd", "device": "cpu", "shapes": [{"height": 64, "width": 64}]}
    with pytest.raises(RecipeError) as info:
        parse_recipe({**base, **data}, "r.yaml")
    assert expected in str(info.value)


def test_a_package_naming_a_block_the_model_lacks_is_a_miss():
    """A hostile or mismatched manifest: a package whose instances name a block this model does not
    have is a miss with the reason, before anything is loaded."""
    from aotbuild.strategies.registry import get_strategy

    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([torch.nn.Linear(2, 2)])
    entry = type("E", (), {"files": (), "manifest": type("M", (), {"packages": (
        {"instances": ["blocks.0", "blocks.7"], "baked": {}},)})()})()
    assert "has no block 'blocks.7'" in get_strategy("aot-package").check(None, model, "transformer", entry)
    entry.manifest.packages = ({"instances": ["blocks.0"], "baked": {}},)
    assert get_strategy("aot-package").check(None, model, "transformer", entry) == ""


@pytest.mark.slow
def test_unbuilt_shape_follows_policy(aot_cache):
    recipe_path, cache, _ = aot_cache
    pipe = load_compiled(recipe_path, cache=cache, on_miss="eager")
    pipe(prompt="x", height=32, width=32, num_inference_steps=1, guidance_scale=0.0)
    assert pipe.unet.forward.calls["unbuilt"] == 1
    strict = load_compiled(recipe_path, cache=cache, strict_shapes=True)
    with pytest.raises(ShapeNotBuilt):
        strict(prompt="x", height=32, width=32, num_inference_steps=1, guidance_scale=0.0)
