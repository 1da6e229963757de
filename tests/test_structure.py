"""No false hit for a changed module: what the compiler sees of a module is checked before a hit.

Measured before this check (tiny-sd, a fresh process): a LoRA adapter added to the UNet was
reported "2 hit" under jit-cache, then the first call compiled (1 FX graph miss); an int8
weight-only UNet was a hit under jit-cache and aot-compile, then compiled. Now each is a miss naming
the first difference, before any call, under every strategy."""

from __future__ import annotations

import pytest
import torch

from aotbuild.errors import CacheMiss
from aotbuild.pipeline.structure import describe, digest, mismatch, record, settings_mismatch


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)


def test_weights_never_count_structure_does():
    a, b = Tiny(), Tiny()
    with torch.no_grad():
        b.to_q.weight.mul_(3)
    assert mismatch(b, record(a, {}), "m") == ""
    b.to_q = torch.nn.Linear(8, 16)
    assert "m.to_q.weight: param Tensor float32 [16, 8] here, param Tensor float32 [8, 8] in the entry" in \
        mismatch(b, record(a, {}), "m")


def test_an_adapter_is_named_as_the_first_difference():
    from peft import LoraConfig, inject_adapter_in_model

    plain = Tiny()
    adapted = inject_adapter_in_model(LoraConfig(r=2, target_modules=["to_q"]), Tiny())
    why = mismatch(adapted, record(plain, {}), "unet")
    assert why.startswith("unet.to_q: peft.tuners.lora.layer.Linear here, torch.nn.modules.linear.Linear in the "
                          "entry"), why


def test_a_quantized_weight_is_named():
    import torch._inductor.config as inductor_config
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    saved = inductor_config.save_config()
    try:
        plain, quantized = Tiny(), Tiny()
        quantize_(quantized, Int8WeightOnlyConfig())
        why = mismatch(quantized, record(plain, {}), "unet")
        assert why.startswith("unet.to_q.weight: param torchao.") and "Int8Tensor" in why, why
    finally:
        inductor_config.load_config(saved)


def test_an_empty_record_never_passes():
    assert "in the entry" in mismatch(Tiny(), {}, "m")


def test_compiler_settings_a_library_changed_are_named():
    assert settings_mismatch({"a": 1, "b": False}, {"a": 1, "b": False}) == ""
    why = settings_mismatch({"coordinate_descent_tuning": False}, {"coordinate_descent_tuning": True})
    assert why.startswith("compiler setting coordinate_descent_tuning: true here, false in the entry")


def test_inductor_records_what_its_cache_key_holds_and_quantize_changes_it():
    import torch._inductor.config as inductor_config
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    from aotbuild.targets.registry import get_target

    target = get_target("inductor")
    before = target.global_settings()
    saved = inductor_config.save_config()
    try:
        quantize_(Tiny(), Int8WeightOnlyConfig())
        changed = settings_mismatch(before, target.global_settings())
        assert "coordinate_descent_check_all_directions: true here" in changed and "(and 2 more)" in changed
    finally:
        inductor_config.load_config(saved)
    assert settings_mismatch(before, target.global_settings()) == ""
    assert len(describe(Tiny())) == 3 + 4 and digest(describe(Tiny())) == digest(describe(Tiny()))


@pytest.mark.slow  # the three strategies' tiny-sd builds (shared with tests/test_strategies.py)
@pytest.mark.parametrize("strategy", ["jit-cache", "aot-package", "aot-compile"])
@pytest.mark.parametrize("change", ["lora", "int8wo"])
def test_a_changed_pipe_is_a_miss_with_its_reason_under_every_strategy(strategy_build, strategy, change):
    from aotbuild import load_compiled
    from aotbuild.dispatch import dispatchers
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.recipe.rules import load_recipe

    recipe_path, cache, _ = strategy_build(strategy)
    recipe = load_recipe(recipe_path)
    pipe = load_pipeline(recipe, resolve_model(recipe, cache), "float32")
    import torch._inductor.config as inductor_config

    saved = inductor_config.save_config()
    try:
        if change == "lora":
            from peft import LoraConfig

            pipe.unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                             init_lora_weights=False))
            named = "peft.tuners.lora.layer.Linear here"
        else:
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            quantize_(pipe.unet, Int8WeightOnlyConfig())
            named = "Int8Tensor"
        with pytest.raises(CacheMiss) as info:
            load_compiled(recipe, pipe=pipe, cache=cache, on_miss="error")
        text = str(info.value)
        assert named in text and "differs from the one the entry was built for" in text
        assert f"{recipe.name}: 0 hit, 1 miss " in text.splitlines()[0]
        # Refused before anything was installed: no report on the pipe, no dispatcher, no compiled call.
        assert not hasattr(pipe, "aotbuild_report") and dispatchers(pipe.unet) == []
        assert all(vars(m).get("_compiled_call_impl") is None for m in pipe.unet.modules())
    finally:
        inductor_config.load_config(saved)


@pytest.mark.slow  # the three strategies' tiny-sd builds (shared with tests/test_strategies.py)
@pytest.mark.parametrize("strategy", ["jit-cache", "aot-package", "aot-compile"])
def test_load_compiled_twice_on_one_pipe_installs_again_cleanly(strategy_build, strategy):
    """After changing weights a user loads again into the same pipe: jit-cache's second compile wrapped
    the first dispatcher and raised Dynamo's Unsupported from aotbuild/dispatch.py."""
    from aotbuild import load_compiled
    from aotbuild.dispatch import Dispatcher
    from aotbuild.recipe.rules import load_recipe

    recipe_path, cache, _ = strategy_build(strategy)
    recipe = load_recipe(recipe_path)
    pipe = load_compiled(recipe, cache=cache, on_miss="error")
    kwargs = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 0.0}
    first = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="pt").images
    with torch.no_grad():
        pipe.unet.conv_in.weight.mul_(1.0)  # "changed weights": the same structure
    again = load_compiled(recipe, pipe=pipe, cache=cache, on_miss="error", strict_shapes=True)
    assert again is pipe and len(pipe.aotbuild_report.hits) == 1
    forward = vars(pipe.unet).get("forward")
    assert not isinstance(getattr(forward, "eager", None), Dispatcher)  # not a dispatcher around a dispatcher
    second = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="pt").images
    assert torch.allclose(second, first, atol=1e-5)  # the same latents: the same image
