"""scope: regional without compiling: input layouts and the stride guard, the block recorder."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from aotbuild.errors import PackageMismatch
from aotbuild.strategies import aoti, calls
from aotbuild.strategies.runner import PackageRoute, PackageRunner
from tests.scheduler_matrix import UNUSABLE, Cell, run


@pytest.mark.parametrize("shape,strides,ok", [
    ((2, 16, 32), (512, 32, 1), True),  # contiguous
    ((2, 16, 32), (768, 32, 1), True),  # a slice along dim 1
    ((4, 3), (1, 4), True),  # transposed
    ((1, 16), (0, 1), True),  # stride 0 on a size-1 dim is harmless
    ((4, 16), (0, 1), False),  # expanded: four rows share one
    ((4, 4), (2, 1), False),  # overlapping windows
    ((4, 4), (4, 4), False),  # two dims on one stride
    ((0, 4), (0, 0), True),  # empty
    ((2, 3), (1,), False),  # rank mismatch
])
def test_copyable_layouts(shape, strides, ok):
    assert calls.copyable(shape, strides) is ok


def test_relayout_gives_exactly_the_strides_asked_for():
    t = torch.arange(16 * 32, dtype=torch.float32).reshape(1, 16, 32)
    out = calls.relayout(t, [768, 32, 1])
    assert out.stride() == (768, 32, 1) and torch.equal(out, t)
    out = calls.relayout(torch.arange(6.0).reshape(2, 3), [1, 2])  # column-major
    assert out.stride() == (1, 2) and torch.equal(out, torch.arange(6.0).reshape(2, 3))


def test_snapshot_keeps_a_strided_input_and_densifies_an_expanded_one():
    sliced = torch.randn(2, 24, 32)[:, 8:]
    expanded = torch.randn(1, 8).expand(4, 8)
    (a, b), _ = calls.snapshot((sliced, expanded), {})
    assert a.stride() == sliced.stride() and torch.equal(a, sliced)
    assert b.stride() == (8, 1) and torch.equal(b, expanded)


class _FakeModel:
    """What ``aoti_load_package`` returns, as far as the runner uses it; records what it was given."""

    def __init__(self):
        self.seen = []

    def load_constants(self, tensors, check_full_update, user_managed):
        pass

    def __call__(self, *args, **kwargs):
        self.seen.append((args, kwargs))
        return kwargs["hidden_states"]


def _guard(strides):
    model = _FakeModel()
    package = {"constants": {}, "strides": strides}
    return PackageRoute(PackageRunner(model, nn.Module(), "transformer.single_transformer_blocks.1",
                                                 package, "cpu")), model


def test_guard_passes_inputs_in_the_package_s_exact_layout_as_they_are():
    run, model = _guard([[768, 32, 1], [768, 32, 1]])  # built for the slices a Flux block passes on
    out = torch.randn(1, 24, 32)
    encoder, hidden = out[:, :8], out[:, 8:]
    run(hidden_states=hidden, encoder_hidden_states=encoder)  # kwargs are compared in name order
    (_, kwargs), = model.seen
    assert kwargs["hidden_states"] is hidden and kwargs["encoder_hidden_states"] is encoder


def test_guard_copies_a_batch_one_slice_whose_size_one_stride_differs():
    """The package checks every input stride, a size-1 dimension's too (AOTI_RUNTIME_CHECK_INPUTS):
    a slice that differs from the package's layout only there is copied, never refused."""
    run, model = _guard([[768, 32, 1], [512, 32, 1]])
    out = torch.randn(1, 24, 32)
    encoder, hidden = out[:, :8], out[:, 8:]
    assert hidden.stride() == (768, 32, 1) and hidden.is_contiguous()  # PyTorch ignores the size-1 dim
    run(hidden_states=hidden, encoder_hidden_states=encoder)
    (_, kwargs), = model.seen
    assert kwargs["hidden_states"].stride() == (512, 32, 1) and torch.equal(kwargs["hidden_states"], hidden)


def test_guard_copies_into_the_package_strides_where_they_matter():
    run, model = _guard([[256, 32, 1], [768, 32, 1]])  # built for slices at batch 2
    encoder, hidden = torch.randn(2, 8, 32), torch.randn(2, 16, 32)  # called with fresh tensors
    run(hidden_states=hidden, encoder_hidden_states=encoder)
    (_, kwargs), = model.seen
    assert kwargs["encoder_hidden_states"] is encoder
    assert kwargs["hidden_states"].stride() == (768, 32, 1) and torch.equal(kwargs["hidden_states"], hidden)


class _Binding(_FakeModel):
    def __init__(self):
        super().__init__()
        self.bound = []

    def load_constants(self, tensors, check_full_update, user_managed):
        self.bound.append({k: v.device.type for k, v in tensors.items()})


def test_under_offload_a_package_takes_its_weights_at_the_first_call_where_the_hook_put_them():
    """offload: model keeps the component on the CPU until the offload hook moves it to the execution
    device, just before its blocks run: a package built for that device binds then, and again after
    every move (each one gives the weights new storage). "meta" stands for the device here."""
    package = {"constants": {"weight": [[2, 2], "float32", "meta"], "bias": [[2], "float32", "meta"]},
               "strides": None, "path": "aoti/block.pt2"}
    block = nn.Linear(2, 2)
    with pytest.raises(PackageMismatch, match="weight is now float32 \\[2, 2\\] on cpu"):
        PackageRunner(_Binding(), block, "unet.block", package, "meta")  # bound at load: refused
    model = _Binding()
    runner = PackageRunner(model, block, "unet.block", package, "meta", bind_at_first_call=True)
    assert model.bound == []
    other = {**package, "constants": {**package["constants"], "weight": [[4, 2], "float32", "meta"]}}
    with pytest.raises(PackageMismatch, match="weight is now float32 \\[2, 2\\] on cpu, but .* \\[4, 2\\] on meta"):
        PackageRunner(_Binding(), block, "unet.block", other, "meta", bind_at_first_call=True)  # at load
    block.to("meta")  # what the hook does before the component runs
    runner(hidden_states=torch.empty(1, 2, device="meta"))
    runner(hidden_states=torch.empty(1, 2, device="meta"))
    assert model.bound == [{"weight": "meta", "bias": "meta"}] and runner.rebinds == 0
    block.weight = nn.Parameter(torch.empty(2, 2, device="meta"))  # moved back and forth: new tensors
    runner(hidden_states=torch.empty(1, 2, device="meta"))
    assert len(model.bound) == 2 and runner.rebinds == 1
    block.to_empty(device="cpu")  # left on the CPU: refused with the reason, never run on wrong weights
    with pytest.raises(PackageMismatch, match="on cpu, but its AOT package was built for float32 \\[2, 2\\] on meta"):
        runner(hidden_states=torch.empty(1, 2, device="meta"))
    assert len(model.seen) == 3


def test_guard_refuses_a_layout_no_copy_can_make():
    run, _ = _guard([[0, 1]])  # a package built for an expanded input (aotbuild never builds one)
    with pytest.raises(PackageMismatch, match=r"built for \[0, 1\], which no copy can make"):
        run(hidden_states=torch.randn(4, 8))
    run, _ = _guard([[8, 1], [8, 1]])
    with pytest.raises(PackageMismatch, match="called with 1 tensors, its AOT package was built for 2"):
        run(hidden_states=torch.randn(4, 8))


class ToyBlock(nn.Module):
    """Returns slices of one output, as Flux's single-stream blocks do."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states, encoder_hidden_states, scale=1.0):
        text = encoder_hidden_states.shape[1]
        x = self.proj(torch.cat([encoder_hidden_states, hidden_states], dim=1)) * scale
        return x[:, :text], x[:, text:]


class Toy(nn.Module):
    _repeated_blocks = ["ToyBlock"]

    def __init__(self, n: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(ToyBlock() for _ in range(n))

    def forward(self, hidden_states, encoder_hidden_states, scales=None):
        for block, scale in zip(self.blocks, scales or [1.0] * len(self.blocks), strict=True):
            encoder_hidden_states, hidden_states = block(hidden_states=hidden_states,
                                                         encoder_hidden_states=encoder_hidden_states, scale=scale)
        return hidden_states


def test_recorder_keeps_every_instance_call_and_one_snapshot_per_group():
    toy = Toy(3)
    recorder = aoti.BlockRecorder(toy, "transformer")
    with torch.no_grad():
        toy(torch.randn(2, 5, 8), torch.randn(2, 3, 8))
    (key, packages), = recorder.groups.items()
    assert len(packages) == 1 and packages[0]["instances"] == ["blocks.0", "blocks.1", "blocks.2"]
    sig = key[1]
    strides = {name: calls[sig]["strides"] for name, calls in recorder.calls.items()}
    # kwargs in name order: encoder_hidden_states, hidden_states; blocks 1 and 2 get slices of (2, 8, 8)
    assert strides == {"blocks.0": [[24, 8, 1], [40, 8, 1]], "blocks.1": [[64, 8, 1], [64, 8, 1]],
                       "blocks.2": [[64, 8, 1], [64, 8, 1]]}
    # The package is exported for what most instances receive: only blocks.0 will copy its inputs.
    recorder.plan_layouts()
    assert packages[0]["layout"] == [[64, 8, 1], [64, 8, 1]]
    assert {name: calls[sig]["copies"] for name, calls in recorder.calls.items()} == {
        "blocks.0": True, "blocks.1": False, "blocks.2": False}
    args, kwargs = aoti._relaid(packages[0]["call"], packages[0]["layout"])
    assert kwargs["hidden_states"].stride() == (64, 8, 1) and kwargs["encoder_hidden_states"].stride() == (64, 8, 1)
    assert torch.equal(kwargs["hidden_states"], packages[0]["call"][1]["hidden_states"])


def test_recorder_gives_an_instance_with_other_float_arguments_its_own_package():
    """torch.export bakes a float argument into the package: no guard could fix another value."""
    toy = Toy(3)
    recorder = aoti.BlockRecorder(toy, "transformer")
    with torch.no_grad():
        toy(torch.randn(1, 5, 8), torch.randn(1, 3, 8), scales=[1.0, 1.0, 0.5])
    (_, packages), = recorder.groups.items()
    assert [p["instances"] for p in packages] == [["blocks.0", "blocks.1"], ["blocks.2"]]
    assert [p["floats"] for p in packages] == [[1.0], [0.5]]
    assert recorder.calls["blocks.2"][next(iter(recorder.calls["blocks.2"]))]["package"] == 1


# ---------------------------------------------------------------------------------------------
# compile.blocks: regional scope for models without _repeated_blocks
# ---------------------------------------------------------------------------------------------

def _recipe(**compile_section):
    from aotbuild.recipe.rules import parse_recipe

    return parse_recipe({"model": "builtin:tiny-sd", "device": "cpu", "shapes": [{"height": 64, "width": 64}],
                         "compile": {"components": ["transformer"], **compile_section}}, "r.yaml")


@pytest.mark.parametrize("section,expected", [
    ({"blocks": ["JointTransformerBlock"]}, "compile.blocks: names the blocks that scope: regional compiles: set "
                                            "compile.scope: regional"),
    ({"scope": "regional", "blocks": ["JointTransformerBlock x3"]}, "'JointTransformerBlock x3' is not a class name"),
    ({"scope": "regional", "blocks": []}, "compile.blocks: expected a non-empty list of names"),
    ({"scope": "regional", "blocks": ["A", "A"]}, "compile.blocks: lists a name twice"),
])
def test_blocks_recipe_errors(section, expected):
    from aotbuild.errors import RecipeError

    with pytest.raises(RecipeError) as info:
        _recipe(**section)
    assert expected in str(info.value)


def test_blocks_are_a_key_factor_and_absent_ones_change_no_key():
    from aotbuild.recipe.schema import recipe_to_dict
    from aotbuild.targets.registry import get_target

    plain, named = _recipe(scope="regional"), _recipe(scope="regional", blocks="JointTransformerBlock")
    assert named.compile.blocks == ("JointTransformerBlock",) and plain.compile.blocks is None
    for target in ("inductor", "neuron", "tpu"):
        settings = get_target(target).compile_settings
        assert "blocks" not in settings(plain, "cpu")  # recipes without compile.blocks keep their keys
        assert settings(named, "cpu")["blocks"] == ["JointTransformerBlock"]
    both = _recipe(scope="regional", blocks=["FluxTransformerBlock", "FluxSingleTransformerBlock"])
    reordered = _recipe(scope="regional", blocks=["FluxSingleTransformerBlock", "FluxTransformerBlock"])
    inductor = get_target("inductor")
    assert inductor.compile_settings(both, "cpu") == inductor.compile_settings(reordered, "cpu")
    assert "blocks" not in recipe_to_dict(plain)["compile"]
    assert recipe_to_dict(named)["compile"]["blocks"] == ["JointTransformerBlock"]


@pytest.fixture(scope="module")
def sd3_transformer(tiny_sd3_dir):
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel.from_pretrained(str(tiny_sd3_dir / "transformer"))


def test_unknown_block_class_lists_the_classes_that_repeat(sd3_transformer):
    from aotbuild.errors import RecipeError
    from aotbuild.pipeline.blocks import select_blocks

    recipe = _recipe(scope="regional", blocks=["JointTransformerBloc"])
    with pytest.raises(RecipeError) as info:
        select_blocks(sd3_transformer, recipe.compile.blocks, recipe)
    text = str(info.value)
    assert text.startswith("r.yaml: compile.blocks: SD3Transformer2DModel has no block class 'JointTransformerBloc'; "
                           "did you mean 'JointTransformerBlock'? (its classes that repeat: JointTransformerBlock x3, ")
    assert "Linear" not in text  # torch's own layers are not blocks
    nested = _recipe(scope="regional", blocks=["JointTransformerBlock", "FeedForward"])
    with pytest.raises(RecipeError, match=r"FeedForward \(transformer_blocks.0.ff\) is inside JointTransformerBlock "
                                          r"\(transformer_blocks.0\): name only one of them"):
        select_blocks(sd3_transformer, nested.compile.blocks, nested)
    with pytest.raises(RecipeError, match="SD3Transformer2DModel declares no _repeated_blocks: name them in "
                                          "compile.blocks .its classes that repeat: JointTransformerBlock x3"):
        select_blocks(sd3_transformer, None, _recipe(scope="regional"))
    found = select_blocks(sd3_transformer, ("JointTransformerBlock",))
    assert [name for name, _ in found] == [f"transformer_blocks.{i}" for i in range(3)]
    assert [b.context_pre_only for _, b in found] == [False, False, True]  # the last one differs


def test_jit_cache_regional_compiles_each_named_block(sd3_transformer):
    """compile_repeated_blocks' way for the recipe's classes: block.compile() on every instance (lazy:
    nothing is compiled until a call)."""
    import copy

    from aotbuild.targets.registry import get_target

    module = copy.deepcopy(sd3_transformer)
    recipe = _recipe(scope="regional", blocks=["JointTransformerBlock"])
    get_target("inductor").compile(module, recipe, "cpu")
    compiled = sorted(n for n, m in module.named_modules() if getattr(m, "_compiled_call_impl", None) is not None)
    assert compiled == [f"transformer_blocks.{i}" for i in range(3)]


@pytest.fixture(scope="module")
def tiny_sd3_dir(tmp_path_factory):
    """builtin:tiny-sd3 (3 JointTransformerBlocks, the last context_pre_only) as a plain folder."""
    from aotbuild import builtin

    return builtin.ensure("builtin:tiny-sd3", tmp_path_factory.mktemp("sd3") / "models")


def test_plan_checks_block_names_without_loading_weights(tiny_sd3_dir, tmp_path, monkeypatch):
    from aotbuild.errors import RecipeError
    from aotbuild.pipeline import models
    from aotbuild.planner import plan

    def no_loading(*args, **kwargs):
        raise AssertionError("plan loaded the pipeline")

    monkeypatch.setattr(models, "load_pipeline", no_loading)
    base = (f"model: {{id: {tiny_sd3_dir}}}\ndevice: cpu\nshapes: [{{height: 64, width: 64}}]\n"
            "compile: {components: [transformer], scope: regional")
    bad = tmp_path / "bad.yaml"
    bad.write_text(base + ", blocks: [JointBlock]}\n")
    with pytest.raises(RecipeError, match=r"bad.yaml: compile.blocks: transformer: SD3Transformer2DModel has no "
                                          r"block class 'JointBlock'; did you mean 'JointTransformerBlock'\? \(its "
                                          r"classes that repeat: JointTransformerBlock x3, "):
        plan([str(bad)], tmp_path / "cache")
    missing = tmp_path / "missing.yaml"
    missing.write_text(base + "}\n")
    with pytest.raises(RecipeError, match=r"compile.scope: regional scope needs a component with _repeated_blocks; "
                                          r"transformer \(SD3Transformer2DModel\) has none: name its block classes in "
                                          r"compile.blocks \(its classes that repeat: JointTransformerBlock x3"):
        plan([str(missing)], tmp_path / "cache")
    good = tmp_path / "good.yaml"
    good.write_text(base + ", blocks: [JointTransformerBlock]}\n")
    job, = plan([str(good)], tmp_path / "cache")
    assert job.status == "miss" and job.factors["compile"]["blocks"] == ["JointTransformerBlock"]


# ---------------------------------------------------------------------------------------------
# For real: build with the CLI; the build's proof is the fresh replica (slow: minutes on 2 cores)
# ---------------------------------------------------------------------------------------------

FLUX_REGIONAL = textwrap.dedent("""
    model: {{id: builtin:tiny-flux, dtype: float32}}
    target: inductor
    device: cpu
    strategy: {strategy}
    offload: {offload}
    compile: {{components: [transformer], scope: regional}}
    shapes: [{{height: 64, width: 64}}]
    warmup: {{num_inference_steps: 2, max_sequence_length: 8, guidance_scale: 3.5}}  # guidance: an input
""")


def _build(folder: Path, strategy: str, offload: str) -> tuple[Path, Path, dict]:
    """The Flux 2+2 regional recipe built by ``aotbuild build`` into a fresh cache under ``folder``:
    (the recipe, the cache, the entry's manifest). Its proof (aotbuild/builder/proof.py) is a fresh process
    in another working directory, every compiler folder empty, loading the entry from another store:
    what it saw is ``proof.served``, which the tests read instead of serving the entry a second time
    (issue 30, item 4)."""
    import json

    from tests.conftest import invoke_cli

    recipe = folder / "recipes" / f"regional-{strategy}-{offload}.yaml"
    recipe.parent.mkdir(parents=True)
    recipe.write_text(FLUX_REGIONAL.format(strategy=strategy, offload=offload))
    cache = folder / "cache"
    # in this process: the build's loader, worker and proof are fresh processes already
    proc = invoke_cli("build", "--json", "--cache", str(cache), str(recipe),
                      env={"TORCHINDUCTOR_CACHE_DIR": str(folder / "build-inductor")})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    key = json.loads(proc.stdout)["jobs"][0]["key"]
    return recipe, cache, json.loads(invoke_cli("show", "--json", "--cache", str(cache), key[:12]).stdout)


@pytest.fixture(scope="module")
def flux_package(tmp_path_factory):
    """aot-package regional, built once under offload: model (issue 26: exported on the call's device,
    bound at the first call). offload is no key factor: the same entry serves without offload."""
    return _build(tmp_path_factory.mktemp("flux-package"), "aot-package", "model")


#: Both aot-package cells read one build: one worker (tests/conftest.py reads the mark).
ONE_PACKAGE_BUILD = pytest.mark.xdist_group("tiny-flux:aot-package:regional")


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "offload"), [pytest.param("aot-package", "model", marks=ONE_PACKAGE_BUILD),
                                                   ("aot-compile", "model")])
def test_flux_regional_packages_serve_every_block(tmp_path, strategy, offload, request):
    """Issue 12: single-stream blocks after the first get slices; every one must run its package (or
    its aot-compile function, which gets the block as an argument and canonical strides).
    Under offload: model (issue 26) both are built and served with accelerate's offload hook on the
    transformer (aot-package's runners bind their weights at the first call, and again whenever the
    hook's move gave them new storage: at every step, "cpu:0" being a copy). The execution device here is
    the CPU: a move between devices is covered by the unit tests of where_called and of binding at
    the first call, not by this one. What is read is the proof's fresh process (``proof.served``);
    tests/test_e2e.py plants a compile and a wrong output in a proof and sees both counted."""
    if strategy == "aot-package":
        _, _, manifest = request.getfixturevalue("flux_package")
    else:
        _, _, manifest = _build(tmp_path, strategy, offload)
    check_every_block_served(manifest, strategy, offload)


@pytest.mark.slow
@ONE_PACKAGE_BUILD
def test_the_flux_package_built_under_offload_serves_a_replica_without_offload(flux_package, tmp_path):
    """The same entry (offload is no key factor) loaded by a fresh replica that does not offload:
    instances sharing a package each open it for themselves, nothing is swapped or rebound. No build proves this
    path, so a real replica serves it (tests/serving.py)."""
    from tests.serving import serve_fresh

    _, cache, manifest = flux_package
    plain = tmp_path / "regional-aot-package-none.yaml"
    plain.write_text(FLUX_REGIONAL.format(strategy="aot-package", offload="none"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = serve_fresh(plain, cache, tmp_path, component="transformer", cwd=elsewhere)
    assert result["hits"] == result["shapes"] == 1 and result["misses"] == 0, result
    assert result["unique_graphs"] == 0 and result["compiles"] == 0, result  # no Dynamo, no compile
    instances = {b for p in manifest["packages"] for b in p["instances"]}
    assert len(instances) == 4 and set(result["calls"]) == instances, result
    assert all(c["built"] == 2 for c in result["calls"].values()), result  # every block, both steps
    # each instance has the package opened for itself: nothing is swapped in before a call (issue 52)
    assert result["swaps"] == 0 and result["rebinds"] == 0, result
    assert result["max_diff"] <= 1e-5 and result["component_max_diff"] <= 1e-5, result
    assert "transformer_blocks.0 was called with" in result["strict"], result
    assert result["offload_hook"] == "NoneType", result


@pytest.mark.slow
@ONE_PACKAGE_BUILD
def test_the_flux_regional_package_serves_threads_copies_and_a_partial_write(flux_package, tmp_path):
    """A server's use of a regional entry (issue 52; tests/test_server_pipelines.py for full scope): 4
    request-scoped pipelines at once, copies, saves and a one-channel ``.data`` write, each like eager.
    Every block instance has its package opened for itself: nothing is swapped between the instances."""
    from tests.serving import assert_like_eager, serve_as_a_server

    _, cache, _ = flux_package
    plain = tmp_path / "regional-aot-package-none.yaml"
    plain.write_text(FLUX_REGIONAL.format(strategy="aot-package", offload="none"))
    result = serve_as_a_server(plain, cache, tmp_path, component="transformer")
    assert_like_eager(result)
    assert result["deepcopy_warnings"] == [] and result["refreshed"] >= 4  # a package per block instance


def check_every_block_served(manifest: dict, strategy: str, offload: str) -> None:
    """What the proof's fresh process saw serving a tiny Flux 2+2 regional entry (``proof.served``)."""
    proof, served = manifest["proof"], manifest["proof"]["served"]
    assert proof["instances"] == 4 and proof["compiles"] == 0, proof
    assert proof["calls"] == 2, proof  # both steps of the warmup, replayed
    packages = {p["block_class"]: p["instances"] for p in manifest["packages"]}
    assert packages == {"FluxTransformerBlock": ["transformer_blocks.0", "transformer_blocks.1"],
                        "FluxSingleTransformerBlock": ["single_transformer_blocks.0", "single_transformer_blocks.1"]}
    assert served["hits"] == 1 and served["misses"] == 0, served
    assert served["dynamo_graphs"] == 0 and served["fxgraph_cache_miss"] == 0, served  # no Dynamo, no compile
    # every block, at both steps, by its package (or function): none fell back to the module's own forward
    assert served["dispatch"] == {b: {"built": 2, "unbuilt": 0} for instances in packages.values()
                                  for b in instances}, served
    if strategy == "aot-package" and offload == "model":
        # The offload hook moves the transformer to diffusers' execution device, "cpu:0", at every
        # step, and .to("cpu:0") copies a CPU tensor: new storage, which each runner re-binds.
        assert served["rebinds"] > 0, served
    assert proof["max_abs_diff"] <= 1e-5, proof  # the transformer's every output, against eager's
    # a call at a shape the entry was not built for (half the height) is refused at the first block
    assert "transformer_blocks.0 was called with" in served["strict"], served
    # in the caller's terms (issue 55): the pipeline's height x width, then the block's latents
    assert served["strict"].startswith('transformer.transformer_blocks.0: the pipeline was called at 32x64 (1 image), '
                                       'which this cache did not build (on_miss="error"); built: 64x64 (1 image, as '
                                       'called). Call the pipeline at a built size, or add {height: 32, width: 64}'), \
        served
    assert served["offload_hook"] == ("CpuOffload" if offload == "model" else "NoneType"), served


#: The scheduler matrix's tiny-flux half (issue 56, items 4 and 5; tiny-sd's is tests/test_schedulers.py), on
#: the package above served without offload. FluxPipeline hands its transformer ``t.expand(batch).to(latents.
#: dtype)`` whatever the scheduler's dtype: no conversion is ever asked for; what a cell tests is that the
#: scheduler works with the pipeline and the entry serves its timesteps and sigmas. Guidance is an input of
#: the transformer (FLUX.1-dev's embedding): any guidance_scale per request is the same call, and true CFG
#: (a negative prompt, true_cfg_scale) is a second call of the same shape per step.
FLUX_SCHEDULERS = {
    "FlowMatchEuler, dynamic shifting (its own)": Cell("FlowMatchEulerDiscreteScheduler"),
    "FlowMatchEuler, no dynamic shifting": Cell("FlowMatchEulerDiscreteScheduler",
                                                config={"use_dynamic_shifting": False}),
    "FlowMatchHeun": Cell("FlowMatchHeunDiscreteScheduler", UNUSABLE, r"`set_timesteps` does not support"),
    "FlowMatchLCM": Cell("FlowMatchLCMScheduler"),
    "UniPC, use_flow_sigmas": Cell("UniPCMultistepScheduler", config={"use_flow_sigmas": True,
                                                                      "prediction_type": "flow_prediction"}),
    "DPM-Solver++, use_flow_sigmas": Cell("DPMSolverMultistepScheduler", config={
        "use_flow_sigmas": True, "prediction_type": "flow_prediction"}),
    "guidance_scale 1.0 (built 3.5)": Cell("FlowMatchEulerDiscreteScheduler", call={"guidance_scale": 1.0}),
    "guidance_scale 7.0 (built 3.5)": Cell("FlowMatchEulerDiscreteScheduler", call={"guidance_scale": 7.0}),
    "true CFG on (true_cfg_scale 4.0, a negative prompt)": Cell(
        "FlowMatchEulerDiscreteScheduler", call={"true_cfg_scale": 4.0, "negative_prompt": "a blurry photo"}),
}


@pytest.mark.slow
@ONE_PACKAGE_BUILD
def test_the_flux_package_serves_each_scheduler_and_guidance_swapped_after_load(flux_package, tmp_path):
    import copy

    from aotbuild import load_compiled
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.recipe.rules import load_recipe

    _, cache, _ = flux_package
    plain = tmp_path / "regional-aot-package-none.yaml"
    plain.write_text(FLUX_REGIONAL.format(strategy="aot-package", offload="none"))
    recipe = load_recipe(plain)
    eager = load_pipeline(recipe, resolve_model(recipe, cache), "float32")
    served = load_compiled(recipe, copy.deepcopy(eager), cache=cache, on_miss="error")
    call = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2, "max_sequence_length": 8,
            "guidance_scale": 3.5}
    results = run("tiny-flux (aot-package, regional)", served, eager, FLUX_SCHEDULERS, call, "transformer")
    assert sum(r.startswith("served") for r in results.values()) == len(FLUX_SCHEDULERS) - 1
