"""A hit never serves a stale graph (issue 31): what a graph depends on is recorded at build and checked
at load and at every call of a compiled module.

Measured before this (tiny-sd, on_miss="error"): FreeU enabled, a user's attention processor set, or
the UNet moved to channels_last were served by aot-package with 0 compiles and a wrong image (the
image without FreeU, the old processor's output, 0.57 off for channels_last); after load, aot-compile
too. The fast tier tests the record and its check (aotbuild/pipeline/dependencies.py) and the dispatcher's
policy; the slow tier runs the matrix of changes x strategies x before/after load on the session's
shared builds (tests/conftest.py ``strategy_build``), each cell either served compiled and equal to
eager with the same change, or refused naming the change, and never compiling.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from aotbuild.dispatch import Dispatcher
from aotbuild.errors import CacheMiss, StaleGraph, UsageError
from aotbuild.pipeline import dependencies


@pytest.fixture(autouse=True)
def active_attention_backend():
    """diffusers' process-wide attention backend as it was: a load of a recipe that declares one
    (changes.attention_backend) sets it, and a later test's compiled calls would be refused under it."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = before


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.conv = torch.nn.Conv2d(4, 4, 3)
        self.scale = 1.0

    def forward(self, x):
        return self.proj(x) * self.scale


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])


def _diff(before, module) -> str:
    return dependencies.diff(before, dependencies.snapshot(module), "m", ignore=dependencies.ROOT_OUTSIDE)


def test_an_attribute_written_or_added_is_named():
    m = Outer()
    before = dependencies.snapshot(m)
    assert _diff(before, m) == ""
    m.blocks[1].scale = 2.0
    assert _diff(before, m) == "m.blocks.1.scale: 2.0 here, 1.0 in the entry"
    m.blocks[1].scale = 1.0
    m.blocks[0].b1 = 1.2  # as enable_freeu does on each up block
    assert _diff(before, m) == "m.blocks.0.b1: 1.2 here, absent in the entry: FreeU?"
    m.blocks[0].b1 = None  # disable_freeu leaves None: the code reads getattr(self, "b1", None)
    assert _diff(before, m) == ""


def test_weights_values_never_count_their_layout_dtype_and_class_do():
    m = Outer()
    before = dependencies.snapshot(m)
    m.load_state_dict({k: v * 3 for k, v in m.state_dict().items()})
    assert _diff(before, m) == ""
    m.to(memory_format=torch.channels_last)
    assert "m.blocks.0.conv.weight: param float32 [4, 4, 3, 3] stride [36, 1, 12, 4]" in _diff(before, m)
    assert _diff(before, m).endswith("another memory format (channels_last?)")
    m.to(memory_format=torch.contiguous_format)
    assert _diff(before, m) == ""
    m.to(torch.float64)
    assert "float64" in _diff(before, m) and _diff(before, m).endswith("another dtype (pipe.to(dtype)?)")
    m.to(torch.float32)
    m.blocks[0].proj = torch.nn.Identity()
    assert _diff(before, m).startswith("m.blocks.0.proj: torch.nn.modules.linear.Identity here")


class Doubling:
    def __call__(self, *args, **kwargs):
        return None


class Halving:
    def __call__(self, *args, **kwargs):
        return None


def test_held_callables_count_by_class_hooks_by_count():
    m = Outer()
    m.blocks[0].processor = Doubling()
    before = dependencies.snapshot(m)
    m.blocks[0].processor = Doubling()  # another object of the same class: the same code
    assert _diff(before, m) == ""
    m.blocks[0].processor = Halving()
    assert _diff(before, m).startswith(f"m.blocks.0.processor: {__name__}.Halving object here, {__name__}.Doubling "
                                       f"object in the entry: another attention processor?")
    m.blocks[0].processor = Doubling()
    handle = m.blocks[1].register_forward_hook(lambda *a: None)
    assert _diff(before, m) == "m.blocks.1.<hooks>: forward 1, pre 0 here, absent in the entry: a hook (a " \
                               "diffusers cache, a forward hook)?"
    handle.remove()
    m.register_forward_hook(lambda *a: None)  # on the compiled module itself: runs outside its graph
    assert _diff(before, m) == ""


def test_an_entry_without_a_record_misses_as_built_by_an_older_aotbuild():
    assert dependencies.diff(None, dependencies.snapshot(Outer()), "unet") == \
        "unet: the entry was built by an older aotbuild (no dependency record): rebuild"


def test_the_watch_catches_each_change_and_rearms_on_a_benign_one():
    m = Outer()
    recorded = {**dependencies.snapshot(m), "globals": [[False, "float32", []]]}
    watch = dependencies.Watch(m, recorded, "m")
    with torch.no_grad():
        assert watch.check() == ""
        m.blocks[0].b1 = 1.2
        assert "b1: 1.2 here" in watch.check()
        assert "b1: 1.2 here" in watch.check()  # sticky until undone
        m.blocks[0].b1 = None
        assert watch.check() == ""
        m.blocks[1].scale = 3.0
        assert "scale: 3.0 here" in watch.check()
        m.blocks[1].scale = 1.0
        m.load_state_dict({k: v + 1 for k, v in m.state_dict().items()})
        assert watch.check() == ""
        m.blocks[1].conv.to(memory_format=torch.channels_last)  # a submodule moved on its own
        assert "blocks.1.conv.weight" in watch.check()
        m.blocks[1].conv.to(memory_format=torch.contiguous_format)
        m.blocks[0].proj.weight = torch.nn.Parameter(torch.zeros(4, 4, dtype=torch.float64))
        assert "blocks.0.proj.weight: param float64" in watch.check()
        m.blocks[0].proj.weight = torch.nn.Parameter(torch.zeros(4, 4))
        assert watch.check() == ""
        m.blocks[0].proj = torch.nn.Linear(4, 4, bias=False)  # a child replaced
        assert "blocks.0.proj.bias: absent here" in watch.check()
    assert "called with grad on" in watch.check()


class Wrapped(torch.Tensor):
    """A tensor with no storage of its own, as a DTensor or a torchao quantized weight: data_ptr is 0."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   strides=inner.stride())

    def __init__(self, inner):
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map

        def unwrap(x):
            return x.inner if isinstance(x, Wrapped) else x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        return tree_map(lambda x: Wrapped(x) if isinstance(x, torch.Tensor) else x, out)


def test_the_watch_follows_a_weight_without_storage_by_its_metadata():
    m = torch.nn.Linear(4, 4)
    m.weight = torch.nn.Parameter(Wrapped(torch.randn(4, 4)), requires_grad=False)
    assert torch._C.TensorBase.data_ptr(m.weight) == 0
    watch = dependencies.Watch(m, {**dependencies.snapshot(m), "globals": []}, "m")
    assert watch.check() == ""
    m.weight.data = Wrapped(torch.randn(4, 4, dtype=torch.float64))  # the Parameter object stays
    assert watch.check().startswith("m.weight: param float64 [4, 4]")


def test_a_block_watch_checks_its_own_subtree_only():
    m = Outer()
    recorded = {**dependencies.snapshot(m), "globals": []}
    watch = dependencies.Watch(m.blocks[1], recorded, "m", under="blocks.1")
    assert watch.check() == ""
    m.blocks[0].scale = 5.0  # another block: runs eagerly (regional), not this block's graph
    assert watch.check() == ""
    m.blocks[1].scale = 5.0
    assert watch.check() == "m.blocks.1.scale: 5.0 here, 1.0 in the entry"


class _PagProcessor:
    def __call__(self, x):
        return x * 2


class _Component(Outer):
    def forward(self, x):
        return self.blocks[1](self.blocks[0](x))


def _record_build(m, blocks: bool):
    """What the build records of ``m``: the snapshot before the warmup, then a warmup through the
    recorders' dispatchers (on the component, or on each block) whose "pipeline" sets a processor on
    every block before its call and restores it after, as diffusers' PAG pipelines do."""
    from aotbuild.dispatch import install_dispatcher, uninstall_dispatchers

    depends = dependencies.snapshot(m)
    dependencies.record_calls(m)
    for owner in list(m.blocks) if blocks else [m]:
        install_dispatcher(owner, "m", {}, owner.forward, "record")

    def pipeline():
        for block in m.blocks:
            block.processor = _PagProcessor()
        with torch.no_grad():
            m(torch.ones(4))
        for block in m.blocks:
            del block.processor

    pipeline()
    pipeline()
    record = {**depends, "globals": dependencies.observed(), "calls": dependencies.call_time(depends)}
    dependencies.reset_observed()
    assert uninstall_dispatchers(m) == (2 if blocks else 1)
    return record


@pytest.mark.parametrize("blocks", [False, True], ids=["component", "regional"])
def test_what_the_pipeline_sets_for_its_calls_is_served_a_users_change_is_not(blocks):
    """PAG sets its attention processors in the pipeline's __call__ and restores them after: the graph
    was traced with them, so a call with them is served; the load (before any call) sees the module
    without them, as the snapshot before the warmup did (it was refused on every call)."""
    m = _Component()
    record = _record_build(m, blocks)
    assert record["calls"]["changed"] == {"blocks.0.processor": f"{__name__}._PagProcessor object",
                                          "blocks.1.processor": f"{__name__}._PagProcessor object"}
    assert _diff(record, m) == ""  # the load-time check: no processor yet
    at_call = {**dependencies.at_call(record), "globals": record["globals"]}
    watches = [dependencies.Watch(b, at_call, "m", f"blocks.{i}") for i, b in enumerate(m.blocks)] if blocks \
        else [dependencies.Watch(m, at_call, "m")]
    for block in m.blocks:
        block.processor = _PagProcessor()  # a new instance of the traced class, as every call makes
    with torch.no_grad():
        assert [w.check() for w in watches] == [""] * len(watches)
        m.blocks[1].scale = 2.0  # the user's change
        assert "m.blocks.1.scale: 2.0 here, 1.0 in the entry" in [w.check() for w in watches]
        m.blocks[1].scale = 1.0
        m.blocks[0].processor = object()  # another processor than the one traced
        assert "another attention processor?" in watches[0].check()
    # a record without the first call's (an older aotbuild's) is compared as before
    assert dependencies.at_call({k: v for k, v in record.items() if k != "calls"})["items"] == record["items"]


class _Entry:
    def __init__(self, structure):
        self.manifest = type("M", (), {"structure": structure})()


def test_the_load_check_of_a_regional_entry_compares_the_compiled_blocks_only():
    """FreeU is on the UNet's up blocks, outside the compiled transformer blocks: it runs eagerly, so the
    load serves it (as the per-call check did after load); a change inside a block is refused."""
    from types import SimpleNamespace

    from aotbuild.runtime import _compiled_paths, _dependency_problem

    m = Outer()
    m.mid = torch.nn.Linear(4, 4)  # not a block: runs eagerly under regional scope
    structure = {"dependencies": {**dependencies.snapshot(m), "globals": []}}
    regional = SimpleNamespace(compile=SimpleNamespace(scope="regional", blocks=("Block",)))
    full = SimpleNamespace(compile=SimpleNamespace(scope="full", blocks=None))
    paths = _compiled_paths(m, regional)
    assert paths == ["blocks.0", "blocks.1"] and _compiled_paths(m, full) == [""]
    m.mid.b1 = 1.2
    m.s1 = 0.9
    assert _dependency_problem(m, "unet", _Entry(structure), {}, True, paths) == ""
    assert _dependency_problem(m, "unet", _Entry(structure), {}, True, [""]).startswith("unet.mid.b1: 1.2 here")
    m.blocks[1].b1 = 1.2
    assert _dependency_problem(m, "unet", _Entry(structure), {}, True, paths) == \
        "unet.blocks.1.b1: 1.2 here, absent in the entry: FreeU?"
    m.blocks[1].b1 = None
    m.blocks[0].proj.to(torch.float64)
    assert _dependency_problem(m, "unet", _Entry(structure), {}, True, paths).startswith(
        "unet.blocks.0.proj.bias: param float64 [4]")


class _Changed:
    def __init__(self, why: str):
        self.why = why

    def check(self) -> str:
        return self.why


@pytest.mark.parametrize("policy", ["error", "eager", "compile"])
def test_a_changed_module_follows_the_load_policy_at_its_call(policy):
    calls = []
    d = Dispatcher("unet", lambda x: calls.append("eager") or x, {'{"args": [["float"]], "kwargs": {}}':
                                                                  lambda x: calls.append("route") or x},
                   lambda x: calls.append("compiled") or x, "error")
    d.watch, d.on_stale = _Changed(""), policy
    d(1.0)
    assert calls == ["route"]
    d.watch = _Changed("unet.up_blocks.0.b1: 1.2 here, absent in the entry: FreeU?")
    if policy == "error":
        with pytest.raises(StaleGraph, match="never compiles: unet.up_blocks.0.b1: 1.2 here"):
            d(1.0)
        assert isinstance(StaleGraph("x"), CacheMiss)
        return
    with pytest.warns(UserWarning, match="FreeU"):
        d(1.0)
    assert calls[-1] == {"eager": "eager", "compile": "compiled"}[policy]


def test_a_jit_cache_route_under_error_refuses_inductor_code_generation():
    """What the route does when a Dynamo guard fails and the graph is not in the installed cache."""
    import contextlib

    import torch._inductor.config as inductor_config

    from aotbuild.strategies.jit_cache import _loading

    class Target:
        loading = staticmethod(contextlib.nullcontext)

    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * 2 + 1, backend="inductor")
    with inductor_config.patch(fx_graph_cache=False):  # a miss, whatever this machine's cache holds
        with pytest.raises(StaleGraph, match="unet: a call needs a graph the installed cache does not have"):
            _loading(Target(), compiled, "unet", refuse=True)(torch.ones(3))
    torch._dynamo.reset()


def test_on_miss_error_means_no_compile_at_an_unbuilt_call_either():
    from aotbuild.runtime import _call_policy

    assert _call_policy("error", strict_shapes=False) == "error"
    assert _call_policy("compile", strict_shapes=True) == "error"
    assert _call_policy("eager", strict_shapes=False) == "eager"
    assert _call_policy("compile", strict_shapes=False) == "compile"


def test_the_manifest_refuses_a_malformed_dependency_record():
    from aotbuild.cache.manifest import ManifestError, _Checker

    c = _Checker()
    good = {"digest": "0" * 64, "lines": [], "dependencies": {"version": 1, "items": {"a": "1"},
                                                              "globals": [[False, "float32", []]]}}
    assert c.structure(good) is good
    for bad in ({"items": {"a": 1}}, {"items": {}, "globals": [[1, "float32", []]]}, {"items": []}):
        with pytest.raises(ManifestError, match="structure.dependencies"):
            c.structure({**good, "dependencies": bad})


# -- the matrix, on the session's shared builds ----------------------------------------------------

#: auto: the default, on a CPU prepacked aot-package (its packages re-derive their constants from the weights)
STRATEGIES = ("jit-cache", "aot-package", "aot-compile", "auto")


class ScaledProcessor:
    """A user's attention processor: diffusers' own, output scaled (its class lives in this test)."""

    def __init__(self):
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.inner = AttnProcessor2_0()

    def __call__(self, attn, hidden_states, *args, **kwargs):
        return self.inner(attn, hidden_states, *args, **kwargs) * 1.5


def _freeu(pipe):
    pipe.enable_freeu(s1=0.9, s2=0.2, b1=1.2, b2=1.4)


def _processor(pipe):
    pipe.unet.set_attn_processor(ScaledProcessor())


def _same_processor(pipe):
    from diffusers.models.attention_processor import AttnProcessor2_0

    pipe.unet.set_attn_processor(AttnProcessor2_0())


def _channels_last(pipe):
    pipe.unet.to(memory_format=torch.channels_last)


def _attribute(pipe):
    pipe.unet.up_blocks[0].resnets[0].output_scale_factor = 2.0


def _new_weights(pipe):
    g = torch.Generator().manual_seed(1)
    pipe.unet.load_state_dict({k: v + 0.02 * torch.randn(v.shape, generator=g, dtype=v.dtype)
                               for k, v in pipe.unet.state_dict().items()})


def _dtype(pipe):
    pipe.to(torch.bfloat16)


def _train(pipe):
    pipe.unet.train()  # the UNet has no dropout with p > 0 and no batch norm: the graph does not read it


def _scheduler(pipe):
    from diffusers import EulerAncestralDiscreteScheduler

    pipe.scheduler = EulerAncestralDiscreteScheduler.from_config(pipe.scheduler.config)


def _steps(pipe):
    pipe.matrix_call = {"num_inference_steps": 3}  # read by _image: the pipeline's call, not the module


def _fused(pipe):
    pipe.fuse_qkv_projections(unet=True, vae=False)


#: The LoRA file _lora loads (made once per module by the ``adapter`` fixture, with peft: tests/test_lora.py).
_ADAPTER: list[str] = []


def _lora(pipe):
    pipe.load_lora_weights(_ADAPTER[0])  # no `lora:` in the recipe: peft's layers replace the UNet's Linears


def _lora_fused(pipe):
    # fused into the weights, then unloaded: the UNet's structure is as built, its weights changed in place
    # through .data (peft's default merge bumps no version counter: a prepacked copy must still follow)
    pipe.load_lora_weights(_ADAPTER[0])
    pipe.fuse_lora()
    pipe.unload_lora_weights()


#: change -> (what it does, its effect on eager's image is measurable, benign: served compiled, and for a
#: change that is refused what the refusal must name (a regular expression searched in the miss's or the
#: call's reason: a refusal for another reason, a corrupt blob or another torch, fails the cell)
CHANGES = {
    "freeu": (_freeu, True, False, r"\bb1: 1\.2 here.*FreeU\?|changes\.freeu\.b1: absent in the cache, 1\.2 here"),
    "processor": (_processor, True, False, rf"processor: {re.escape(ScaledProcessor.__module__)}\.ScaledProcessor "
                                           r"object here"),
    "same-class-processor": (_same_processor, False, True, None),
    # eager: no change; a stale package: garbage
    "channels-last": (_channels_last, False, False, r"stride \[36, 1, 12, 4\].*\(channels_last\?\)"
                                                    r"|changes\.memory_format: absent in the cache, channels_last "
                                                    r"here"),
    "attribute": (_attribute, True, False, r"up_blocks\.0\.resnets\.0\.output_scale_factor: 2\.0 here, 1\.0 in the "
                                           r"entry"),
    "new-weights": (_new_weights, True, True, None),
    "dtype": (_dtype, True, False, r"unet is bfloat16 but|:bfloat16"),
    "train": (_train, False, True, None),
    "scheduler-swap": (_scheduler, True, True, None),
    "step-count": (_steps, True, True, None),
    # eager: the same numbers; the module's structure changed
    "fused-projections": (_fused, False, False, r"attn1\.to_qkv: torch\.nn\.modules\.linear\.Linear here, absent"
                                               r"|attn1\.fused_projections: True here, False in the entry"),
    "lora-without-recipe": (_lora, True, False, r"to_q: peft\.tuners\.lora\.layer\.Linear here"
                                                r"|_hf_peft_config_loaded: True here, absent in the entry: a LoRA"),
    # refused by what the fuse left on the UNet (diffusers' _safe_fusing flag); the weights it changed in
    # place are followed by every strategy (a prepacked copy: tests/test_prepack.py's .data cases)
    "lora-fused": (_lora_fused, True, False, r"unet\._safe_fusing: False here, absent in the entry"),
}
_EAGER: dict[tuple[str, str], torch.Tensor] = {}


#: (models folder, model) -> the pipeline from_pretrained loaded once, never changed: each cell gets a copy.
_LOADED: dict[tuple[str, str], object] = {}


def _pipe(recipe, models_dir):
    """A fresh pipeline of ``recipe``: a deep copy of one from_pretrained load (the same modules, weights,
    strides and processors; about half a load's time, for the matrix's ~90 pipelines). A recipe with
    ``changes`` is loaded each time: its load also sets process-wide state (an attention backend)."""
    import copy

    from aotbuild.pipeline.models import load_pipeline, resolve_model

    if recipe.changes is not None:
        return load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")
    key = (str(models_dir), recipe.model.id)
    if key not in _LOADED:
        _LOADED[key] = load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")
    return copy.deepcopy(_LOADED[key])


def _image(pipe, recipe):
    from aotbuild.pipeline.pipecall import warmup_kwargs

    call = {**warmup_kwargs(recipe, recipe.shapes[0], pipe), **getattr(pipe, "matrix_call", {})}
    return pipe(**call, output_type="pt").images.float()


def _eager(name, recipe, models_dir, changes=None):
    """Eager's image with the change ``name`` (of ``changes``, default CHANGES), once per model."""
    key = (recipe.model.id, name)
    if key not in _EAGER:
        pipe = _pipe(recipe, models_dir)
        if name != "none":
            (changes or CHANGES)[name][0](pipe)
        _EAGER[key] = _image(pipe, recipe)
    return _EAGER[key]


@pytest.fixture
def no_codegen(monkeypatch):
    """A compile is a failure: abort at Inductor's first code generation instead of waiting for it."""
    from torch._inductor import compile_fx

    def refuse(*args, **kwargs):
        raise AssertionError("Inductor generated code: a cell compiled")

    monkeypatch.setattr(compile_fx._InProcessFxCompile, "codegen_and_compile", refuse)


@pytest.fixture(scope="module")
def adapter(models_dir, tmp_path_factory):
    """A tiny LoRA of the UNet's attention projections, random (init_lora_weights=False: it moves the image)."""
    from tests.loras import ATTENTION, make_adapter

    model = next((models_dir / "models").glob("tiny-sd-v*"))
    folder = make_adapter(model, tmp_path_factory.mktemp("stale-lora"), 4, 4, ATTENTION, 1)
    _ADAPTER[:] = [str(folder)]
    return folder


def refusal(exc: Exception) -> str:
    """The reason of a refusal: the load report's MISS line, else the error's first line (a StaleGraph,
    a ShapeNotBuilt or a UsageError at the call or the load)."""
    lines = str(exc).strip().splitlines()
    return next((x.strip() for x in lines if "MISS" in x), lines[0])


def names_the_change(reason: str, names: str | None) -> bool:
    """Whether a refusal's ``reason`` names the change: its cell's regular expression matches it."""
    return names is not None and re.search(names, reason) is not None


def run_matrix(label, recipe, cache, models_dir, changes, component="unet", traces=False):
    """Each change x before/after load on the entry ``cache`` holds for ``recipe``: served compiled and
    within 1e-4 of eager with the change, or refused naming it; never a compile (the caller aborts
    Inductor's code generation), never a stale image. ``traces``: Dynamo may trace at the first call
    (jit-cache: that is not compiling). Returns the printed cells."""
    from torch._dynamo.utils import counters

    from aotbuild import load_compiled
    from aotbuild.pipeline import dependencies

    plain = _eager("none", recipe, models_dir)
    results = {}
    for name, (change, effect, benign, names) in changes.items():
        expected = _eager(name, recipe, models_dir, changes)
        moved = (expected - plain).abs().max().item()
        if effect:  # an ignored change cannot pass
            assert moved > 1e-3, f"{name}: no measurable effect in eager ({moved})"
        torch._dynamo.reset()  # once per change: under jit-cache, "after" may reuse the trace "before" made
        for when in ("before", "after"):
            graphs = counters["stats"]["unique_graphs"]
            pipe = _pipe(recipe, models_dir)
            try:
                if when == "before":
                    change(pipe)
                load_compiled(recipe, pipe, cache=cache, on_miss="error")
                # the per-call check is the same object for every strategy (aotbuild/runtime.py _watch)
                assert isinstance(getattr(pipe, component).forward.watch, dependencies.Watch)
                if when == "after":
                    change(pipe)
                got = _image(pipe, recipe)
            except (CacheMiss, UsageError) as exc:
                reason = refusal(exc)
                results[(name, when)] = "refused: " + reason
                assert not benign, f"{label} {name} {when}: a benign change was refused: {exc}"
                assert names_the_change(reason, names), f"{label} {name} {when}: refused for another reason: {exc}"
                continue
            served = getattr(pipe, component).forward.calls["built"]
            error = (got - expected).abs().max().item()
            results[(name, when)] = f"served compiled ({served} calls), {error:.1e} from eager"
            assert served >= 1 and error <= 1e-4, f"{label} {name} {when}: stale ({error} from eager)"
            if not traces:
                assert counters["stats"]["unique_graphs"] == graphs, f"{label} {name} {when}: Dynamo traced"
    print(f"\n{label}:\n" + "\n".join(f"  {n} {w}: {r}" for (n, w), r in results.items()))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_change_is_served_stale(strategy, strategy_build, models_dir, no_codegen, adapter):
    """Each change x before/after load: served compiled and within 1e-4 of eager with the change, or
    refused naming it; never a compile (on_miss="error"), never a stale image."""
    from aotbuild.recipe.rules import load_recipe

    recipe_path, cache, report = strategy_build(strategy)
    run_matrix(strategy, load_recipe(recipe_path), cache, models_dir, CHANGES, traces=strategy == "jit-cache")
    if strategy == "aot-compile":  # what its saved guards no longer check is in the manifest (GuardFilter)
        from aotbuild.cache.store import Store

        manifest = Store(cache).load_manifest(report["jobs"][0]["key"])
        assert manifest.packages and all("GLOBAL_STATE" in r["dropped_guards"] for r in manifest.packages)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_call_in_another_grad_mode_is_refused(strategy, strategy_build, models_dir, no_codegen):
    """Grad mode is part of what a trace assumed: a denoiser call with grad on (the build's ran under
    the pipeline's no_grad) is refused under on_miss="error", not compiled."""
    from aotbuild import load_compiled
    from aotbuild.recipe.rules import load_recipe

    recipe_path, cache, _ = strategy_build(strategy)
    recipe = load_recipe(recipe_path)
    pipe = load_compiled(recipe, _pipe(recipe, models_dir), cache=cache, on_miss="error")
    seen = []
    handle = pipe.unet.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)) or None, with_kwargs=True)
    _image(pipe, recipe)
    handle.remove()
    args, kwargs = seen[0]
    with torch.enable_grad(), pytest.raises(StaleGraph, match="called with grad on"):
        pipe.unet(*args, **kwargs)
    with torch.no_grad(), warnings.catch_warnings():
        pipe.unet(*args, **kwargs)  # and served again as built


@pytest.mark.slow
def test_jit_cache_refuses_a_compile_the_dependency_check_did_not_foresee(strategy_build, models_dir):
    """Under on_miss="error", a graph jit-cache's installed cache lacks (a Dynamo guard failed on a
    change the recorded dependencies do not cover) raises at Inductor's code generation instead of
    compiling silently. The change here is FreeU with the per-call check switched off."""
    from aotbuild import load_compiled
    from aotbuild.recipe.rules import load_recipe

    recipe_path, cache, _ = strategy_build("jit-cache")
    recipe = load_recipe(recipe_path)
    torch._dynamo.reset()
    pipe = load_compiled(recipe, _pipe(recipe, models_dir), cache=cache, on_miss="error")
    expected = _eager("none", recipe, models_dir)
    assert (_image(pipe, recipe) - expected).abs().max().item() <= 1e-4  # served from the cache: no codegen
    pipe.unet.forward.watch = None  # a change the record cannot see
    _freeu(pipe)
    with pytest.raises(StaleGraph, match="a call needs a graph the installed cache does not have") as refused:
        _image(pipe, recipe)
    # and what builds it for this pipeline, into the cache it was loaded from (as every other refusal says)
    assert f"aotbuild.build(recipe, pipe=pipe, cache={str(cache)!r})" in str(refused.value), str(refused.value)


def test_aot_compiles_guard_filter_notes_the_kinds_it_drops():
    """aot-compile saves its artifacts without the guards torch cannot serialize and without GLOBAL_STATE
    (grad mode, numerics and the thread count, which aotbuild checks per call instead): each record names
    those kinds (dropped_guards), so an entry says what torch no longer re-checks (issue 31 item 1)."""
    from aotbuild.strategies import aot_compile

    entries: list = []

    def record(guards):
        entries.extend(guards)
        return [True] * len(guards)

    torch._dynamo.reset()
    compiled = torch.compile(aot_compile.call, backend="eager", fullgraph=True, options={"guard_filter_fn": record})
    compiled(torch.nn.Linear(3, 3), torch.randn(2, 3))
    torch._dynamo.reset()
    portable, pinned = aot_compile.GuardFilter(keep_global_state=False), aot_compile.GuardFilter(keep_global_state=True)
    kept = portable(entries)
    assert kept == aot_compile.portable_guards(entries)
    assert portable.dropped == {str(e.guard_type) for e, keep in zip(entries, kept, strict=True) if not keep}
    assert {"GLOBAL_STATE", "GRAD_MODE"} <= portable.dropped and "TENSOR_MATCH" not in portable.dropped
    pinned(entries)
    assert pinned.dropped == portable.dropped - {"GLOBAL_STATE"}  # kernels that bake the thread count keep it
    strategy = aot_compile.AotCompile()
    assert strategy.check_records(({"dropped_guards": ["GLOBAL_STATE"]},)) == ""
    assert strategy.check_records(({},)) == ""  # an entry built before the kinds were recorded
    assert "dropped_guards" in strategy.check_records(({"dropped_guards": ["a b"]},))


# -- hooks' and processors' settings, global numerics (issue 31 items 2, 4, 5) -----------------------


def _tiny_flux_transformer():
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=8,
                                  num_attention_heads=2, joint_attention_dim=8, pooled_projection_dim=8,
                                  axes_dims_rope=(2, 2, 4))


def test_a_cache_hook_is_named_with_its_settings_and_once_disabled_serves_again():
    """enable_cache is refused by its config and hooks (their settings too: a threshold changed in place
    moves nothing else); disable_cache leaves each block's own forward bound on it, the same code as
    none: it was refused after the hook was gone (issue 31 item 2)."""
    from diffusers.hooks import FirstBlockCacheConfig

    m = _tiny_flux_transformer()
    recorded = {**dependencies.snapshot(m), "globals": []}
    watch = dependencies.Watch(m, recorded, "transformer")
    m.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    assert watch.check() == ("transformer._cache_config: diffusers.hooks.first_block_cache.FirstBlockCacheConfig "
                             "(threshold=0.2) here, absent in the entry: a diffusers cache hook (enable_cache)?")
    m.disable_cache()
    assert "forward" in vars(m.transformer_blocks[0])  # what diffusers leaves behind
    assert watch.check() == "" and _diff(recorded, m) == ""
    m.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    armed = {**dependencies.snapshot(m), "globals": []}
    watch = dependencies.Watch(m, armed, "transformer")
    assert watch.check() == ""
    leader = m.transformer_blocks[0]._diffusers_hook.hooks["fbc_leader_block_hook"]
    leader.threshold = 0.5  # in place: the same objects, another setting
    assert watch.check().startswith("transformer.transformer_blocks.0._diffusers_hook: hooks "
                                    "fbc_leader_block_hook=FBCHeadBlockHook (threshold=0.5) here")
    m.disable_cache()


def test_a_dataclass_other_than_a_cache_config_is_not_recorded():
    """transformers 5's configs are dataclasses whose fields include the folder loaded from
    (_name_or_path): recorded, a cache copied elsewhere would miss (found in review)."""
    import dataclasses

    @dataclasses.dataclass
    class Config:
        _name_or_path: str = "/somewhere"

    m = Outer()
    m.config = Config()
    assert "config" not in dependencies.snapshot(m)["items"]
    m._cache_config = Config()
    assert dependencies.snapshot(m)["items"]["_cache_config"].endswith("Config (_name_or_path='/somewhere')")


def test_a_processors_attention_backend_is_recorded_per_processor_and_process_wide():
    """set_attention_backend writes ``_attention_backend`` on each processor object in place and sets
    diffusers' process-wide active backend; the record kept the processor's class only (issue 31 item 4)."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    m = _tiny_flux_transformer()
    recorded = dependencies.snapshot(m)
    watch = dependencies.Watch(m, {**recorded, "globals": []}, "transformer")  # the module only
    state = dependencies.Watch(m, {**recorded, "globals": [dependencies.call_state()]}, "transformer")
    active = _AttentionBackendRegistry._active_backend
    try:
        m.set_attention_backend("_native_math")
        assert "processor: diffusers.models.transformers.transformer_flux.FluxAttnProcessor object " \
               "(_attention_backend='_native_math') here, " in watch.check()
        m.reset_attention_backend()  # the processors' only: the active backend stays _native_math
        assert watch.check() == ""
        assert "autocast off, diffusers attention backend _native_math; the entry was traced with " in state.check()
    finally:
        _AttentionBackendRegistry._active_backend = active
    assert state.check() == ""


@pytest.mark.parametrize("setting", ["deterministic", "matmul precision"])
def test_a_call_under_other_numeric_settings_is_refused(setting):
    """torch.use_deterministic_algorithms and the float32 matmul precision change the kernels a compiled
    graph runs; aot-compile's loads drop Dynamo's GLOBAL_STATE guard, which checked them (issue 31 item 5)."""
    m = Outer()
    with torch.no_grad():
        recorded = {**dependencies.snapshot(m), "globals": [dependencies.call_state()]}
        watch = dependencies.Watch(m, recorded, "m")
        assert watch.check() == ""
        before = (torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision())
        try:
            if setting == "deterministic":
                torch.use_deterministic_algorithms(True)
                words = "default dtype float32, autocast off, deterministic; the entry"
            else:
                torch.set_float32_matmul_precision("high")
                words = "autocast off, cuda matmul tf32, float32 matmul precision high; the entry"
            assert words in watch.check()
        finally:
            torch.use_deterministic_algorithms(before[0])
            torch.set_float32_matmul_precision(before[1])
        assert watch.check() == ""


# -- diffusers cache hooks on a transformer model (one tiny-flux build) ------------------------------

#: Full scope, aot-package: the strategy that ignored a cache hook (0.11 off, issue 31). The checks are
#: strategy-independent (aotbuild/runtime.py: _dependency_problem at load, _watch's Watch per call, the
#: same for every strategy: run_matrix asserts the Watch on every tiny-sd strategy), so one build of one
#: strategy covers what a hook does to them. It declares an attention backend (changes.attention_backend,
#: one that runs on the CPU): the same build serves a pipe with that backend set by hand (every load of the
#: recipe sets it, so the cache-hook matrix's pipes and eager images have it too).
FLUX_BACKEND = "_native_math"
#: The model: builtin:tiny-flux at one block of each kind (tests/loras.py flux_1_1, a folder the build
#: makes): the cache hook's first block, and a block after it that the hook skips.
FLUX_RECIPE = f"""\
model: {{id: "{{model}}", dtype: float32}}
target: inductor
device: cpu
strategy: aot-package
compile: {{components: [transformer]}}
shapes: [{{height: 64, width: 64}}]
warmup: {{num_inference_steps: 2, max_sequence_length: 8, guidance_scale: 3.5}}
changes: {{attention_backend: {FLUX_BACKEND}}}
"""


@pytest.fixture(scope="module")
def flux_build(tmp_path_factory):
    """FLUX_RECIPE built by the CLI once per run: (recipe file, cache root, which holds the model too)."""
    import json

    from tests.conftest import invoke_cli, once_per_run

    def build(folder):
        from aotbuild import builtin
        from tests.loras import flux_1_1

        folder.mkdir(parents=True, exist_ok=True)
        builtin.ensure("builtin:tiny-flux", folder / "builtin")
        model = flux_1_1(folder / "builtin", folder / "cache" / "models" / "tiny-flux-1-1")
        recipe = folder / "tiny_flux_aot-package.yaml"
        recipe.write_text(FLUX_RECIPE.replace("{model}", str(model)))
        # in this process: the build's loader, worker and proof are fresh processes already (bd8368f)
        proc = invoke_cli("build", "--json", "--cache", str(folder / "cache"), str(recipe),
                          env={"TORCHINDUCTOR_CACHE_DIR": str(folder / "build-inductor"), "AOTBUILD_CACHE": ""})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert json.loads(proc.stdout)["jobs"][0]["status"] == "built"
        return [str(recipe), str(folder / "cache")]

    recipe, cache = once_per_run(tmp_path_factory, "stale-flux-aot-package", build)
    return recipe, cache


def _first_block_cache(pipe):
    from diffusers.hooks import FirstBlockCacheConfig

    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=10.0))  # the 2nd step reuses the 1st's residual


def _cache_enabled_then_disabled(pipe):
    _first_block_cache(pipe)
    pipe.transformer.disable_cache()  # leaves each block's own forward bound on it: the same code


CACHE_HOOKS = {
    "first-block-cache": (_first_block_cache, True, False,
                          r"transformer\._cache_config: diffusers\.hooks\.first_block_cache\.FirstBlockCacheConfig "
                          r"\(threshold=10\.0\) here, absent in the entry: a diffusers cache hook"),
    "cache-hook-disabled": (_cache_enabled_then_disabled, False, True, None),
}


#: Refusals as the matrix printed them (one per cell kind: before load, the load's MISS line or error; after,
#: the call's error), and refusals for other reasons: each cell's expression must match its own change's
#: reasons only, so a cell refused for another reason fails (issue 31 review: any refusal passed).
REFUSED = {
    "freeu": ["MISS unet 64x64 0123456789ab  not built: changes.freeu.b1: absent in the cache, 1.2 here; "
              "changes.freeu.b2: absent in the cache, 1.4 here; changes.freeu.s1: absent in the cache, 0.9 here; "
              "and 1 more",
              "unet changed since its entry was built, and load_compiled(on_miss=\"error\") never compiles: "
              "unet.up_blocks.0.b1: 1.2 here, absent in the entry: FreeU?. Undo the change"],
    "processor": [f"unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor: {__name__}.ScaledProcessor "
                  f"object here, diffusers.models.attention_processor.AttnProcessor2_0 object in the entry: another "
                  f"attention processor?"],
    "channels-last": ["MISS unet 64x64 0123456789ab  not built: changes.memory_format: absent in the cache, "
                      "channels_last here",
                      "unet.conv_in.weight: param float32 [8, 4, 3, 3] stride [36, 1, 12, 4] cpu grad here, param "
                      "float32 [8, 4, 3, 3] stride [36, 9, 3, 1] cpu grad in the entry: another memory format "
                      "(channels_last?)"],
    "attribute": ["unet.up_blocks.0.resnets.0.output_scale_factor: 2.0 here, 1.0 in the entry"],
    "dtype": ["the pipeline's unet is bfloat16 but tiny_sd.yaml says float32: convert it, or fix model.dtype",
              "unet was called with arg[0]=1x4x8x8:bfloat16, arg[1]=scalar:bfloat16, which this cache did not build"],
    "fused-projections": ["MISS unet 64x64 0123456789ab  unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1."
                          "to_qkv: torch.nn.modules.linear.Linear here, absent in the entry: the module differs",
                          "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.fused_projections: True here, "
                          "False in the entry"],
    "lora-without-recipe": ["MISS unet 64x64 0123456789ab  unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1."
                            "to_q: peft.tuners.lora.layer.Linear here, torch.nn.modules.linear.Linear in the entry",
                            "unet._hf_peft_config_loaded: True here, absent in the entry: a LoRA loaded "
                            "(load_lora_weights)?"],
    "lora-fused": ["MISS unet           64x64        8c2659489189  unet._safe_fusing: False here, absent in the entry"],
    "first-block-cache": ["transformer._cache_config: diffusers.hooks.first_block_cache.FirstBlockCacheConfig "
                          "(threshold=10.0) here, absent in the entry: a diffusers cache hook (enable_cache)?"],
}
UNRELATED = [
    "MISS unet 64x64 0123456789ab  not built: env.torch: 2.13.0+cpu in the cache, 2.14.1+cpu here",
    "MISS unet 64x64 0123456789ab  blob 3f1c9a0b is corrupt (hash mismatch)",
    "MISS unet 64x64 0123456789ab  unet: the entry was built by an older aotbuild (no dependency record): rebuild",
    "unet is called with grad on, default dtype float32, autocast off, default numerics; the entry was traced with "
    "grad off, default dtype float32, autocast off, default numerics: another grad mode",
]


def test_a_matrix_cell_accepts_only_a_refusal_that_names_its_change():
    cells = {**CHANGES, **CACHE_HOOKS}
    assert set(REFUSED) == {name for name, cell in cells.items() if not cell[2]}  # every refused change
    for name, reasons in REFUSED.items():
        for reason in reasons:
            named = [other for other, cell in cells.items() if names_the_change(reason, cell[3])]
            assert named == [name], (reason, named)
    for reason in UNRELATED:
        assert not any(names_the_change(reason, cell[3]) for cell in cells.values()), reason
    assert not names_the_change("MISS ...", None)  # a benign cell has nothing to name: a refusal fails it


@pytest.mark.slow
def test_a_cache_hook_on_a_transformer_is_never_ignored(flux_build, no_codegen):
    """A diffusers cache hook (enable_cache) before or after load: refused naming it, never served
    without the hook (aot-package served the image without it, 0.11 off) nor a Dynamo error at the
    call; the hook enabled then disabled serves compiled, equal to eager."""
    from pathlib import Path

    from aotbuild.recipe.rules import load_recipe

    recipe_path, cache = flux_build
    recipe = load_recipe(recipe_path)
    run_matrix("aot-package (tiny-flux)", recipe, Path(cache), Path(cache), CACHE_HOOKS, "transformer")


@pytest.mark.slow
def test_a_declared_attention_backend_serves_a_pipe_with_it_set_by_hand(flux_build, no_codegen):
    """changes.attention_backend (issue 31 item 4): the recipe's build sets the backend, and a user's pipe
    that calls set_attention_backend itself hits, 0 compiles, equal to eager with the backend, whether its
    recipe declares the backend or keys the pipe's (load_compiled(recipe, pipe=pipe), as
    build(recipe, pipe=pipe) builds it). A pipe without it misses; its processors reset after load are
    refused at the call, naming the backend."""
    import dataclasses
    from pathlib import Path

    from torch._dynamo.utils import counters

    from aotbuild import load_compiled
    from aotbuild.pipeline.changes import active_backend
    from aotbuild.recipe.rules import load_recipe

    recipe_path, cache = flux_build
    declared = load_recipe(recipe_path)
    plain = dataclasses.replace(declared, changes=None)
    root = Path(cache)

    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    def users_pipe():
        _AttentionBackendRegistry._active_backend = AttentionBackendName.NATIVE  # as in a fresh process
        pipe = _pipe(plain, root)
        assert active_backend() == "native"  # the plain recipe's load sets none
        pipe.transformer.set_attention_backend(FLUX_BACKEND)
        return pipe

    expected = _image(users_pipe(), plain)
    for recipe in (declared, plain):
        pipe = users_pipe()
        graphs = counters["stats"]["unique_graphs"]
        load_compiled(recipe, pipe, cache=root, on_miss="error")
        got = _image(pipe, recipe)
        assert pipe.aotbuild_report.misses == [] and pipe.transformer.forward.calls["built"] >= 1
        assert counters["stats"]["unique_graphs"] == graphs
        assert (got - expected).abs().max().item() <= 1e-4
    pipe.transformer.reset_attention_backend()  # the processors' only (the active backend stays)
    with pytest.raises(StaleGraph, match=r"\(_attention_backend='_native_math'\) in the entry: another attention "
                                         r"backend \(set_attention_backend\)\?.*changes\.attention_backend"):
        _image(pipe, plain)
    _AttentionBackendRegistry._active_backend = AttentionBackendName.NATIVE  # a process that never set one
    with pytest.raises(CacheMiss, match=r"declares changes: \{attention_backend: \"_native_math\"\} and this "
                                        r"pipeline holds none of them"):
        load_compiled(declared, _pipe(plain, root), cache=root, on_miss="error")


def test_the_watch_sees_a_hook_replaced_a_child_added_to_a_leaf_and_a_global_hook():
    """What the fast check missed (issue 52): a hook replaced by another keeps the count the record holds,
    a leaf's children were not watched, and process-wide module hooks were not looked at."""
    from torch.nn.modules.module import register_module_forward_hook

    def loaded_with(mod, args, out):
        return out

    m = Outer()
    first = m.blocks[0].proj.register_forward_hook(loaded_with)
    recorded = {**dependencies.snapshot(m), "globals": [[False, "float32", []]]}
    watch = dependencies.Watch(m, recorded, "m")
    with torch.no_grad():
        assert watch.check() == ""
        first.remove()
        second = m.blocks[0].proj.register_forward_hook(lambda mod, args, out: out * 2)
        assert "blocks.0.proj: a forward hook was replaced" in watch.check()
        assert "replaced" in watch.check()  # sticky until undone
        second.remove()
        m.blocks[0].proj.register_forward_hook(loaded_with)
        assert watch.check() == ""  # the hook it was loaded with, again
    m = Outer()
    watch = dependencies.Watch(m, {**dependencies.snapshot(m), "globals": [[False, "float32", []]]}, "m")
    with torch.no_grad():
        m.blocks[0].proj.extra = torch.nn.ReLU()  # a child added to a leaf
        assert "extra" in watch.check()
        del m.blocks[0].proj.extra
        assert watch.check() == ""
        handle = register_module_forward_hook(lambda mod, args, out: out)
        try:
            assert "process-wide module hook" in watch.check()
        finally:
            handle.remove()
        assert watch.check() == ""
