"""Recipes as data: the schema, the immutable Recipe, and the checks the data alone allows.

The schema below is the single source of truth: validation walks it, ``docs/recipes.md`` is checked
against it by a test, and every error names the file, the key and what is allowed. Reading files is
aotbuild/recipe/files.py's; the checks that need the registries (targets, strategies) or a model are
aotbuild/recipe/rules.py's (``parse_recipe``), which is what callers use.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from aotbuild.errors import RecipeError
from aotbuild.recipe.frozen import freeze, thaw
from aotbuild.utils.suggest import suggest
from aotbuild.utils.text import printable

SCOPES = ("full", "regional")
OFFLOADS = ("none", "model")
MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
DTYPES = ("float32", "float16", "bfloat16")
MEMORY_FORMATS = ("channels_last",)
#: ``changes.freeu``'s factors (diffusers' enable_freeu arguments).
FREEU_FACTORS = ("s1", "s2", "b1", "b2")
#: Pipeline-call arguments that the shapes own: a warmup may not set them (nor ``num_frames`` where a
#: shape sets it: aotbuild/pipeline/pipecall.py).
SHAPE_OWNED = ("height", "width", "num_images_per_prompt", "num_videos_per_prompt")
#: Pipeline-call arguments a warmup may not set because they cannot be written in YAML or are ours.
WARMUP_FORBIDDEN = SHAPE_OWNED + ("generator", "latents", "callback_on_step_end", "prompt_embeds")
MAX_SIDE = 16384
#: A shape's label (:meth:`Shape.__str__`): [FRAMESx]HEIGHTxWIDTH[bBATCH], ASCII digits only.
_SHAPE_LABEL = re.compile(r"(?:([0-9]+)x)?([0-9]+)x([0-9]+)(?:b([0-9]+))?", re.IGNORECASE)


@dataclass(frozen=True)
class Field:
    """One recipe key: its type, default and allowed values, for validation and the docs."""

    type: str  # "str", "int", "bool", "str?", "list[str]", "mapping", "section", "shapes"
    default: Any = None
    choices: tuple[str, ...] = ()
    doc: str = ""
    required: bool = False
    #: "target" or "strategy": the allowed values are the names in that registry, which the caller
    #: of :func:`parse_structure` supplies (aotbuild/recipe/rules.py: a registry is above recipe data)
    registry: str = ""


SCHEMA: dict[str, dict[str, Field] | Field] = {
    "model": {
        "id": Field("str", required=True, doc="Hub id, local folder, or builtin:NAME (tiny-sd, tiny-sdxl, tiny-sd3, "
                                              "tiny-flux, tiny-pixart-sigma, tiny-wan, tiny-wan22, tiny-qwenimage)"),
        "revision": Field("str?", doc="Hub revision; pin a commit sha for production"),
        "pipeline": Field("str?", doc="diffusers pipeline class; default: model_index.json's"),
        "dtype": Field("str?", choices=DTYPES, doc="default: the target's (float32 inductor, bfloat16 neuron/tpu)"),
        "variant": Field("str?", doc="weights variant, e.g. fp16"),
        "quantization": Field("quantization", None, doc="quantize components after loading (torchao)"),
        "components": Field("mapping", None, doc="components loaded from another repository or folder than model.id: "
                                                 "{controlnet: ID} or {controlnet: {id, revision, subfolder}} "
                                                 "(diffusers models)"),
    },
    "target": Field("str", "inductor", doc="where the compiled code runs", registry="target"),
    "device": Field("str?", doc="default: the target's (inductor: cuda if available, else cpu)"),
    "strategy": Field("str", "auto", registry="strategy",
                      doc="what an entry is and how it is served: a registered strategy (`aotbuild targets` lists "
                          "them, each with what it stores); auto: per job, the first that builds and passes the "
                          "proof"),
    "offload": Field("str", "none", OFFLOADS, "model: enable_model_cpu_offload(); needs scope: regional"),
    "compile": {
        "components": Field("list[str]", ("unet",), doc="pipeline components to compile"),
        "scope": Field("str", "full", SCOPES, "full: torch.compile(module); regional: compile_repeated_blocks"),
        "blocks": Field("list[str]", None, doc="block classes of scope: regional; default: the model's "
                                               "_repeated_blocks"),
        "mode": Field("str", "default", MODES, "torch.compile's mode"),
        "fullgraph": Field("bool", True, doc="torch.compile's fullgraph"),
        "dynamic": Field("bool", False, doc="torch.compile's dynamic; static-shape targets need false"),
        "options": Field("mapping", {}, doc="torch.compile's options (Inductor config patches)"),
    },
    "shapes": Field("shapes", required=True, doc="list of {height, width, batch_size}; batch_size = images per prompt"),
    "pad_batch": Field("bool", False, doc="a call between two built batch sizes of a shape is padded to the next "
                                          "one (each entry's proof says whether padding is exact); not a key factor"),
    "warmup": Field("mapping", {}, doc="keyword arguments of the pipeline call used for warmup"),
    "schedulers": Field("list[str]", None, doc="diffusers scheduler classes served besides the pipeline's own: the "
                                               "warmup runs once with each (Class.from_config(pipe.scheduler.config)); "
                                               "a key factor"),
    "lora": {
        "rank": Field("int", required=True, doc="the largest adapter rank served: enable_lora_hotswap(target_rank)"),
        "target_modules": Field("list[str]", None, doc="the modules adapters may target; default: the first "
                                                       "adapter's"),
        "adapters": Field("adapters", required=True, doc="the adapters loaded at build and by load_compiled"),
    },
    "parallel": {
        "tensor": Field("int", 1, doc="tensor-parallel degree: ranks the compiled components are sharded over "
                                      "(the model's _tp_plan); 1: unsharded"),
    },
    "text_length": {
        "min": Field("int", required=True, doc="the shortest text the compiled components serve, in tokens as the "
                                               "pipeline passes them (at least 2)"),
        "max": Field("int", required=True, doc="the longest text served (at most 65536)"),
    },
    "changes": {
        "freeu": Field("mapping", None, doc="FreeU's factors {s1, s2, b1, b2}: pipe.enable_freeu(...) on the unet"),
        "attention_processor": Field("str?", doc="a diffusers attention processor class: set_attn_processor(Class()) "
                                                 "on each compiled component"),
        "attention_backend": Field("str?", doc="a diffusers attention backend (attention_dispatch's "
                                               "AttentionBackendName): set_attention_backend(name) on each compiled "
                                               "component"),
        "cache": Field("mapping", None, doc="a diffusers cache hook {config: a diffusers.hooks config class, its "
                                            "fields}: enable_cache(...) on each compiled component"),
        "memory_format": Field("str?", choices=MEMORY_FORMATS, doc="the compiled components' weights' memory format: "
                                                                    "component.to(memory_format=torch.channels_last)"),
    },
}
#: The largest tensor-parallel degree a recipe may ask for.
MAX_TENSOR_PARALLEL = 64
#: quant_types calibrated at build on the warmup's calls (PT2E, aotbuild/strategies/calibrate.py): served by
#: strategy aot-package with freezing only, bound to the weights calibrated on.
CALIBRATED_QUANT_TYPES = ("int8static",)
QUANT_SCHEMA = {
    "backend": Field("str", required=True, choices=("torchao",), doc="the quantization library"),
    "quant_type": Field("str", required=True,
                        choices=("int8wo", "int8dq", "int4wo", "float8wo", "float8dq", *CALIBRATED_QUANT_TYPES),
                        doc="torchao's Int8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, "
                            "Int4WeightOnlyConfig, Float8WeightOnlyConfig, Float8DynamicActivationFloat8WeightConfig; "
                            "int8static: PT2E X86InductorQuantizer calibrated on the warmup (convolutions too)"),
    "quant_kwargs": Field("mapping", {}, doc="keyword arguments of the backend's config class"),
    "components": Field("list[str]", None, doc="which components to quantize; default: compile.components"),
}
ADAPTER_SCHEMA = {
    "path": Field("str", required=True, doc="a .safetensors file or a folder holding pytorch_lora_weights.safetensors, "
                                            "relative to the recipe's folder; or a Hub id with weight_name"),
    "adapter_name": Field("str", required=True, doc="the adapter's name (load_lora_weights' adapter_name)"),
    "scale": Field("float", 1.0, doc="the adapter's weight, fixed at load"),
    "weight_name": Field("str?", doc="the file in a folder or Hub repo; default pytorch_lora_weights.safetensors"),
}
SHAPE_SCHEMA = {
    "height": Field("int", required=True, doc="pixels, a positive multiple of 8"),
    "width": Field("int", required=True, doc="pixels, a positive multiple of 8"),
    "batch_size": Field("batches", 1, doc="images (or videos) per prompt: num_images_per_prompt or "
                                          "num_videos_per_prompt; a list makes one job per size (batch buckets)"),
    "num_frames": Field("int", None, doc="video pipelines only: frames per video (Wan: 4k+1)"),
}
MAX_FRAMES = 4096
#: A shape's largest batch_size.
MAX_BATCH = 1024


@dataclass(frozen=True)
class QuantSpec:
    """``model.quantization``: a backend's quantization applied to components after loading."""

    backend: str
    quant_type: str
    quant_kwargs: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    components: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ModelSpec:
    id: str
    revision: str | None = None
    pipeline: str | None = None
    dtype: str | None = None
    variant: str | None = None
    quantization: QuantSpec | None = None
    #: ``model.components``: name -> {"id", optional "revision", "subfolder"} (frozen), each loaded by its
    #: class's ``from_pretrained`` and handed to the pipeline's (aotbuild/pipeline/models.py)
    components: Any = None


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    adapter_name: str
    scale: float = 1.0
    weight_name: str | None = None


@dataclass(frozen=True)
class LoraSpec:
    """``lora``: adapters that hot-swap without recompiling (diffusers' enable_lora_hotswap)."""

    rank: int
    target_modules: tuple[str, ...] | None
    adapters: tuple[LoraAdapter, ...]


@dataclass(frozen=True)
class ParallelSpec:
    """``parallel``: how the compiled components are sharded across ranks (aotbuild/features/parallel.py)."""

    tensor: int = 1


@dataclass(frozen=True)
class TextLength:
    """``text_length``: the range of text lengths served by one build where the component's text
    dimension follows the prompt (aotbuild/pipeline/textlen.py; issue 34)."""

    min: int
    max: int


#: The longest ``text_length.max``: Qwen-Image reads at most 1,024 prompt tokens.
MAX_TEXT_LENGTH = 65536


@dataclass(frozen=True)
class ChangesSpec:
    """``changes``: what users change on a pipeline after from_pretrained, re-created by every load of the
    recipe (aotbuild/pipeline/changes.py). None: not declared (never a key factor)."""

    freeu: Mapping[str, float | int] | None = None
    attention_processor: str | None = None
    attention_backend: str | None = None
    cache: Mapping[str, Any] | None = None
    memory_format: str | None = None


@dataclass(frozen=True)
class CompileSpec:
    components: tuple[str, ...] = ("unet",)
    scope: str = "full"
    blocks: tuple[str, ...] | None = None  # regional: the block classes; None: the model's _repeated_blocks
    mode: str = "default"
    fullgraph: bool = True
    dynamic: bool = False
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, order=True)
class Shape:
    height: int
    width: int
    batch_size: int = 1
    #: video pipelines: frames per video; None (images, or the pipeline's default) keeps it out of keys
    num_frames: int | None = None

    def __str__(self) -> str:
        """The label: ``64x96``, ``64x96b2`` (batch 2), ``9x64x96`` (9 frames), ``9x64x96b2``.

        The batch has its own mark so that three numbers are always frames x height x width: a
        label ``AxBxC`` for both (batch C, or A frames) could not be read back (issue 30)."""
        text = f"{self.height}x{self.width}"
        if self.num_frames is not None:
            text = f"{self.num_frames}x{text}"
        return text if self.batch_size == 1 else f"{text}b{self.batch_size}"

    @classmethod
    def parse(cls, text: str) -> Shape:
        """The shape a label names: the exact inverse of ``str(shape)`` (``x`` and ``b`` in either case).

        Raises ValueError for anything else. Only the label's form is checked here; what a recipe
        allows (multiples of 8, the bounds) is the recipe's check."""
        match = _SHAPE_LABEL.fullmatch(text.strip()) if len(text) <= 80 else None
        if match is None:
            raise ValueError(f"{text!r} is not a shape: expected HEIGHTxWIDTH or FRAMESxHEIGHTxWIDTH, then "
                             "bBATCH for a batch above 1 (e.g. 64x96, 64x96b2, 9x64x96)")
        frames, height, width, batch = (None if g is None else int(g) for g in match.groups())
        if 0 in (frames, height, width, batch):
            raise ValueError(f"{text!r} is not a shape: its sizes are positive")
        return cls(height, width, 1 if batch is None else batch, frames)

    def as_dict(self) -> dict[str, int]:
        """A key factor: ``num_frames`` only where the shape sets it (so image recipes keep their keys)."""
        out = {"height": self.height, "width": self.width, "batch_size": self.batch_size}
        return out if self.num_frames is None else {**out, "num_frames": self.num_frames}


@dataclass(frozen=True)
class Recipe:
    name: str
    source: str
    model: ModelSpec
    target: str
    device: str | None
    strategy: str
    offload: str
    compile: CompileSpec
    shapes: tuple[Shape, ...]
    warmup: Mapping[str, Any]
    lora: LoraSpec | None = None
    #: ``parallel``; None: unsharded (as ``tensor: 1``)
    parallel: ParallelSpec | None = None
    #: ``changes``; None: the pipeline as from_pretrained gives it
    changes: ChangesSpec | None = None
    #: ``text_length``; None: every length is static (the warmup's)
    text_length: TextLength | None = None
    #: ``pad_batch``: a call between two built batch sizes is padded to the next (aotbuild/pipeline/batch.py)
    pad_batch: bool = False
    #: each of ``shapes``' index in the recipe's own list (a ``batch_size`` list makes several): error keys
    shape_sources: tuple[int, ...] = field(default=(), compare=False)
    #: ``schedulers``: scheduler classes the build warms up with besides the pipeline's own
    #: (aotbuild/pipeline/schedulers.py); None: only the pipeline's own
    schedulers: tuple[str, ...] | None = None
    #: The folder a relative ``model.id`` is resolved against; None: the recipe file's folder. A job
    #: or proof process gets it from its parent (it runs elsewhere) instead of re-reading the file.
    folder: str | None = field(default=None, compare=False)
    #: Where the jobs load the pipeline from instead of ``model.id``: a pipeline object passed to
    #: ``aotbuild.build(recipe, pipe=pipe)``, saved for them. Never from a file (Python only), never
    #: in a manifest or a key: the keys come from the components' classes and configs, as for a load.
    pipeline_folder: str | None = field(default=None, compare=False)

    @property
    def base(self) -> Path:
        """Where a relative path in the recipe is resolved: ``folder``, else the file's folder."""
        return Path(self.folder) if self.folder else Path(self.source).parent

    def error(self, key: str | None, message: str) -> RecipeError:
        return RecipeError(self.source, key, message)

    def shape_key(self, i: int) -> str:
        """The recipe's key of ``shapes[i]`` as written (a ``batch_size`` list is one written shape)."""
        return f"shapes[{self.shape_sources[i] if i < len(self.shape_sources) else i}]"

    @property
    def tensor_parallel(self) -> int:
        """The tensor-parallel degree: ranks per job (1: unsharded)."""
        return self.parallel.tensor if self.parallel is not None else 1

    def warmup_arguments(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The warmup call's arguments: the target's defaults, then the recipe's own."""
        return {**dict(defaults or {}), **thaw(self.warmup)}

    def warmup_factors(self, defaults: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Every warmup argument but the prompt text: they shape what components see.

        A prompt's text stays out, its structure goes in: ``prompt: [a cat, a dog]`` runs the
        denoiser at twice the batch of ``prompt: a cat``, so each prompt argument is keyed as
        ``{"texts": N}`` (the default prompt is one text). An image file's path stays out too: the image
        is resized to the shape, and what it holds changes no compiled graph (aotbuild/pipeline/images.py);
        null (no image passed) goes in."""
        from aotbuild.constants import IMAGE_ARGUMENTS, PROMPT_ARGUMENTS

        args = self.warmup_arguments(defaults)
        args.setdefault("prompt", "")
        return {k: ({"texts": prompt_count(args[k])} if k in PROMPT_ARGUMENTS else args[k]) for k in sorted(args)
                if not (k in IMAGE_ARGUMENTS and isinstance(args[k], str))}


def prompt_count(value: Any) -> int:
    """How many texts a prompt argument holds: a list holds one per item, anything else one."""
    return len(value) if isinstance(value, (list, tuple)) else 1


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def describe_value(value: Any) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


class _Checker:
    def __init__(self, source: str, choices: Mapping[str, tuple[str, ...]] | None = None):
        self.source = source
        self.choices = dict(choices or {})  # registry name -> its names (Field.registry)

    def fail(self, key: str | None, message: str) -> RecipeError:
        return RecipeError(self.source, key, message)

    def keys(self, data: Mapping, schema: Mapping[str, Any], prefix: str) -> None:
        for key in data:
            if not isinstance(key, str):
                raise self.fail(prefix or None, f"keys must be text, got {describe_value(key)}")
            if key not in schema:
                allowed = ", ".join(schema)
                raise self.fail(f"{prefix}{key}", f"unknown key{suggest(key, list(schema))} (allowed: {allowed})")
        for key, spec in schema.items():
            if isinstance(spec, Field) and spec.required and data.get(key) is None:
                raise self.fail(f"{prefix}{key}", f"is required ({spec.doc})")

    def value(self, key: str, value: Any, spec: Field) -> Any:
        if value is None:
            if spec.required:
                raise self.fail(key, f"is required ({spec.doc})")
            return spec.default
        kind = spec.type.rstrip("?")
        if kind == "str":
            if not isinstance(value, str) or not value.strip():
                raise self.fail(key, f"expected a non-empty string, got {describe_value(value)}")
            choices = self.choices.get(spec.registry, ()) if spec.registry else spec.choices
            if choices and value not in choices:
                raise self.fail(key, f"{value!r} is not allowed{suggest(value, choices)} "
                                     f"(allowed: {', '.join(choices)})")
            return value
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise self.fail(key, f"expected a finite number, got {describe_value(value)}")
            return float(value)
        if kind == "quantization":
            if not isinstance(value, dict):
                raise self.fail(key, f"expected a mapping with keys {', '.join(QUANT_SCHEMA)}, got "
                                     f"{describe_value(value)}")
            self.keys(value, QUANT_SCHEMA, f"{key}.")
            return QuantSpec(**{k: self.value(f"{key}.{k}", value.get(k), s) for k, s in QUANT_SCHEMA.items()})
        if kind == "adapters":
            if not isinstance(value, list) or not value:
                raise self.fail(key, "expected a non-empty list of {path, adapter_name, scale} mappings")
            out = []
            for i, item in enumerate(value):
                where = f"{key}[{i}]"
                if not isinstance(item, dict):
                    raise self.fail(where, f"expected a mapping with path and adapter_name, got {describe_value(item)}")
                self.keys(item, ADAPTER_SCHEMA, f"{where}.")
                out.append(LoraAdapter(**{k: self.value(f"{where}.{k}", item.get(k), s)
                                          for k, s in ADAPTER_SCHEMA.items()}))
            if len({a.adapter_name for a in out}) != len(out):
                raise self.fail(key, "names an adapter twice")
            return tuple(out)
        if kind == "bool":
            if not isinstance(value, bool):
                raise self.fail(key, f"expected true or false, got {describe_value(value)}")
            return value
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.fail(key, f"expected an integer, got {describe_value(value)}")
            return value
        if kind == "batches":
            return self.batches(key, value)
        if kind == "list[str]":
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
                raise self.fail(key, f"expected a non-empty list of names, got {describe_value(value)}")
            if len(set(value)) != len(value):
                raise self.fail(key, "lists a name twice")
            return tuple(value)
        if kind == "mapping":
            if not isinstance(value, dict):
                raise self.fail(key, f"expected a mapping, got {describe_value(value)}")
            self.json_value(key, value)
            return freeze(value)
        raise AssertionError(kind)  # pragma: no cover

    def json_value(self, key: str, value: Any) -> None:
        """Plain JSON data only: keys are text, floats are finite (they go into the cache key)."""
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise self.fail(key, f"keys must be text, got {describe_value(k)}")
                self.json_value(f"{key}.{k}", v)
        elif isinstance(value, list):
            for i, v in enumerate(value):
                self.json_value(f"{key}[{i}]", v)
        elif isinstance(value, float) and not math.isfinite(value):
            raise self.fail(key, f"must be a finite number, got {value!r}")
        elif not (value is None or isinstance(value, (str, int, float, bool))):
            raise self.fail(key, f"expected plain YAML data, got {describe_value(value)}")

    def batches(self, key: str, value: Any) -> tuple[int, ...]:
        """A shape's ``batch_size``: one size, or a list of them (batch buckets, issue 56: one job per size)."""
        listed = isinstance(value, list)
        if listed and not value:
            raise self.fail(key, "expected a batch size or a non-empty list of them (e.g. [1, 4])")
        sizes = value if listed else [value]
        for j, size in enumerate(sizes):
            where = f"{key}[{j}]" if listed else key
            if isinstance(size, bool) or not isinstance(size, int):
                raise self.fail(where, f"expected an integer, got {describe_value(size)}")
            if not 1 <= size <= MAX_BATCH:
                raise self.fail(where, f"{size} is not allowed: 1 to {MAX_BATCH}")
            if size in sizes[:j]:
                raise self.fail(key, f"lists {size} twice")
        return tuple(sizes)

    def section(self, data: Any, name: str) -> dict[str, Any]:
        schema = SCHEMA[name]
        assert isinstance(schema, dict)
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise self.fail(name, f"expected a mapping with keys {', '.join(schema)}, got {describe_value(data)}")
        self.keys(data, schema, f"{name}.")
        return {k: self.value(f"{name}.{k}", data.get(k), spec) for k, spec in schema.items()}

    def shapes(self, data: Any) -> tuple[tuple[Shape, ...], tuple[int, ...]]:
        """The shapes, one per batch size, and each one's index in the recipe's list."""
        if not isinstance(data, list) or not data:
            raise self.fail("shapes", "expected a non-empty list of {height, width, batch_size} mappings")
        shapes: list[Shape] = []
        sources: list[int] = []
        for i, item in enumerate(data):
            key = f"shapes[{i}]"
            if not isinstance(item, dict):
                raise self.fail(key, f"expected a mapping with height, width and batch_size, "
                                     f"got {describe_value(item)}")
            self.keys(item, SHAPE_SCHEMA, f"{key}.")
            values = {k: self.value(f"{key}.{k}", item.get(k), spec) for k, spec in SHAPE_SCHEMA.items()}
            for side in ("height", "width"):
                v = values[side]
                if v <= 0 or v % 8 or v > MAX_SIDE:
                    raise self.fail(f"{key}.{side}", f"{v} is not allowed: sizes must be positive multiples "
                                                     f"of 8, at most {MAX_SIDE}")
            if values["num_frames"] is not None and not 1 <= values["num_frames"] <= MAX_FRAMES:
                raise self.fail(f"{key}.num_frames", f"{values['num_frames']} is not allowed: 1 to {MAX_FRAMES}")
            batches = values["batch_size"]
            for batch in batches if isinstance(batches, tuple) else (batches,):
                shape = Shape(**{**values, "batch_size": batch})
                if shape in shapes:
                    raise self.fail(key, f"duplicates shapes[{sources[shapes.index(shape)]}] ({shape})")
                shapes.append(shape)
                sources.append(i)
        return tuple(shapes), tuple(sources)


#: The source of a recipe given as data (a dict), not read from a file.
DATA_SOURCE = "<recipe>"


def parse_structure(data: Any, source: str = DATA_SOURCE, name: str | None = None, *, folder: str | None = None,
                    choices: Mapping[str, tuple[str, ...]] | None = None) -> Recipe:
    """Recipe data (a YAML file's structure, e.g. a plain dict) checked key by key into a
    :class:`Recipe`: known keys, types, allowed values (``choices``: the names of each registry a
    field takes its values from), sizes. Rules that span keys and the checks against the targets and
    strategies are :func:`aotbuild.recipe.rules.parse_recipe`'s, which callers use.

    ``name`` defaults to the file's stem, or for data without a file to ``recipe-<12 hex>``, derived
    from the content (the same data always gets the same name). ``folder``: where a relative
    ``model.id`` folder is resolved (default: the file's folder; for data, the working directory)."""
    check = _Checker(source, choices)
    if not isinstance(data, dict):
        raise check.fail(None, f"expected a mapping of recipe keys at the top level, got {describe_value(data)}")
    check.keys(data, SCHEMA, "")
    top = {k: check.value(k, data.get(k), spec) for k, spec in SCHEMA.items() if isinstance(spec, Field)
           and spec.type != "shapes"}
    sections = {name: how.make(check, name, data.get(name)) for name, how in SECTIONS.items()}
    shapes, sources = check.shapes(data.get("shapes"))
    warmup = top["warmup"]
    for arg in warmup:
        if arg in WARMUP_FORBIDDEN:
            owner = "shapes" if arg in SHAPE_OWNED else "aotbuild"
            raise check.fail(f"warmup.{arg}", f"cannot be set here: {owner} sets it")
    if not name:  # a file's name is a pull request's: any control character in it is escaped
        name = content_name(data) if source == DATA_SOURCE else printable(Path(source).stem)
    return Recipe(name=name, source=source, folder=folder, target=top["target"], device=top["device"],
                  strategy=top["strategy"], offload=top["offload"], shapes=shapes, warmup=warmup, **sections,
                  pad_batch=top["pad_batch"], shape_sources=sources,
                  schedulers=top["schedulers"])


def _changes(check: _Checker, spec: ChangesSpec) -> ChangesSpec | None:
    """``changes``: FreeU's four finite factors, a cache's ``config`` name, class and backend names. What
    the model and this diffusers allow is checked at plan time (aotbuild/pipeline/changes.py). Empty: None."""
    if spec.freeu is not None:
        missing = [k for k in FREEU_FACTORS if k not in spec.freeu]
        extra = [k for k in spec.freeu if k not in FREEU_FACTORS]
        if missing or extra:
            raise check.fail("changes.freeu", f"takes exactly {', '.join(FREEU_FACTORS)} (enable_freeu's factors); "
                                              + (f"missing {', '.join(missing)}" if missing else
                                                 f"unknown {', '.join(map(printable, extra))}"))
        for k in FREEU_FACTORS:
            v = spec.freeu[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise check.fail(f"changes.freeu.{k}", f"expected a number, got {describe_value(v)}")
        # each number as written: enable_freeu(b1=1) stores the int 1, which the dependency record tells from 1.0
        spec = ChangesSpec(**{**spec.__dict__, "freeu": freeze({k: spec.freeu[k] for k in FREEU_FACTORS})})
    if spec.cache is not None:
        name = spec.cache.get("config")
        if not isinstance(name, str) or not name.isidentifier():
            raise check.fail("changes.cache", "names its diffusers config class in config: (e.g. {config: "
                                              "FirstBlockCacheConfig, threshold: 0.05})")
    if spec.attention_processor is not None and not spec.attention_processor.isidentifier():
        raise check.fail("changes.attention_processor", f"{printable(spec.attention_processor)[:80]!r} is not a class "
                                                        f"name (e.g. AttnProcessor2_0)")
    if spec.attention_backend is not None and not spec.attention_backend.isidentifier():
        raise check.fail("changes.attention_backend", f"{printable(spec.attention_backend)[:80]!r} is not a backend "
                                                      f"name (e.g. _native_math)")
    return None if spec == ChangesSpec() else spec


#: ``model.components``: at most this many; each value's keys.
MAX_SOURCES = 16
SOURCE_KEYS = ("id", "revision", "subfolder")


def _model(check: _Checker, spec: ModelSpec) -> ModelSpec:
    """``model.components``: each key a component name, each value a Hub id or a folder (text) or a mapping
    of :data:`SOURCE_KEYS` holding ``id``; made mappings (frozen). Where each is, and what class its
    config names, is checked at plan time (aotbuild/pipeline/models.py)."""
    sources = spec.components
    if sources is None:
        return spec
    if not sources:
        raise check.fail("model.components", "is empty: name a component and where it comes from "
                                             "({controlnet: lllyasviel/sd-controlnet-canny}), or remove it")
    if len(sources) > MAX_SOURCES:
        raise check.fail("model.components", f"names {len(sources)} components, more than {MAX_SOURCES}")
    normalized = {}
    for name, value in sources.items():
        key = f"model.components.{name}"
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", name):  # no _private name: a keyword of from_pretrained
            raise check.fail("model.components", f"{printable(name)[:80]!r} is not a component name (e.g. "
                                                 f"controlnet, unet)")
        value = thaw(value)
        if isinstance(value, str):
            value = {"id": value}
        if not isinstance(value, dict):
            raise check.fail(key, f"expected a Hub id or a folder, or a mapping with id (and revision, subfolder), "
                                  f"got {describe_value(value)}")
        for k in value:
            if k not in SOURCE_KEYS:
                raise check.fail(f"{key}.{printable(k)[:80]}", f"unknown key (allowed: {', '.join(SOURCE_KEYS)})")
        for k in SOURCE_KEYS:
            v = value.get(k)
            if v is None and k != "id":
                continue
            if v is None:
                raise check.fail(f"{key}.id", "is required: the component's Hub id or folder")
            if not isinstance(v, str) or not v.strip() or len(v) > 300 or not v.isprintable():
                raise check.fail(f"{key}.{k}", f"expected a printable text of at most 300 characters, got "
                                               f"{describe_value(v)}")
        if value["id"].startswith("builtin:"):
            raise check.fail(f"{key}.id", "a built-in model is a whole pipeline: give a component's Hub id or folder")
        sub = value.get("subfolder")
        if sub is not None and (sub.startswith("/") or "\\" in sub
                                or any(part in ("", ".", "..") for part in sub.split("/"))):
            raise check.fail(f"{key}.subfolder", f"{sub!r}: a folder inside the component's repository "
                                                 f"(no '..', not absolute)")
        normalized[name] = value
    return ModelSpec(**{**spec.__dict__, "components": freeze(normalized)})


@dataclass(frozen=True)
class Section:
    """How :func:`parse_structure` makes one section (a mapping) of :data:`SCHEMA`, the same way for
    each: its keys checked against the schema into ``spec``; an absent section is None where
    ``optional`` (else the spec's defaults); a scalar is the ``shorthand`` key's value (``model:
    builtin:tiny-sd``); ``after`` checks what spans the section's keys (it returns the section, or None
    for one that declares nothing)."""

    spec: type
    optional: bool = True
    shorthand: str | None = None
    after: Callable[[_Checker, Any], Any] | None = None

    def make(self, check: _Checker, name: str, data: Any) -> Any:
        if data is None and self.optional:
            return None
        if isinstance(data, str) and self.shorthand:
            data = {self.shorthand: data}
        spec = self.spec(**check.section(data, name))
        return self.after(check, spec) if self.after else spec


#: Every section of :data:`SCHEMA`, by the Recipe field it fills (tests/test_recipe.py holds the two
#: tables to each other and to Recipe's fields).
SECTIONS: dict[str, Section] = {
    "model": Section(ModelSpec, optional=False, shorthand="id", after=_model),
    "compile": Section(CompileSpec, optional=False),
    "lora": Section(LoraSpec),
    "parallel": Section(ParallelSpec),
    "changes": Section(ChangesSpec, after=_changes),
    "text_length": Section(TextLength),
}


def check_structure_rules(recipe: Recipe) -> None:
    """Rules that span keys of the recipe alone (no registry, no model): component names, what
    ``compile.blocks`` and ``offload`` need."""
    for name in recipe.compile.components:
        if not name.isidentifier():  # a folder of the model: never a path ("../../x")
            raise recipe.error("compile.components", f"{name!r} is not a component name (e.g. unet, transformer)")
    if recipe.compile.blocks is not None:
        if recipe.compile.scope != "regional":
            raise recipe.error("compile.blocks", "names the blocks that scope: regional compiles: set compile.scope: "
                                                 "regional, or remove compile.blocks")
        for name in recipe.compile.blocks:
            if not name.isidentifier():
                raise recipe.error("compile.blocks", f"{name!r} is not a class name (e.g. JointTransformerBlock)")
    if recipe.offload == "model" and recipe.compile.scope != "regional":
        raise recipe.error("offload", "model offload needs compile.scope: regional (offload hooks cannot be traced)")
    lora, quant = recipe.lora, recipe.model.quantization
    if lora is not None:
        if lora.rank < 1 or lora.rank > 4096:
            raise recipe.error("lora.rank", f"{lora.rank} is not allowed: 1 to 4096")
        if len(lora.adapters) > 1:
            raise recipe.error("lora.adapters", "lists more than one adapter: hot-swap is verified with one (diffusers "
                                                "0.42 prepares only the first adapter for hot-swap: a second is loaded "
                                                "unpadded, with a float scale, and recompiles); swap adapters at "
                                                "runtime with load_lora_weights(..., hotswap=True)")
        if quant is not None:
            raise recipe.error("lora", "LoRA with model.quantization is not supported yet (not shown to hot-swap "
                                       "without a compile): use one or the other")
    for name, setting in (("lora", lora), ("model.quantization", quant)):
        if setting is not None and recipe.offload != "none":
            raise recipe.error(name, "cannot be combined with offload: model")
    _check_text_length(recipe)
    _check_pad_batch(recipe)
    tensor = recipe.tensor_parallel
    if not 1 <= tensor <= MAX_TENSOR_PARALLEL:
        raise recipe.error("parallel.tensor", f"{tensor} is not allowed: 1 to {MAX_TENSOR_PARALLEL}")
    if tensor > 1:
        # Each refusal until shown to work sharded (docs/recipes.md, "Tensor parallelism").
        for key, setting, why in (
                ("offload", recipe.offload != "none", "model offload cannot be combined with tensor parallelism "
                                                      "(diffusers refuses it too: each rank already holds one shard)"),
                ("lora", lora is not None, "LoRA with tensor parallelism is not supported: _tp_plan shards the base "
                                           "layers only (diffusers refuses adapters on a sharded model)"),
                ("model.quantization", quant is not None, "quantization with tensor parallelism is not supported "
                                                          "yet (not shown to shard)"),
                ("compile.scope", recipe.compile.scope == "regional", "regional scope with tensor parallelism is "
                                                                      "not supported yet: use scope: full")):
            if setting:
                raise recipe.error(key, why)
    if quant is not None and quant.components is not None:
        for component in quant.components:
            if component not in recipe.compile.components:
                raise recipe.error("model.quantization.components", f"{component!r} is not compiled "
                                                                    f"(compile.components: "
                                                                    f"{', '.join(recipe.compile.components)})")


def _check_text_length(recipe: Recipe) -> None:
    text = recipe.text_length
    if text is None:
        return
    if not 2 <= text.min <= text.max <= MAX_TEXT_LENGTH:
        raise recipe.error("text_length", f"{text.min} to {text.max} is not allowed: 2 <= min <= max <= "
                                          f"{MAX_TEXT_LENGTH} (a length of 1 is one the compiler specializes on)")
    if recipe.compile.scope != "full":
        raise recipe.error("text_length", "needs compile.scope: full (a regional build compiles each block on its "
                                          "own inputs, which the range does not reach)")


def _check_pad_batch(recipe: Recipe) -> None:
    """``pad_batch`` pads a component's whole call to a built batch: what it needs (issue 56, item 3)."""
    if not recipe.pad_batch:
        return
    for setting, why in (
            (recipe.compile.scope != "full", "needs compile.scope: full (a regional build's blocks are not padded one "
                                             "by one)"),
            (recipe.text_length is not None, "cannot be combined with text_length yet (a call padded in its batch and "
                                             "ranged in its text length is not proven)"),
            (recipe.tensor_parallel > 1, "cannot be combined with tensor parallelism yet (not proven sharded)")):
        if setting:
            raise recipe.error("pad_batch", why)
    if all(s.batch_size == 1 for s in recipe.shapes):
        raise recipe.error("pad_batch", "pads a call up to a built batch_size above 1, and every shape builds "
                                        "batch_size 1: list the sizes to serve (e.g. batch_size: [1, 4]) or remove "
                                        "pad_batch")


def content_name(data: Any) -> str:
    """``recipe-<12 hex>``: the sha256 of the data's canonical JSON (sorted keys, no spaces)."""
    import hashlib

    text = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=repr)
    return "recipe-" + hashlib.sha256(text.encode()).hexdigest()[:12]


def recipe_spec(recipe: Recipe) -> dict[str, Any]:
    """The recipe as JSON for a child process (a build job, the proof, a bench run): its validated
    data, name and source, and the absolute folder relative paths resolve against (the child runs
    in another directory). The child never re-reads the recipe file: :func:`recipe_from_spec`."""
    data = recipe_to_dict(recipe)
    data.pop("name")
    return {"data": data, "name": recipe.name, "source": recipe.source,
            "folder": str(recipe.base.absolute()),
            **({"pipeline_folder": recipe.pipeline_folder} if recipe.pipeline_folder else {})}


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain JSON data (for manifests and ``--json``)."""
    model = {k: v for k, v in recipe.model.__dict__.items() if k not in ("quantization", "components")}
    if recipe.model.components is not None:  # only when set: a recipe without it reads as before
        model["components"] = thaw(recipe.model.components)
    q = recipe.model.quantization
    if q is not None:  # the optional settings appear only when set (recipes without them read as before)
        model["quantization"] = {"backend": q.backend, "quant_type": q.quant_type, "quant_kwargs": thaw(q.quant_kwargs),
                                 **({"components": list(q.components)} if q.components is not None else {})}
    extra: dict[str, Any] = {}
    if recipe.lora is not None:
        extra["lora"] = {"rank": recipe.lora.rank,
                         **({"target_modules": list(recipe.lora.target_modules)}
                            if recipe.lora.target_modules is not None else {}),
                         "adapters": [{k: v for k, v in a.__dict__.items() if v is not None}
                                      for a in recipe.lora.adapters]}
    if recipe.parallel is not None:
        extra["parallel"] = {"tensor": recipe.parallel.tensor}
    if recipe.text_length is not None:
        extra["text_length"] = {"min": recipe.text_length.min, "max": recipe.text_length.max}
    if recipe.changes is not None:
        extra["changes"] = {k: thaw(v) for k, v in recipe.changes.__dict__.items() if v is not None}
    if recipe.pad_batch:  # only when set: a recipe without it reads as before
        extra["pad_batch"] = True
    if recipe.schedulers is not None:
        extra["schedulers"] = list(recipe.schedulers)
    return json.loads(json.dumps({
        "name": recipe.name, "model": model, "target": recipe.target, "device": recipe.device,
        "strategy": recipe.strategy, "offload": recipe.offload,
        "compile": {**{k: v for k, v in recipe.compile.__dict__.items() if k != "blocks" or v is not None},
                    "components": list(recipe.compile.components),
                    "options": thaw(recipe.compile.options)},
        "shapes": [s.as_dict() for s in recipe.shapes], "warmup": thaw(recipe.warmup), **extra,
    }))
