"""The warmup call is built from the pipeline's own __call__ signature, and the recipe is checked
against it at plan, in every job and at load_compiled."""

from __future__ import annotations

import pytest

from aotbuild.errors import RecipeError
from aotbuild.pipeline.pipecall import CallSignature, check_recipe, warmup_kwargs
from aotbuild.recipe.rules import parse_recipe
from aotbuild.recipe.schema import Shape


class ImagePipeline:  # SD-like: takes **kwargs
    def __call__(self, prompt=None, height=None, width=None, num_inference_steps=50, guidance_scale=7.5,
                 num_images_per_prompt=1, generator=None, **kwargs):
        pass


class VideoPipeline:  # Wan-like: no **kwargs
    def __call__(self, prompt=None, negative_prompt=None, height=480, width=832, num_frames=81,
                 num_inference_steps=50, guidance_scale=5.0, num_videos_per_prompt=1, generator=None):
        pass


class BarePipeline:  # neither count argument, no prompt, no generator
    def __call__(self, height=None, width=None, steps=10):
        pass


def recipe(**over):
    data = {"model": {"id": "builtin:tiny-sd"}, "shapes": [{"height": 64, "width": 64}],
            "warmup": {"num_inference_steps": 2}}
    data.update(over)
    return parse_recipe(data, "r.yaml")


def test_the_signature_names_what_the_pipeline_takes():
    image, video, bare = CallSignature.of(ImagePipeline), CallSignature.of(VideoPipeline()), CallSignature.of(
        BarePipeline)
    assert (image.count_argument, image.is_video, image.takes_kwargs) == ("num_images_per_prompt", False, True)
    assert (video.count_argument, video.is_video, video.takes_kwargs) == ("num_videos_per_prompt", True, False)
    assert (bare.count_argument, bare.is_video) == (None, False) and "self" not in bare.params


def test_the_per_prompt_count_goes_to_whichever_argument_the_pipeline_takes():
    r = recipe(shapes=[{"height": 64, "width": 96, "batch_size": 2}])
    image = warmup_kwargs(r, r.shapes[0], ImagePipeline)
    video = warmup_kwargs(r, r.shapes[0], VideoPipeline)
    assert image["num_images_per_prompt"] == 2 and "num_videos_per_prompt" not in image
    assert video["num_videos_per_prompt"] == 2 and "num_images_per_prompt" not in video
    assert (image["height"], image["width"], image["num_inference_steps"]) == (64, 96, 2)
    assert image["prompt"] and image["generator"] is not None
    assert "num_frames" not in video  # the shape sets none: the pipeline's default


def test_nothing_the_pipeline_does_not_take_is_passed():
    r = recipe(warmup={})
    bare = warmup_kwargs(r, r.shapes[0], BarePipeline, defaults={"num_inference_steps": 1})
    assert set(bare) == {"height", "width"}  # no prompt, no generator, no count, no target default
    r = recipe()
    assert warmup_kwargs(r, r.shapes[0], ImagePipeline, defaults={"num_inference_steps": 1})[
        "num_inference_steps"] == 2  # the recipe's own wins over the target's default


def test_num_frames_goes_to_a_video_pipeline_from_the_shape():
    r = recipe(shapes=[{"num_frames": 9, "height": 64, "width": 64}])
    assert warmup_kwargs(r, r.shapes[0], VideoPipeline)["num_frames"] == 9
    check_recipe(r, CallSignature.of(VideoPipeline))


@pytest.mark.parametrize("over,pipeline,key,says", [
    ({"warmup": {"num_inference_step": 2}}, ImagePipeline, "warmup.num_inference_step",
     "not an argument of ImagePipeline.__call__; did you mean 'num_inference_steps'?"),
    ({"warmup": {"guidance_scale": 4.0}}, BarePipeline, "warmup.guidance_scale", "not an argument of BarePipeline"),
    ({"shapes": [{"height": 64, "width": 64, "batch_size": 2}], "warmup": {}}, BarePipeline, "shapes[0].batch_size",
     "takes neither num_images_per_prompt nor num_videos_per_prompt"),
    ({"shapes": [{"height": 64, "width": 64, "num_frames": 9}]}, ImagePipeline, "shapes[0].num_frames",
     "is not a video pipeline"),
    ({"shapes": [{"height": 64, "width": 64, "num_frames": 9}], "warmup": {"num_frames": 13}}, VideoPipeline,
     "warmup.num_frames", "the shapes own it"),
])
def test_what_the_pipeline_cannot_take_is_a_recipe_error_naming_the_key(over, pipeline, key, says):
    with pytest.raises(RecipeError) as info:
        check_recipe(recipe(**over), CallSignature.of(pipeline))
    assert info.value.key == key and says in info.value.message


def test_a_warmup_may_set_num_frames_when_no_shape_does():
    check_recipe(recipe(warmup={"num_frames": 13}), CallSignature.of(VideoPipeline))


@pytest.mark.parametrize("arg", ["num_images_per_prompt", "num_videos_per_prompt", "height"])
def test_the_shapes_own_the_count_and_size_arguments(arg):
    with pytest.raises(RecipeError, match=f"warmup.{arg}: cannot be set here: shapes sets it"):
        recipe(warmup={arg: 2})


def test_video_shapes_have_labels_and_keys_of_their_own():
    assert str(Shape(64, 96)) == "64x96" and str(Shape(64, 96, 2)) == "64x96b2"
    assert str(Shape(64, 96, num_frames=9)) == "9x64x96" and str(Shape(64, 96, 2, 9)) == "9x64x96b2"
    assert Shape(64, 64).as_dict() == {"height": 64, "width": 64, "batch_size": 1}  # image keys unchanged
    assert Shape(64, 64, num_frames=9).as_dict() == {"height": 64, "width": 64, "batch_size": 1, "num_frames": 9}
    with pytest.raises(RecipeError, match="num_frames: 0 is not allowed"):
        recipe(shapes=[{"height": 64, "width": 64, "num_frames": 0}])
    r = recipe(shapes=[{"height": 64, "width": 64, "num_frames": 9}, {"height": 64, "width": 64, "num_frames": 13}])
    assert [str(s) for s in r.shapes] == ["9x64x64", "13x64x64"]


def test_plan_checks_the_warmup_against_the_pipeline_class_without_loading_it(models_dir):
    """model_index.json names the class; its signature is read without weights (diffusers#... users hit
    a misspelt argument only when the job ran, 10 s and a load later)."""
    from aotbuild import plan

    data = {"model": {"id": "builtin:tiny-sd", "dtype": "float32"}, "shapes": [{"height": 64, "width": 64}],
            "warmup": {"num_inference_step": 2}}
    with pytest.raises(RecipeError, match="did you mean 'num_inference_steps'"):
        plan([data], models_dir)
    data["warmup"] = {"num_inference_steps": 2}
    data["shapes"] = [{"height": 64, "width": 64, "num_frames": 9}]
    with pytest.raises(RecipeError, match="StableDiffusionPipeline is not a video pipeline"):
        plan([data], models_dir)


def test_load_compiled_refuses_a_misspelt_warmup_as_a_recipe_error_not_a_miss(models_dir):
    from aotbuild import load_compiled

    data = {"model": {"id": "builtin:tiny-sd", "dtype": "float32"}, "shapes": [{"height": 64, "width": 64}],
            "warmup": {"guidance_scal": 0.0}}
    with pytest.raises(RecipeError, match="warmup.guidance_scal: .*did you mean 'guidance_scale'"):
        load_compiled(data, cache=models_dir, on_miss="error")


@pytest.mark.parametrize("name", ["StableDiffusionPipeline", "StableDiffusionXLPipeline", "FluxPipeline",
                                  "PixArtSigmaPipeline", "WanPipeline", "StableDiffusion3Pipeline"])
def test_plan_reads_a_pipeline_signature_from_its_source_as_the_import_would(name):
    """plan reads __call__'s parameters with ast (importing a pipeline imports torch, transformers and any
    installed quantization backend: seconds per plan); it must say what inspect says."""
    import diffusers

    from aotbuild.pipeline.pipecall import _signature_from_source

    assert _signature_from_source(name) == CallSignature.of(getattr(diffusers, name))


@pytest.mark.parametrize("annotation,refuses", [("int", True), ("float", True), ("List[str]", True),
                                                ("Optional[int]", False), ("int | None", False), ("Any", False),
                                                ("typing.Optional[str]", False), ("'int | None'", False),
                                                ("Union[int, None]", False), ("Union[str, NoneType]", False),
                                                ("not python(", False)])
def test_a_null_is_refused_only_where_the_annotation_admits_no_none(annotation, refuses):
    from aotbuild.pipeline.pipecall import refuses_null

    assert refuses_null(annotation) is refuses


def test_plan_refuses_a_null_the_pipeline_cannot_take_and_passes_one_that_means_its_default(models_dir):
    """Found in review: ``num_inference_steps: null`` passed ``plan`` and failed the job inside the
    pipeline (``set_timesteps(None)``), after a load. A null where the parameter's default is None
    (``negative_prompt``) or its annotation admits None (``output_type: Optional[str] = "pil"``) is the
    pipeline's own value and still passes."""
    from aotbuild import plan

    data = {"model": {"id": "builtin:tiny-sd", "dtype": "float32"}, "shapes": [{"height": 64, "width": 64}]}
    for arg in ("num_inference_steps", "guidance_scale", "eta"):
        with pytest.raises(RecipeError) as info:
            plan([{**data, "warmup": {arg: None}}], models_dir)
        assert info.value.key == f"warmup.{arg}", info.value
        assert "null is not a value StableDiffusionPipeline.__call__ takes" in info.value.message
        assert "leave the key out for the pipeline's default" in info.value.message
    plan([{**data, "warmup": {"negative_prompt": None, "output_type": None, "num_inference_steps": 2}}], models_dir)
    from diffusers import StableDiffusionPipeline

    signature = CallSignature.of(StableDiffusionPipeline)
    assert {"num_inference_steps", "guidance_scale", "eta"} <= set(signature.no_null)
    assert not {"negative_prompt", "output_type", "height", "latents"} & set(signature.no_null)


def test_a_null_the_pipeline_compares_with_none_is_its_own_value_and_passes():
    """An annotation can say less than the code: AceStepPipeline takes ``num_inference_steps: int = ...``
    and handles ``num_inference_steps is None`` itself, so a null there is not refused; SD's file never
    compares it with None, so SD's is."""
    from aotbuild.pipeline.pipecall import _signature_from_source, _unhandled

    assert _unhandled(("a", "b", "c", "d"), "if a is None: pass\nif b is not None: pass\nc == None\nx = d") == ("d",)
    assert _unhandled(("a",), "") == ()  # no source to read: none refused
    ace = _signature_from_source("AceStepPipeline")
    assert ace is not None and "num_inference_steps" in ace.params and "num_inference_steps" not in ace.no_null
    assert "num_inference_steps" in _signature_from_source("StableDiffusionPipeline").no_null
