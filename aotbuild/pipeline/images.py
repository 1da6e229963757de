"""The images a pipeline's call takes: img2img, inpainting, ControlNet, instruct-pix2pix, image-to-video.

A text-to-image warmup needs nothing but a prompt; ``StableDiffusionImg2ImgPipeline`` and its kin fail
without an ``image`` (diffusers: "Input is in incorrect format"), and an image cannot be written in
YAML. For each of :data:`IMAGE_ARGUMENTS` the pipeline's ``__call__`` takes, the warmup passes:

* the recipe's file, where ``warmup.<name>`` names one (a path inside the recipe's repository,
  relative to the recipe's folder), decoded by Pillow and resized to the shape;
* nothing, where ``warmup.<name>`` is null (a pipeline for which the image is optional, run without);
* else, where the pipeline needs one (its ``__call__`` annotates the argument as admitting no None:
  img2img, inpainting, ControlNet, image-to-video), an image made here at the shape's size
  (:func:`synthetic`): the same pixels in every process, so the proof and every load replay what the
  build ran. Where the annotation admits None (Flux Kontext, Flux2, QwenImage-Edit: the image is
  optional and changes what the denoiser sees), none is made: the warmup is what it was before.

The shape owns the size: an img2img pipeline's call takes no ``height``/``width`` (its output is its
input's size), so the image is made (or resized) at the shape's, and a request with an image of that
size is served by the entry built for it. What an image holds never changes what is compiled (static
shapes; the values flow through the graph), so a file's path or content is no key factor, as a
prompt's text is none (aotbuild/recipe/schema.py ``warmup_factors``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aotbuild.constants import IMAGE_ARGUMENTS
from aotbuild.recipe.files import repository
from aotbuild.recipe.frozen import thaw
from aotbuild.recipe.schema import Recipe, describe_value
from aotbuild.utils.text import printable

#: The largest image file a recipe may name, and the most pixels it may decode to (checked from the header,
#: before any pixel is decoded).
MAX_IMAGE_BYTES = 64 << 20
MAX_IMAGE_PIXELS = 64 << 20
#: The formats Pillow may decode a recipe's image as (it sniffs content, not names: an EPS would run
#: Ghostscript; a recipe is data, docs/security.md).
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "BMP")

__all__ = ["check", "for_call", "synthetic"]


def synthetic(name: str, height: int, width: int) -> Any:
    """A deterministic PIL image of ``height`` x ``width``: for ``mask_image`` a white rectangle (the
    middle half of each side) on black, mode L; else an RGB gradient with fixed noise (not flat: a
    ControlNet or an encoder sees structure). The same pixels in every process and on every machine."""
    import numpy as np
    from PIL import Image

    if name == "mask_image":
        mask = np.zeros((height, width), np.uint8)
        mask[height // 4: height - height // 4, width // 4: width - width // 4] = 255
        return Image.fromarray(mask, "L")
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 200 // max(width - 1, 1), y * 200 // max(height - 1, 1),
                     (x + y) * 200 // max(height + width - 2, 1)], axis=-1)
    noise = np.random.default_rng(0).integers(0, 56, size=(height, width, 3))
    return Image.fromarray((base + noise).astype(np.uint8), "RGB")


def check(recipe: Recipe, takes: tuple[str, ...], *, files: bool) -> None:
    """Each image argument the recipe's warmup sets: one the call takes (pipecall.check_recipe checks
    that), a path (text) or null; with ``files`` (``plan`` and a build job, not a replica's load, which
    never runs the warmup), the file is inside the recipe's repository and decodes as an image."""
    for name in IMAGE_ARGUMENTS:
        if name not in recipe.warmup or name not in takes:
            continue
        value = thaw(recipe.warmup[name])
        if value is not None and not isinstance(value, str):
            raise recipe.error(f"warmup.{name}", f"an image file's path (resized to each shape) or null (no "
                                                 f"{name} passed), got {describe_value(value)}")
        if value is not None and files:
            _load(recipe, name, value, 8, 8)  # decoded now: a file Pillow cannot read fails the plan, not a job


def _file(recipe: Recipe, name: str, value: str) -> Path:
    key = f"warmup.{name}"
    if printable(value) != value:  # a NUL, a newline: no file's name
        raise recipe.error(key, f"{value[:200]!r}: a path holds no control characters")
    file = recipe.base / value
    try:  # a name too long, a loop of links: no path
        repo = repository(recipe.base)
        inside, exists = file.resolve().is_relative_to(repo), file.is_file()
    except (OSError, ValueError) as exc:
        raise recipe.error(key, f"{value[:200]}: cannot be used as a path ({getattr(exc, 'strerror', None) or exc})"
                           ) from None
    if not inside:
        raise recipe.error(key, f"{value} is outside the recipe's repository {repo} (a symlink?): refused")
    if not exists:
        raise recipe.error(key, f"no such image file: {file}")
    return file


def _load(recipe: Recipe, name: str, value: str, height: int, width: int) -> Any:
    """The recipe's image file, read bounded (aotbuild.utils.safeio), decoded by Pillow, converted (RGB; a
    mask L) and resized to the shape; a file Pillow cannot read is a recipe error naming it."""
    import io

    from PIL import Image

    from aotbuild.utils import safeio

    file = _file(recipe, name, value)
    try:
        data = safeio.read_bytes(file, MAX_IMAGE_BYTES, within=repository(recipe.base))
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as opened:
            if opened.width * opened.height > MAX_IMAGE_PIXELS:
                raise ValueError(f"{opened.width}x{opened.height} pixels, above {MAX_IMAGE_PIXELS}")
            image = opened.convert("L" if name == "mask_image" else "RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise recipe.error(f"warmup.{name}", f"{file}: not an image Pillow reads as one of "
                                             f"{', '.join(IMAGE_FORMATS)} ({exc})") from None
    return image if image.size == (width, height) else image.resize((width, height), Image.Resampling.LANCZOS)


def for_call(recipe: Recipe, takes: tuple[str, ...], needs: tuple[str, ...], height: int,
             width: int) -> dict[str, Any]:
    """The image arguments of one warmup call at ``height`` x ``width``: the recipe's file, resized; none
    where the recipe says null; else, for those the pipeline ``needs``, :func:`synthetic`. Only arguments
    the call takes."""
    images: dict[str, Any] = {}
    for name in IMAGE_ARGUMENTS:
        if name not in takes:
            continue
        if name not in recipe.warmup:
            if name in needs:
                images[name] = synthetic(name, height, width)
        elif (value := thaw(recipe.warmup[name])) is not None:
            images[name] = _load(recipe, name, value, height, width)
    return images
