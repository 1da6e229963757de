"""What a compiled graph depends on beyond its tensor inputs: recorded at build, checked at load and per call.

A compiled component bakes in what the module's Python did when it was traced: plain attributes
(FreeU's ``b1``/``s1`` on the UNet's up blocks, a chunk size, a flag), the objects it called (an
attention processor, a diffusers hook, a forward wrapper), each weight's dtype, shape, strides,
device and ``requires_grad``, and the global state of the call (grad mode, default dtype,
autocast, deterministic algorithms and matmul precision). Neither the key (the recipe) nor the
structure check (aotbuild/pipeline/structure.py: classes and tensor shapes) sees those, and the AOT
strategies' artifacts do not re-check them: aot-package served the image without FreeU, the old
processor's output, and garbage for channels_last weights, with 0 compiles (issue 31). So the
build records a conservative *snapshot* of the component (:func:`snapshot`: for every submodule its
class, its plain attributes, the classes and plain settings of the objects it holds (a processor's
``_attention_backend``, a hook's ``threshold``, a cache hook's config), its tensor attributes'
metadata, its forward hook counts, and per parameter and buffer its metadata, never a value), the
global state its calls ran under and what each compiled module held at its first call
(:func:`observe`, from the build's recorders; :func:`call_time`: a pipeline may set a processor for
its calls, diffusers' PAG does). The load compares the live module with it (:func:`diff`: the first
difference in words) and, once per call of each compiled module, a :class:`Watch` re-checks it (with
the first call's differences applied: :func:`at_call`) cheaply: precomputed (dict, keys) pairs
compared by value, parameters by metadata only, so new weights of the same structure
(``load_state_dict``), a processor of the same class and settings, and a hook enabled then removed
(``disable_cache`` leaves the module's own ``forward`` bound on it: the same code) keep serving.

What is left out on purpose: ``training`` (read only by dropout with p > 0 and batch norm, whose
``training`` is kept), dict-valued attributes (peft's per-adapter ``scaling``: a hot-swapped
adapter's scale is the LoRA feature's to check), aotbuild's own dispatcher and the compiled call
``module.compile()`` sets, and the watched module's own hooks and ``forward`` (they run around the
dispatcher, outside the compiled code).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import hashlib
import operator
import re
import sys
import types
from collections.abc import Iterator, Mapping
from typing import Any

from aotbuild.utils.text import printable

__all__ = ["VERSION", "ROOT_OUTSIDE", "only_devices", "snapshot", "numeric_flags", "digest", "diff", "recipe_key",
           "observe", "observed", "reset_observed", "record_calls", "at_call", "call_time", "call_state", "Watch"]

#: The snapshot's format: another version is compared as "built by another aotbuild".
VERSION = 1
#: Attributes every torch module has that are not code the graph runs (hooks are counted apart).
_MODULE_INTERNALS = frozenset({
    "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "_backward_pre_hooks", "_backward_hooks",
    "_is_full_backward_hook", "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "_compiled_call_impl", "training",
})
#: Root-only: what wraps the compiled module from outside (aotbuild's dispatcher, an offload hook's
#: forward) is not in the graph.
ROOT_OUTSIDE = frozenset({"forward", "_old_forward", "<hooks>"})
_PLAIN = (bool, int, float, str, type(None))
#: The per-call state's flag of diffusers' active attention backend (:func:`numeric_flags`).
_BACKEND_FLAG = "diffusers attention backend "
_HOOKS = "<hooks>"


# -- the snapshot ---------------------------------------------------------------------------------


def _is_plain(value: Any) -> bool:
    if isinstance(value, _PLAIN):
        return True
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return all(isinstance(v, _PLAIN) for v in value)
    return False


def _tensor_meta(t: Any, kind: str) -> str:
    dtype = str(t.dtype).replace("torch.", "")
    return (f"{kind} {dtype} {list(t.shape)} stride {list(t.stride())} {t.device.type}"
            f"{' grad' if t.requires_grad else ''}")


def _callable_name(value: Any) -> str:
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return f"function {getattr(value, '__module__', '')}.{getattr(value, '__qualname__', '?')}"
    cls = type(value)
    return f"{cls.__module__}.{cls.__qualname__} object{_settings(value)}"


def _plain_text(value: Any) -> str:
    return repr(value.value if isinstance(value, enum.Enum) else value)


def _settings(value: Any) -> str:
    """An object's plain settings, `` (k=v, ...)`` or "": a processor's ``_attention_backend``
    (``set_attention_backend`` writes it on each processor in place), a hook's ``threshold``, a
    dataclass config's fields. Recorded by class only, a change of value was served (issue 31 item 4)."""
    pairs = _plain_vars(value)
    return " (" + ", ".join(f"{k}={_plain_text(v)}" for k, v in pairs) + ")" if pairs else ""


def _plain_vars(value: Any) -> tuple[tuple[str, Any], ...]:
    """(name, value) of ``value``'s plain instance attributes, None left out (absent: class defaults)."""
    try:
        d = vars(value)
    except TypeError:  # no __dict__ (a builtin, __slots__)
        return ()
    if not d:
        return ()
    return tuple((k, v) for k, v in d.items() if v is not None and _is_plain(v) and k != "fn_ref")


def _attribute(name: str, value: Any) -> str | None:
    """What the snapshot keeps of one attribute, or None (not something compiled code reads as a constant)."""
    import torch

    if _is_plain(value):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return repr(value)
    if isinstance(value, torch.Tensor):
        return _tensor_meta(value, "tensor")
    if isinstance(value, torch.nn.Module):
        return None  # a submodule (or a reference to one): walked as a module
    if name == "_diffusers_hook":  # a HookRegistry: which hooks it runs, by name, class and settings
        hooks = getattr(value, "hooks", {})
        if not hooks:  # an empty registry runs nothing: pipelines make one per call (Flux's cache_context)
            return None
        return "hooks " + ", ".join(f"{k}={type(h).__qualname__}{_settings(h)}" for k, h in sorted(hooks.items()))
    if callable(value) and not isinstance(value, type):
        if getattr(type(value), "aotbuild_wrapper", False):  # aotbuild's dispatcher: around the graph
            return None
        return _callable_name(value)
    # A diffusers cache hook's config, by its fields. Only that attribute: transformers' configs are
    # dataclasses too, whose fields (_name_or_path: the folder loaded from) are no graph's constants.
    if name == "_cache_config" and dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        return f"{cls.__module__}.{cls.__qualname__}{_settings(value)}"
    return None


def _own_forward(sub: Any, name: str, value: Any) -> bool:
    """Whether ``value`` is ``sub``'s own class ``forward``, bound to it: what a diffusers hook leaves as
    ``sub.forward`` once removed (``disable_cache``), the same code as no attribute at all."""
    return (name == "forward" and getattr(value, "__self__", None) is sub
            and getattr(value, "__func__", None) is getattr(type(sub), "forward", None))


def _kept(sub: Any, name: str, value: Any) -> str | None:
    """What the snapshot keeps of ``sub``'s attribute ``name``, or None."""
    if name in _MODULE_INTERNALS or value is None or _own_forward(sub, name, value):
        return None
    return _attribute(name, value)


def _keeps_training(sub: Any) -> bool:
    import torch

    if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
        return True
    return isinstance(sub, torch.nn.modules.dropout._DropoutNd) and float(getattr(sub, "p", 0.0)) > 0.0


def _hooks(sub: Any) -> str | None:
    forward, pre = len(sub._forward_hooks), len(sub._forward_pre_hooks)
    return f"forward {forward}, pre {pre}" if forward or pre else None


def _items(module: Any) -> Iterator[tuple[str, str]]:
    """(path, what) for every submodule, attribute, hook count and tensor of ``module``."""
    for path, sub in module.named_modules(remove_duplicate=False):
        prefix = f"{path}." if path else ""
        cls = type(sub)
        yield path or ".", f"{cls.__module__}.{cls.__qualname__}"
        for name, value in vars(sub).items():
            what = _kept(sub, name, value)  # None is absent: getattr(self, "b1", None)
            if what is not None:
                yield prefix + name, what
        if _keeps_training(sub):
            yield prefix + "training", repr(sub.training)
        hooks = _hooks(sub)
        if hooks:
            yield prefix + _HOOKS, hooks
        for name, t in sub._parameters.items():
            if t is not None:
                yield prefix + name, _tensor_meta(t, "param")
        for name, t in sub._buffers.items():
            if t is not None:
                yield prefix + name, _tensor_meta(t, "buffer")


def snapshot(module: Any) -> dict[str, Any]:
    """The manifest's ``structure.dependencies``: every item (path -> what) and their digest; the
    build adds ``globals``, the states its calls ran under (:func:`observed`)."""
    items = dict(_items(module))
    return {"version": VERSION, "digest": digest(items), "items": items}


def digest(items: Mapping[str, str]) -> str:
    return hashlib.sha256("\n".join(f"{k}\t{v}" for k, v in sorted(items.items())).encode()).hexdigest()


def _hint(path: str, here: str | None, there: str | None) -> str:
    leaf = path.rsplit(".", 1)[-1]
    if leaf in ("b1", "b2", "s1", "s2"):
        return ": FreeU?"
    if leaf == "processor":
        return _BACKEND_HINT if _backend_only(here, there) else ": another attention processor?"
    if leaf == "_hf_peft_config_loaded" or "peft.tuners." in (here or ""):
        return ": a LoRA loaded (load_lora_weights)? A recipe's lora section builds for hot-swapped adapters"
    if leaf == "_cache_config":
        return ": a diffusers cache hook (enable_cache)?"
    if leaf == "_diffusers_hook" or leaf == _HOOKS:
        return ": a hook (a diffusers cache, a forward hook)?"
    if " stride " in (here or "") and " stride " in (there or ""):
        h, t = (here or "").split(" stride ")[0], (there or "").split(" stride ")[0]
        if h == t:
            return ": another memory format (channels_last?)"
        if h.split(" ")[1] != t.split(" ")[1]:
            return ": another dtype (pipe.to(dtype)?)"
        return ": moved, or requires_grad changed"
    return ""


#: A processor's backend (``_attention_backend``, written in place by ``set_attention_backend``) or the
#: process-wide one differs, nothing else: declared by ``changes.attention_backend``.
_BACKEND_HINT = ": another attention backend (set_attention_backend)?"


def _backend_only(here: str | None, there: str | None) -> bool:
    """Whether two held objects' records differ only in ``_attention_backend`` (one class, other settings equal)."""
    def without(what: str) -> str:
        return re.sub(r"(, )?_attention_backend='[^']*'", "", what).replace("(, ", "(").replace(" ()", "")
    return bool(here and there) and here != there and without(here) == without(there)


def recipe_key(reason: str) -> str:
    """The recipe key that declares the change a :func:`diff` or :class:`Watch` reason names
    (aotbuild/pipeline/changes.py: FreeU's factors, an attention processor or backend, a memory format), or "" for
    one no recipe declares. A diffusers
    cache hook is declarable but no strategy builds one (``changes.cache`` is refused at plan time)."""
    for hint, key in _DECLARED_BY:
        if reason.endswith(hint):
            return key
    return ""


#: A difference's hint (:func:`_hint`) -> the recipe key that declares such a change.
_DECLARED_BY = ((": FreeU?", "changes.freeu"), (": another attention processor?", "changes.attention_processor"),
                (_BACKEND_HINT, "changes.attention_backend"),
                (": another memory format (channels_last?)", "changes.memory_format"))


def diff(recorded: Mapping[str, Any] | None, live: Mapping[str, Any], component: str,
         under: str = "", ignore: frozenset[str] = frozenset()) -> str:
    """The first difference between a recorded snapshot and the live one, in words (``"unet.up_blocks.0.b1:
    1.2 here, absent in the entry: FreeU?"``), or "". ``under``: only paths below that module path
    (a block); ``ignore``: paths (relative to ``under``) left out."""
    if not recorded or not isinstance(recorded.get("items"), Mapping):
        return f"{component}: the entry was built by an older aotbuild (no dependency record): rebuild"
    if recorded.get("version") != VERSION:
        return f"{component}: the entry's dependency record is version {recorded.get('version')!r}, this " \
               f"aotbuild reads {VERSION}: rebuild"
    there, here = _below(recorded["items"], under, ignore), _below(live["items"], under, ignore)
    if not under and not ignore and recorded.get("digest") == live.get("digest"):
        return ""
    for path in sorted(set(there) | set(here), key=lambda p: (p not in here, p)):
        a, b = here.get(path), there.get(path)
        if a != b:
            full = ".".join(p for p in (component, under, "" if path == "." else path) if p)
            entry = printable(str(b) if b is not None else "absent")
            return f"{printable(full)}: {printable(a or 'absent')} here, {entry} in the entry{_hint(path, a, b)}"
    return ""


def _below(items: Mapping[str, Any], under: str, ignore: frozenset[str]) -> dict[str, Any]:
    if not under:
        return {k: v for k, v in items.items() if k not in ignore}
    out = {}
    head = under + "."
    for k, v in items.items():
        if k == under:
            rel = "."
        elif k.startswith(head):
            rel = k[len(head):]
        else:
            continue
        if rel not in ignore:
            out[rel] = v
    return out


# -- the global state of a call --------------------------------------------------------------------

_OBSERVED: list[list[Any]] = []
#: The component whose calls the build records (:func:`record_calls`), and per module path (relative to
#: it) the items of that module's subtree at its first recorded call.
_ROOT: list[Any] = []
_AT_CALL: dict[str, dict[str, str]] = {}


def call_state() -> list[Any]:
    """Grad mode, default dtype, and the autocast state of CPU and CUDA followed by the numeric settings
    off their defaults (:func:`numeric_flags`): what a trace assumes of the process."""
    import torch

    autocast = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
    return [torch.is_grad_enabled(), str(torch.get_default_dtype()).replace("torch.", ""),
            [f"{d}:{str(torch.get_autocast_dtype(d)).replace('torch.', '')}" for d in autocast] + numeric_flags()]


def numeric_flags() -> list[str]:
    """The process-wide settings that change what compiled code computes, those off their defaults only
    (an entry built before they were recorded ran under the defaults, so its states still compare):
    deterministic algorithms (Inductor generates other kernels, eager picks other ones), TF32 and
    reduced-precision reductions of CUDA matmuls and the float32 matmul precision (Inductor bakes them
    into its kernels), and diffusers' active attention backend (a trace calls the one it found).
    Dynamo's GLOBAL_STATE guard checks most of these, and aot-compile's loads drop it
    (aotbuild/strategies/aot_compile.py): this check holds for every strategy. The thread count it
    also checks changes no result and is left out."""
    import torch

    flags = []
    if torch.are_deterministic_algorithms_enabled():
        flags.append("deterministic warn-only" if torch.is_deterministic_algorithms_warn_only_enabled()
                     else "deterministic")
    matmul = torch.backends.cuda.matmul
    if matmul.allow_tf32:
        flags.append("cuda matmul tf32")
    if not matmul.allow_fp16_reduced_precision_reduction:
        flags.append("no fp16 reduced-precision reduction")
    if not matmul.allow_bf16_reduced_precision_reduction:
        flags.append("no bf16 reduced-precision reduction")
    precision = torch.get_float32_matmul_precision()
    if precision != "highest":
        flags.append(f"float32 matmul precision {precision}")
    # diffusers' process-wide attention backend: what a processor without its own _attention_backend
    # dispatches to (set_attention_backend sets it and each processor's; reset_attention_backend only
    # the processors'). Read only where diffusers loaded it: the check never imports diffusers.
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    backend = getattr(registry, "_active_backend", None)
    if backend is not None and getattr(backend, "value", backend) != "native":
        flags.append(f"{_BACKEND_FLAG}{getattr(backend, 'value', backend)}")
    return flags


def record_calls(module: Any) -> None:
    """Start recording the calls of ``module`` (a component): the states seen and, at the first call of
    the component or of each of its blocks, what that module holds then (:func:`call_time`)."""
    reset_observed()
    _ROOT.append(module)


def observe(module: Any = None) -> None:
    """Called by the build's recorders at each call of a component or block (``module``: the one
    called): the states seen, and the module's items at its first call. A pipeline's ``__call__`` may set
    what the graph is traced with before it calls the module and restore it after (diffusers' PAG sets
    its attention processors for the denoising loop): the per-call check compares a call with that, the
    load-time check (before any call) with the snapshot taken before the warmup."""
    state = call_state()
    if state not in _OBSERVED:
        _OBSERVED.append(state)
    if not _ROOT:
        return
    root = _ROOT[0]
    target = root if module is None else module
    path = next((p for p, m in root.named_modules(remove_duplicate=False) if m is target), None)
    if path is None or path in _AT_CALL:  # not in the component (not recorded), or seen already
        return
    prefix = f"{path}." if path else ""
    _AT_CALL[path] = {(prefix + k if k != "." else path or "."): v for k, v in _items(target)}


def observed() -> list[list[Any]]:
    return [list(s) for s in _OBSERVED]


def call_time(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest's ``structure.dependencies.calls`` for the snapshot ``recorded`` (taken before the
    warmup): what the recorded modules held at their first call that differs from it, as ``changed``
    (path -> what) and ``removed`` (paths)."""
    items = dict(recorded["items"])
    merged = _overlay(items, _AT_CALL)
    for path in _AT_CALL:  # what wraps a recorded module (the recorder itself, a dispatcher) is not its graph's
        for name in ROOT_OUTSIDE:
            key = f"{path}.{name}" if path else name
            if key in items:
                merged[key] = items[key]
            else:
                merged.pop(key, None)
    return {"changed": {k: v for k, v in merged.items() if items.get(k) != v},
            "removed": sorted(k for k in items if k not in merged)}


def _overlay(items: Mapping[str, str], subtrees: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    out = dict(items)
    for path in sorted(subtrees, key=lambda p: (p.count(".") + bool(p), p)):  # outer first, inner over it
        if path:
            head = path + "."
            out = {k: v for k, v in out.items() if k != path and not k.startswith(head)}
        else:
            out = {}
        out.update(subtrees[path])
    return out


def at_call(recorded: Mapping[str, Any]) -> dict[str, Any]:
    """The record a call is compared with: the snapshot with the first call's differences
    (``calls``) applied; the snapshot itself for a record without them (built by an older aotbuild)."""
    calls = recorded.get("calls")
    if not isinstance(calls, Mapping) or not isinstance(recorded.get("items"), Mapping):
        return dict(recorded)
    items = {k: v for k, v in recorded["items"].items() if k not in set(calls.get("removed") or ())}
    items.update(calls.get("changed") or {})
    return {**recorded, "items": items, "digest": digest(items)}


def reset_observed() -> None:
    _OBSERVED.clear()
    _ROOT.clear()
    _AT_CALL.clear()


def _describe_state(state: list[Any]) -> str:
    grad, dtype, settings = state
    autocast = [s for s in settings if ":" in s]
    flags = [s for s in settings if ":" not in s]
    return (f"grad {'on' if grad else 'off'}, default dtype {dtype}, autocast {', '.join(autocast) or 'off'}, "
            f"{', '.join(flags) or 'default numerics'}")


# -- the per-call check ----------------------------------------------------------------------------


class Watch:
    """The cheap per-call check of one compiled module (a component, or a regional block) against the
    entry's record. Armed from the live module once it matched the record (at load), a call compares
    flat lists built by C-level maps: each submodule's attribute dict (its length and the recorded
    keys' values), the held objects' classes, the children, the hook counts, and each parameter's and
    buffer's data pointer (``.to(dtype)``, ``.to(memory_format=...)``, a device move or a new
    Parameter each allocate anew; ``load_state_dict`` copies in place). Not in the fast check:
    ``requires_grad`` flipped in place (aot-compile's own guards check it, an AOT package's output does
    not depend on it; the load-time check does compare it). A
    fingerprint that moved is re-checked in full (:func:`diff` against the record, never against the
    armed state): a difference is the reason returned, none (``disable_freeu`` leaves its factors as
    None, new weights) re-arms on the new state."""

    def __init__(self, module: Any, recorded: Mapping[str, Any], component: str, under: str = "",
                 devices: bool = True):
        self.module = module
        self.recorded = recorded
        self.component = component
        self.under = under
        self.devices = devices
        self.ignore = ROOT_OUTSIDE
        self.states = [(s[0], s[1], tuple(s[2])) for s in recorded.get("globals") or []]
        self.reason = ""
        self._arm()
        #: the hooks at load, by submodule (compared by identity: :meth:`_hooks_replaced`)
        self.hooks_at_load = (self._hooks_by_path(), _global_hooks())

    def _hooks_by_path(self) -> dict[tuple[str, int], tuple[Any, ...]]:
        return {(path, i % 2): tuple(h.values()) for i, (path, h) in enumerate(zip(self.hook_paths, self.hooks,
                                                                                   strict=True))}

    def _arm(self) -> None:
        dicts, plain, objects, children, hooks, trained, stores = [], [], [], [], [], [], []
        self.hook_paths: list[str] = []
        for path, sub in self.module.named_modules(remove_duplicate=False):
            d = vars(sub)
            root = path == ""
            dicts.append(d)
            keys = [k for k, v in d.items() if not (root and k in ROOT_OUTSIDE) and _kept(sub, k, v) is not None]
            held = [k for k in keys if not _is_plain(d[k])]
            if len(keys) > len(held):
                plain.append((d, operator.itemgetter(*[k for k in keys if k not in held])))
            objects += [(d, k) for k in held]
            children.append(d["_modules"])  # a leaf's too: a child added to it changes what runs
            if not root:
                hooks += [sub._forward_hooks, sub._forward_pre_hooks]
                self.hook_paths += [path, path]
            if _keeps_training(sub):
                trained.append(sub)
            stores += [d["_parameters"], d["_buffers"]]
        self.dicts, self.plain, self.objects, self.children = dicts, plain, objects, children
        self.hooks, self.trained, self.stores = hooks, trained, [st for st in stores if st]
        # A tensor with no storage of its own (a DTensor, a torchao quantized weight: data_ptr 0) is
        # followed by its metadata instead, slower but rare.
        import torch

        self.odd = [(st, name) for st in self.stores for name, t in st.items()
                    if t is not None and t.numel() and t.device.type != "meta"
                    and torch._C.TensorBase.data_ptr(t) == 0]
        armed = self._fingerprint()
        self.armed = (*armed[:1], copy.deepcopy(armed[1]), *armed[2:])  # a list attribute changed in place moves
        from torch.utils.hooks import RemovableHandle

        self.hook_serial = RemovableHandle.next_id
        self.armed_hooks, self.armed_global = self._hook_values(), _global_hooks()
        self.reason = ""

    def _fingerprint(self) -> tuple[Any, ...]:
        import torch

        tensors = [t for st in self.stores for t in st.values() if t is not None]
        try:
            values = [get(d) for d, get in self.plain]
        except KeyError:  # a recorded attribute was deleted
            values = None
        # Hooks by count here; one replaced by another keeps the count (issue 52), so :meth:`moved` also
        # compares them by identity whenever a hook was registered anywhere since (torch numbers every
        # registration: RemovableHandle.next_id), and the process-wide module hooks, which eager runs for
        # every submodule and a served graph does not.
        return (list(map(len, self.dicts)), values, [_fingerprint(d.get(k)) for d, k in self.objects],
                [m for mods in self.children for m in mods.values()], list(map(len, self.hooks)),
                [m.training for m in self.trained], list(map(torch._C.TensorBase.data_ptr, tensors)),
                [_fingerprint(st.get(name)) for st, name in self.odd], tuple(map(len, _global_hooks())))

    def moved(self) -> bool:
        """Whether anything the fingerprint covers differs from when it was armed, or a hook was replaced."""
        if self._fingerprint() != self.armed:
            return True
        from torch.utils.hooks import RemovableHandle

        if RemovableHandle.next_id == self.hook_serial:  # no hook registered anywhere since: none replaced
            return False
        self.hook_serial = RemovableHandle.next_id
        return (self._hook_values() != self.armed_hooks) or _global_hooks() != self.armed_global

    def _hook_values(self) -> list[tuple[Any, ...]]:
        return list(map(tuple, map(dict.values, self.hooks)))

    def check(self) -> str:
        """Why this call cannot be served by the entry (the first difference), or ""."""
        if self.states:
            state = _state_now()
            if state not in self.states:
                backend_only = _without_backend(state) in map(_without_backend, self.states)
                return (f"{self.component}{'.' + self.under if self.under else ''} is called with "
                        f"{_describe_state([state[0], state[1], list(state[2])])}; the entry was traced with "
                        f"{_describe_state(list(self.states[0]))}" + (_BACKEND_HINT if backend_only else
                        ": another grad mode, default dtype, autocast or numeric setting (deterministic "
                        "algorithms, TF32, matmul precision, diffusers' attention backend)"))
        if not self.moved():
            return self.reason
        live = snapshot(self.module)
        if self.under:  # the block's own items, with the recorded paths' prefix
            live = {**live, "items": {(f"{self.under}.{k}" if k != "." else self.under): v
                                      for k, v in live["items"].items()}}
        reason = diff(self.recorded, live, self.component, self.under, self.ignore)
        if reason and not self.devices and only_devices(self.recorded, live, self.under, self.ignore):
            reason = ""
        reason = reason or self._hooks_replaced()
        self._arm()
        self.reason = reason
        return reason


    def _hooks_replaced(self) -> str:
        """A change of hooks the record cannot show (it counts them): one replaced by another since load,
        or a process-wide module hook registered or removed since."""
        by_path, global_hooks = self.hooks_at_load
        if _global_hooks() != global_hooks:
            return (f"{self.component}: a process-wide module hook (torch.nn.modules.module."
                    f"register_module_forward_hook or _pre_hook) was registered or removed since load; eager runs "
                    f"it for every submodule, the entry's graphs do not")
        for (path, kind), now in self._hooks_by_path().items():
            before = by_path.get((path, kind))
            if before is not None and before != now and len(before) == len(now):
                where = ".".join(p for p in (self.under, path) if p)
                return (f"{self.component}.{where}: a forward {'pre-' if kind else ''}hook was replaced by another "
                        f"since load; the entry's graphs run the hooks it was built with")
        return ""


def _global_hooks() -> tuple[Any, ...]:
    from torch.nn.modules import module as torch_module

    return tuple(tuple(getattr(torch_module, name, {}).values()) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_forward_hooks_always_called"))


def _without_backend(state: tuple[Any, ...]) -> tuple[Any, ...]:
    return (state[0], state[1], tuple(s for s in state[2] if not s.startswith(_BACKEND_FLAG)))


def _state_now() -> tuple[Any, ...]:
    s = call_state()
    return (s[0], s[1], tuple(s[2]))


def only_devices(recorded: Mapping[str, Any], live: Mapping[str, Any], under: str, ignore: frozenset[str]) -> bool:
    """Whether every difference is a tensor's device (offload moves weights between calls)."""
    there, here = _below(recorded["items"], under, ignore), _below(live["items"], under, ignore)
    if set(there) != set(here):
        return False

    def strip(what: str) -> str:
        return " ".join(w for w in what.split(" ") if w not in ("cpu", "cuda", "meta", "xpu", "mps"))
    return all(strip(str(there[k])) == strip(str(here[k])) for k in there)


def _fingerprint(value: Any) -> Any:
    """A held object's class and plain settings (a function itself; a tensor's metadata), and for a
    diffusers HookRegistry its hooks' names and settings (hooks come and go in place; a processor's
    ``_attention_backend`` is written in place)."""
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType)):
        return id(value)
    if hasattr(value, "stride") and hasattr(value, "dtype") and hasattr(value, "shape"):
        return (id(value), value.dtype, value.shape, value.stride(), value.device.type)
    hooks = getattr(value, "hooks", None) if type(value).__name__ == "HookRegistry" else None
    if isinstance(hooks, dict):
        return type(value), tuple((k, type(h), _plain_vars(h)) for k, h in hooks.items())
    return type(value), _plain_vars(value)


