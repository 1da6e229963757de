"""Pipelines whose call takes an image (img2img, inpainting, ControlNet, instruct-pix2pix, image-to-video)
build and serve: the warmup passes the recipe's image file, resized to the shape, or one made at the
shape's size (aotbuild/pipeline/images.py). Before, the warmup passed none and every strategy failed
with diffusers' "Input is in incorrect format"."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import PIL.Image
import pytest

from aotbuild.errors import RecipeError
from aotbuild.pipeline.pipecall import CallSignature, check_recipe, warmup_kwargs
from aotbuild.recipe.rules import parse_recipe
from aotbuild.recipe.schema import Shape
from tests.conftest import invoke_cli, run_python


class Img2Img:  # diffusers' StableDiffusionImg2ImgPipeline: no height or width, the image's size is the output's
    def __call__(self, prompt=None, image: PIL.Image.Image | list[PIL.Image.Image] = None, strength=0.8,
                 num_inference_steps=50, guidance_scale=7.5, num_images_per_prompt=1, generator=None, **kwargs):
        pass


class Inpaint:  # StableDiffusionInpaintPipeline: image, mask_image, height and width
    def __call__(self, prompt=None, image: PIL.Image.Image = None, mask_image: PIL.Image.Image = None, height=None,
                 width=None, strength=1.0, num_inference_steps=50, guidance_scale=7.5, generator=None):
        pass


class Kontext:  # FluxKontextPipeline, Flux2Pipeline: the image is optional (its annotation admits None)
    def __call__(self, prompt=None, image: PIL.Image.Image | None = None, height=None, width=None, generator=None):
        pass


class Text2Img:
    def __call__(self, prompt=None, height=None, width=None, num_inference_steps=50, generator=None):
        pass


def recipe(tmp_path, **warmup):
    return parse_recipe({"model": {"id": "builtin:tiny-sd"}, "shapes": [{"height": 64, "width": 96}],
                         "warmup": {"num_inference_steps": 2, **warmup}}, folder=str(tmp_path))


def test_an_image_argument_the_recipe_leaves_out_is_made_at_the_shape_s_size_the_same_in_every_call(tmp_path):
    r = recipe(tmp_path)
    shape = Shape(height=64, width=96)
    first, again = warmup_kwargs(r, shape, Img2Img), warmup_kwargs(r, shape, Img2Img)
    assert first["image"].size == (96, 64) and first["image"].mode == "RGB"  # PIL: (width, height)
    assert "height" not in first and "width" not in first  # img2img takes neither: the image's size is the shape
    pixels = np.asarray(first["image"])
    assert np.array_equal(pixels, np.asarray(again["image"])) and pixels.std() > 10  # the same, and not flat
    inpaint = warmup_kwargs(r, shape, Inpaint)
    mask = np.asarray(inpaint["mask_image"])
    assert inpaint["mask_image"].mode == "L" and set(np.unique(mask)) == {0, 255}  # something to repaint, some kept
    assert (inpaint["height"], inpaint["width"]) == (64, 96) and inpaint["image"].size == (96, 64)
    assert "image" not in warmup_kwargs(r, shape, Text2Img)  # only to a pipeline that takes it
    # an optional image (it changes what the denoiser sees) is made for no one: the warmup is what it was
    assert "image" not in warmup_kwargs(r, shape, Kontext) and CallSignature.of(Kontext).needs_image == ()


def test_a_recipe_s_image_file_is_resized_to_each_shape_and_null_passes_none(tmp_path):
    from PIL import Image

    Image.fromarray(np.full((30, 50, 3), (10, 200, 30), np.uint8)).save(tmp_path / "photo.png")
    r = recipe(tmp_path, image="photo.png", mask_image=None)
    check_recipe(r, CallSignature.of(Inpaint))
    call = warmup_kwargs(r, Shape(height=64, width=96), Inpaint)
    assert call["image"].size == (96, 64) and np.asarray(call["image"])[32, 48].tolist() == [10, 200, 30]
    assert "mask_image" not in call  # null: not passed (a pipeline for which it is optional runs without)


@pytest.mark.parametrize("value, says", [
    (3, r"an image file's path .* or null .*got 3 \(int\)"),
    ("a\x00b.png", "a path holds no control characters"),
    ("fake.png", "not an image Pillow reads as one of PNG, JPEG, WEBP, BMP"),  # an EPS, whatever its name
    ("missing.png", "no such image file"),
    ("../outside.png", "outside the recipe's repository"),
    ("notes.txt", "not an image Pillow reads"),
])
def test_an_image_the_warmup_cannot_read_is_a_recipe_error_naming_the_key(tmp_path, value, says):
    folder = tmp_path / "repo"
    folder.mkdir()
    (folder / "pyproject.toml").write_text("")  # the repository's root: a file outside it is refused
    (tmp_path / "outside.png").write_bytes(b"")
    (folder / "notes.txt").write_text("not a picture")
    (folder / "fake.png").write_bytes(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n")
    r = recipe(folder, image=value)
    with pytest.raises(RecipeError, match=f"warmup.image: .*{says}"):
        check_recipe(r, CallSignature.of(Img2Img))  # plan's check reads the image: a job would fail later


def test_a_replica_s_load_does_not_need_the_build_s_image_file(tmp_path):
    r = recipe(tmp_path, image="only-on-the-build-machine.png")
    check_recipe(r, CallSignature.of(Img2Img), files=False)  # load_compiled's check: no warmup runs there
    with pytest.raises(RecipeError, match="no such image file"):
        check_recipe(r, CallSignature.of(Img2Img))


def test_an_image_file_is_no_key_factor_and_null_is_one(tmp_path):
    """What an image holds changes no compiled graph (it is resized to the shape): a file's path keys
    like the made image; null changes the call (no image) and the key."""
    made = recipe(tmp_path).warmup_factors()
    assert recipe(tmp_path, image="a.png").warmup_factors() == made
    assert recipe(tmp_path, image=None).warmup_factors() != made


def test_plan_refuses_a_missing_image_file_before_any_load(tmp_path, models_dir):
    path = tmp_path / "i2i.yaml"
    path.write_text(textwrap.dedent("""\
        model: {id: builtin:tiny-sd, pipeline: StableDiffusionImg2ImgPipeline}
        device: cpu
        shapes: [{height: 64, width: 64}]
        warmup: {num_inference_steps: 2, image: photos/cat.png}
    """))
    proc = invoke_cli("plan", "--cache", str(models_dir), str(path))
    assert proc.returncode == 2 and "warmup.image: no such image file" in proc.stderr, proc.stderr


SERVE = """
import json
import numpy as np, torch
from PIL import Image
from diffusers import StableDiffusionInpaintPipeline, StableDiffusionPipeline
from torch._dynamo.utils import counters
import aotbuild

recipe, cache, model = json.loads(ARGS)
rng = np.random.default_rng(7)  # the user's own image and mask, not the build's
image = Image.fromarray(rng.integers(0, 255, (64, 64, 3)).astype(np.uint8))
mask = Image.fromarray(np.where(rng.random((64, 64)) > 0.5, 255, 0).astype(np.uint8), "L")
call = dict(prompt="a dog", image=image, mask_image=mask, height=64, width=64, strength=0.75,
            num_inference_steps=4, guidance_scale=0.0, output_type="np")
eager = StableDiffusionInpaintPipeline.from_pretrained(model)
expected = eager(generator=torch.Generator().manual_seed(1), **call).images
pipe = aotbuild.load_compiled(recipe, pipe=StableDiffusionInpaintPipeline.from_pretrained(model), cache=cache,
                              on_miss="error", strict_shapes=True)
got = pipe(generator=torch.Generator().manual_seed(1), **call).images
calls = dict(pipe.unet.forward.calls)
# a server's other pipeline on the same load: from_pipe shares the components, the compiled UNet included
text = dict(prompt="a cat", height=64, width=64, num_inference_steps=2, guidance_scale=0.0, output_type="np")
shared = StableDiffusionPipeline.from_pipe(pipe)(generator=torch.Generator().manual_seed(2), **text).images
own = StableDiffusionPipeline.from_pipe(eager)(generator=torch.Generator().manual_seed(2), **text).images
print(json.dumps({"hits": len(pipe.aotbuild_report.hits), "graphs": counters["stats"]["unique_graphs"],
                  "fx_miss": counters["inductor"]["fxgraph_cache_miss"], "calls": calls,
                  "after_text": pipe.unet.forward.calls, "diff": float(np.abs(got - expected).max()),
                  "text_diff": float(np.abs(shared - own).max())}))
"""


@pytest.mark.slow  # one real build (auto) of the tiny UNet for an inpainting pipeline, and a fresh serve
def test_an_inpainting_pipeline_builds_from_a_recipe_s_image_and_serves_a_user_s_image_and_mask(tmp_path,
                                                                                               models_dir):
    """The recipe names an image file and leaves the mask to the build; a fresh process serves another
    image and mask at another strength with 0 compiles, equal to eager's inpainting, and text-to-image
    through ``from_pipe`` on the same load."""
    from PIL import Image

    Image.fromarray(np.random.default_rng(3).integers(0, 255, (100, 80, 3)).astype(np.uint8)).save(
        tmp_path / "photo.png")
    path = tmp_path / "inpaint.yaml"
    path.write_text(textwrap.dedent("""\
        model: {id: builtin:tiny-sd, pipeline: StableDiffusionInpaintPipeline, dtype: float32}
        device: cpu
        shapes: [{height: 64, width: 64}]
        warmup: {num_inference_steps: 2, guidance_scale: 0.0, image: photo.png}
    """))
    cache = tmp_path / "cache"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"), "AOTBUILD_CACHE": ""}
    build = invoke_cli("build", "--json", "--cache", str(cache), str(path), env=env)
    assert build.returncode == 0, build.stdout[-3000:] + build.stderr[-3000:]
    job, = json.loads(build.stdout)["jobs"]
    assert job["status"] == "built", job
    model = next((cache / "models").glob("tiny-sd-*"))
    code = SERVE.replace("ARGS", repr(json.dumps([str(path), str(cache), str(model)])))
    proc = run_python(code, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "serve-inductor")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    assert served["hits"] == 1 and served["graphs"] == 0 and served["fx_miss"] == 0, served
    assert served["calls"] == {"built": 3, "unbuilt": 0} and served["diff"] < 1e-4, served
    # StableDiffusionPipeline.from_pipe(pipe): text-to-image on the same compiled UNet, 0 compiles, as eager
    assert served["after_text"] == {"built": 5, "unbuilt": 0} and served["text_diff"] < 1e-4, served


class _Scheduler:
    pass


class _Refusing:  # a pipeline whose own call refuses the warmup's input, as img2img does without an image
    scheduler = _Scheduler()

    def __call__(self, **kwargs):
        raise ValueError("Input is in incorrect format")


class _Ours:  # one whose call fails inside aotbuild's code (a recorder's, a dispatcher's): a strategy's doing
    scheduler = _Scheduler()

    def __call__(self, **kwargs):
        from aotbuild.pipeline.images import synthetic

        synthetic("image", -1, 4)


class _OutOfMemory:  # the pipeline's own code, but not an input refused: another strategy may not hit it
    scheduler = _Scheduler()

    def __call__(self, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")


class _Rewrapped(_Ours):  # library code that catches aotbuild's error and raises its own from it
    def __call__(self, **kwargs):
        try:
            super().__call__()
        except ValueError as exc:
            raise ValueError("the model failed") from exc


@pytest.mark.parametrize("pipe, eager, marked", [(_Refusing(), True, True), (_Ours(), True, False),
                                                 (_Refusing(), False, False), (_OutOfMemory(), True, False),
                                                 (_Rewrapped(), True, False)])
def test_only_the_pipeline_s_own_eager_failure_is_marked_for_auto_to_stop(tmp_path, pipe, eager, marked):
    from types import SimpleNamespace

    from aotbuild import constants
    from aotbuild.strategies.base import BuildJob

    job = BuildJob(SimpleNamespace(recipe=recipe(tmp_path)), pipe, "unet", None, {}, tmp_path)
    with pytest.raises(Exception) as caught:
        job.run_warmup(eager=eager)  # eager=False: jit-cache's warmup runs compiled code
    assert getattr(caught.value, constants.EAGER_CALL_FAILED, False) is marked


@pytest.mark.slow  # one real try (a load and an eager warmup in a fresh process), then a plan-speed rebuild
def test_auto_stops_at_the_first_strategy_when_the_pipeline_s_own_call_fails_eagerly(tmp_path, models_dir):
    """img2img with ``image: null``: the pipeline refuses the call before any compile. Auto tried every
    strategy, each loading the pipeline and failing the same way (minutes each at real size); now the
    rest are dropped, saying why, and the next build skips them all until --retry-failed."""
    path = tmp_path / "i2i.yaml"
    path.write_text(textwrap.dedent("""\
        model: {id: builtin:tiny-sd, pipeline: StableDiffusionImg2ImgPipeline, dtype: float32}
        device: cpu
        shapes: [{height: 64, width: 64}]
        warmup: {num_inference_steps: 2, image: null}
    """))
    cache = tmp_path / "cache"
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"), "AOTBUILD_CACHE": ""}
    build = invoke_cli("build", "--json", "--cache", str(cache), str(path), env=env)
    assert build.returncode == 1, build.stdout[-3000:]
    job, = json.loads(build.stdout)["jobs"]
    outcomes = [(a["strategy"], a["outcome"]) for a in job["attempts"]]
    assert outcomes[0] == ("aot-package+freezing", "failed") and len(outcomes) == 4, outcomes
    assert {o for _, o in outcomes[1:]} == {"dropped"} and "Input is in incorrect format" in job["reason"], job
    assert all("not tried: the pipeline's own call failed" in a["reason"] for a in job["attempts"][1:])
    again = invoke_cli("build", "--json", "--cache", str(cache), str(path), env=env)
    job, = json.loads(again.stdout)["jobs"]
    assert job["status"] == "failed" and "every strategy auto tries failed before" in job["reason"], job
    assert job["reason"].count("not tried: the pipeline's own call failed") == 3 and "--retry-failed" in job["reason"]
