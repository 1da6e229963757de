"""``lora``: LoRA adapters that hot-swap without recompiling (diffusers' enable_lora_hotswap).

diffusers (#9279, #9453) can swap one adapter for another of the same target modules and a rank up
to ``target_rank`` without recompiling: ``pipe.enable_lora_hotswap(target_rank=R)`` before the first
adapter pads every adapter's weights to rank R and keeps its scaling a tensor, and
``load_lora_weights(..., hotswap=True)`` then copies another adapter's weights into them. So the
compiled denoiser is specialized on R and the target modules (key factors), never on an adapter's
values. What would recompile (peft silently grows the tensors for a higher rank; other modules add
layers; ``set_adapters`` turns the scaling back into a Python float) is refused before any weight
changes: in the recipe (a recipe error naming ``lora.rank`` or the modules) and, after load, by the
pipe's ``load_lora_weights``, which ``load_compiled`` wraps (:func:`guard`).

Adapters are data from a pull request: a local path must be a ``.safetensors`` file (never a
pickle), regular, whose real path stays inside the repository holding the recipe; its header is read
with bounded work for its modules and rank (no weights are loaded to plan).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aotbuild.errors import UsageError
from aotbuild.features.base import Feature, Where
from aotbuild.recipe.files import repository
from aotbuild.recipe.schema import LoraAdapter, Recipe
from aotbuild.utils import safeio
from aotbuild.utils.text import printable

DEFAULT_WEIGHT_NAME = "pytorch_lora_weights.safetensors"
MAX_HEADER = 64 * 1024 * 1024
#: A safetensors header is {name: {dtype, shape: [...], data_offsets: [...]}, "__metadata__": {...}}.
MAX_HEADER_DEPTH = 8
#: ``<component>.<module path>.lora_A.weight`` (peft) or ``.lora.down.weight`` (older diffusers).
_KEY = re.compile(r"^(?P<component>[A-Za-z_][A-Za-z0-9_]*)\.(?P<module>.+)\.(?:lora_A|lora\.down|lora_down)\.weight$")
#: A module path as torch names it (``down_blocks.0.attentions.1.to_out.0``): it becomes a key factor,
#: so a name with a control character or a space would make every entry built with it unreadable.
_MODULE = re.compile(r"^[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*\Z")
#: What a safetensors dtype looks like (F32, BF16, F8_E4M3, ...); which ones exist is safetensors' check.
_DTYPE = re.compile(r"^[A-Z][A-Z0-9_]{0,15}\Z")
#: The most dimensions a tensor of a LoRA file may have (a conv's weight has 4).
MAX_DIMS = 8
#: Methods of a served pipeline that would recompile or break the hot-swap layout: refused after load.
REFUSED_AFTER_LOAD = ("set_adapters", "fuse_lora", "unfuse_lora", "unload_lora_weights", "delete_adapters",
                      "disable_lora", "enable_lora", "enable_lora_hotswap")

__all__ = ["AdapterFile", "read", "resolve", "factors", "prepare", "guard", "random_adapter", "require"]


def require() -> Any:
    try:
        import peft
    except ImportError:
        raise UsageError("lora needs peft: pip install 'aotbuild[lora]'") from None
    return peft


@dataclass(frozen=True)
class AdapterFile:
    """What an adapter's safetensors header says, per component: module paths and the largest rank."""

    path: Path
    modules: dict[str, set[str]]  # component -> module paths
    rank: int

    def targets(self, component: str) -> set[str]:
        """peft's target_modules names for a component: each path's last name (``to_out.0`` as itself)."""
        return {target_name(m) for m in self.modules.get(component, set())}


def target_name(module_path: str) -> str:
    parts = module_path.split(".")
    return ".".join(parts[-2:]) if len(parts) > 1 and parts[-1].isdigit() else parts[-1]


def read(path: Path) -> AdapterFile:
    """The header of a LoRA .safetensors file (8 bytes of length, then JSON): never its tensors.

    The file is opened once, through aotbuild.utils.safeio (a regular file, without blocking); the header's
    length and JSON depth are checked on the bytes read, then ``safetensors`` itself parses that same
    open file (through ``/proc/self/fd``, never re-opened by its path) and checks that the header's
    offsets cover the file exactly: a truncated file is refused here, when the recipe is planned."""
    try:
        with safeio.open_regular(path) as f:
            head = f.read(8)
            if len(head) < 8:
                raise UsageError(f"{path}: not a safetensors file")
            (length,) = struct.unpack("<Q", head)
            if length > min(MAX_HEADER, os.fstat(f.fileno()).st_size):
                raise UsageError(f"{path}: a safetensors header of {length} bytes: refused")
            header = safeio.loads_json(f.read(length), max_bytes=MAX_HEADER, max_depth=MAX_HEADER_DEPTH)
            if not isinstance(header, dict):
                raise UsageError(f"{path}: not a safetensors file")
            check_header(path, header)
            shapes = _shapes(f.fileno())
    except UsageError:
        raise
    except safeio.TooDeep:
        raise UsageError(f"{path}: a safetensors header nested more than {MAX_HEADER_DEPTH} levels deep: "
                         f"refused") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read its safetensors header: {printable(str(exc))[:200]}") from None
    modules: dict[str, set[str]] = {}
    rank = 0
    for key, shape in shapes.items():
        match = _KEY.match(key)
        if match and not _MODULE.match(match["module"]):
            raise UsageError(f"{printable(path)}: tensor {describe(key)}: its module path is not a torch module's "
                             f"name (letters, digits, _ and dots)")
        if match and shape:
            modules.setdefault(match["component"], set()).add(match["module"])
            rank = max(rank, int(shape[0]))
    if not modules:
        raise UsageError(f"{path}: holds no LoRA weights (no '<component>.<module>.lora_A.weight' tensors)")
    found = AdapterFile(Path(path), modules, rank)
    for component in sorted(modules):
        check_targets(f"{printable(path)}: component {describe(component)}'s module paths", found.targets(component))
    return found


def check_targets(where: str, targets: set[str] | tuple[str, ...]) -> None:
    """A LoRA's target modules (peft's names: a key factor) are bounded in count (AOTBUILD_MAX_LORA_TARGETS),
    whether a pull request's recipe lists them or its adapter file's header names them (issue 32): only
    the header's size bounded them before. ``where``: the file and component, or the recipe key."""
    from aotbuild.constants import LIMITS, limit

    bound, count = limit("lora_targets"), len(targets)
    if count > bound:
        raise UsageError(f"{where}: {count} target modules: at most {bound} (raise it with "
                         f"{LIMITS['lora_targets'][0]})")


def describe(value: Any) -> str:
    """A header's value in a message: its repr (control characters escaped), cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2 ** 63


def check_header(path: Path, header: dict[str, Any]) -> None:
    """Every value of a safetensors header that anything reads, type-checked before use: each tensor a
    mapping whose ``dtype`` is a dtype's name, ``shape`` a list of at most MAX_DIMS sizes, and
    ``data_offsets`` [begin, end] (that they cover the data exactly is safetensors' check);
    ``__metadata__`` a mapping of text to text (what diffusers reads an adapter's alpha and settings
    from). A wrong value is a UsageError naming the
    file and the field (issue 32: a pull request commits this file); safetensors then checks again."""
    def fail(field: str, expected: str, value: Any) -> UsageError:
        return UsageError(f"{printable(path)}: safetensors header field {field}: expected {expected}, got "
                          f"{describe(value)} ({type(value).__name__})")

    for name, info in header.items():
        where = describe(name)
        if name == "__metadata__":
            if not isinstance(info, dict):
                raise fail(where, "a mapping of text to text", info)
            for key, value in info.items():
                if not isinstance(value, str):
                    raise fail(f"__metadata__.{describe(key)}", "text", value)
            continue
        if not isinstance(info, dict):
            raise fail(where, "a mapping with dtype, shape and data_offsets", info)
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or not _DTYPE.match(dtype):
            raise fail(f"{where}.dtype", "a dtype's name (F32, BF16, ...)", dtype)
        if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_natural(n) for n in shape):
            raise fail(f"{where}.shape", f"a list of at most {MAX_DIMS} sizes (integers from 0)", shape)
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(n) for n in offsets)
                and offsets[0] <= offsets[1]):
            raise fail(f"{where}.data_offsets", "[begin, end], integers from 0, begin <= end", offsets)


def _shapes(fd: int) -> dict[str, list[int]]:
    """Tensor name -> shape, as ``safetensors`` reads the open file ``fd`` (its own header checks: data
    offsets in order and covering the file; a ValueError when they do not hold)."""
    from safetensors import safe_open

    proc = f"/proc/self/fd/{fd}"
    try:
        with safe_open(proc if os.path.exists(proc) else f"/dev/fd/{fd}", framework="numpy") as st:
            return {name: list(st.get_slice(name).get_shape()) for name in st.keys()}
    except Exception as exc:  # safetensors' SafetensorError is a bare Exception
        raise ValueError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None


def resolve(recipe: Recipe, adapter: LoraAdapter, key: str = "lora.adapters[0].path") -> Path:
    """The adapter's safetensors file: a local file (or a folder's weight file) inside the recipe's
    repository, else a Hub repo's file (``weight_name``), fetched by huggingface_hub."""
    weight = adapter.weight_name or DEFAULT_WEIGHT_NAME
    if not weight.endswith(".safetensors") or "/" in weight or "\\" in weight or printable(weight) != weight:
        raise recipe.error(key.replace(".path", ".weight_name"), f"{weight!r}: adapters are .safetensors files "
                                                                  f"(never a pickle), named plainly")
    if printable(adapter.path) != adapter.path:  # a NUL, a newline: no file's nor Hub repo's name
        raise recipe.error(key, f"{adapter.path!r}: a path or Hub id holds no control characters")
    try:
        local = recipe.base / adapter.path
        if local.exists() or adapter.path.startswith((".", "/", "~")):
            file = local / weight if local.is_dir() else local
            if not file.name.endswith(".safetensors"):
                raise recipe.error(key, f"{adapter.path}: adapters are .safetensors files (never a pickle)")
            repo = repository(recipe.base)
            if not file.resolve().is_relative_to(repo):
                raise recipe.error(key, f"{adapter.path} is outside the recipe's repository {repo} (a symlink?): "
                                        f"refused")
            if not file.is_file():
                raise recipe.error(key, f"no such adapter file: {file}")
            return file
    except OSError as exc:  # a name too long, a loop of links: the path cannot be a file here
        raise recipe.error(key, f"{adapter.path[:200]}: cannot be used as a path ({exc.strerror or exc})") from None
    from aotbuild.pipeline.hub import repo_id_problem
    from aotbuild.pipeline.models import hub_file

    why = repo_id_problem(adapter.path)
    if why:  # the recipe's fault (exit 2), not the Hub's (issue 53)
        raise recipe.error(key, f"{adapter.path[:100]!r}: no such file, and {why}")
    return hub_file(adapter.path, weight, None)


def targets(recipe: Recipe, component: str) -> tuple[str, ...]:
    """The modules adapters may target: ``lora.target_modules``, else the first adapter's."""
    assert recipe.lora is not None
    if recipe.lora.target_modules is not None:
        return tuple(sorted(recipe.lora.target_modules))
    return tuple(sorted(read(resolve(recipe, recipe.lora.adapters[0])).targets(component)))


def check_recipe(recipe: Recipe, component: str) -> None:
    """Every listed adapter fits ``lora.rank`` and the target modules (read from its header)."""
    assert recipe.lora is not None
    allowed = set(targets(recipe, component))
    for i, adapter in enumerate(recipe.lora.adapters):
        found = read(resolve(recipe, adapter, f"lora.adapters[{i}].path"))
        if found.rank > recipe.lora.rank:
            raise recipe.error("lora.rank", f"adapter {adapter.adapter_name} has rank {found.rank}, above "
                                            f"lora.rank {recipe.lora.rank}: raise lora.rank")
        extra = found.targets(component) - allowed
        if extra:
            raise recipe.error("lora.target_modules", f"adapter {adapter.adapter_name} targets {sorted(extra)}, "
                                                      f"not in {sorted(allowed)}")


def factors(recipe: Recipe, component: str) -> dict[str, Any] | None:
    """The key factor of LoRA hot-swap: the rank and target modules it is compiled for, and the
    adapters' names (their layers are the module's structure); never their weights."""
    if recipe.lora is None:
        return None
    return {"rank": recipe.lora.rank, "target_modules": list(targets(recipe, component)),
            "adapters": [a.adapter_name for a in recipe.lora.adapters]}


def _tuner_layers(module: Any) -> list[Any]:
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


def scale(pipe: Any, recipe: Recipe, adapter: LoraAdapter) -> None:
    """The adapter's weight, applied in place to its scaling tensors: ``set_adapters`` would make them
    Python floats, which Dynamo specializes on (a recompile per value)."""
    if adapter.scale == 1.0:
        return
    for component in recipe.compile.components:
        for layer in _tuner_layers(getattr(pipe, component)):
            value = layer.scaling.get(adapter.adapter_name)
            if hasattr(value, "mul_"):
                value.mul_(adapter.scale)


def prepare(pipe: Any, recipe: Recipe) -> None:
    """Hot-swap ready: ``enable_lora_hotswap(target_rank)``, then each adapter loaded and scaled."""
    if recipe.lora is None:
        return
    require()
    pipe.enable_lora_hotswap(target_rank=recipe.lora.rank)
    for i, adapter in enumerate(recipe.lora.adapters):
        file = resolve(recipe, adapter, f"lora.adapters[{i}].path")
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, adapter_name=adapter.adapter_name,
                               use_safetensors=True)
        scale(pipe, recipe, adapter)


def guard(pipe: Any, recipe: Recipe) -> None:
    """After load: the pipe's ``load_lora_weights`` checks an adapter before it swaps (rank, modules,
    ``hotswap=True``, a served adapter's name), re-applies the recipe's scale after; what would
    recompile is refused with the reason."""
    if recipe.lora is None or getattr(pipe, "_aotbuild_lora_guard", False):
        return
    lora = recipe.lora
    names = {a.adapter_name: a for a in lora.adapters}
    allowed = {c: set(targets(recipe, c)) for c in recipe.compile.components}
    load = pipe.load_lora_weights

    def load_lora_weights(source: Any, adapter_name: str | None = None, hotswap: bool = False, **kwargs: Any) -> Any:
        if not hotswap:
            raise UsageError("this pipeline is compiled for hot-swapped adapters: call load_lora_weights(..., "
                             f"adapter_name=<one of {sorted(names)}>, hotswap=True); a new adapter would recompile")
        if adapter_name not in names:
            raise UsageError(f"adapter_name={adapter_name!r}: hot-swap replaces one of {sorted(names)}")
        if isinstance(source, (str, os.PathLike)):
            base = Path(source)
            weight = kwargs.get("weight_name") or DEFAULT_WEIGHT_NAME
            if not isinstance(weight, str):
                raise UsageError(f"weight_name={describe(weight)}: expected a file name")
            file = base / weight if base.is_dir() else base
            if file.exists():
                found = read(file)
                if found.rank > lora.rank:
                    raise UsageError(f"{file} has rank {found.rank}, above the lora.rank {lora.rank} this pipeline "
                                     f"was compiled for: nothing was swapped (peft would grow the weights and "
                                     f"recompile)")
                for component, ok in allowed.items():
                    extra = found.targets(component) - ok
                    if extra:
                        raise UsageError(f"{file} targets {sorted(extra)} of {component}, not in the modules this "
                                         f"pipeline was compiled for ({sorted(ok)}): nothing was swapped")
        out = load(source, adapter_name=adapter_name, hotswap=True, **kwargs)
        scale(pipe, recipe, names[adapter_name])
        return out

    pipe.load_lora_weights = load_lora_weights
    for method in REFUSED_AFTER_LOAD:
        if hasattr(pipe, method):
            setattr(pipe, method, _refused(method))
    pipe._aotbuild_lora_guard = True


def _refused(method: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise UsageError(f"{method}() on a pipeline served with hot-swapped adapters would recompile (or change "
                         f"what was compiled): the adapters' scales are fixed at load (lora.adapters[].scale); "
                         f"swap adapters with load_lora_weights(..., hotswap=True)")

    return refuse


def random_adapter(pipe: Any, recipe: Recipe, component: str, folder: Path, seed: int = 0) -> Path:
    """A LoRA file of rank max(1, lora.rank // 2) for the component's adapted modules, random weights
    (the proof swaps it in: another adapter must serve with 0 compiles too)."""
    import torch
    from safetensors.torch import save_file

    assert recipe.lora is not None
    rank = max(1, recipe.lora.rank // 2)
    generator = torch.Generator("cpu").manual_seed(seed)
    module = getattr(pipe, component)
    tensors = {}
    for name, layer in module.named_modules():
        base = getattr(layer, "base_layer", None)
        if base is None or not hasattr(layer, "lora_A"):
            continue
        weight = base.weight
        out_f, in_f = weight.shape[0], weight.shape[1]
        tail = tuple(weight.shape[2:])
        a = torch.randn((rank, in_f, *tail), generator=generator) * 0.1
        b = torch.randn((out_f, rank, *((1,) * len(tail))), generator=generator) * 0.1
        tensors[f"{component}.{name}.lora_A.weight"] = a.to(weight.dtype).contiguous()
        tensors[f"{component}.{name}.lora_B.weight"] = b.to(weight.dtype).contiguous()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / DEFAULT_WEIGHT_NAME
    save_file(tensors, str(path))  # no alpha in its metadata: diffusers takes alpha = rank, a scaling of 1
    return path


class Lora(Feature):
    """``lora``: adapters loaded for hot-swap at build and load, keyed by rank and target modules,
    guarded after load, and proven with a second adapter swapped in."""

    section = "lora"

    def check_recipe(self, recipe: Recipe, model: Any, pipeline_class: str) -> None:
        for component in recipe.compile.components:  # each adapter's header against lora.rank and the modules
            check_recipe(recipe, component)

    def factors(self, recipe: Recipe, where: Where) -> dict[str, Any] | None:
        return factors(recipe, where.component)

    def prepare(self, pipe: Any, recipe: Recipe) -> None:
        prepare(pipe, recipe)

    def after_load(self, pipe: Any, recipe: Recipe) -> None:
        guard(pipe, recipe)  # a hot-swap is checked before it changes a weight

    def changes_modules(self, recipe: Recipe, component: str) -> bool:
        return True  # peft's layers in every compiled component

    def reference(self, pipe: Any, recipe: Recipe, component: str, calls: list[tuple[Any, Any, list[Any]]],
                  folder: Path) -> tuple[Path, list[tuple[Any, Any, list[Any]]]]:
        """A random adapter of rank max(1, lora.rank // 2) swapped into the eager pipeline, the recorded
        calls' eager outputs with it, then the recipe's adapter swapped back: (its file, those calls)."""
        import torch
        from torch.utils._pytree import tree_leaves

        assert recipe.lora is not None
        adapter = recipe.lora.adapters[0]
        module = getattr(pipe, component)
        swapped = random_adapter(pipe, recipe, component, folder, seed=1)
        pipe.load_lora_weights(str(swapped.parent), weight_name=swapped.name, adapter_name=adapter.adapter_name,
                               hotswap=True)
        scale(pipe, recipe, adapter)  # as the served pipe's guard does after a swap
        with torch.no_grad():
            outputs = [(args, kwargs, [t.detach().clone() for t in tree_leaves(module(*args, **kwargs))
                                       if isinstance(t, torch.Tensor)]) for args, kwargs, _ in calls]
        own = resolve(recipe, adapter)
        pipe.load_lora_weights(str(own.parent), weight_name=own.name, adapter_name=adapter.adapter_name, hotswap=True)
        scale(pipe, recipe, adapter)
        return swapped, outputs
