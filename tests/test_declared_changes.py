"""A recipe's ``changes`` section (issue 31, item 4): FreeU's factors, an attention processor, a diffusers
cache hook and a memory format, declared so a build re-creates them (aotbuild/pipeline/changes.py).

Before it, ``save_pretrained`` dropped all four, so neither a build of the recipe nor
``aotbuild.build(recipe, pipe=pipe)`` could build for a pipeline with FreeU on: a StaleGraph's advice
could only be "undo the change". The fast tier checks the section's parsing, its key factor (absent:
no key changes, tests/test_key_pins.py), the plan-time checks against the model, that loads apply it,
that the changes are read off a live pipe (or refused with the reason) by ``build(recipe, pipe=pipe)``
and ``load_compiled(recipe, pipe=pipe)``, and the advice of a miss; the slow test builds a FreeU recipe
and serves a user's pipe with the same FreeU compiled.
"""

from __future__ import annotations

import pytest
import torch

import aotbuild
from aotbuild.errors import CacheMiss, RecipeError, StaleGraph, UsageError
from aotbuild.features.registry import detect_changes
from aotbuild.pipeline import changes
from aotbuild.recipe.rules import parse_recipe
from aotbuild.recipe.schema import ChangesSpec, recipe_to_dict
from tests.conftest import TINY_DICT as TINY

FREEU = {"s1": 0.9, "s2": 0.2, "b1": 1.2, "b2": 1.4}


def _recipe(**declared):
    return parse_recipe({**TINY, "changes": declared} if declared else TINY)


def _pipe(recipe, root):
    from aotbuild.pipeline.models import load_pipeline, resolve_model

    return load_pipeline(recipe, resolve_model(recipe, root), "float32")


def _change(name):
    return next(c for c in changes.CHANGES if c.name == name)


def _keys(recipe, root):
    return {j.component: j.key for j in aotbuild.plan(recipe, cache=root)}


class ScaledProcessor:
    """A user's processor: a class of this test file, which no recipe can name."""

    def __call__(self, attn, hidden_states, *args, **kwargs):
        from diffusers.models.attention_processor import AttnProcessor2_0

        return AttnProcessor2_0()(attn, hidden_states, *args, **kwargs) * 1.5


# -- the section --------------------------------------------------------------------------------------


def test_the_section_parses_and_round_trips():
    recipe = _recipe(freeu=FREEU, attention_processor="AttnProcessor", memory_format="channels_last",
                     cache={"config": "FirstBlockCacheConfig", "threshold": 0.2}, attention_backend="_native_math")
    assert dict(recipe.changes.freeu) == FREEU and recipe.changes.memory_format == "channels_last"
    data = recipe_to_dict(recipe)["changes"]
    assert data == {"freeu": FREEU, "attention_processor": "AttnProcessor", "memory_format": "channels_last",
                    "cache": {"config": "FirstBlockCacheConfig", "threshold": 0.2},
                    "attention_backend": "_native_math"}
    assert parse_recipe({**TINY, "changes": data}).changes == recipe.changes
    assert _recipe().changes is None and parse_recipe({**TINY, "changes": {}}).changes is None
    assert "changes" not in recipe_to_dict(_recipe())


@pytest.mark.parametrize(("declared", "key", "words"), [
    ({"freeu": {"s1": 0.9, "s2": 0.2, "b1": 1.2}}, "changes.freeu", "missing b2"),
    ({"freeu": {**FREEU, "b3": 1.0}}, "changes.freeu", "unknown b3"),
    ({"freeu": {**FREEU, "b1": "high"}}, "changes.freeu.b1", "expected a number"),
    ({"memory_format": "channels_first"}, "changes.memory_format", "channels_last"),
    ({"cache": {"threshold": 0.2}}, "changes.cache", "config:"),
    ({"attention_processor": "../evil"}, "changes.attention_processor", "not a class name"),
    ({"attention_backend": "../evil"}, "changes.attention_backend", "not a backend name"),
    ({"attention_backend": ["native"]}, "changes.attention_backend", "expected"),
    ({"freu": FREEU}, "changes.freu", "did you mean 'freeu'"),
])
def test_a_malformed_section_names_its_key(declared, key, words):
    with pytest.raises(RecipeError) as info:
        _recipe(**declared)
    assert info.value.key == key and words in str(info.value)


def test_only_declared_changes_are_key_factors_of_the_components_they_change():
    from aotbuild.context import Context, job_factors

    def factors(recipe, component):
        ctx = Context.create(recipe, ".", resolve_model=False)
        return job_factors(ctx, component, "X", {}, recipe.shapes[0], "StableDiffusionPipeline")

    plain = factors(_recipe(), "unet")
    assert "changes" not in plain  # the section's absence keeps every key (tests/test_key_pins.py)
    declared = _recipe(freeu=FREEU, memory_format="channels_last")
    assert factors(declared, "unet")["changes"] == {"freeu": FREEU, "memory_format": "channels_last"}
    assert factors(declared, "vae")["changes"] == {"memory_format": "channels_last"}  # FreeU is the unet's
    assert "changes" not in factors(_recipe(freeu=FREEU), "vae")
    # a cache field at its default is the same setting: declared or read off a pipe, one key
    at_default = _recipe(cache={"config": "FirstBlockCacheConfig", "threshold": 0.05})
    assert changes.factors(at_default, "unet") == {"cache": {"config": "FirstBlockCacheConfig"}}


@pytest.fixture
def active_attention_backend():
    """diffusers' process-wide attention backend, put back after the test: set_attention_backend (a
    declared changes.attention_backend's load) sets it for the whole process."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    before = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = before


def _flux(**declared):
    data = {**TINY, "model": {"id": "builtin:tiny-flux", "dtype": "float32"},
            "compile": {"components": ["transformer"]}}
    return parse_recipe({**data, "changes": declared} if declared else data)


def test_an_attention_backend_is_keyed_only_when_declared_and_checked_against_diffusers(tmp_path):
    """set_attention_backend was recorded (a miss named it) but no recipe could declare it (issue 31
    item 4): now changes.attention_backend, a key factor of every compiled component when declared."""
    assert changes.factors(_flux(attention_backend="_native_math"), "transformer") == \
        {"attention_backend": "_native_math"}
    assert changes.factors(_flux(), "transformer") is None  # the key pins' recipes keep their keys
    keys = _keys(_flux(), tmp_path), _keys(_flux(attention_backend="_native_math"), tmp_path)
    assert keys[0]["transformer"] != keys[1]["transformer"]
    with pytest.raises(RecipeError) as info:
        aotbuild.plan(_flux(attention_backend="_native_mat"), cache=tmp_path)
    assert info.value.key == "changes.attention_backend" and "did you mean '_native_math'" in str(info.value)
    assert "flash_hub" not in str(info.value).split("(allowed: ")[1]  # what it refuses is not offered
    with pytest.raises(RecipeError) as info:  # a kernel from the Hub at each load: no load reaches the network
        aotbuild.plan(_flux(attention_backend="flash_hub"), cache=tmp_path)
    assert info.value.key == "changes.attention_backend" and "from the Hugging Face Hub" in str(info.value)
    text = parse_recipe({**TINY, "compile": {"components": ["unet", "text_encoder"]},
                         "changes": {"attention_backend": "_native_math"}})
    with pytest.raises(RecipeError) as info:  # transformers' text encoder is no diffusers model
        aotbuild.plan(text, cache=tmp_path)
    assert info.value.key == "changes.attention_backend" and "text_encoder (CLIPTextModel) has no " \
        "set_attention_backend" in str(info.value)


def test_a_declared_backend_is_applied_and_read_back_off_a_users_pipe(tmp_path, active_attention_backend):
    """The recipe's load sets the backend on each processor and process-wide; a user's pipe with the same
    set_attention_backend reads as that declaration (so build(recipe, pipe=pipe) and
    load_compiled(recipe, pipe=pipe) key it as the declared recipe), and the snapshot of the two is one."""
    from aotbuild.pipeline import dependencies

    built = _pipe(_flux(attention_backend="_native_math"), tmp_path)  # what a build job of the recipe loads
    assert changes.active_backend() == "_native_math"
    processors = {p._attention_backend.value for p in built.transformer.attn_processors.values()}
    assert processors == {"_native_math"}
    _change("attention_backend").apply(built.transformer, "native", None)  # back to diffusers' default, process-wide
    plain = _flux()
    pipe = _pipe(plain, tmp_path)
    assert detect_changes(pipe, plain) == changes.Detected(None)
    pipe.transformer.set_attention_backend("_native_math")
    active = changes.active_backend()
    assert detect_changes(pipe, plain) == changes.Detected(ChangesSpec(attention_backend="_native_math"))
    assert changes.active_backend() == active  # the meta twin's set_attention_backend left the process alone
    built = _pipe(_flux(attention_backend="_native_math"), tmp_path)
    assert dependencies.snapshot(built.transformer)["items"] == dependencies.snapshot(pipe.transformer)["items"]
    assert changes.same_keys(_flux(attention_backend="_native_math"), detect_changes(pipe, plain).changes)


def test_a_unets_backend_is_the_process_wide_one(models_dir, active_attention_backend):
    """A UNet's processors (AttnProcessor2_0) hold no backend: set_attention_backend on it sets only the
    active backend, which a compiled call's state is checked against; it reads as that declaration."""
    recipe = _recipe()
    pipe = _pipe(recipe, models_dir)
    pipe.unet.set_attention_backend("_native_math")
    assert detect_changes(pipe, recipe) == changes.Detected(ChangesSpec(attention_backend="_native_math"))
    _change("attention_backend").apply(pipe.unet, "native", None)
    assert detect_changes(pipe, recipe) == changes.Detected(None)


def test_a_backend_changed_after_load_names_the_recipe_key_that_declares_it(active_attention_backend):
    """A processor whose backend differs, or a call under another active backend, is refused with the hint
    that maps to changes.attention_backend (the StaleGraph's advice names it)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    from aotbuild.dispatch import Dispatcher
    from aotbuild.pipeline import dependencies

    def record(processor: str) -> dict:
        items = {"a.processor": processor}
        return {"version": dependencies.VERSION, "items": items, "digest": dependencies.digest(items)}

    here = "diffusers.models.transformers.transformer_flux.FluxAttnProcessor object"
    why = dependencies.diff(record(f"{here} (_attention_backend='_native_math')"), record(here), "transformer")
    assert why.endswith("another attention backend (set_attention_backend)?")
    assert dependencies.recipe_key(why) == "changes.attention_backend"
    other = dependencies.diff(record(f"{here} (scale=1.0)"), record(f"{here} (scale=2.0)"), "transformer")
    assert dependencies.recipe_key(other) == "changes.attention_processor"  # not the backend: another setting
    m = torch.nn.Linear(2, 2)
    with torch.no_grad():
        watch = dependencies.Watch(m, {**dependencies.snapshot(m), "globals": [dependencies.call_state()]}, "m")
        _AttentionBackendRegistry.set_active_backend(AttentionBackendName("_native_math"))  # as set_attention_backend
        reason = watch.check()
    assert "diffusers attention backend _native_math" in reason
    assert dependencies.recipe_key(reason) == "changes.attention_backend"
    d = Dispatcher("m", lambda x: x, {'{"args": [["float"]], "kwargs": {}}': lambda x: x}, lambda x: x, "error")
    d.on_stale, d.watch = "error", watch
    with pytest.raises(StaleGraph, match=r"declare it in the recipe \(changes\.attention_backend"), torch.no_grad():
        d(1.0)


# -- plan-time checks against the model ---------------------------------------------------------------


def test_the_plan_keys_a_declared_change_and_checks_it_against_the_model(cache):
    plain, freeu = _keys(_recipe(), cache), _keys(_recipe(freeu=FREEU), cache)
    assert plain["unet"] != freeu["unet"]
    with pytest.raises(RecipeError) as info:
        aotbuild.plan(_recipe(attention_processor="AttnProcesor"), cache=cache)
    assert info.value.key == "changes.attention_processor"
    assert "did you mean 'AttnProcessor'" in str(info.value) and "AttnProcessor2_0" in str(info.value)
    with pytest.raises(RecipeError) as info:  # UNet2DConditionModel is no CacheMixin
        aotbuild.plan(_recipe(cache={"config": "FirstBlockCacheConfig"}), cache=cache)
    assert info.value.key == "changes.cache" and "has no enable_cache" in str(info.value)
    with pytest.raises(RecipeError) as info:
        aotbuild.plan(_recipe(cache={"config": "FirstBlockCache"}), cache=cache)
    assert info.value.key == "changes.cache.config" and "FirstBlockCacheConfig" in str(info.value)


def test_freeu_on_a_pipeline_without_a_unet_is_a_recipe_error(tmp_path):
    flux = {**TINY, "model": {"id": "builtin:tiny-flux", "dtype": "float32"},
            "compile": {"components": ["transformer"]}}
    with pytest.raises(RecipeError) as info:
        aotbuild.plan(parse_recipe({**flux, "changes": {"freeu": FREEU}}), cache=tmp_path)
    assert info.value.key == "changes.freeu" and "FluxPipeline has no unet" in str(info.value)
    with pytest.raises(RecipeError) as info:
        aotbuild.plan(parse_recipe({**flux, "changes": {"cache": {"config": "FirstBlockCacheConfig", "treshold": 1}}}),
                      cache=tmp_path)
    assert info.value.key == "changes.cache.treshold" and "did you mean 'threshold'" in str(info.value)


# -- applied by every load, read off a live pipe ------------------------------------------------------


def test_a_load_applies_the_declared_changes(models_dir):
    from diffusers.models.attention_processor import AttnProcessor

    pipe = _pipe(_recipe(freeu=FREEU, attention_processor="AttnProcessor", memory_format="channels_last"), models_dir)
    assert all(block.b1 == 1.2 and block.s2 == 0.2 for block in pipe.unet.up_blocks)
    assert {type(p) for p in pipe.unet.attn_processors.values()} == {AttnProcessor}
    assert pipe.unet.conv_in.weight.is_contiguous(memory_format=torch.channels_last)
    assert not pipe.unet.conv_in.weight.is_contiguous()
    plain = _pipe(_recipe(), models_dir)
    assert plain.unet.up_blocks[0].b1 is None if hasattr(plain.unet.up_blocks[0], "b1") else True


def test_the_changes_of_a_live_pipe_are_read_as_the_recipe_declares_them(models_dir):
    recipe = _recipe()
    pipe = _pipe(recipe, models_dir)
    assert detect_changes(pipe, recipe) == changes.Detected(None)  # from_pretrained's pipe: nothing
    from diffusers.models.attention_processor import AttnProcessor2_0

    pipe.unet.set_attn_processor(AttnProcessor2_0())  # the class it had: no change
    assert detect_changes(pipe, recipe) == changes.Detected(None)
    pipe.enable_freeu(**FREEU)
    pipe.unet.to(memory_format=torch.channels_last)
    found = detect_changes(pipe, recipe)
    assert found.changes == _recipe(freeu=FREEU, memory_format="channels_last").changes and not found.refused



def test_a_text_encoder_as_from_pretrained_loads_it_is_no_change(models_dir):
    """transformers' from_pretrained marks the model (_is_hf_initialized, _use_kernels, _weight_conversions)
    where a construction from its config does not: build(recipe, pipe=pipe) refused every unchanged pipe
    that compiles a text encoder (found in review). channels_last cannot show on it (no 4-D weight), so a
    UNet in channels_last is still the recipe's one memory format."""
    recipe = parse_recipe({**TINY, "compile": {"components": ["unet", "vae", "text_encoder"]}})
    pipe = _pipe(recipe, models_dir)
    assert detect_changes(pipe, recipe) == changes.Detected(None)
    pipe.unet.to(memory_format=torch.channels_last)
    pipe.vae.to(memory_format=torch.channels_last)
    assert detect_changes(pipe, recipe) == changes.Detected(ChangesSpec(memory_format="channels_last"))


def _marked_on_load(monkeypatch, cls, marks):
    """A future library: ``cls.from_pretrained`` sets ``marks`` (path -> value) on every model it loads, as
    transformers 5.25 leaves ``_use_kernels`` True where 5.24 left it False."""
    load = cls.from_pretrained.__func__

    def marked(klass, *args, **kwargs):
        model = load(klass, *args, **kwargs)
        for path, value in marks.items():
            owner, _, name = path.rpartition(".")
            setattr(model.get_submodule(owner), name, value)
        return model

    monkeypatch.setattr(cls, "from_pretrained", classmethod(marked))


def _users_value(value):
    return not value if isinstance(value, bool) else value + 1


#: What a future release's load might set: another value of one transformers sets today, and new names.
_TRANSFORMERS_MARKS = [{"_use_kernels": True}, {"_use_kernels": False},
                       {"_something_new": 3, "encoder.layers.0._kernel_flag": True}]


@pytest.mark.parametrize("marks", _TRANSFORMERS_MARKS, ids=["use_kernels_true", "use_kernels_false", "new_names"])
def test_what_a_transformers_load_sets_is_no_change_whatever_its_value(models_dir, monkeypatch, marks):
    """transformers 5.25 leaves text_encoder._use_kernels True after from_pretrained; the values hard-coded
    from 5.24 (False) refused every unchanged pipe that compiles a text encoder (issue 54 item 3). The
    fresh load the pipe is compared with is the library's own from_pretrained, without weights: what a
    release sets on load is on it too, at that release's value, and a user's value over it still differs."""
    from transformers import CLIPTextModel

    _marked_on_load(monkeypatch, CLIPTextModel, marks)
    recipe = parse_recipe({**TINY, "compile": {"components": ["unet", "vae", "text_encoder"]}})
    pipe = _pipe(recipe, models_dir)
    for path, value in marks.items():  # the case is real: the pipe's own load set them
        owner, _, name = path.rpartition(".")
        assert getattr(pipe.text_encoder.get_submodule(owner), name) is value
    assert detect_changes(pipe, recipe) == changes.Detected(None)
    pipe.unet.to(memory_format=torch.channels_last)  # a real change is still read
    pipe.vae.to(memory_format=torch.channels_last)
    assert detect_changes(pipe, recipe) == changes.Detected(ChangesSpec(memory_format="channels_last"))
    path, value = next(iter(marks.items()))
    owner, _, name = path.rpartition(".")
    setattr(pipe.text_encoder.get_submodule(owner), name, _users_value(value))  # the user's, over the load's
    found = detect_changes(pipe, recipe)
    assert found.changes is None and (f"text_encoder.{path} is {_users_value(value)!r} here, {value!r} in a fresh "
                                      f"load") in found.refused, found.refused


def test_what_a_diffusers_load_sets_is_no_change(models_dir, monkeypatch):
    """The same for a diffusers model: a release whose from_pretrained sets attributes of its own (none in
    0.42) keeps an unchanged UNet unchanged, and FreeU, a processor or a value written over the load's is
    still read or refused (issue 54 item 3)."""
    from diffusers import UNet2DConditionModel
    from diffusers.models.attention_processor import AttnProcessor

    marks = {"_something_new": 3, "conv_in._loaded_by": "a future diffusers"}
    _marked_on_load(monkeypatch, UNet2DConditionModel, marks)
    recipe = _recipe()
    pipe = _pipe(recipe, models_dir)
    assert pipe.unet._something_new == 3 and pipe.unet.conv_in._loaded_by == "a future diffusers"
    assert detect_changes(pipe, recipe) == changes.Detected(None)
    pipe.enable_freeu(**FREEU)
    pipe.unet.set_attn_processor(AttnProcessor())
    assert detect_changes(pipe, recipe) == changes.Detected(_recipe(freeu=FREEU,
                                                                    attention_processor="AttnProcessor").changes)
    pipe.unet._something_new = 4
    found = detect_changes(pipe, recipe)
    assert found.changes is None and "unet._something_new is 4 here, 3 in a fresh load" in found.refused


def test_the_fresh_load_reads_no_weights_and_leaves_the_libraries_logging_as_it_was(models_dir):
    """The twin is each library's from_pretrained of the component's config and an empty weights file, on
    the meta device (or, where a load step refuses it, as transformers 5.25's kernelize does, as fake
    tensors): no weight is read or allocated, and its report of the missing ones is silenced without
    changing what the user's process logs."""
    import diffusers
    import transformers
    from torch._subclasses.fake_tensor import FakeTensor

    recipe = parse_recipe({**TINY, "compile": {"components": ["unet", "vae", "text_encoder"]}})
    pipe = _pipe(recipe, models_dir)

    def logging_state():
        return [(lib.utils.logging.get_verbosity(), lib.utils.logging.is_progress_bar_enabled())
                for lib in (transformers, diffusers)]

    before = logging_state()
    for component in recipe.compile.components:
        twin = changes._meta_twin(getattr(pipe, component))
        assert twin.loaded and all(t.device.type == "meta" or isinstance(t, FakeTensor)
                                   for t in twin.module.parameters()), component
    assert logging_state() == before


def test_where_the_library_cannot_load_a_twin_what_a_load_sets_is_refused_saying_so(models_dir, monkeypatch):
    """A release whose from_pretrained refuses a checkpoint without weights leaves the twin built from the
    config alone: what the load set reads as a change, refused with why, never accepted unseen."""
    monkeypatch.setattr(changes, "_load_twin", lambda library, module: None)
    recipe = parse_recipe({**TINY, "compile": {"components": ["unet", "text_encoder"]}})
    pipe = _pipe(recipe, models_dir)
    found = detect_changes(pipe, recipe)
    assert found.changes is None and "built from the config alone" in found.refused
    assert found.refused.startswith("text_encoder.")  # the UNet's own load sets nothing its config does not


def test_a_processor_on_one_component_is_not_declared_for_all(models_dir):
    """The VAE keeps its own default processor (AttnProcessor2_0, which reads as its name, not None): the
    recipe would have set AttnProcessor on it too, built a VAE entry the user's VAE never matches
    (found in review)."""
    from diffusers.models.attention_processor import AttnProcessor

    recipe = parse_recipe({**TINY, "compile": {"components": ["unet", "vae"]}})
    pipe = _pipe(recipe, models_dir)
    assert pipe.vae.attn_processors  # the tiny VAE has attention: the case is real
    pipe.unet.set_attn_processor(AttnProcessor())
    found = detect_changes(pipe, recipe)
    assert found.changes is None and "is on some compiled components but not on vae" in found.refused


def test_freeu_factors_keep_their_type_so_a_declared_int_meets_a_users_int(models_dir):
    """enable_freeu(b1=1) stores the int 1; the dependency record tells it from 1.0. The recipe made every
    factor a float, so a user's int factor was refused by build(recipe, pipe=pipe) and never met an entry
    built from `b1: 1` (found in review)."""
    from aotbuild.pipeline import dependencies

    ints = {**FREEU, "b1": 1, "b2": 2}
    recipe = _recipe()
    pipe = _pipe(recipe, models_dir)
    pipe.enable_freeu(**ints)
    found = detect_changes(pipe, recipe)
    assert found == changes.Detected(_recipe(freeu=ints).changes) and found.changes.freeu["b1"] == 1
    built = _pipe(_recipe(freeu=ints), models_dir)  # what a build job of the declared recipe loads
    assert dependencies.snapshot(built.unet)["items"] == dependencies.snapshot(pipe.unet)["items"]
    from aotbuild.keys import canonical_json

    as_float = _recipe(freeu={**ints, "b1": 1.0})  # another setting: keyed apart, as the record tells it apart
    assert canonical_json(changes.factors(_recipe(freeu=ints), "unet")) \
        != canonical_json(changes.factors(as_float, "unet"))



def test_a_quantized_pipe_is_read_for_its_changes_not_refused(models_dir):
    """A recipe's own quantization (torchao's modules) is not on the meta twin: every quantized pipe was
    refused, so load_compiled(recipe, pipe=pipe) keyed a FreeU pipe without FreeU and its miss said the
    pipeline "cannot be built for", naming a torchao attribute (found in review)."""
    pytest.importorskip("torchao")
    from aotbuild.features import quantization as quantize

    recipe = parse_recipe({**TINY, "model": {**TINY["model"], "quantization": {"backend": "torchao",
                                                                               "quant_type": "int8wo"}}})
    pipe = _pipe(recipe, models_dir)
    quantize.apply(pipe, recipe)
    assert detect_changes(pipe, recipe) == changes.Detected(None)
    pipe.enable_freeu(**FREEU)
    assert detect_changes(pipe, recipe) == changes.Detected(ChangesSpec(freeu=_recipe(freeu=FREEU).changes.freeu))

@pytest.mark.parametrize(("change", "words"), [
    (lambda pipe: pipe.unet.set_attn_processor(ScaledProcessor()),
     "test_declared_changes.ScaledProcessor, not one of diffusers' attention processors"),
    (lambda pipe: pipe.unet.set_attn_processor(type("Mine", (ScaledProcessor,), {"__module__": "__main__"})()),
     "defined in __main__"),
    (lambda pipe: setattr(pipe.unet.up_blocks[0].resnets[0], "output_scale_factor", 2.0),
     "unet.up_blocks.0.resnets.0.output_scale_factor is 2.0 here, 1.0 in a fresh load"),
    (lambda pipe: (pipe.enable_freeu(**FREEU), setattr(pipe.unet.up_blocks[1], "b1", 3.0)),
     "unet.up_blocks.1.b1 is 3.0 here, 1.2 in a fresh load"),
    (lambda pipe: pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.set_processor(
        __import__("diffusers").models.attention_processor.AttnProcessor()),
     "processor is diffusers.models.attention_processor.AttnProcessor object here"),
])
def test_a_change_no_other_process_can_re_create_is_refused_with_the_reason(models_dir, change, words):
    recipe = _recipe()
    pipe = _pipe(recipe, models_dir)
    change(pipe)
    found = detect_changes(pipe, recipe)
    assert found.changes is None and words in found.refused, found.refused
    with pytest.raises(UsageError, match="cannot build for this pipeline") as info:
        aotbuild.build(TINY, cache=models_dir, pipe=pipe)
    assert words in str(info.value)


def test_a_diffusers_cache_hook_is_read_off_a_transformer_and_refused_as_no_build_makes_one(tmp_path):
    """The cache hook is read as the recipe would declare it, and refused with the reason: no strategy
    builds one (issue 31 item 6), so build(recipe, pipe=pipe) would only fail its jobs."""
    from diffusers.hooks import FirstBlockCacheConfig

    flux = parse_recipe({**TINY, "model": {"id": "builtin:tiny-flux", "dtype": "float32"},
                         "compile": {"components": ["transformer"]}})
    pipe = _pipe(flux, tmp_path)
    assert detect_changes(pipe, flux) == changes.Detected(None)  # FluxAttnProcessor is the model's own default
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.2))
    value, why = _change("cache").read(pipe.transformer, "transformer")
    assert dict(value) == {"config": "FirstBlockCacheConfig", "threshold": 0.2} and not why
    found = detect_changes(pipe, flux)
    assert found.changes is None and found.refused.startswith(
        "transformer's changes.cache: FirstBlockCacheConfig: no strategy builds a diffusers cache hook")
    pipe.transformer.disable_cache()
    assert detect_changes(pipe, flux) == changes.Detected(None)


def test_what_no_strategy_builds_is_refused_at_plan_time_with_what_works(tmp_path, cache):
    """A declared fused processor needs fuse_qkv_projections' to_qkv (the build's warmup failed on it)
    and a declared cache hook failed every build (issue 31 items 3 and 6): both were accepted by plan."""
    with pytest.raises(RecipeError) as info:
        aotbuild.plan(_recipe(attention_processor="FusedAttnProcessor2_0"), cache=cache)
    assert info.value.key == "changes.attention_processor"
    assert "FusedAttnProcessor2_0 reads the fused projections fuse_qkv_projections() makes" in str(info.value)
    assert "Declare the unfused processor (AttnProcessor2_0)" in str(info.value)
    with pytest.raises(RecipeError) as info:  # a typo is not offered a fused one
        aotbuild.plan(_recipe(attention_processor="FusedAttnProcesor2_0"), cache=cache)
    assert "Fused" not in str(info.value).split("(allowed: ")[1]
    flux = {**TINY, "model": {"id": "builtin:tiny-flux", "dtype": "float32"},
            "compile": {"components": ["transformer"]}}
    with pytest.raises(RecipeError) as info:
        aotbuild.plan(parse_recipe({**flux, "changes": {"cache": {"config": "FirstBlockCacheConfig"}}}),
                      cache=tmp_path)
    assert info.value.key == "changes.cache"
    assert "no strategy builds a diffusers cache hook" in str(info.value) and 'on_miss="eager"' in str(info.value)


# -- build(recipe, pipe=pipe) and load_compiled(recipe, pipe=pipe) key the pipe's changes ------------


def test_build_for_a_pipe_re_applies_its_changes_and_a_load_of_that_pipe_keys_them(cache, fake_compiles):
    recipe = _recipe()
    pipe = _pipe(recipe, cache)
    pipe.enable_freeu(**FREEU)
    declared = _keys(_recipe(freeu=FREEU), cache)
    report = aotbuild.build(TINY, cache=cache, pipe=pipe)
    assert fake_compiles == [declared["unet"]] and report.results[0].job.recipe.changes is not None
    with pytest.raises(CacheMiss) as info:  # a stand-in entry: the load keys it, then refuses its artifacts
        aotbuild.load_compiled(TINY, pipe, cache=cache, on_miss="error")
    assert declared["unet"][:12] in str(info.value)
    # a pipe of the plain model misses the FreeU entry, and is told what builds it
    empty = cache.parent / "empty"
    with pytest.raises(CacheMiss) as info:
        aotbuild.load_compiled(TINY, pipe, cache=empty, on_miss="error")
    assert (f"next: `aotbuild.build(recipe, pipe=pipe, cache={str(empty)!r})` builds them for this pipeline (it "
            f"re-applies the pipeline's changes: {{freeu: ") in str(info.value) and "declare that in the recipe" in \
        str(info.value)
    # the recipe's own changes and the pipe's must agree
    with pytest.raises(UsageError, match="are not the ones"):
        aotbuild.build({**TINY, "changes": {"freeu": {**FREEU, "b1": 1.1}}}, cache=cache, pipe=pipe)


def test_a_miss_of_a_pipe_without_the_recipes_declared_changes_says_so(cache):
    """The recipe declares FreeU, the pipe passed has none: build(recipe, pipe=pipe) builds the recipe's
    FreeU entries (a hit once CI built them) and this pipe misses them again, so the miss's next line
    offered a build that never helps (found in review). It names the difference instead."""
    pipe = _pipe(_recipe(), cache)
    with pytest.raises(CacheMiss) as info:
        aotbuild.load_compiled({**TINY, "changes": {"freeu": FREEU}}, pipe, cache=cache, on_miss="error")
    assert "declares changes: {freeu: " in str(info.value) and "this pipeline holds none of them" in str(info.value)
    assert "build(recipe, pipe=pipe)` builds" not in str(info.value)
    pipe.enable_freeu(**FREEU)  # the same FreeU: the build for this pipe is the way
    with pytest.raises(CacheMiss, match=r"next: `aotbuild.build\(recipe, pipe=pipe, cache='[^']+'\)` builds them"):
        aotbuild.load_compiled({**TINY, "changes": {"freeu": FREEU}}, pipe, cache=cache, on_miss="error")
    # b1 1.0 declared, the int 1 in the pipe: another setting and key (a dict's == calls them equal)
    pipe.enable_freeu(**{**FREEU, "b1": 1})
    with pytest.raises(CacheMiss, match="this pipeline holds changes: {freeu: "):
        aotbuild.load_compiled({**TINY, "changes": {"freeu": {**FREEU, "b1": 1.0}}}, pipe, cache=cache, on_miss="error")
    assert not changes.same_keys(_recipe(freeu={**FREEU, "b1": 1.0}), _recipe(freeu={**FREEU, "b1": 1}).changes)

def test_a_miss_of_a_pipe_with_a_change_no_recipe_declares_says_so(cache):
    pipe = _pipe(_recipe(), cache)
    pipe.unet.set_attn_processor(ScaledProcessor())
    with pytest.raises(CacheMiss) as info:
        aotbuild.load_compiled(TINY, pipe, cache=cache, on_miss="error")
    assert "next: this pipeline cannot be built for: unet's attention processor ScaledProcessor" in str(info.value)
    assert "build(recipe, pipe=pipe)` builds" not in str(info.value)


def test_a_stale_graph_names_the_recipe_key_that_declares_the_change():
    from aotbuild.dispatch import Dispatcher

    class Changed:
        def __init__(self, why):
            self.why = why

        def check(self):
            return self.why

    d = Dispatcher("unet", lambda x: x, {'{"args": [["float"]], "kwargs": {}}': lambda x: x}, lambda x: x, "error")
    d.on_stale = "error"
    d.watch = Changed("unet.up_blocks.0.b1: 1.2 here, absent in the entry: FreeU?")
    with pytest.raises(StaleGraph) as info:
        d(1.0)
    assert "declare it in the recipe (changes.freeu" in str(info.value) and "save_pretrained" not in str(info.value)
    d.watch = Changed("unet.conv_in.weight: param float32 [8, 4, 3, 3] stride [36, 1, 12, 4] cpu grad here, "
                      "param float32 [8, 4, 3, 3] stride [36, 9, 3, 1] cpu grad in the entry: another memory format "
                      "(channels_last?)")
    with pytest.raises(StaleGraph, match=r"changes\.memory_format"):
        d(1.0)
    d.watch = Changed("unet.up_blocks.0.resnets.0.output_scale_factor: 2.0 here, 1.0 in the entry")
    with pytest.raises(StaleGraph, match="refuses others with the reason"):
        d(1.0)
    # a torch forward hook (or an offload hook) is no cache hook a recipe declares (found in review)
    d.watch = Changed("unet.conv_in.<hooks>: forward 1, pre 0 here, absent in the entry: a hook (a diffusers cache, "
                      "a forward hook)?")
    with pytest.raises(StaleGraph) as info:
        d(1.0)
    assert "declare it in the recipe" not in str(info.value) and "refuses others" in str(info.value)
    # a diffusers cache hook: declarable, but no strategy builds one (refused at plan time), so not offered
    d.watch = Changed("transformer._cache_config: diffusers.hooks.first_block_cache.FirstBlockCacheConfig "
                      "(threshold=0.2) here, absent in the entry: a diffusers cache hook (enable_cache)?")
    with pytest.raises(StaleGraph) as info:
        d(1.0)
    assert "declare it in the recipe" not in str(info.value) and "refuses others" in str(info.value)


def test_a_stale_graph_s_build_advice_names_the_cache_the_pipeline_was_loaded_from(tmp_path):
    """Advice followed as written does what it says (aotbuild/advice.py): the build for the changed pipe goes
    into the cache load_compiled read, so the next load finds it. The default root needs no ``cache=``."""
    from aotbuild.advice import Situation
    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.dispatch import Dispatcher
    from aotbuild.errors import StaleGraph

    class Changed:
        def check(self):
            return "unet.up_blocks.0.b1: 1.2 here, absent in the entry: FreeU?"

    d = Dispatcher("unet", lambda x: x, {'{"args": [["float"]], "kwargs": {}}': lambda x: x}, lambda x: x, "error")
    d.watch = Changed()
    other = tmp_path / "ci-cache"
    for root, says in ((other, f"aotbuild.build(recipe, pipe=pipe, cache={str(other)!r})"),
                       (resolve_cache_root(None), "aotbuild.build(recipe, pipe=pipe), then load again")):
        d.situation = Situation(("recipes/tiny.yaml",), root)
        with pytest.raises(StaleGraph) as info:
            d(1.0)
        assert says in str(info.value), str(info.value)


# -- built and served ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_declared_freeu_is_built_and_a_users_pipe_with_it_is_served_compiled(models_dir, tmp_path, monkeypatch):
    """aot-package served the image without FreeU for a pipe with FreeU (issue 31); now the recipe
    declares FreeU, the build bakes it in, and a user's own pipe with the same enable_freeu hits, with
    0 compiles and eager-with-FreeU's image. The model is tiny-sd with a UNet of resnets only
    (tests/loras.py): both up blocks FreeU scales, no transformer blocks to compile kernels for."""
    from torch._dynamo.utils import counters
    from torch._inductor import compile_fx

    from aotbuild.pipeline.pipecall import warmup_kwargs
    from tests.conftest import invoke_cli
    from tests.loras import attention_free_sd

    model = attention_free_sd(models_dir, tmp_path / "attention-free-sd")
    own = {**TINY, "model": {"id": str(model), "dtype": "float32"}}  # the model, no change declared
    cache = tmp_path / "cache"
    data = {**own, "strategy": "aot-package", "changes": {"freeu": FREEU}}
    path = tmp_path / "tiny_freeu.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    # in this process: the build's worker and proof are fresh processes already (a CLI process of its
    # own only imported torch and diffusers again)
    proc = invoke_cli("build", "--json", "--cache", str(cache), str(path),
                      env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"), "AOTBUILD_CACHE": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    recipe = parse_recipe(data)

    def image(pipe):
        return pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe), output_type="pt").images.float()

    plain = _pipe(parse_recipe(own), cache)
    without = image(plain)
    plain.enable_freeu(**FREEU)
    expected = image(plain)
    assert (expected - without).abs().max().item() > 1e-3  # FreeU moves the image: an ignored FreeU cannot pass

    pipe = _pipe(parse_recipe(own), cache)  # the user's own pipe, FreeU enabled by hand
    pipe.enable_freeu(**FREEU)
    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setattr(compile_fx._InProcessFxCompile, "codegen_and_compile",
                        lambda *a, **k: pytest.fail("Inductor generated code: the load compiled"))
    aotbuild.load_compiled(str(path), pipe, cache=cache, on_miss="error")
    got = image(pipe)
    assert pipe.aotbuild_report.misses == [] and pipe.unet.forward.calls["built"] >= 1
    assert counters["stats"]["unique_graphs"] == graphs
    assert (got - expected).abs().max().item() <= 1e-4
