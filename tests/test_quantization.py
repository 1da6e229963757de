"""Quantized denoisers: ``model.quantization`` (torchao), keyed from the recipe alone, built, served."""

from __future__ import annotations

import json

import pytest

from aotbuild.errors import RecipeError
from tests.conftest import invoke_cli
from tests.loras import one_level_sd

QUANTIZED = {"model": {"id": "builtin:tiny-sd", "dtype": "float32",
                       "quantization": {"backend": "torchao", "quant_type": "int8wo"}},
             "target": "inductor", "device": "cpu", "strategy": "jit-cache", "compile": {"components": ["unet"]},
             "shapes": [{"height": 64, "width": 64}], "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0}}


def data(**model) -> dict:
    out = json.loads(json.dumps(QUANTIZED))
    out["model"]["quantization"].update(model)
    return out


@pytest.mark.parametrize("strategy,says", [("aot-compile", "use strategy jit-cache"),
                                           ("aot-package", "use strategy jit-cache")])
def test_strategies_that_cannot_serve_tensor_subclasses_refuse_the_recipe(strategy, says):
    from aotbuild.recipe.rules import parse_recipe

    with pytest.raises(RecipeError) as info:
        parse_recipe({**QUANTIZED, "strategy": strategy})
    assert info.value.key == "model.quantization" and says in info.value.message


@pytest.mark.parametrize("over,key", [({"backend": "bitsandbytes"}, "model.quantization.backend"),
                                      ({"quant_type": "int7"}, "model.quantization.quant_type"),
                                      ({"components": ["vae"]}, "model.quantization.components")])
def test_a_bad_quantization_is_a_recipe_error_naming_the_key(over, key):
    from aotbuild.recipe.rules import parse_recipe

    with pytest.raises(RecipeError) as info:
        parse_recipe(data(**over))
    assert info.value.key == key


def test_the_quantization_and_what_it_sets_in_inductor_are_key_factors(models_dir):
    from aotbuild import plan

    quantized = plan([data()], models_dir)[0]
    factor = quantized.factors["quantization"]
    assert factor["backend"] == "torchao" and factor["version"] and factor["quant_type"] == "int8wo"
    assert factor["inductor"] == {"coordinate_descent_check_all_directions": True, "coordinate_descent_tuning": True,
                                  "force_fuse_int_mm_with_mul": True}
    plain = plan([{**QUANTIZED, "model": {"id": "builtin:tiny-sd", "dtype": "float32"}}], models_dir)[0]
    assert "quantization" not in plain.factors and plain.key != quantized.key
    assert plan([data(quant_type="int8dq")], models_dir)[0].key != quantized.key
    off = plan([data(quant_kwargs={"set_inductor_config": False})], models_dir)[0]
    assert off.factors["quantization"]["inductor"] == {} and off.key != quantized.key


def test_without_torchao_the_error_says_how_to_install_it(monkeypatch):
    import builtins

    from aotbuild.errors import UsageError
    from aotbuild.features import quantization as quantize

    real = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(UsageError, match=r"pip install 'aotbuild\[torchao\]'"):
        quantize.require()


@pytest.mark.slow  # one real compile of the int8 UNet and its proof
def test_an_int8_weight_only_build_serves_with_0_compiles_equal_to_eager_quantized(models_dir, tmp_path):
    """The build's proof is the replica (aotbuild/builder/proof.py): a fresh process, every compiler folder
    empty, quantizes the pipeline as the recipe says, loads the entry from another store and replays
    every call; what it saw is the entry's ``proof.served`` (issue 30, item 4: no second serve here)."""
    # the one-level tiny UNet: every kind of Linear int8 replaces, fewer kernels to compile than tiny-sd's
    model = one_level_sd(models_dir, tmp_path / "one-level-sd")
    recipe = tmp_path / "tiny_sd_int8wo.yaml"
    recipe.write_text(json.dumps({**QUANTIZED, "model": {**QUANTIZED["model"], "id": str(model)}}))
    cache = tmp_path / "cache"
    # in this process: the build's loader, worker and proof are fresh processes already
    build = invoke_cli("build", "--json", "--cache", str(cache), str(recipe),
                       env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"), "AOTBUILD_CACHE": ""})
    assert build.returncode == 0, build.stdout[-3000:]
    job = json.loads(build.stdout)["jobs"][0]
    assert job["status"] == "built"
    manifest = json.loads(invoke_cli("show", "--json", "--cache", str(cache), job["key"][:12]).stdout)
    proof, served = manifest["proof"], manifest["proof"]["served"]
    # equal to eager quantized the same way (the proof's own pipeline), with 0 compiles and no FX graph miss
    assert proof["compiles"] == 0 and proof["max_abs_diff"] <= 1e-5 and proof["calls"] >= 1, proof
    assert served["hits"] == 1 and served["fxgraph_cache_miss"] == 0 and served["fxgraph_cache_hit"] >= 1, served
    assert served["dispatch"] == {"": {"built": proof["calls"], "unbuilt": 0}}, served
    # served with int8 weights: the entry's structure (checked before its load was a hit) names their class
    to_q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight: param "
    line, = (x for x in manifest["structure"]["lines"] if x.startswith(to_q))
    assert line[len(to_q):].split()[0].endswith(".Int8Tensor"), line
