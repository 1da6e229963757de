"""Keys change with every factor and with nothing else (paths, cwd, hostname, device index)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

import pytest

from aotbuild import context, keys
from aotbuild.cache.store import Store
from aotbuild.context import Context
from aotbuild.errors import RecipeError
from aotbuild.planner import jobs_for
from aotbuild.recipe.rules import load_recipe, parse_recipe
from tests.conftest import TINY_RECIPE


def plan_keys(recipe, root):
    return [j.key for j in jobs_for(Context.create(recipe, root), Store(root))]


def base_data() -> dict:
    import yaml

    return yaml.safe_load(TINY_RECIPE.read_text())


def test_key_ignores_paths_cwd_and_hostname(models_dir, tmp_path, monkeypatch):
    reference = plan_keys(load_recipe(TINY_RECIPE), models_dir)
    # Same recipe from another folder, same model in another cache root, from another cwd and host.
    other_root = tmp_path / "other"
    shutil.copytree(models_dir / "models", other_root / "models")
    recipe_copy = tmp_path / "copy" / "tiny_sd_cpu.yaml"
    recipe_copy.parent.mkdir()
    shutil.copy(TINY_RECIPE, recipe_copy)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(socket, "gethostname", lambda: "another-host")
    monkeypatch.setenv("USER", "somebody-else")
    assert plan_keys(load_recipe(recipe_copy), other_root) == reference
    # The factors never hold an absolute path.
    job = jobs_for(Context.create(load_recipe(recipe_copy), other_root), Store(other_root))[0]
    text = keys.canonical_json(job.factors)
    assert str(tmp_path) not in text and str(models_dir) not in text and os.getcwd() not in text


@pytest.mark.parametrize("change", [
    lambda d: d["warmup"].update(guidance_scale=7.5),
    lambda d: d["warmup"].update(num_inference_steps=3),
    lambda d: d["model"].update(dtype="bfloat16"),
    lambda d: d["model"].update(variant="fp16"),
    lambda d: d.setdefault("compile", {}).update(scope="regional"),
    lambda d: d.setdefault("compile", {}).update(mode="max-autotune"),
    lambda d: d.setdefault("compile", {}).update(options={"cpp.dynamic_threads": False}),
    lambda d: d.setdefault("compile", {}).update(fullgraph=False),
], ids=["guidance", "steps", "dtype", "variant", "scope", "mode", "options", "fullgraph"])
def test_key_changes_with_each_recipe_factor(models_dir, change):
    data = base_data()
    reference = plan_keys(parse_recipe(data, "r.yaml"), models_dir)
    change(data)
    changed = plan_keys(parse_recipe(data, "r.yaml"), models_dir)
    assert changed[0] != reference[0] and changed[1] != reference[1]


def test_prompt_text_is_not_a_factor(models_dir):
    data = base_data()
    reference = plan_keys(parse_recipe(data, "r.yaml"), models_dir)
    data["warmup"]["prompt"] = "an entirely different prompt"
    assert plan_keys(parse_recipe(data, "r.yaml"), models_dir) == reference


def test_a_list_of_prompts_is_keyed_by_its_length_not_its_texts(models_dir):
    """[a cat, a dog] runs the denoiser at twice the batch of one prompt: never the same entry."""
    data = base_data()
    one = plan_keys(parse_recipe(data, "r.yaml"), models_dir)
    data["warmup"]["prompt"] = ["a cat", "a dog"]
    two = plan_keys(parse_recipe(data, "r.yaml"), models_dir)
    data["warmup"]["prompt"] = ["a bird", "a fish"]
    assert plan_keys(parse_recipe(data, "r.yaml"), models_dir) == two
    data["warmup"]["prompt"] = ["a single prompt in a list"]
    assert plan_keys(parse_recipe(data, "r.yaml"), models_dir) == one
    assert not set(one) & set(two)
    factors = jobs_for(Context.create(parse_recipe({**data, "warmup": {"prompt": ["a", "b"], "negative_prompt": "c"}},
                                                   "r.yaml"), models_dir), Store(models_dir))[0].factors
    assert factors["warmup"]["prompt"] == {"texts": 2} and factors["warmup"]["negative_prompt"] == {"texts": 1}


def test_each_shape_has_its_own_key(models_dir):
    data = base_data()
    data["shapes"].append({"height": 64, "width": 64, "batch_size": 2})
    ks = plan_keys(parse_recipe(data, "r.yaml"), models_dir)
    assert len(set(ks)) == 3


def _env(**changes):
    real = context.environment_factors()
    return lambda: {**real, **changes}


def _other_cpu_isa(monkeypatch, root):
    import torch

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2-other")


def _other_builtin_version(monkeypatch, root):
    """tiny-sd v99, served from a folder of that name (a copy of v1 is enough for planning)."""
    from aotbuild import builtin

    model = builtin.lookup("builtin:tiny-sd")
    v1 = root / "models" / model.folder_name
    monkeypatch.setattr(type(model), "version", 99)
    (root / "models" / model.folder_name).symlink_to(v1, target_is_directory=True)


def _other_config(monkeypatch, root):
    from aotbuild.pipeline import models

    real = models.component_config
    monkeypatch.setattr(models, "component_config",
                        lambda *a, **k: (lambda c: (c[0], {**c[1], "changed": True}))(real(*a, **k)))


#: Each factor a key must change with, changed where it comes from (what the environment reports, the
#: CPU, the built-in model's version, the component's config.json), then planned as a build would.
FACTOR_SOURCES = {
    "env.torch": lambda mp, root: mp.setattr(context, "environment_factors", _env(torch="2.99.0")),
    "env.diffusers": lambda mp, root: mp.setattr(context, "environment_factors", _env(diffusers="9.9.9")),
    "env.transformers": lambda mp, root: mp.setattr(context, "environment_factors", _env(transformers="9.9.9")),
    "env.python": lambda mp, root: mp.setattr(context, "environment_factors", _env(python="3.99")),
    "device.cpu_isa": _other_cpu_isa,
    "device.onednn_max_cpu_isa": lambda mp, root: mp.setenv("ONEDNN_MAX_CPU_ISA", "avx2"),
    "model.builtin_version": _other_builtin_version,
    "component.config": _other_config,
}


def _private_root(models_dir, tmp_path) -> Path:
    """A cache root of this test's own, holding the session's built-in model."""
    root = tmp_path / "root"
    shutil.copytree(models_dir / "models", root / "models", symlinks=True)
    return root


@pytest.mark.parametrize("factor", list(FACTOR_SOURCES))
def test_key_changes_with_environment_and_model_factors(models_dir, tmp_path, monkeypatch, factor):
    root = _private_root(models_dir, tmp_path)
    before = jobs_for(Context.create(load_recipe(TINY_RECIPE), root), Store(root))
    FACTOR_SOURCES[factor](monkeypatch, root)
    after = jobs_for(Context.create(load_recipe(TINY_RECIPE), root), Store(root))
    assert len(before) == len(after) == 2 and all(j.key for j in before + after)
    for old, new in zip(before, after, strict=True):
        assert new.key != old.key
        diff = keys.differences(old.factors, new.factors)
        assert diff and all(line.startswith(factor + ".") or line.startswith(factor + ":") for line in diff), diff


def test_key_ignores_dict_order_rank_and_device_index(models_dir, tmp_path, monkeypatch):
    """What must not matter, through the planner: the order config.json lists its keys in, the
    launcher's rank/world variables, and which GPU of a machine the recipe names."""
    import torch

    from aotbuild.pipeline import models

    reference = plan_keys(load_recipe(TINY_RECIPE), models_dir)
    real = models.component_config
    monkeypatch.setattr(models, "component_config",
                        lambda *a, **k: (lambda c: (c[0], dict(reversed(c[1].items()))))(real(*a, **k)))
    for name, value in {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "CUDA_VISIBLE_DEVICES": "3",
                        "MASTER_ADDR": "10.0.0.3"}.items():
        monkeypatch.setenv(name, value)
    assert plan_keys(load_recipe(TINY_RECIPE), models_dir) == reference

    # cuda:0 and cuda:3 of one machine (the same GPU model): one key. CUDA is faked for planning only.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    per_device = []
    for device in ("cuda:0", "cuda:3"):
        data = base_data()
        data["device"] = device
        per_device.append(plan_keys(parse_recipe(data, "r.yaml"), models_dir))
    assert per_device[0] == per_device[1] and None not in per_device[0]
    assert not set(per_device[0]) & set(reference)  # and the device kind itself is a factor


def test_module_config_matches_config_file(models_dir):
    """The runtime keys a loaded module; the planner reads config.json: both must agree."""
    from aotbuild.pipeline import models

    recipe = load_recipe(TINY_RECIPE)
    resolved = models.resolve_model(recipe, models_dir)
    pipe = models.load_pipeline(recipe, resolved, "float32")
    for name in ("unet", "vae", "text_encoder"):
        assert models.module_config(getattr(pipe, name)) == models.component_config(resolved, name, None)


def test_differences_read_well():
    lines = keys.differences({"env": {"torch": "2.13.0"}}, {"env": {"torch": "2.14.1"}})
    assert lines == ["env.torch: 2.13.0 in the cache, 2.14.1 here"]


def test_thread_count_is_a_factor_only_when_threads_are_pinned(models_dir, monkeypatch):
    import torch

    default = parse_recipe(base_data(), "r.yaml")
    data = base_data()
    data["compile"] = {"options": {"cpp.dynamic_threads": False}}
    pinned = parse_recipe(data, "r.yaml")
    before = plan_keys(default, models_dir), plan_keys(pinned, models_dir)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 64)
    assert plan_keys(default, models_dir) == before[0]  # dynamic threads: valid for any count
    assert plan_keys(pinned, models_dir) != before[1]


def test_relative_model_folder_is_found_next_to_the_recipe(models_dir, tmp_path, monkeypatch):
    """A recipe and its model move together: ``id: ../model`` means next to the recipe's folder,
    from any cwd, and the key is the same as from anywhere else."""
    import yaml

    from aotbuild.pipeline.models import resolve_model

    model = next(p for p in (models_dir / "models").iterdir() if p.is_dir())
    shutil.copytree(model, tmp_path / "project" / "model")
    data = base_data()
    data["model"]["id"] = "../model"
    recipe_file = tmp_path / "project" / "recipes" / "r.yaml"
    recipe_file.parent.mkdir()
    recipe_file.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)  # ../model from here does not exist
    recipe = load_recipe(recipe_file)
    assert Path(resolve_model(recipe, tmp_path).location) == (tmp_path / "project" / "model").resolve()
    data["model"]["id"] = "../missing"
    recipe_file.write_text(yaml.safe_dump(data))
    with pytest.raises(RecipeError, match=r"model.id: no such folder: ../missing \(looked for .*project/missing and "):
        resolve_model(load_recipe(recipe_file), tmp_path)


def test_a_miss_is_explained_by_the_nearest_entry_for_the_component():
    """Fewest differing factors wins, across recipes (a copied recipe finds its original's entries);
    on a tie the entry of the same recipe wins; an empty cache is named as such."""
    from aotbuild.cache.explain import explain_miss
    from tests import manifests

    here = manifests.factors(env={"torch": "2.13"})

    def entry(recipe, component="unet", **changes):
        factors = manifests.factors(env={"torch": "2.13"}, component={"name": component})
        for path, value in changes.items():
            section, name = path.split("__")
            factors[section][name] = value
        return manifests.manifest(factors, recipe=recipe)

    two_off = entry("mine", shape__height=96, env__torch="2.12")
    one_off = entry("original", warmup__guidance_scale=5.0)
    assert explain_miss([two_off, one_off], "mine", "unet", here) == \
        "not built: warmup.guidance_scale: 5.0 in the cache, 0.0 here"
    tie = entry("mine", shape__width=96)
    assert explain_miss([one_off, tie], "mine", "unet", here) == "not built: shape.width: 96 in the cache, 64 here"
    assert explain_miss([entry("x", component="vae")], "mine", "unet", here) == \
        "not built: the cache has no entry for a unet of class UNet2DConditionModel yet"
    assert "the cache at /c is empty" in explain_miss([], "mine", "unet", here, Path("/c"))
    # Like with like: an entry of another component class is never the nearest (its config differs
    # whole: "class: SanaTransformer2DModel in the cache, WanTransformer3DModel here; ... and 31 more").
    other_class = entry("mine", component__class="WanTransformer3DModel")
    assert explain_miss([other_class], "mine", "unet", here) == \
        "not built: the cache has no entry for a unet of class UNet2DConditionModel yet"
    assert explain_miss([other_class, two_off], "mine", "unet", here).startswith("not built: env.torch")
