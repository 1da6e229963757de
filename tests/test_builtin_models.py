"""The built-in tiny SDXL, SD3, Flux and QwenImage pipelines: deterministic, loadable, callable, plannable.

Each model is created once per session (about a second each); nothing here compiles. The real
builds of their recipes are slow and live with the other builds (a few minutes each on 2 cores).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from aotbuild import builtin
from aotbuild.pipeline import models, pipecall
from aotbuild.recipe.rules import load_recipe
from tests.conftest import REPO, invoke_cli

pytestmark = pytest.mark.xdist_group("builtin-models")  # one worker makes the built-in models this module shares

# built-in -> (recipe, the component it compiles, pipeline class, T5 tokenizer folder or None)
NEW_BUILTINS = {
    "tiny-flux": ("tiny_flux_cpu.yaml", "transformer", "FluxPipeline", "tokenizer_2"),
    "tiny-sdxl": ("tiny_sdxl_cpu.yaml", "unet", "StableDiffusionXLPipeline", None),
    "tiny-sd3": ("tiny_sd3_cpu.yaml", "transformer", "StableDiffusion3Pipeline", "tokenizer_3"),
    "tiny-qwenimage": ("tiny_qwenimage_cpu.yaml", "transformer", "QwenImagePipeline", None),
}


def digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="session")
def builtin_root(tmp_path_factory) -> Path:
    """A cache root holding the three built-ins (created once per session)."""
    root = tmp_path_factory.mktemp("builtin-models")
    for name in NEW_BUILTINS:
        builtin.ensure(builtin.PREFIX + name, root / "models")
    return root


@pytest.mark.parametrize("name", sorted(NEW_BUILTINS))
def test_creation_is_deterministic(name, builtin_root, tmp_path):
    first = builtin_root / "models" / builtin.lookup(builtin.PREFIX + name).folder_name
    second = builtin.ensure(builtin.PREFIX + name, tmp_path / "models")
    assert second.name == first.name == f"{name}-v{builtin.BUILTINS[name].version}"
    assert digests(first) == digests(second)
    assert any(f.endswith(".safetensors") for f in digests(first))
    assert json.loads((first / "model_index.json").read_text())["_class_name"] == NEW_BUILTINS[name][2]


@pytest.mark.parametrize("name", sorted(NEW_BUILTINS))
def test_loads_and_runs_one_eager_call_at_the_recipe_shape(name, builtin_root):
    recipe_file, component, pipeline_class, _ = NEW_BUILTINS[name]
    recipe = load_recipe(REPO / "recipes" / recipe_file)
    assert recipe.model.id == builtin.PREFIX + name and recipe.compile.components == (component,)
    resolved = models.resolve_model(recipe, builtin_root)
    assert resolved.builtin_version == builtin.BUILTINS[name].version
    pipe = models.load_pipeline(recipe, resolved, "float32")
    assert type(pipe).__name__ == pipeline_class
    pipecall.check_recipe(recipe, pipecall.CallSignature.of(pipe))
    # The planner keys config.json, a build job keys the loaded module: they must agree.
    module = getattr(pipe, component)
    assert models.module_config(module) == models.component_config(resolved, component, None)
    shape = recipe.shapes[0]
    kwargs = pipecall.warmup_kwargs(recipe, shape, pipe)
    image = pipe(**kwargs).images[0]
    assert image.size == (shape.width, shape.height)


def test_denoisers_are_the_architectures_they_stand_for(builtin_root):
    import diffusers

    def load(name, cls, sub):
        folder = builtin_root / "models" / builtin.lookup(builtin.PREFIX + name).folder_name
        return getattr(diffusers, cls).from_pretrained(str(folder / sub))

    flux = load("tiny-flux", "FluxTransformer2DModel", "transformer")
    assert len(flux.transformer_blocks) >= 2 and len(flux.single_transformer_blocks) >= 2
    assert flux.config.guidance_embeds
    sd3 = load("tiny-sd3", "SD3Transformer2DModel", "transformer")
    pre_only = [b.context_pre_only for b in sd3.transformer_blocks]
    assert pre_only[-1] and pre_only.count(False) >= 2  # a group of two or more identical blocks
    unet = load("tiny-sdxl", "UNet2DConditionModel", "unet")
    assert unet.config.addition_embed_type == "text_time"


@pytest.mark.parametrize("name", [n for n, v in sorted(NEW_BUILTINS.items()) if v[3]])
def test_t5_tokenizer_round_trips_text_and_saves_as_created(name, builtin_root):
    from transformers import AutoTokenizer

    folder = builtin_root / "models" / builtin.lookup(builtin.PREFIX + name).folder_name / NEW_BUILTINS[name][3]
    loaded = AutoTokenizer.from_pretrained(str(folder))
    created = builtin.t5_tokenizer()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2)
    for text in ("a photo of a cat", "An astronaut riding a horse at sunset, 4K (oil painting)!"):
        ids = loaded(text).input_ids
        assert ids == created(text).input_ids
        assert ids[-1] == loaded.eos_token_id and loaded.unk_token_id not in ids
        assert loaded.decode(ids, skip_special_tokens=True) == text
    padded = loaded("a cat", padding="max_length", max_length=8, truncation=True).input_ids
    assert padded == created("a cat").input_ids + [loaded.pad_token_id] * 5


def test_the_qwen2_tokenizer_round_trips_text_and_saves_as_created(builtin_root):
    """tiny-qwenimage's byte-level BPE: any text tokenizes (no unknown token), its words are one token
    each, the chat template's markers are special tokens, and the saved tokenizer is the created one."""
    from transformers import AutoTokenizer

    folder = builtin_root / "models" / builtin.lookup("builtin:tiny-qwenimage").folder_name / "tokenizer"
    loaded, created = AutoTokenizer.from_pretrained(str(folder)), builtin.qwen2_tokenizer()
    for text in ("a photo of a cat", "An astronaut riding a horse at sunset, 4K (oil painting)! \u00e9"):
        ids = loaded(text).input_ids
        assert ids == created(text).input_ids and loaded.decode(ids) == text
    assert len(loaded(" cat").input_ids) == 1 and len(loaded("<|im_start|>user").input_ids) == 2
    # padded to the batch's longest prompt, not to a fixed length: the text length follows the prompt
    batch = loaded(["a cat", "a small red cat with a big blue dog"], padding=True).input_ids
    assert len(batch[0]) == len(batch[1]) == len(loaded("a small red cat with a big blue dog").input_ids)


def test_plan_lists_each_recipe_s_component(builtin_root):
    recipes = [str(REPO / "recipes" / v[0]) for v in NEW_BUILTINS.values()]
    proc = invoke_cli("plan", "--json", "--cache", str(builtin_root), *recipes)
    assert proc.returncode == 0, proc.stderr
    jobs = json.loads(proc.stdout)["jobs"]
    assert {(j["recipe"], j["component"], j["status"]) for j in jobs} == {
        (Path(v[0]).stem, v[1], "miss") for v in NEW_BUILTINS.values()}
    assert "creating" not in proc.stderr  # the session's models were found, not created again


def test_the_default_component_on_a_transformer_model_says_what_to_name(builtin_root):
    """compile.components defaults to [unet]; a Flux or SD3 recipe without it is told to name the transformer."""
    from aotbuild.errors import RecipeError
    from aotbuild.recipe.rules import parse_recipe

    recipe = parse_recipe({"model": "builtin:tiny-flux", "shapes": [{"height": 64, "width": 64}]}, "r.yaml")
    with pytest.raises(RecipeError, match=r"compile.components: 'unet' is not a component of builtin:tiny-flux; "
                                          r"compile.components defaults to \[unet\].*compile.components: "
                                          r"\[transformer\]"):
        models.check_components(recipe, models.resolve_model(recipe, builtin_root))
