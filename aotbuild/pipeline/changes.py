"""``changes``: the ways users change a pipeline after ``from_pretrained``, declared so a build re-creates them.

A compiled graph bakes in FreeU's factors, the attention processor it called, the weights' memory
format and a diffusers cache hook (aotbuild/pipeline/dependencies.py records them; a load or a call with
other ones misses). ``save_pretrained`` keeps none of them, so neither a build job loading the model
nor ``aotbuild.build(recipe, pipe=pipe)`` (which saves the pipe for its jobs) could build for such a
pipeline. A recipe's ``changes`` section declares them; each is one :class:`Change`:

=========================  =====================================================  ==================
``changes.freeu``          ``pipe.enable_freeu(s1=, s2=, b1=, b2=)``               the ``unet`` only
``changes.attention_processor``  ``component.set_attn_processor(<class>())``       compiled components
``changes.attention_backend``    ``component.set_attention_backend(<name>)``         compiled components
``changes.cache``          ``component.enable_cache(<config class>(**fields))``    compiled components
``changes.memory_format``  ``component.to(memory_format=torch.channels_last)``     compiled components
=========================  =====================================================  ==================

Each is a key factor of the components it changes, only when declared (a recipe without the section
keeps every key), checked at plan time against the model's classes (:func:`check_recipe`), and
applied by ``models.load_pipeline`` right after ``from_pretrained`` (:func:`apply`): in the build's
jobs, their proofs and ``load_compiled``. :func:`detect` reads the same changes off a live pipeline
(``build(recipe, pipe=pipe)``, and ``load_compiled(recipe, pipe=pipe)`` for a recipe that declares
none): it loads each compiled component again, without weights, by its library's own
``from_pretrained`` (so whatever a release's load sets on a model is on that twin too, at that
release's value: issue 54 item 3), applies the changes it found there, and compares the two
dependency snapshots; whatever still differs (a processor class of the user's, a processor set on
some layers only, an attribute written by hand) cannot be re-created in another process and is
refused with that difference.

What no strategy builds is refused at plan time and by :func:`detect` (:meth:`Change.unbuildable`):
a fused attention processor (it needs ``fuse_qkv_projections``' ``to_qkv``), an attention backend whose
kernel diffusers downloads from the Hub at each load, and, for now, every cache hook (issue 31 items 3
and 6).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from aotbuild.features.base import Feature, Where
from aotbuild.recipe.frozen import freeze, thaw
from aotbuild.recipe.schema import FREEU_FACTORS, ChangesSpec, Recipe
from aotbuild.utils.suggest import suggest
from aotbuild.utils.text import printable

__all__ = ["FREEU_FACTORS", "FREEU_COMPONENT", "Change", "CHANGES", "factors", "same_keys", "check_recipe", "apply",
           "detect", "Detected", "processor_classes", "attention_backends", "active_backend", "cache_config_classes",
           "as_recipe_text"]

#: The component FreeU changes (``DiffusionPipeline.enable_freeu`` calls ``self.unet.enable_freeu``).
FREEU_COMPONENT = "unet"


def processor_classes() -> dict[str, type]:
    """diffusers' attention processor classes, by name: what ``changes.attention_processor`` may name."""
    from diffusers.models import attention_processor

    return {name: cls for name, cls in vars(attention_processor).items()
            if isinstance(cls, type) and "Processor" in name and cls.__module__.startswith("diffusers.")
            and any("__call__" in vars(base) for base in cls.__mro__[:-1]) and not name.startswith("_")}


def attention_backends() -> tuple[str, ...]:
    """diffusers' attention backends (``attention_dispatch.AttentionBackendName``), by value: what
    ``changes.attention_backend`` may name."""
    from diffusers.models.attention_dispatch import AttentionBackendName

    return tuple(b.value for b in AttentionBackendName)


def active_backend() -> str:
    """diffusers' process-wide attention backend (``set_attention_backend`` sets it with each processor's),
    by value: what a processor without its own ``_attention_backend`` dispatches to."""
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    backend = _AttentionBackendRegistry._active_backend
    return str(getattr(backend, "value", backend))


def cache_config_classes() -> dict[str, type]:
    """diffusers' cache hook configs (``diffusers.hooks``), by name: what ``changes.cache.config`` may name."""
    import diffusers.hooks

    return {name: cls for name, cls in vars(diffusers.hooks).items()
            if isinstance(cls, type) and dataclasses.is_dataclass(cls) and name.endswith("Config")
            and ("Cache" in name or "Broadcast" in name)}


# -- the changes, one object each ---------------------------------------------------------------------


@dataclass(frozen=True)
class Change:
    """One declarable change: its recipe key, which components it changes, its key factor, its plan-time
    check, how it is applied to a live pipeline (or a meta module) and how it is read off one."""

    name: str

    @property
    def key(self) -> str:
        return f"changes.{self.name}"

    def value(self, spec: ChangesSpec) -> Any:
        return getattr(spec, self.name)

    def changes(self, component: str) -> bool:
        return True

    def factor(self, value: Any) -> Any:
        return thaw(value)

    def check(self, recipe: Recipe, value: Any, component: str, module_class: type | None) -> None:
        """recipe.error(...) when ``module_class`` (None: not importable here) cannot take the change."""

    def apply(self, module: Any, value: Any, recipe: Recipe | None) -> None:
        raise NotImplementedError

    def read(self, module: Any, component: str) -> tuple[Any, str]:
        """(the declarable value this live module holds, or None; why it cannot be declared, or "")."""
        raise NotImplementedError

    def as_fresh(self, module: Any, fresh: Any) -> bool:
        """Whether ``module`` holds what a fresh load (``fresh``, on the meta device) holds: no change."""
        return False

    def shows(self, module: Any) -> bool:
        """Whether the change, applied, can be read off ``module`` (channels_last on a model without a 4-D
        weight cannot: a text encoder)."""
        return True

    def unbuildable(self, value: Any) -> str:
        """Why no strategy builds ``value`` (refused at plan time and by ``build(recipe, pipe=pipe)``), or ""."""
        return ""


class _FreeU(Change):
    def changes(self, component: str) -> bool:
        return component == FREEU_COMPONENT

    def check(self, recipe: Recipe, value: Any, component: str, module_class: type | None) -> None:
        if component == FREEU_COMPONENT and module_class is not None and not hasattr(module_class, "enable_freeu"):
            raise recipe.error(self.key, f"{component} ({module_class.__name__}) has no enable_freeu: FreeU "
                                         f"changes a UNet's up blocks")

    def apply(self, module: Any, value: Any, recipe: Recipe | None) -> None:
        module.enable_freeu(**{k: value[k] for k in FREEU_FACTORS})  # an int stays one: as a user's call

    def read(self, module: Any, component: str) -> tuple[Any, str]:
        if component != FREEU_COMPONENT:
            return None, ""
        seen = []
        for block in getattr(module, "up_blocks", None) or ():
            values = tuple(getattr(block, k, None) for k in FREEU_FACTORS)
            if any(v is not None for v in values):
                seen.append(values)
        if not seen:
            return None, ""
        first = seen[0]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in first):
            return None, f"{component}.up_blocks: FreeU factors {first} are not finite numbers"
        kept = (int(v) if isinstance(v, int) else float(v) for v in first)  # an int as the user's call stored it
        return freeze(dict(zip(FREEU_FACTORS, kept, strict=True))), ""


#: A fused processor computes from ``to_qkv`` (``fuse_qkv_projections`` makes it), which a processor
#: set alone does not: the build's warmup failed on it (issue 31 item 3).
_FUSED = "Fused"


class _Processor(Change):
    def check(self, recipe: Recipe, value: Any, component: str, module_class: type | None) -> None:
        known = processor_classes()
        if value not in known:
            allowed = sorted(k for k in known if not k.startswith(_FUSED))
            raise recipe.error(self.key, f"{printable(value)!r} is not an attention processor of diffusers"
                                         f"{suggest(value, allowed)} (allowed: {', '.join(allowed)})")
        why = self.unbuildable(value)
        if why:
            raise recipe.error(self.key, why)
        if module_class is not None and not hasattr(module_class, "set_attn_processor"):
            raise recipe.error(self.key, f"{component} ({module_class.__name__}) has no set_attn_processor: it "
                                         f"takes no attention processor")
        try:
            known[value]()
        except Exception as exc:  # noqa: BLE001 - a processor that needs arguments, a library or a GPU
            raise recipe.error(self.key, f"{value} cannot be created without arguments here: "
                                         f"{printable(str(exc))[:160]}") from None

    def apply(self, module: Any, value: Any, recipe: Recipe | None) -> None:
        module.set_attn_processor(processor_classes()[value]())

    def unbuildable(self, value: Any) -> str:
        if not str(value).startswith(_FUSED):
            return ""
        return (f"{value} reads the fused projections fuse_qkv_projections() makes (to_qkv), which change the "
                f"module's structure: no build re-creates them (a pipe with them misses, named). Declare the "
                f"unfused processor ({str(value)[len(_FUSED):]}), or serve fused projections eagerly "
                f"(on_miss=\"eager\")")

    def as_fresh(self, module: Any, fresh: Any) -> bool:
        def classes(m: Any) -> dict[str, type]:
            return {k: type(p) for k, p in (getattr(m, "attn_processors", None) or {}).items()}
        return classes(module) == classes(fresh)

    def read(self, module: Any, component: str) -> tuple[Any, str]:
        processors = getattr(module, "attn_processors", None)
        if not isinstance(processors, Mapping) or not processors:
            return None, ""
        classes = {type(p) for p in processors.values()}
        if len(classes) > 1:  # the caller's comparison says whether the meta module's defaults differ too
            return None, ""
        cls = classes.pop()
        known = processor_classes()
        if known.get(cls.__name__) is cls:
            return cls.__name__, ""
        where = ("defined in __main__ (a script or notebook)" if cls.__module__ == "__main__"
                 else f"{cls.__module__}.{cls.__qualname__}, not one of diffusers' attention processors")
        return None, (f"{component}'s attention processor {cls.__qualname__} is {where}: the build's processes "
                      f"cannot re-create it (changes.attention_processor names one of "
                      f"diffusers.models.attention_processor's classes)")


#: diffusers' default backend: a processor whose ``_attention_backend`` is None dispatches to the active
#: one, which is this unless ``set_attention_backend`` set another.
_DEFAULT_BACKEND = "native"


class _Backend(Change):
    """``set_attention_backend(name)``: writes ``_attention_backend`` on each processor object that has one
    (diffusers' dispatching processors: Flux's, Wan's, QwenImage's; a UNet's AttnProcessor2_0 has none)
    and sets diffusers' process-wide active backend, which the per-call state holds
    (dependencies.numeric_flags): a declared backend is in the build's record both ways."""

    def check(self, recipe: Recipe, value: Any, component: str, module_class: type | None) -> None:
        known = attention_backends()
        if value not in known:
            allowed = sorted(k for k in known if not self.unbuildable(k))
            raise recipe.error(self.key, f"{printable(value)!r} is not an attention backend of diffusers"
                                         f"{suggest(value, allowed)} (allowed: {', '.join(allowed)})")
        why = self.unbuildable(value)
        if why:
            raise recipe.error(self.key, why)
        if module_class is not None and not hasattr(module_class, "set_attention_backend"):
            raise recipe.error(self.key, f"{component} ({module_class.__name__}) has no set_attention_backend: it is "
                                         f"not a diffusers model")
        from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

        try:  # a backend whose library is not installed here (flash-attn, sageattention, xformers)
            _check_attention_backend_requirements(AttentionBackendName(value))
        except (RuntimeError, ImportError) as exc:
            raise recipe.error(self.key, f"{value} cannot run here: {printable(str(exc))[:160]}") from None

    def apply(self, module: Any, value: Any, recipe: Recipe | None) -> None:
        module.set_attention_backend(value)

    def unbuildable(self, value: Any) -> str:
        if not str(value).endswith("_hub"):
            return ""
        return (f"{value} has diffusers download its kernel from the Hugging Face Hub (the kernels package) at each "
                f"load: a load of an entry never reaches the network (docs/runtime.md, \"cache and remote\"). "
                f"Declare a backend of an installed library (native, _native_math, flash, sage, xformers, ...)")

    def read(self, module: Any, component: str) -> tuple[Any, str]:
        if not hasattr(module, "set_attention_backend"):
            return None, ""
        own = {str(getattr(b, "value", b)) for b in _processor_backends(module)}
        if len(own) > 1:  # some processors only: the caller's snapshot comparison names the difference
            return None, ""
        if own:
            return own.pop(), ""
        # no processor holds its own: what they dispatch to is the active backend (a UNet's processors read
        # none, but the per-call state refuses a call under another one: declared, the build records it)
        active = active_backend()
        return (None if active == _DEFAULT_BACKEND else active), ""

    def shows(self, module: Any) -> bool:
        return hasattr(module, "set_attention_backend")


def _processor_backends(module: Any) -> list[Any]:
    """The ``_attention_backend`` each processor of ``module`` holds (None left out)."""
    out = []
    for sub in module.modules():
        processor = getattr(sub, "processor", None)
        backend = getattr(processor, "_attention_backend", None) if processor is not None else None
        if backend is not None:
            out.append(backend)
    return out


class _Cache(Change):
    def factor(self, value: Any) -> Any:
        return {"config": value["config"], **_cache_fields(value)}

    def check(self, recipe: Recipe, value: Any, component: str, module_class: type | None) -> None:
        known = cache_config_classes()
        name = value["config"]
        if name not in known:
            raise recipe.error(f"{self.key}.config", f"{printable(name)!r} is not a cache config of diffusers"
                                                     f"{suggest(name, list(known))} (allowed: "
                                                     f"{', '.join(sorted(known))})")
        fields = {f.name: f for f in dataclasses.fields(known[name]) if f.init}
        for field_name in value:
            if field_name != "config" and field_name not in fields:
                raise recipe.error(f"{self.key}.{field_name}", f"{name} has no field {printable(field_name)!r}"
                                                               f"{suggest(field_name, list(fields))} (fields: "
                                                               f"{', '.join(fields)})")
        try:
            known[name](**{k: v for k, v in thaw(value).items() if k != "config"})
        except Exception as exc:  # noqa: BLE001 - a required field missing, a value of the wrong kind
            raise recipe.error(self.key, f"{name}({', '.join(k for k in value if k != 'config')}) is refused: "
                                         f"{printable(str(exc))[:160]}") from None
        if module_class is not None and not hasattr(module_class, "enable_cache"):
            raise recipe.error(self.key, f"{component} ({module_class.__name__}) has no enable_cache: diffusers' "
                                         f"cache hooks are for its transformer models")
        raise recipe.error(self.key, self.unbuildable(value))

    def unbuildable(self, value: Any) -> str:
        # Tried on tiny-flux with FirstBlockCacheConfig (issue 31 item 6): jit-cache cannot capture the
        # hooked transformer whole (Dynamo skips the hook's torch.compiler.disable()d code), aot-package's
        # export calls it outside the pipeline's cache_context ("No cache context is set"). Under regional
        # scope the hooks sit on the compiled blocks themselves, where the dispatcher would replace the
        # hook's forward: not served either.
        config = value.get("config", "a cache config") if isinstance(value, Mapping) else "a cache config"
        return (f"{printable(str(config))}: no strategy builds a diffusers cache hook (jit-cache cannot capture the "
                f"hooked transformer whole; aot-package and aot-compile trace it outside the pipeline's "
                f"cache_context; regional blocks carry the hooks themselves). What works: the cache hook with "
                f"this component eager (load_compiled(..., on_miss=\"eager\")), or the component compiled "
                f"without the hook")

    def apply(self, module: Any, value: Any, recipe: Recipe | None) -> None:
        config = cache_config_classes()[value["config"]]
        module.enable_cache(config(**{k: v for k, v in thaw(value).items() if k != "config"}))

    def read(self, module: Any, component: str) -> tuple[Any, str]:
        config = getattr(module, "_cache_config", None)
        if config is None:
            return None, ""
        cls = type(config)
        if cache_config_classes().get(cls.__name__) is not cls:
            return None, f"{component}'s cache config {cls.__qualname__} is not one of diffusers' cache configs"
        out: dict[str, Any] = {"config": cls.__name__}
        for f in dataclasses.fields(config):
            if not f.init:
                continue
            value, default = getattr(config, f.name), _default(f)
            if default is not _NO_DEFAULT and _same(value, default):
                continue
            plain = _plain(value)
            if plain is _NOT_PLAIN:
                return None, (f"{component}'s {cls.__name__}.{f.name} is {type(value).__name__}, not data a recipe "
                              f"can hold: the build's processes cannot re-create it")
            out[f.name] = plain
        return freeze(out), ""


class _MemoryFormat(Change):
    def apply(self, module: Any, value: Any, recipe: Recipe | None) -> None:
        import torch

        module.to(memory_format=getattr(torch, value))

    def read(self, module: Any, component: str) -> tuple[Any, str]:
        import torch

        for p in _eligible(module):
            try:
                if p.is_contiguous(memory_format=torch.channels_last) and not p.is_contiguous():
                    return "channels_last", ""
            except (RuntimeError, NotImplementedError, TypeError):  # a tensor subclass without strides
                continue  # (a quantized or sharded weight): the snapshot comparison still sees it
        return None, ""

    def shows(self, module: Any) -> bool:
        return next(_eligible(module), None) is not None


def _eligible(module: Any) -> Any:
    """The weights channels_last changes the strides of: 4-D, more than one channel and one pixel."""
    for p in module.parameters():
        try:
            if p.dim() == 4 and p.shape[1] > 1 and p.shape[2] * p.shape[3] > 1:
                yield p
        except (RuntimeError, NotImplementedError, TypeError):
            continue


#: In the order :func:`apply` applies them (a processor before its backend, which set_attn_processor's new
#: objects would not hold, and before the cache hooks that wrap the blocks; the memory format last: it moves
#: the weights).
CHANGES: tuple[Change, ...] = (_FreeU("freeu"), _Processor("attention_processor"), _Backend("attention_backend"),
                               _Cache("cache"), _MemoryFormat("memory_format"))

_NO_DEFAULT = object()
_NOT_PLAIN = object()


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return _NO_DEFAULT


def _same(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b) or (isinstance(a, (tuple, list)) and list(a) == list(b))
    except Exception:  # noqa: BLE001 - a value without a plain ==
        return False


def _plain(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else _NOT_PLAIN
    if isinstance(value, (list, tuple)):
        items = [_plain(v) for v in value]
        return _NOT_PLAIN if any(v is _NOT_PLAIN for v in items) else items
    return _NOT_PLAIN


def _cache_fields(value: Mapping[str, Any]) -> dict[str, Any]:
    """A cache setting's fields without those at their default (declared or detected, one key): the
    config class decides the defaults; where it cannot be imported, the fields as written."""
    fields = {k: thaw(v) for k, v in value.items() if k != "config"}
    try:
        cls = cache_config_classes().get(value["config"])
    except ImportError:
        cls = None
    if cls is None:
        return fields
    defaults = {f.name: _default(f) for f in dataclasses.fields(cls) if f.init}
    return {k: v for k, v in fields.items() if k not in defaults or defaults[k] is _NO_DEFAULT
            or not _same(_plain(defaults[k]), v)}


# -- key factors, plan-time checks, applying ---------------------------------------------------------


def factors(recipe: Recipe, component: str) -> dict[str, Any] | None:
    """The ``changes`` key factor of one component: the declared changes that change it; None when
    there are none (the key is then what it was without the section)."""
    spec = recipe.changes
    if spec is None:
        return None
    out = {c.name: c.factor(c.value(spec)) for c in CHANGES if c.value(spec) is not None and c.changes(component)}
    return out or None


def same_keys(recipe: Recipe, other: ChangesSpec | None) -> bool:
    """Whether ``other`` keys every compiled component of ``recipe`` as its own ``changes`` do (as the
    key compares: 1 is not 1.0, which the dependency record tells apart too)."""
    from aotbuild.keys import canonical_json

    mine, theirs = recipe, dataclasses.replace(recipe, changes=other)
    return all(canonical_json(factors(mine, c)) == canonical_json(factors(theirs, c))
               for c in recipe.compile.components)


def check_recipe(recipe: Recipe, components: Mapping[str, tuple[str, str]], pipeline_class: str) -> None:
    """Plan time: each declared change against the model's component classes (``components``: name ->
    (library, class), from model_index.json) and the names this diffusers knows."""
    spec = recipe.changes
    if spec is None:
        return
    if spec.freeu is not None and FREEU_COMPONENT not in components:
        raise recipe.error("changes.freeu", f"{pipeline_class} has no {FREEU_COMPONENT}: FreeU (enable_freeu) "
                                            f"changes a UNet's up blocks (components: {', '.join(components)})")
    for change in CHANGES:
        value = change.value(spec)
        if value is None:
            continue
        named = [FREEU_COMPONENT] if change.name == "freeu" else list(recipe.compile.components)
        for component in named:
            library, class_name = components.get(component, ("", ""))
            change.check(recipe, value, component, _class(library, class_name))


def _class(library: str, class_name: str) -> type | None:
    import importlib

    if library not in ("diffusers", "transformers"):  # never import a module a model folder names
        return None
    try:
        return getattr(importlib.import_module(library), class_name, None)
    except ImportError:
        return None


def apply(pipe: Any, recipe: Recipe) -> None:
    """The declared changes, on a pipeline ``from_pretrained`` just loaded (models.load_pipeline), each
    checked first against the loaded component's class (a load without a plan gets the plan's errors)."""
    spec = recipe.changes
    if spec is None:
        return
    for change in CHANGES:
        value = change.value(spec)
        if value is None:
            continue
        for component in ([FREEU_COMPONENT] if change.name == "freeu" else recipe.compile.components):
            module = getattr(pipe, component, None)
            if module is None:
                raise recipe.error(change.key, f"the pipeline has no {component}")
            change.check(recipe, value, component, type(module))
            change.apply(module, value, recipe)


# -- reading the changes off a live pipeline --------------------------------------------------------


@dataclass(frozen=True)
class Detected:
    """What :func:`detect` found: the declarable changes (None: none), or why they cannot be declared."""

    changes: ChangesSpec | None
    refused: str = ""


def detect(pipe: Any, recipe: Recipe, *, changed_modules: Callable[[str], bool]) -> Detected:
    """The declarable changes of ``pipe``'s compiled components (and FreeU on its unet): each
    component is built again from its config on the meta device, the changes read off the live one
    are applied to it, and the two dependency snapshots must then agree (a tensor by shape and
    strides: dtype and device are the recipe's). ``refused`` is the first thing that cannot be
    re-created in another process, in words. ``changed_modules(component)``: whether a feature of the
    recipe puts other modules in it (``features.registry.changes_modules``)."""
    from aotbuild.pipeline import dependencies

    found: dict[str, Any] = {}
    components = list(dict.fromkeys([*recipe.compile.components]))
    for component in components:
        module = getattr(pipe, component, None)
        if module is None:
            continue
        mine: dict[str, Any] = {}
        twin = _meta_twin(module)
        fresh = None if twin is None else twin.module
        for change in CHANGES:
            if fresh is not None and change.as_fresh(module, fresh):
                continue
            value, why = change.read(module, component)
            if why:
                return Detected(None, why)
            if value is None:
                continue
            why = change.unbuildable(value)
            if why:
                return Detected(None, f"{component}'s {change.key}: {why}")
            if change.name in found and found[change.name] != value:
                return Detected(None, f"{component}'s {change.key} ({_show(value)}) differs from another "
                                      f"component's ({_show(found[change.name])}): the recipe declares one for all")
            mine[change.name] = value
        if fresh is None:
            if mine:
                return Detected(None, f"{component} ({type(module).__name__}) cannot be built again from its config "
                                      f"here, so its changes cannot be checked")
            continue
        try:
            with _active_backend_kept():  # the twin's set_attention_backend must not change the process's
                for change in CHANGES:
                    if change.name in mine:
                        change.apply(fresh, mine[change.name], None)
        except Exception as exc:  # noqa: BLE001 - diffusers refused the change on a fresh module
            return Detected(None, f"{component}: its changes cannot be re-created: {printable(str(exc))[:160]}")
        # A component the recipe quantizes or puts LoRA layers in is not its meta twin (torchao's, peft's
        # modules): only the changes read are kept; the load's check against the entry still sees the rest.
        prepared = changed_modules(component)
        why = "" if prepared else _remaining(dependencies.snapshot(module)["items"], twin.items(), component,
                                             dependencies.ROOT_OUTSIDE, loaded=twin.loaded)
        if why:
            return Detected(None, why)
        found.update(mine)
    # a component that holds none of a change the others hold: the recipe would apply it to all
    for name, value in found.items():
        change = next(c for c in CHANGES if c.name == name)
        for component in components:
            # != value, not "is None": a processor class that is the component's own default reads as its name
            module = getattr(pipe, component, None)
            if change.changes(component) and module is not None and change.shows(module) \
                    and change.read(module, component)[0] != value:
                return Detected(None, f"{change.key} ({_show(value)}) is on some compiled components but not on "
                                      f"{component}: the recipe declares one for all")
    if not found:
        return Detected(None)
    return Detected(ChangesSpec(**found))


@contextlib.contextmanager
def _active_backend_kept() -> Iterator[None]:
    """diffusers' process-wide attention backend as it was, whatever the body sets."""
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    before = getattr(registry, "_active_backend", None)
    try:
        yield
    finally:
        if registry is not None:
            registry._active_backend = before


#: What the twin's load reads first in its folder: each library's weights file, written empty.
_WEIGHTS_FILE = {"transformers": "model.safetensors", "diffusers": "diffusion_pytorch_model.safetensors"}


@dataclass(frozen=True)
class _Twin:
    """A compiled component as a fresh load holds it, on the meta device: ``module``; ``loaded``, whether
    its library's own ``from_pretrained`` made it (else it was built from its config: no load step ran);
    ``folder``, the folder that load read, and ``location``, the one the live module was loaded from."""

    module: Any
    loaded: bool = False
    folder: str = ""
    location: str = ""

    def items(self) -> dict[str, str]:
        """The twin's dependency snapshot, as if loaded from the live module's folder: a value the load
        derives from its folder (transformers' ``name_or_path``) names the live module's."""
        from aotbuild.pipeline import dependencies

        items = dependencies.snapshot(self.module)["items"]
        if not (self.folder and self.location):
            return items
        mine, theirs = repr(self.folder), repr(self.location)
        return {path: theirs if what == mine else what for path, what in items.items()}


def _meta_twin(module: Any) -> _Twin | None:
    """The component as a fresh load holds it, without its weights, or None.

    Loaded by its library's own ``from_pretrained``, from a folder holding its config and an empty
    weights file, where no weight takes memory (:func:`_load_twin`), so whatever that load sets on a
    model (transformers 5.24's ``_is_hf_initialized``, ``_use_kernels`` False and ``_weight_conversions``;
    5.25's ``_use_kernels`` True) is on the twin too, at the value this version gives it: the 5.24 values,
    hard-coded, read every unchanged text encoder of 5.25 as changed (issue 54 item 3). Where that load
    fails here, the component built from its config (blocks.meta_module), which lacks what a load sets:
    a difference then says so (:func:`_remaining`)."""
    from aotbuild.pipeline.blocks import meta_module

    config = getattr(module, "config", None)
    if config is None:
        return None
    library = "transformers" if type(module).__module__.startswith("transformers.") else "diffusers"
    data = config.to_dict() if hasattr(config, "to_dict") and library == "transformers" else dict(config)
    location = data.get("_name_or_path")
    loaded = _load_twin(library, module)
    if loaded is not None:
        twin, folder = loaded
        return _Twin(twin, True, folder, location if isinstance(location, str) else "")
    twin = meta_module(library, type(module).__name__, data)
    return None if twin is None else _Twin(twin)


def _load_twin(library: str, module: Any) -> tuple[Any, str] | None:
    """(``type(module).from_pretrained`` of a temporary folder, that folder), or None where this library
    cannot load so here. The folder holds the module's config, written by its library, and an empty
    weights file: every weight is missing, so none is read, and the load runs where none is allocated
    (:func:`_weightless`); its report of the missing weights is silenced."""
    import importlib
    import tempfile
    import warnings
    from pathlib import Path

    cls = type(module)
    if library not in _WEIGHTS_FILE or getattr(importlib.import_module(library), cls.__name__, None) is not cls:
        return None  # only the library's own classes, as blocks.meta_module: never a load a subclass redefines
    with tempfile.TemporaryDirectory(prefix="aotbuild-twin-") as folder, _quiet(library), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            from safetensors.torch import save_file

            if library == "transformers":
                module.config.save_pretrained(folder)
            else:
                module.save_config(folder)
            save_file({}, str(Path(folder) / _WEIGHTS_FILE[library]))
        except Exception:  # noqa: BLE001 - a config its own library cannot write: the config twin
            return None
        first = _PLACE_THAT_LOADED.get(cls, 0)  # a place that refused this class once refuses it again
        for place, (where, kwargs) in enumerate(_weightless(library)):
            if place < first:
                continue
            try:
                with where:
                    twin = cls.from_pretrained(folder, local_files_only=True, **kwargs)
            except Exception:  # noqa: BLE001 - a load step this place cannot run: the next place, or none
                continue
            _PLACE_THAT_LOADED[cls] = place
            return twin, folder
    return None


#: The first place of :func:`_weightless` whose load of a class succeeded, by class: each load that fails
#: costs a load (transformers 5.25 refuses the meta device at its last step; issue 54 item 3).
_PLACE_THAT_LOADED: dict[type, int] = {}


def _weightless(library: str) -> Iterator[tuple[Any, dict[str, Any]]]:
    """Where the twin's load runs, without memory for a weight, each with its ``from_pretrained`` arguments,
    in order. First the meta device (transformers' ``device_map="meta"`` keeps the missing weights there;
    diffusers' load leaves them on it). Then torch's FakeTensorMode, a plain load whose tensors say
    ``cpu`` and hold no memory: for a load step that refuses the meta device, as transformers 5.25's
    ``kernelize`` (run by default, it validates the model's device) does (issue 54 item 3)."""
    import torch

    yield torch.device("meta"), ({"device_map": "meta"} if library == "transformers" else {})
    from torch._subclasses.fake_tensor import FakeTensorMode

    yield FakeTensorMode(allow_non_fake_inputs=True), {}


@contextlib.contextmanager
def _quiet(library: str) -> Iterator[None]:
    """``library``'s logging at errors only and its progress bars off, then as they were: the twin's load
    reports each weight missing, which is the point of it."""
    import importlib

    logging = importlib.import_module(f"{library}.utils.logging")
    verbosity, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)
        if bars:
            logging.enable_progress_bar()


def _remaining(live: Mapping[str, str], fresh: Mapping[str, str], component: str, outside: frozenset[str], *,
               loaded: bool = True) -> str:
    """The first difference left between the live module and its re-created twin, in words, or "".
    ``outside``: what wraps the component from outside its graph (an offload hook's forward, a
    dispatcher), left out as the load's check leaves it out. ``loaded``: whether the twin's library loaded
    it (:func:`_meta_twin`); else the words say that what a load sets is missing from it."""
    def comparable(what: str) -> str:
        if what.startswith(("param ", "buffer ", "tensor ")):  # kind dtype [shape] stride [...] device [grad]
            words = what.split(" ")
            shape_and_stride = what[len(words[0]) + len(words[1]) + 2:].rsplit("]", 1)[0] + "]"
            return f"{words[0]} {shape_and_stride}"
        return what

    for path in sorted((set(live) | set(fresh)) - outside):
        a, b = live.get(path), fresh.get(path)
        if a is None or b is None or comparable(a) != comparable(b):
            full = f"{component}.{path}" if path != "." else component
            return (f"{printable(full)} is {printable(a or 'absent')} here, {printable(b or 'absent')} in a fresh "
                    f"load with the declarable changes found (FreeU, attention_processor, attention_backend, cache, "
                    f"memory_format): a change the build's processes cannot re-create{'' if loaded else _UNLOADED}")
    return ""


_UNLOADED = (" (the fresh load was built from the config alone here: this library's from_pretrained could not "
             "load it without weights, so what such a load sets on a model is missing from it)")


def _show(value: Any) -> str:
    return printable(str(thaw(value)))[:120]


def as_recipe_text(spec: ChangesSpec) -> str:
    """The ``changes`` section that declares ``spec``, as one line of YAML flow text."""
    import json

    parts = [f"{name}: {json.dumps(thaw(getattr(spec, name)))}" for name in (c.name for c in CHANGES)
             if getattr(spec, name) is not None]
    return "changes: {" + ", ".join(parts) + "}"


class DeclaredChanges(Feature):
    """``changes``: FreeU, an attention processor, a cache hook, channels_last, applied by
    ``models.load_pipeline`` in every process (save_pretrained keeps none of them), keyed per
    component, checked at plan time against the model's classes."""

    section = "changes"

    def check_recipe(self, recipe: Recipe, model: Any, pipeline_class: str) -> None:
        check_recipe(recipe, model.components(), pipeline_class)  # FreeU on a model with a unet, known names

    def factors(self, recipe: Recipe, where: Where) -> dict[str, Any] | None:
        return factors(recipe, where.component)
