"""strategy: aot-compile: the parts that need no compile (feature gate, validation, canonical strides,
grouping, routing, structure checks, keys), and one real regional build on a real architecture.
tests/test_strategies.py holds it to the promises every strategy keeps."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from aotbuild import ShapeNotBuilt
from aotbuild.dispatch import RouteDeclined, install_dispatcher, signature
from aotbuild.errors import RecipeError
from aotbuild.recipe.rules import parse_recipe
from aotbuild.strategies import aot_compile, calls
from aotbuild.strategies.registry import get_strategy

BASE = {"model": {"id": "builtin:tiny-sd"}, "strategy": "aot-compile", "shapes": [{"height": 64, "width": 64}]}


def test_an_older_torch_is_refused_when_the_recipe_is_read(monkeypatch):
    monkeypatch.setattr(aot_compile, "_torch_version", lambda: (2, 12))
    with pytest.raises(RecipeError, match=r"strategy aot-compile needs torch >= 2.13 \(verified\); this is torch"):
        parse_recipe(BASE)


def test_a_torch_without_the_api_is_refused(monkeypatch):
    monkeypatch.delattr(torch.compiler, "load_compiled_function")
    with pytest.raises(RecipeError, match="lacks torch.compiler.load_compiled_function"):
        parse_recipe(BASE)


@pytest.mark.parametrize(("change", "expected"), [
    ({"target": "neuron"}, "strategy aot-compile runs on target inductor (not neuron)"),
    ({"compile": {"fullgraph": False}}, "fullgraph must be true"),
    ({"compile": {"mode": "max-autotune"}}, "verified with mode: default only"),
    ({"offload": "model"}, "offload: model offload needs compile.scope: regional"),
    ({"compile": {"options": {"freezing": True}}}, "compile.options.freezing: strategy aot-compile would keep the "
                                                   "build's weights"),
])
def test_settings_it_cannot_honour_are_refused(change, expected):
    with pytest.raises(RecipeError, match=re.escape(expected)):
        parse_recipe({**BASE, **change})


def test_model_offload_is_accepted_with_regional_scope():
    recipe = parse_recipe({**BASE, "offload": "model", "compile": {"scope": "regional"}})
    assert recipe.offload == "model" and recipe.compile.scope == "regional"


class _Block(torch.nn.Module):
    """A block whose moves are recorded, not made (a meta tensor cannot be copied back)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.moves: list[str] = []

    def to(self, device):
        self.moves.append(str(device))
        return self


def test_a_block_is_compiled_on_the_device_its_call_ran_on_and_put_back():
    """Under offload: model the hook has moved the component back to the CPU by the time the warmup's
    calls are compiled; the block goes to the call's device for its compile, then home."""
    block = _Block()
    with calls.where_called(block, ((torch.ones(2, device="meta"),), {"scale": 1.0})):
        assert block.moves == ["meta"]
    assert block.moves == ["meta", "cpu"]
    with calls.where_called(block, ((torch.ones(2),), {})):  # called where it is: nothing moves
        pass
    assert block.moves == ["meta", "cpu"]
    with pytest.raises(ValueError), calls.where_called(block, ((torch.ones(2, device="meta"),), {})):
        raise ValueError("a failed compile still puts the block back")
    assert block.moves == ["meta", "cpu", "meta", "cpu"]

    class HalfMoved(_Block):
        def to(self, device):
            super().to(device)
            if str(device) == "meta":
                raise RuntimeError("out of memory")  # some parameters moved, then the move failed
            return self

    half = HalfMoved()
    with pytest.raises(RuntimeError, match="out of memory"), \
            calls.where_called(half, ((torch.ones(2, device="meta"),), {})):
        raise AssertionError("not reached")
    assert half.moves == ["meta", "cpu"]  # put back all the same


def test_the_artifacts_keep_the_portable_guards_but_the_global_state_one():
    """``portable_guards`` is torch's keep_portable_guards_unsafe less GLOBAL_STATE (it holds the thread
    count), on the guards Dynamo makes for a module call (the eager backend: no code generated)."""
    entries: list = []

    def record(guards):
        entries.extend(guards)
        return [True] * len(guards)

    compiled = torch.compile(aot_compile.call, backend="eager", fullgraph=True, options={"guard_filter_fn": record})
    compiled(torch.nn.Linear(3, 3), torch.randn(2, 3))
    portable = torch.compiler.keep_portable_guards_unsafe(entries)
    kept = aot_compile.portable_guards(entries)
    pairs = list(zip(entries, portable, kept, strict=True))
    assert {e.guard_type for e, was, now in pairs if was and not now} == {"GLOBAL_STATE"}
    assert not any(now and not was for _, was, now in pairs)
    assert [e.guard_type for e, _, now in pairs if now].count("TENSOR_MATCH") == 3  # input, weight, bias


def test_the_thread_count_is_no_key_factor_of_aot_compile_any_more():
    """Its artifacts serve any thread count (tests/test_threads.py); the target keys the count where the
    kernels bake it in (cpp.dynamic_threads: false), for every strategy alike."""
    target = __import__("aotbuild.targets.registry", fromlist=["get_target"]).get_target("inductor")
    assert get_strategy("aot-compile").compile_factors(target, "cpu") == {}
    assert get_strategy("aot-compile").compile_factors(target, "cuda") == {}


def test_canonical_strides_are_made_without_copying_when_they_can_be():
    x = torch.randn(1, 4, 6)[:, :, :]  # contiguous
    odd = x.as_strided((1, 4, 6), (99, 6, 1))  # a size-1 dimension with another stride: still "contiguous"
    assert odd.is_contiguous() and odd.stride() != (24, 6, 1)
    fixed = aot_compile.canonical(odd)
    assert fixed.stride() == (24, 6, 1) and fixed.data_ptr() == odd.data_ptr()  # the same memory
    sliced = torch.randn(4, 12)[:, ::2]
    copied = aot_compile.canonical({"a": [sliced], "b": 3})
    assert copied["a"][0].stride() == (6, 1) and torch.equal(copied["a"][0], sliced) and copied["b"] == 3
    dense = torch.randn(2, 3)
    assert aot_compile.canonical(dense) is dense


class Block(torch.nn.Module):
    def __init__(self, width: int = 4, flag: bool = False):
        super().__init__()
        self.proj = torch.nn.Linear(width, width)
        self.flag = flag

    def forward(self, x, scale=1.0):
        return self.proj(x) * scale


def test_the_recorder_groups_what_one_artifact_can_serve():
    a, b, c, d = Block(), Block(), Block(flag=True), Block(width=8)
    recorder = aot_compile.CallRecorder([("a", a), ("b", b), ("c", c), ("d", d)])
    x = torch.randn(2, 4)
    with torch.no_grad():
        a(x), b(x), c(x), d(torch.randn(2, 8)), a(x, scale=0.5), a(torch.randn(3, 4))
    recorder.remove()
    groups = sorted((g["instances"], g["floats"], g["grad"]) for g in recorder.groups.values())
    # a and b are identical: one group; c differs by a plain attribute, d by its tensors' shapes;
    # another float value or another batch is another group
    assert groups == sorted([(["a", "b"], [], False), (["c"], [], False), (["d"], [], False),
                             (["a"], [0.5], False), (["a"], [], False)])
    assert "forward" not in vars(a)


class FakeFunction:
    def __init__(self, passes: bool = True):
        self.passes = passes
        self.calls = 0

    def guard_check(self, module, *args, **kwargs):
        return self.passes

    def __call__(self, module, *args, **kwargs):
        self.calls += 1
        return module.proj(args[0]) + 100


def test_the_runner_picks_the_variant_by_floats_and_grad_and_respects_its_guards():
    block = Block()
    plain, half = FakeFunction(), FakeFunction()
    runner = aot_compile.AotRunner(block, "unet.a", [({"floats": [], "grad": False}, plain),
                                                     ({"floats": [0.5], "grad": False}, half)])
    x = torch.randn(2, 4)
    with torch.no_grad():
        runner(x)
        runner(x, scale=0.5)
        assert (plain.calls, half.calls) == (1, 1)
        with pytest.raises(RouteDeclined, match="float arguments differ"):
            runner(x, scale=0.25)
    with pytest.raises(RouteDeclined, match="grad mode"):
        runner(x)
    refused = aot_compile.AotRunner(block, "unet.a", [({"floats": [], "grad": False}, FakeFunction(passes=False))])
    with torch.no_grad(), pytest.raises(RouteDeclined, match="guards refused"):
        refused(x)


@pytest.mark.parametrize("policy", ["error", "eager", "compile"])
def test_a_declined_call_follows_the_call_policy(policy):
    block = Block()
    x = torch.randn(2, 4)
    refused = aot_compile.AotRunner(block, "unet", [({"floats": [], "grad": False}, FakeFunction(passes=False))])
    fallback_calls = []

    def fallback(*args, **kwargs):
        fallback_calls.append(1)
        return block.proj(args[0])

    sig = signature((x,), {})
    dispatcher = install_dispatcher(block, "unet", {sig: refused}, fallback, policy)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if policy == "error":
            with pytest.raises(ShapeNotBuilt, match="which this cache built, but its aot-compile guards refused"):
                block(x)
            return
        out = block(x)
        block(x)
    assert torch.allclose(out, block.proj(x))
    assert dispatcher.calls == {"built": 0, "unbuilt": 2}
    assert len(fallback_calls) == (2 if policy == "compile" else 0)
    assert len([w for w in caught if "guards refused" in str(w.message)]) == 1  # warned once, not per call


class FakeEntry:
    def __init__(self, packages):
        self.manifest = type("M", (), {"packages": packages})()


def test_check_refuses_a_module_of_another_structure_or_without_the_block():
    strategy = get_strategy("aot-compile")
    model = torch.nn.Module()
    model.blocks = torch.nn.ModuleList([Block(), Block()])
    digest = calls.structure_digest(model.blocks[0])
    ok = FakeEntry([{"instances": ["blocks.0", "blocks.1"], "structure": digest}])
    assert strategy.check(None, model, "transformer", ok) == ""
    model.blocks[1].flag = True  # a plain attribute the code may branch on, which torch's guards ignore
    assert "transformer.blocks.1 differs from the module" in strategy.check(None, model, "transformer", ok)
    missing = FakeEntry([{"instances": ["blocks.7"], "structure": digest}])
    assert "has no block 'blocks.7'" in strategy.check(None, model, "transformer", missing)


def test_kernels_built_in_this_process_count_as_compiles_and_installed_ones_do_not(tmp_path):
    """A function (or a jit-cache hit) whose kernels are not in the Inductor folder rebuilds them with
    no FX graph cache miss and no Dynamo frame: the proof must still see it."""
    from pathlib import Path

    from aotbuild.targets.inductor import active_cache_dir, kernels_built_here
    from aotbuild.targets.registry import get_target

    target = get_target("inductor")
    name, count = get_strategy("aot-compile").compile_counter(target)
    assert name == "Dynamo graphs traced + FX graph cache misses + kernels built here"
    before = count()
    blob = tmp_path / "kernel.so"
    blob.write_bytes(b"compiled at build time")
    target.install([("ab/kernel.so", blob), ("ab/kernel.cpp", blob)], "cpu")
    assert count() == before and kernels_built_here() == 0  # installed: not a compile
    (Path(active_cache_dir()) / "cd").mkdir()
    (Path(active_cache_dir()) / "cd" / "rebuilt.so").write_bytes(b"compiled here")
    assert kernels_built_here() == 1 and count() == before + 1


def test_a_record_s_module_globals_are_given_back_only_from_modules_already_imported():
    """Dynamo's code loads a module it needs through a global it installs (``___module_collections_<id>``),
    which torch 2.13 does not save: the record names them, and the load gives them back, never
    importing what this process has not (a manifest cannot make a load import a module)."""
    import collections
    import sys

    record = {"modules": {"___module_collections_1_c0": "collections",
                          "___module_nowhere_2_c0": "aotbuild_test_never_imported"}}
    assert aot_compile.modules_for(record) == {"___module_collections_1_c0": collections}
    assert "aotbuild_test_never_imported" not in sys.modules
    assert aot_compile.modules_for({}) is None
    strategy = get_strategy("aot-compile")
    good = {"structure": "x", "floats": [], "grad": False, **record}
    assert strategy.check_records((good,)) == ""
    for bad in ({"os": "os"}, {"___module_x_1": "os; rm"}, {"___module_x_1": 3}, ["___module_x_1"]):
        assert "packages[].modules" in strategy.check_records(({**good, "modules": bad},))


@pytest.mark.slow  # a real build and its proof: a few seconds of compiling on 2 cores
def test_a_clip_text_encoder_builds_and_serves_through_its_module_globals(models_dir, tmp_path):
    """A CLIP text encoder returns a transformers ModelOutput (an OrderedDict), which Dynamo's code
    rebuilds through a global for ``collections``: its entry failed its proof ("Missing required
    external references") until the record carried that global. The proof serves the entry in a
    fresh process: 0 compiles, equal to eager."""
    import json
    import shutil

    from tests.conftest import invoke_cli

    cache = tmp_path / "cache"
    shutil.copytree(models_dir / "models", cache / "models")
    recipe = tmp_path / "text_encoder.yaml"
    recipe.write_text(json.dumps({**BASE, "compile": {"components": ["text_encoder"]},
                                  "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0}}))
    built = invoke_cli("build", "--json", "--cache", str(cache), str(recipe),
                       env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "AOTBUILD_CACHE": ""})
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    job, = json.loads(built.stdout)["jobs"]
    manifest = json.loads(invoke_cli("show", "--json", "--cache", str(cache), job["key"]).stdout)
    record, = manifest["packages"]
    assert "collections" in record["modules"].values()
    assert manifest["proof"]["compiles"] == 0 and manifest["proof"]["max_abs_diff"] <= 1e-4
