"""Every list and size a recipe (or a model folder planned at plan time) can make large is bounded,
refused with the key and the variable that raises the bound (issue 32, item 5): a custom schedule's
length, the images and pixels of one warmup call, the text encoders' sequence length, a warmup's
frames, the jobs of a tensor-parallel recipe, and the sizes of a component built on the meta device.
The refusal and its message are asserted, never a time."""

from __future__ import annotations

import pytest

from aotbuild.errors import RecipeError
from aotbuild.recipe.rules import parse_recipe

BASE = {"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}]}


def refused(data: dict) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        parse_recipe(data)
    return info.value


@pytest.mark.parametrize("over,key,says,variable", [
    ({"warmup": {"timesteps": list(range(1000, 0, -1))}}, "warmup.timesteps",
     "1000 warmup steps (items of timesteps): at most 200", "AOTBUILD_MAX_STEPS"),
    ({"warmup": {"sigmas": [1.0 - i / 5000 for i in range(5000)]}}, "warmup.sigmas",
     "5000 warmup steps (items of sigmas): at most 200", "AOTBUILD_MAX_STEPS"),
    ({"warmup": {"negative_prompt_2": ["x"] * 65}}, "warmup.negative_prompt_2", "65 prompts: at most 64",
     "AOTBUILD_MAX_PROMPTS"),
    ({"warmup": {"prompt": ["a cat"] * 64}, "shapes": [{"height": 64, "width": 64, "batch_size": 17}]},
     "shapes[0].batch_size", "1088 images per warmup call (batch_size 17 x 64 prompts): at most 1024",
     "AOTBUILD_MAX_BATCH"),
    ({"shapes": [{"height": 64, "width": 64}, {"height": 16384, "width": 16384}]}, "shapes[1]",
     "268435456 pixels per warmup call (16384x16384, 1 frames, 1 images): at most 134217728", "AOTBUILD_MAX_PIXELS"),
    ({"shapes": [{"height": 8192, "width": 8192, "batch_size": 3}]}, "shapes[0]",
     "201326592 pixels per warmup call (8192x8192, 1 frames, 3 images)", "AOTBUILD_MAX_PIXELS"),
    ({"shapes": [{"height": 2048, "width": 2048, "num_frames": 4096}]}, "shapes[0]",
     "17179869184 pixels per warmup call (2048x2048, 4096 frames, 1 images)", "AOTBUILD_MAX_PIXELS"),
    ({"warmup": {"num_frames": 4096}, "shapes": [{"height": 2048, "width": 2048}]}, "shapes[0]",
     "(2048x2048, 4096 frames, 1 images)", "AOTBUILD_MAX_PIXELS"),
    ({"warmup": {"max_sequence_length": 1_000_000}}, "warmup.max_sequence_length",
     "1000000 tokens per prompt: at most 4096", "AOTBUILD_MAX_SEQUENCE"),
    ({"compile": {"options": {"compile_threads": 100_000}}}, "compile.options.compile_threads",
     "100000 compile processes: at most 64", "AOTBUILD_MAX_COMPILE_THREADS"),
    ({"compile": {"options": {"cpp.threads": 100_000, "cpp.dynamic_threads": False}}}, "compile.options.cpp.threads",
     "100000 threads per CPU kernel: at most 64", "AOTBUILD_MAX_COMPILE_THREADS"),  # num_threads(100000)
    ({"parallel": {"tensor": 64}, "shapes": [{"height": 8 * (i + 1), "width": 64} for i in range(5)]},
     "compile.components", "320 jobs (components x shapes x tensor-parallel ranks): at most 256", "AOTBUILD_MAX_JOBS"),
])
def test_a_recipe_over_a_bound_is_refused_with_its_key_and_the_operator_can_raise_it(monkeypatch, over, key, says,
                                                                                      variable):
    data = {**BASE, **over}
    error = refused(data)
    assert error.key == key, str(error)
    assert says in error.message and f"(raise it with {variable})" in error.message, error.message
    monkeypatch.setenv(variable, str(10 ** 12))
    parse_recipe(data)  # the operator's choice: nothing else refuses it


def test_the_bounds_allow_what_real_recipes_ask_for():
    """A Wan 2.2 video at 81x720x1280, a 50-step custom schedule, SDXL at batch 8 with two prompts."""
    parse_recipe({**BASE, "shapes": [{"height": 720, "width": 1280, "num_frames": 81}],
                  "warmup": {"sigmas": [1.0 - i / 50 for i in range(50)], "max_sequence_length": 512}})
    parse_recipe({**BASE, "shapes": [{"height": 1024, "width": 1024, "batch_size": 8}],
                  "warmup": {"prompt": ["a", "b"]}})
    parse_recipe({**BASE, "shapes": [{"height": 16384, "width": 8192}]})  # the largest side, on half the other


def test_a_warmup_num_frames_is_bounded_like_a_shapes():
    error = refused({**BASE, "warmup": {"num_frames": 10 ** 9}})
    assert error.key == "warmup.num_frames" and "1000000000 is not allowed: 1 to 4096" in error.message


@pytest.mark.parametrize("name", ["num_inference_steps", "max_sequence_length", "num_frames"])
@pytest.mark.parametrize("value,shown", [(100_000.0, "100000.0 (float)"), (True, "True (bool)"),
                                         ("9999", "'9999' (str)"), (0, "0 (int)"), (-5, "-5 (int)")])
def test_a_warmup_count_is_a_whole_number_so_no_type_slips_past_its_bound(name, value, shown):
    """Found in review: the bounds measured ints only, so ``num_inference_steps: 100000.0`` passed
    unmeasured, and diffusers' PNDMScheduler (SD 1.x's) runs 100,009 steps for it."""
    error = refused({**BASE, "warmup": {name: value}})
    assert error.key == f"warmup.{name}" and f"expected a whole number from 1, got {shown}" in error.message, error


# -- a model built on the meta device at plan time --------------------------------------------------

@pytest.fixture
def pr_model(models_dir, tmp_path):
    """A pull request's copy of the tiny SD model and a recipe whose compile.blocks plan checks by
    building the UNet from its config.json on the meta device (aotbuild/pipeline/models.py check_blocks)."""
    import shutil

    folder = tmp_path / "pr" / "model"
    shutil.copytree(next((models_dir / "models").glob("tiny-sd-v*")), folder)
    recipe = tmp_path / "pr" / "r.yaml"
    recipe.write_text("model: {id: ./model, dtype: float32}\ndevice: cpu\nshapes: [{height: 64, width: 64}]\n"
                      "compile: {components: [unet], scope: regional, blocks: [BasicTransformerBlock]}\n")
    return folder, recipe


def _set_config(folder, **values):
    import json

    path = folder / "unet" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


@pytest.mark.parametrize("values,says,variable", [
    ({"layers_per_block": 10_000}, "layers_per_block is 10000, over the layers", "AOTBUILD_MAX_MODEL_LAYERS"),
    ({"block_out_channels": [32, 1_000_000]}, "block_out_channels[1] is 1000000, over the size",
     "AOTBUILD_MAX_MODEL_WIDTH"),
    ({"down_block_types": ["DownBlock2D"] * 5000}, "down_block_types (items) is 5000, over the layers",
     "AOTBUILD_MAX_MODEL_LAYERS"),
    ({"transformer_layers_per_block": [1, 20_000]}, "transformer_layers_per_block[1] is 20000, over the layers",
     "AOTBUILD_MAX_MODEL_LAYERS"),
    ({"extra": {"nested": {"sample_size": 10 ** 9}}}, "extra.nested.sample_size is 1000000000, over the size",
     "AOTBUILD_MAX_MODEL_WIDTH"),
])
def test_a_model_config_is_sized_before_plan_builds_it_even_on_meta(pr_model, tmp_path, monkeypatch, values, says,
                                                                      variable):
    from aotbuild.errors import ModelUnavailable
    from aotbuild.pipeline import blocks
    from aotbuild.planner import plan
    from tests.conftest import invoke_cli

    folder, recipe = pr_model
    _set_config(folder, **values)
    built = []
    real = blocks.meta_module
    monkeypatch.setattr(blocks, "meta_module", lambda *a: built.append(a) or real(*a))
    with pytest.raises(ModelUnavailable) as info:
        plan([str(recipe)], tmp_path / "cache")
    assert built == []  # refused before anything was built, even on the meta device
    message = str(info.value)
    assert message.startswith(f"{folder.resolve()}/unet/config.json: "), message
    assert says in message and f"raise it with {variable}" in message, message
    proc = invoke_cli("plan", "--cache", str(tmp_path / "cache"), str(recipe))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if says in line], proc.stderr


def test_the_operator_raises_a_model_bound_and_plan_builds_it(pr_model, tmp_path, monkeypatch):
    from aotbuild.pipeline import blocks
    from aotbuild.planner import plan

    folder, recipe = pr_model
    _set_config(folder, layers_per_block=2000)
    monkeypatch.setenv("AOTBUILD_MAX_MODEL_LAYERS", "4000")  # the operator's choice
    built = []
    monkeypatch.setattr(blocks, "meta_module", lambda *a: built.append(a[2]["layers_per_block"]))  # None: unchecked
    job, = plan([str(recipe)], tmp_path / "cache")
    assert built == [2000] and job.status == "miss"


def test_a_model_config_whose_bounded_sizes_multiply_is_stopped_by_its_module_count(pr_model, tmp_path, monkeypatch):
    """Found in review: each key is bounded on its own, but they multiply (1,024 down blocks x
    ``layers_per_block: 1024`` passed both bounds: a million blocks). Scaled down: with a layers bound
    of 16 the budget is 16 x 64 = 1,024 modules; tiny-sd's UNet registers 216, and 1,596 with
    ``layers_per_block: 16``, which is within the per-key bound."""
    from aotbuild.errors import ModelUnavailable
    from aotbuild.planner import plan
    from tests.conftest import invoke_cli

    folder, recipe = pr_model
    monkeypatch.setenv("AOTBUILD_MAX_MODEL_LAYERS", "16")
    job, = plan([str(recipe)], tmp_path / "cache")  # the real config: well inside
    assert job.status == "miss", job.reason
    _set_config(folder, layers_per_block=16)
    with pytest.raises(ModelUnavailable) as info:
        plan([str(recipe)], tmp_path / "cache")
    message = str(info.value)
    assert message.startswith(f"{folder.resolve()}/unet/config.json: builds more than 1024 modules"), message
    assert "raise it with AOTBUILD_MAX_MODEL_LAYERS" in message, message
    proc = invoke_cli("plan", "--cache", str(tmp_path / "cache"), str(recipe), env={"AOTBUILD_MAX_MODEL_LAYERS": "16"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert [line for line in proc.stderr.splitlines() if "builds more than 1024 modules" in line], proc.stderr


@pytest.mark.parametrize("value", [["StableDiffusionPipeline"], 5, "Pipe\n::error::x", "../x"])
def test_a_model_index_class_name_is_type_checked_before_it_becomes_a_key_factor(pr_model, tmp_path, value):
    """``_class_name`` is the pipeline key factor and the class a build loads: a list or a number was
    keyed as its str() (every entry built with it then failed to load)."""
    import json

    from aotbuild.planner import plan

    folder, recipe = pr_model
    index = folder / "model_index.json"
    index.write_text(json.dumps({**json.loads(index.read_text()), "_class_name": value}))
    job, = plan([str(recipe)], tmp_path / "cache")
    assert job.status == "unavailable" and job.key is None
    assert "model_index.json: _class_name is " in job.reason and "expected a pipeline class name" in job.reason
    assert "\n" not in job.reason


@pytest.mark.parametrize("value", ["9" * 400 + "B", "99999999999TiB", f"{2 ** 63}B"])  # a size has a unit
def test_a_size_setting_past_2_62_bytes_is_one_line_not_a_traceback(tmp_path, value):
    """Found in review: ``AOTBUILD_MAX_SIZE`` (or a pull request's ``[tool.aotbuild] max_size``) of 400
    digits is inf as a float, and ``int(inf)`` raised an OverflowError's traceback."""
    from aotbuild.cache.layout import parse_size
    from aotbuild.errors import UsageError
    from tests.conftest import invoke_cli

    with pytest.raises(UsageError, match=r"is not a size of 0 to 2\^62 bytes"):
        parse_size(value)
    proc = invoke_cli("gc", "--cache", str(tmp_path / "c"), env={"AOTBUILD_MAX_SIZE": value})
    assert proc.returncode == 2 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and "is not a size of 0 to 2^62 bytes" in proc.stderr, proc.stderr
    assert parse_size("20GB") == 20 * 10 ** 9 and parse_size(2 ** 62) == 2 ** 62


def test_a_video_shape_without_num_frames_counts_the_pipelines_default_frames(tmp_path):
    """Found in review: where neither the shape nor the warmup sets num_frames, a video pipeline makes
    its own default (Wan: 81 frames), but the pixel bound counted 1, so a 16384x8192 shape on a Wan
    model (2^27 pixels, at the bound) asked for 81 times the bound. plan knows the pipeline and
    counts its default; the same shape with num_frames: 1 stays allowed."""
    from aotbuild.planner import plan

    recipe = tmp_path / "r.yaml"
    text = "model: {id: builtin:tiny-wan, dtype: float32}\ncompile: {components: [transformer]}\nshapes: [%s]\n"
    recipe.write_text(text % "{height: 16384, width: 8192}")
    with pytest.raises(RecipeError) as info:
        plan([str(recipe)], tmp_path / "cache")
    assert info.value.key == "shapes[0]", str(info.value)
    assert ("10871635968 pixels per warmup call (16384x8192, 81 frames (num_frames unset: the pipeline's default), "
            "1 images): at most 134217728 (raise it with AOTBUILD_MAX_PIXELS)") in info.value.message, info.value
    recipe.write_text(text % "{height: 16384, width: 8192, num_frames: 1}")
    job, = plan([str(recipe)], tmp_path / "cache")
    assert job.status == "miss", job.reason


@pytest.mark.parametrize("command", ["plan", "build"])
def test_the_jobs_of_one_command_across_recipe_files_are_bounded(tmp_path, command):
    """Found in review: each recipe file was bounded on its own (AOTBUILD_MAX_JOBS), so ``plan DIR`` or
    ``build DIR`` of many files, each within its bound, asked for any number of jobs."""
    from tests.conftest import invoke_cli

    folder = tmp_path / "recipes"
    folder.mkdir()
    for i in range(3):
        shapes = ", ".join(f"{{height: {8 * (j + 1)}, width: 64}}" for j in range(2))
        (folder / f"r{i}.yaml").write_text(f"model: builtin:tiny-sd\nshapes: [{shapes}]\n")
    env = {"HF_HUB_OFFLINE": "1", "AOTBUILD_MAX_TOTAL_JOBS": "5"}
    proc = invoke_cli(command, "--cache", str(tmp_path / "c"), str(folder), env=env)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.splitlines() == ["error: 6 jobs across 3 recipes in one command: at most 5 (raise it with "
                                        "AOTBUILD_MAX_TOTAL_JOBS, or name fewer recipes)"], proc.stderr
    env["AOTBUILD_MAX_TOTAL_JOBS"] = "2"  # more files than jobs allowed: refused before any file is read
    proc = invoke_cli(command, "--cache", str(tmp_path / "c"), str(folder), env=env)
    assert proc.returncode == 2 and "3 recipe files in one command: at most 2 jobs per command" in proc.stderr, \
        proc.stderr


# -- every warmup value, by what its name says it measures (found in review) ----------------------

@pytest.mark.parametrize("warmup,key,says,variable", [
    ({"prior_num_inference_steps": 100_000}, "warmup.prior_num_inference_steps", "100000 warmup steps: at most 200",
     "AOTBUILD_MAX_STEPS"),  # Kandinsky's prior
    ({"pyramid_num_inference_steps_list": [150, 150]}, "warmup.pyramid_num_inference_steps_list",
     "sum of 300 warmup steps: at most 200", "AOTBUILD_MAX_STEPS"),  # stages run one after another
    ({"num_waveforms_per_prompt": 2000}, "warmup.num_waveforms_per_prompt", "2000 outputs per prompt: at most 1024",
     "AOTBUILD_MAX_BATCH"),
    ({"num_waveforms_per_prompt": 17, "prompt": ["a"] * 64}, "shapes[0].batch_size",
     "1088 images per warmup call (batch_size 1 x 64 prompts x 17 num_waveforms_per_prompt): at most 1024",
     "AOTBUILD_MAX_BATCH"),  # each within its bound, multiplied
    ({"audio_length_in_s": 1e6}, "warmup.audio_length_in_s", "1000000.0 seconds of output: at most 600",
     "AOTBUILD_MAX_WARMUP_SECONDS"),
    ({"decode_chunk_size": 10 ** 9}, "warmup.decode_chunk_size", "1000000000 (a count): at most 65536",
     "AOTBUILD_MAX_WARMUP_NUMBER"),
    ({"max_area": 10 ** 12}, "warmup.max_area", "1000000000000: at most 65536 in size",
     "AOTBUILD_MAX_WARMUP_NUMBER"),  # a name no pattern knows: it may be a size
    ({"attention_kwargs": {"num_tokens": 10 ** 7}}, "warmup.attention_kwargs.num_tokens",
     "10000000 tokens per prompt: at most 4096", "AOTBUILD_MAX_SEQUENCE"),  # nested
    ({"original_size": [[1, 2]] * 6000}, "warmup.original_size",
     "more than 10000 values in the warmup", "AOTBUILD_MAX_WARMUP_ITEMS"),  # nested lists counted item by item
])
def test_every_warmup_number_and_list_is_bounded_by_what_its_name_measures(monkeypatch, warmup, key, says, variable):
    error = refused({**BASE, "warmup": warmup})
    assert error.key.startswith(key), str(error)
    assert says in error.message and f"(raise it with {variable})" in error.message, error.message
    monkeypatch.setenv(variable, str(10 ** 12))
    parse_recipe({**BASE, "warmup": warmup})  # the operator's choice: nothing else refuses it


@pytest.mark.parametrize("warmup,key,says", [
    ({"video_length": 10 ** 6}, "warmup.video_length", "1000000 is not allowed: 1 to 4096"),  # Latte's frames
    ({"frames": 0}, "warmup.frames", "0 is not allowed: 1 to 4096"),
    ({"prior_num_inference_steps": 25.5}, "warmup.prior_num_inference_steps", "expected a whole number"),
    ({"guidance_scale": float("inf")}, "warmup.guidance_scale", "finite number"),
    ({"eta": float("nan")}, "warmup.eta", "finite number"),
    ({"seed": -1}, "warmup.seed", "a seed is a whole number from 0 to 2^64-1"),
    ({"num_images": -3}, "warmup.num_images", "expected a number from 0"),
])
def test_a_warmup_value_of_the_wrong_kind_is_refused(warmup, key, says):
    error = refused({**BASE, "warmup": warmup})
    assert error.key == key and says in error.message, error


def test_factors_and_seeds_are_not_sizes():
    """A huge guidance_scale multiplies a tensor and costs nothing more; a seed picks noise."""
    parse_recipe({**BASE, "warmup": {"guidance_scale": 1e9, "strength": 0.5, "seed": 2 ** 63,
                                     "sigmas": [1e308, 1e308], "cross_attention_kwargs": {"scale": 1e7}}})


def test_a_latte_video_length_counts_as_frames_in_the_pixel_bound():
    error = refused({**BASE, "warmup": {"video_length": 4096}, "shapes": [{"height": 2048, "width": 2048}]})
    assert error.key == "shapes[0]" and "(2048x2048, 4096 frames, 1 images)" in error.message, error


def test_a_video_pipeline_that_computes_its_own_frames_is_counted_at_the_largest_default():
    """Found in review: CogVideoX's (and SVD's) num_frames default is None: it computes its own from the
    model's config, which plan does not load, and the pixel bound counted 1 frame. It counts the largest
    whole default of diffusers' video pipelines (161) and says to set num_frames; set, it counts that."""
    import diffusers

    from aotbuild.pipeline.pipecall import CallSignature, check_recipe
    from aotbuild.recipe.rules import UNKNOWN_DEFAULT_FRAMES

    call = CallSignature.of(diffusers.CogVideoXPipeline)
    error = refused_by(check_recipe, {**BASE, "shapes": [{"height": 1024, "width": 1024}]}, call)
    assert error.key == "shapes[0]" and (
        f"({1024 * 1024 * UNKNOWN_DEFAULT_FRAMES} pixels per warmup call (1024x1024, 161 frames (num_frames unset: "
        f"the pipeline computes its own, counted as the largest default; set num_frames), 1 images)") \
        .lstrip("(") in error.message, error
    check_recipe(parse_recipe({**BASE, "shapes": [{"height": 1024, "width": 1024, "num_frames": 49}]}), call)


def refused_by(check, data: dict, *args) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        check(parse_recipe(data), *args)
    return info.value
