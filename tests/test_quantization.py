"""Quantized denoisers: ``model.quantization`` (torchao), keyed from the recipe alone, built, served."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

from aotbuild.errors import RecipeError
from tests.conftest import run_cli, run_python

QUANTIZED = {"model": {"id": "builtin:tiny-sd", "dtype": "float32",
                       "quantization": {"backend": "torchao", "quant_type": "int8wo"}},
             "target": "inductor", "device": "cpu", "compile": {"components": ["unet"]},
             "shapes": [{"height": 64, "width": 64}], "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0}}


def data(**model) -> dict:
    out = json.loads(json.dumps(QUANTIZED))
    out["model"]["quantization"].update(model)
    return out


@pytest.mark.parametrize("strategy,says", [("aot-compile", "use strategy jit-cache"),
                                           ("aot-package", "use strategy jit-cache")])
def test_strategies_that_cannot_serve_tensor_subclasses_refuse_the_recipe(strategy, says):
    from aotbuild.recipes import parse_recipe

    with pytest.raises(RecipeError) as info:
        parse_recipe({**QUANTIZED, "strategy": strategy})
    assert info.value.key == "model.quantization" and says in info.value.message


@pytest.mark.parametrize("over,key", [({"backend": "bitsandbytes"}, "model.quantization.backend"),
                                      ({"quant_type": "int7"}, "model.quantization.quant_type"),
                                      ({"components": ["vae"]}, "model.quantization.components")])
def test_a_bad_quantization_is_a_recipe_error_naming_the_key(over, key):
    from aotbuild.recipes import parse_recipe

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

    from aotbuild import quantize
    from aotbuild.errors import UsageError

    real = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(UsageError, match=r"pip install 'aotbuild\[torchao\]'"):
        quantize.require()


SERVE = textwrap.dedent("""
    import json, sys
    from aotbuild import load_compiled
    from aotbuild.recipes import load_recipe
    from aotbuild.context import job_pipeline
    from aotbuild.pipecall import warmup_kwargs
    from aotbuild.strategies import get_strategy
    from aotbuild.targets import get_target
    from torch._dynamo.utils import counters

    r = load_recipe(sys.argv[1])
    cache = sys.argv[2]

    def outputs(pipe):
        seen = []
        h = pipe.unet.register_forward_hook(lambda m, a, o: seen.append(o[0].detach().clone()))
        pipe(**warmup_kwargs(r, r.shapes[0], pipe), output_type="pt")
        h.remove()
        return seen

    name, count = get_strategy(r.strategy).compile_counter(get_target(r.target))
    before = count()
    pipe = load_compiled(r, cache=cache, on_miss="error", strict_shapes=True)
    served = outputs(pipe)
    compiles = count() - before
    _, eager = job_pipeline(r, __import__("pathlib").Path(cache))  # quantized eagerly, the same way
    expected = outputs(eager)
    print("RESULT " + json.dumps({"hits": len(pipe.aotbuild_report.hits), "compiles": compiles,
                                  "fx_miss": counters["inductor"]["fxgraph_cache_miss"],
                                  "weight": type(pipe.unet.get_submodule(
                                      "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q").weight).__name__,
                                  "diff": max(float((a - b).abs().max()) for a, b in zip(served, expected))}))
""")


@pytest.mark.slow  # one real compile of the int8 UNet and its proof, then a fresh replica
def test_an_int8_weight_only_build_serves_with_0_compiles_equal_to_eager_quantized(models_dir, tmp_path):
    recipe = tmp_path / "tiny_sd_int8wo.yaml"
    recipe.write_text(json.dumps(QUANTIZED))
    cache = tmp_path / "cache"
    shutil.copytree(models_dir / "models", cache / "models")
    build = run_cli("build", "--json", "--cache", str(cache), str(recipe),
                    env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"), "AOTBUILD_CACHE": ""})
    assert build.returncode == 0, build.stdout[-3000:]
    assert json.loads(build.stdout)["jobs"][0]["status"] == "built"
    replica = tmp_path / "replica"
    shutil.move(str(cache), replica / "cache")
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    (tmp_path / "elsewhere").mkdir()
    proc = run_python(f"import runpy, sys; sys.argv = ['s', {str(recipe)!r}, {str(replica / 'cache')!r}]; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(replica / "empty-inductor"), "AOTBUILD_CACHE": ""},
                      cwd=tmp_path / "elsewhere")
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert result["hits"] == 1 and result["compiles"] == 0 and result["fx_miss"] == 0, result
    assert result["weight"] == "Int8Tensor" and result["diff"] <= 1e-5, result
