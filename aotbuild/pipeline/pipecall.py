"""How a pipeline is called: the warmup call built from the pipeline's own ``__call__`` signature.

diffusers pipelines differ in what they take: an image pipeline takes ``num_images_per_prompt``, a
video pipeline ``num_videos_per_prompt`` and ``num_frames``; most current pipelines take no
``**kwargs`` (an argument they do not know is a TypeError), and those that do ignore a misspelt one
(the warmup would then run, say, 50 steps and the key would hold the typo). So the call is built
from ``inspect.signature(type(pipe).__call__)``: the shape's per-prompt count goes to whichever
count argument the pipeline takes, ``num_frames`` only to a video pipeline, and nothing is passed
that the pipeline does not name. :func:`check_recipe` refuses, as recipe errors, what the pipeline
cannot take; ``plan`` runs it with the class named in ``model_index.json`` (no weights loaded), and
every job, proof and ``load_compiled`` with the loaded pipeline's class.

How the pipeline applies guidance (one call at twice the batch, two calls, an input of the
transformer) is its own business: what the component is called with is recorded at build, and the
proof and the runtime dispatch on exactly that (aotbuild/dispatch.py).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

from aotbuild.constants import DEFAULT_WARMUP_PROMPT, IMAGE_ARGUMENTS
from aotbuild.recipe.frozen import thaw
from aotbuild.recipe.schema import Recipe, Shape, describe_value
from aotbuild.utils.suggest import suggest

#: The per-prompt count arguments, in the order they are looked for.
COUNT_ARGUMENTS = ("num_images_per_prompt", "num_videos_per_prompt")

__all__ = ["CallSignature", "COUNT_ARGUMENTS", "check_recipe", "pipeline_class", "warmup_kwargs"]


@dataclass(frozen=True)
class CallSignature:
    """What a pipeline's ``__call__`` takes."""

    pipeline: str
    params: tuple[str, ...]  # named parameters (self, *args and **kwargs left out)
    takes_kwargs: bool
    #: the parameters annotated as tensors only (:func:`takes_only_tensors`): latents, prompt_embeds, ...
    tensors: tuple[str, ...] = ()
    #: the parameters a null cannot be given (:func:`refuses_null`, and the pipeline's file never compares
    #: them with None): num_inference_steps, guidance_scale, ...
    no_null: tuple[str, ...] = ()
    #: the image arguments (``constants.IMAGE_ARGUMENTS``) annotated as admitting no None: the pipeline needs
    #: one (img2img, inpainting, ControlNet), so a warmup that names none gets one made (pipeline/images.py);
    #: one that admits None (Flux Kontext, Flux2, QwenImage-Edit) is passed only where the recipe names a file
    needs_image: tuple[str, ...] = ()

    @classmethod
    def of(cls, pipeline: Any) -> CallSignature:
        """The signature of a pipeline instance's or class's ``__call__``."""
        klass = pipeline if isinstance(pipeline, type) else type(pipeline)
        parameters = inspect.signature(klass.__call__).parameters
        named = tuple(n for n, p in parameters.items()
                      if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
        tensors = tuple(n for n in named if parameters[n].annotation is not parameters[n].empty
                        and takes_only_tensors(_annotation_text(parameters[n].annotation)))
        no_null = tuple(n for n in named if parameters[n].annotation is not parameters[n].empty
                        and parameters[n].default is not parameters[n].empty and parameters[n].default is not None
                        and refuses_null(_annotation_text(parameters[n].annotation)))
        needs_image = tuple(n for n in IMAGE_ARGUMENTS if n in named
                            and parameters[n].annotation is not parameters[n].empty
                            and refuses_null(_annotation_text(parameters[n].annotation)))
        no_null = _unhandled(no_null, _module_text(klass.__call__))
        return cls(klass.__name__, named, any(p.kind is p.VAR_KEYWORD for p in parameters.values()), tensors,
                   no_null, needs_image)

    @property
    def count_argument(self) -> str | None:
        """``num_images_per_prompt`` or ``num_videos_per_prompt``, whichever it takes, or None."""
        return next((a for a in COUNT_ARGUMENTS if a in self.params), None)

    @property
    def is_video(self) -> bool:
        return "num_frames" in self.params

    def takes(self, name: str) -> bool:
        return name in self.params


def signature_of(name: str) -> CallSignature | None:
    """The ``__call__`` signature of diffusers' pipeline class ``name`` for ``plan``: read from its
    source with ``ast`` when the class defines ``__call__`` itself (no import: importing a pipeline
    imports torch, transformers and whatever quantization backends are installed, seconds per plan),
    else from the imported class; None when diffusers has no such class."""
    found = _signature_from_source(name)
    if found is not None:
        return found
    cls = pipeline_class(name)
    return CallSignature.of(cls) if cls is not None else None


@functools.lru_cache(maxsize=1)
def _pipeline_files() -> dict[str, str]:
    """class name -> the diffusers source file that defines it (one scan of diffusers/pipelines/)."""
    import importlib.util
    import re
    from pathlib import Path

    spec = importlib.util.find_spec("diffusers")
    if spec is None or not spec.origin:
        return {}
    found: dict[str, str] = {}
    pattern = re.compile(r"^class (\w+)\(", re.M)
    for path in sorted((Path(spec.origin).parent / "pipelines").rglob("pipeline_*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        for match in pattern.finditer(text):
            found.setdefault(match.group(1), str(path))
    return found


def _signature_from_source(name: str) -> CallSignature | None:
    import ast
    from pathlib import Path

    path = _pipeline_files().get(name)
    if path is None:
        return None
    for node in ast.parse(Path(path).read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            call = next((f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and f.name == "__call__"), None)
            if call is None:
                return None  # inherited: the import knows
            a = call.args
            named = [x for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg != "self"]
            tensors = tuple(x.arg for x in named if x.annotation is not None
                            and takes_only_tensors(ast.unparse(x.annotation)))
            positional = [*a.posonlyargs, *a.args]  # defaults: the last ones'; kw_defaults: None where none
            with_default = positional[len(positional) - len(a.defaults):]
            defaults = {**{x.arg: d for x, d in zip(with_default, a.defaults, strict=True)},
                        **{x.arg: d for x, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None}}
            no_null = tuple(x.arg for x in named if x.annotation is not None and x.arg in defaults
                            and not (isinstance(defaults[x.arg], ast.Constant) and defaults[x.arg].value is None)
                            and refuses_null(ast.unparse(x.annotation)))
            no_null = _unhandled(no_null, Path(path).read_text(encoding="utf-8"))
            return CallSignature(name, tuple(x.arg for x in named), a.kwarg is not None, tensors, no_null)
    return None


#: torch's tensor classes, as an annotation names them (``torch.Tensor``, the legacy ``FloatTensor``...).
_TENSOR_CLASSES = frozenset({"Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "LongTensor",
                             "IntTensor", "ShortTensor", "ByteTensor", "CharTensor", "BoolTensor"})
#: Annotations that hold their items' types: a parameter takes tensors only if every item is one.
_HOLDERS = frozenset({"Optional", "Union", "List", "list", "Tuple", "tuple", "Sequence"})


def takes_only_tensors(annotation: str) -> bool:
    """Whether a parameter annotated ``annotation`` (its source text) takes tensors and nothing else
    that a recipe could write: ``torch.Tensor | None``, ``Optional[List[torch.FloatTensor]]`` (``None``
    is the default, not a value to pass). A warmup cannot give such an argument: YAML has no tensor,
    and a null or a list there passed ``plan`` and failed the build (issue 53)."""
    import ast

    def leaves(node: ast.expr) -> list[str]:
        if isinstance(node, ast.Constant) and node.value is None:
            return []
        if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a forward reference
            try:
                return leaves(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return ["?"]
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            return leaves(node.left) + leaves(node.right)
        if isinstance(node, ast.Subscript) and ast.unparse(node.value).rpartition(".")[2] in _HOLDERS:
            items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
            return [leaf for item in items for leaf in leaves(item)]
        if isinstance(node, (ast.Name, ast.Attribute)):
            return [ast.unparse(node).rpartition(".")[2]]
        return ["?"]  # Callable[...], Dict[...], a literal ...: not a tensor

    try:
        found = leaves(ast.parse(annotation, mode="eval").body)
    except SyntaxError:
        return False
    return bool(found) and all(leaf in _TENSOR_CLASSES for leaf in found)


#: Names in an annotation that admit None.
_ADMIT_NONE = frozenset({"Optional", "Any", "NoneType"})


def refuses_null(annotation: str) -> bool:
    """Whether a parameter annotated ``annotation`` (its source text), whose default is not None, takes no
    None: nothing in the annotation admits it (``None``, ``NoneType``, ``Optional``, ``Any``). A ``null``
    in the warmup for ``num_inference_steps: int = 50`` passed ``plan`` and failed the job inside the
    pipeline, a load later; an unreadable annotation admits it (the job will tell)."""
    import ast

    try:
        tree = ast.parse(annotation, mode="eval")
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and (node.value is None or node.value == "None"):
            return False
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and not refuses_null(node.value):
            return False  # a forward reference that admits None
        if isinstance(node, (ast.Name, ast.Attribute)) and ast.unparse(node).rpartition(".")[2] in _ADMIT_NONE:
            return False
    return True


def _unhandled(names: tuple[str, ...], source: str) -> tuple[str, ...]:
    """Of ``names``, those the pipeline's source file never compares with None: a pipeline that writes
    ``audio_duration is None`` handles a None its annotation does not admit (AceStepPipeline), so a null
    there is its own value, not a mistake. No source to read: none is refused (the job will tell)."""
    import re

    if not source:
        return ()
    return tuple(n for n in names if not re.search(rf"\b{re.escape(n)}\s*(?:is\s+(?:not\s+)?|[!=]=\s*)None\b", source))


def _module_text(function: Any) -> str:
    """The source file that defines ``function`` ("" where it cannot be read)."""
    try:
        return inspect.getsource(inspect.getmodule(function))
    except (OSError, TypeError):
        return ""


def _annotation_text(annotation: Any) -> str:
    """An imported ``__call__``'s annotation as source text (a string one is already)."""
    return annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)


def pipeline_class(name: str) -> type | None:
    """diffusers' pipeline class of that name (imports diffusers), or None when it has none."""
    import diffusers

    try:
        cls = getattr(diffusers, name, None)
    except Exception:  # noqa: BLE001 - a lazy module that fails to import: plan cannot check, the job will
        return None
    return cls if isinstance(cls, type) else None


def check_recipe(recipe: Recipe, call: CallSignature, *, files: bool = True) -> None:
    """Every recipe setting the pipeline's call must honour, as a recipe error naming the key.
    ``files=False`` (a replica's load, which runs no warmup): the files the warmup reads (an image:
    aotbuild/pipeline/images.py) need not be here."""
    for arg in recipe.warmup:
        if not call.takes(arg):
            raise recipe.error(f"warmup.{arg}", f"not an argument of {call.pipeline}.__call__"
                                                f"{suggest(arg, list(call.params))}")
        if arg in call.tensors:  # any value: null, a list, a string (issue 53)
            got = describe_value(thaw(recipe.warmup[arg]))
            raise recipe.error(f"warmup.{arg}", f"{call.pipeline}.__call__ takes a tensor for {arg}, which a recipe "
                                                f"cannot give (got {got}; a null or a list is no tensor): remove it")
        if recipe.warmup[arg] is None and arg in call.no_null:
            raise recipe.error(f"warmup.{arg}", f"null is not a value {call.pipeline}.__call__ takes for {arg} (its "
                                                f"annotation admits no None): leave the key out for the pipeline's "
                                                f"default, or give a value")
    from aotbuild.pipeline import images  # Pillow and numpy only when a warmup passes an image

    images.check(recipe, call.params, files=files)
    framed = [i for i, s in enumerate(recipe.shapes) if s.num_frames is not None]
    for i, shape in enumerate(recipe.shapes):
        if shape.batch_size > 1 and call.count_argument is None:
            raise recipe.error(f"{recipe.shape_key(i)}.batch_size",
                               f"{call.pipeline} takes neither num_images_per_prompt nor num_videos_per_prompt: one "
                               f"output per prompt (give warmup.prompt a list of prompts for a larger batch)")
        if shape.num_frames is not None and not call.is_video:
            raise recipe.error(f"{recipe.shape_key(i)}.num_frames",
                               f"{call.pipeline} is not a video pipeline (its __call__ takes no num_frames): remove "
                               f"num_frames")
    if framed and "num_frames" in recipe.warmup:
        raise recipe.error("warmup.num_frames", f"{recipe.shape_key(framed[0])} sets num_frames: the shapes own it, "
                                                f"so set it in each shape, not in the warmup")
    if call.is_video and not framed and "num_frames" not in recipe.warmup:  # the pipeline's default frames
        from aotbuild.recipe.rules import check_pixels

        check_pixels(recipe, _default_frames(call.pipeline))


def _default_frames(name: str) -> int | None:
    """The ``num_frames`` diffusers' pipeline ``name`` makes when the call sets none (Wan: 81), else 1;
    None where its default is None: it computes them from the model (CogVideoX, SVD; check_pixels)."""
    cls = pipeline_class(name)
    try:
        default = inspect.signature(cls.__call__).parameters["num_frames"].default if cls is not None else None
    except (KeyError, TypeError, ValueError):
        return 1
    if default is None and cls is not None:
        return None
    return default if isinstance(default, int) and not isinstance(default, bool) and default > 1 else 1


def warmup_kwargs(recipe: Recipe, shape: Shape, pipeline: Any, seed: int = 0,
                  defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    """The pipeline call of one warmup: the recipe's warmup arguments at one shape, for this pipeline.

    ``pipeline``: the pipeline (or its class). ``defaults``: the target's warmup defaults, passed only
    where the pipeline takes them. Latents come from a CPU generator: identical on every device, and
    the only way on Neuron/XLA, which cannot create random tensors on the device."""
    import torch

    call = CallSignature.of(pipeline)
    kwargs = {k: v for k, v in (defaults or {}).items() if call.takes(k)}
    kwargs.update(recipe.warmup_arguments())
    from aotbuild.pipeline import images

    for name in IMAGE_ARGUMENTS:  # a file's path or null: the image itself, or nothing passed
        kwargs.pop(name, None)
    kwargs.update(images.for_call(recipe, call.params, call.needs_image, shape.height, shape.width))
    if call.takes("prompt"):
        kwargs.setdefault("prompt", DEFAULT_WARMUP_PROMPT)
    for name, value in (("height", shape.height), ("width", shape.width), ("num_frames", shape.num_frames),
                        (call.count_argument, shape.batch_size)):
        if name is not None and value is not None and call.takes(name):
            kwargs[name] = value
    if call.takes("generator"):
        kwargs["generator"] = torch.Generator("cpu").manual_seed(seed)
    return kwargs
