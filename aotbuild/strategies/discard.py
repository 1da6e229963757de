"""Served without the dense copies of prepacked weights (issue 52 item 2): ``load_compiled(...,
discard_weights=True)``.

A package built with freezing reads prepacked copies of the convolution and large linear weights
(prepack.py), derived at load from the module's own; the module keeps its dense weights too, so a
served UNet holds its weights twice (SD 1.5 size: 7.1 GB served against eager's 4.0 GB, issue 52). With
the opt-in, each weight whose only reader is a prepacked constant's recipe is dropped after the first
bind: the module's parameter becomes a :class:`DiscardedWeight`, a tensor with the weight's shape,
dtype, strides and device and no memory, so every structural check sees the module as it was, and any
use of its values raises :class:`~aotbuild.errors.WeightsDiscarded`, naming the API that changes them:
:func:`refit`. torch's ``freezing_discard_parameters``, TensorRT's weight-stripped engines and ZeroGPU's
``aoti_apply`` are the precedents.

What a user can no longer do with a discarded weight (docs/prepack.md, "Without the dense weights"):
read it (``state_dict`` values, ``save_pretrained``, ``torch.save``, ``.numpy()``), write it in place
(``load_state_dict``, ``copy_``, a LoRA fuse), move or convert it (``pipe.to(...)``), run the module
eagerly (an unbuilt shape under ``on_miss="compile"``/``"eager"``, a stale call) or copy it
(``copy.deepcopy``): each raises ``WeightsDiscarded``. Assigning a dense tensor back (``w.data = t``, a
new ``nn.Parameter``) is a replaced weight like any other: the runner re-derives from it.
"""

from __future__ import annotations

import contextvars
from collections.abc import Mapping
from typing import Any

from aotbuild.errors import PackageMismatch, UsageError, WeightsDiscarded
from aotbuild.strategies.subclasses import unwrapped

#: What the error says a user can do instead.
REFIT = ("aotbuild.refit(module, state_dict) changes the weights of a module served with "
         "load_compiled(..., discard_weights=True); docs/prepack.md, \"Without the dense weights\"")


def _discarded_class() -> type:
    """:class:`DiscardedWeight`, defined on first use (the runtime imports torch lazily)."""
    global DiscardedWeight
    if "DiscardedWeight" in globals():
        return DiscardedWeight
    import torch

    class DiscardedWeight(torch.Tensor):  # noqa: F811 - defined once, on first use
        """A dropped weight: its metadata without memory. Detaching or aliasing it gives another;
        any other operator raises :class:`WeightsDiscarded`."""

        where: str

        @staticmethod
        def __new__(cls, like: Any, where: str, requires_grad: bool = False) -> Any:
            t = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                    device=like.device, requires_grad=requires_grad)
            t.where = where
            return t

        @classmethod
        def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
                return cls(args[0], args[0].where)
            where = next((a.where for a in args if isinstance(a, cls)), "a weight")
            raise WeightsDiscarded(f"{where} was discarded after load (discard_weights=True: only its prepacked "
                                   f"copy is kept), so {func} cannot run on it; {REFIT}")

        __torch_function__ = torch._C._disabled_torch_function_impl

        def __repr__(self) -> str:  # printing a module's parameter must not raise
            return f"DiscardedWeight({self.where}, {list(self.shape)}, {str(self.dtype).replace('torch.', '')})"

        def __deepcopy__(self, memo: dict[int, Any]) -> Any:
            raise WeightsDiscarded(f"{self.where} was discarded after load: a copy of the module cannot be "
                                   f"served without it; {REFIT}")

        def __reduce_ex__(self, protocol: Any) -> Any:
            raise WeightsDiscarded(f"{self.where} was discarded after load: it cannot be saved; {REFIT}")

        def untyped_storage(self) -> Any:  # safetensors (save_pretrained) reads the storage first
            raise WeightsDiscarded(f"{self.where} was discarded after load: it has no memory to read or save; "
                                   f"{REFIT}")

        def numpy(self, *args: Any, **kwargs: Any) -> Any:
            raise WeightsDiscarded(f"{self.where} was discarded after load: it has no values; {REFIT}")

    globals()["DiscardedWeight"] = DiscardedWeight
    return DiscardedWeight


def is_discarded(t: Any) -> bool:
    return "DiscardedWeight" in globals() and isinstance(t, DiscardedWeight)


def discardable(runner: Any) -> list[str]:
    """The weights of ``runner``'s module that only its prepacked constants' recipes read: not handed to
    the package as they are, not compiled into it, and read only by recipes all of whose inputs are such
    weights (a recipe is replayed with every input dense or none), besides the lifted constants stored with
    the package (int8static's per-channel scales: every int8 weight's recipe reads its own)."""
    candidates = {fqn for fqn in runner.derived_from if fqn not in runner.meta and fqn not in runner.baked
                  and fqn not in runner.lifted and unwrapped(fqn) is None}  # a subclass weight's part: kept
    readable = candidates | set(runner.lifted)
    return sorted(fqn for fqn in candidates
                  if all(set(runner.derived[name]["inputs"]) <= readable for name in runner._readers[fqn]))


#: Set by ``load_compiled(..., discard_weights=True)`` around its install: the runners it makes drop
#: each discardable weight as soon as its prepacked constants are derived (the dense weights and their
#: prepacked copies are never all in memory at once: the load's peak stays near eager's).
DISCARDING: contextvars.ContextVar[bool] = contextvars.ContextVar("aotbuild_discarding", default=False)


def drop(module: Any, fqn: str, label: str) -> int:
    """Put a :class:`DiscardedWeight` in place of ``module``'s tensor ``fqn``; the bytes it held (0 when
    it is gone already)."""
    cls = _discarded_class()
    *path, leaf = fqn.split(".")
    owner = module.get_submodule(".".join(path)) if path else module
    store = owner._parameters if owner._parameters.get(leaf) is not None else owner._buffers
    t = store.get(leaf)
    if t is None or is_discarded(t):
        return 0
    # Not wrapped in nn.Parameter: Parameter.__new__ on a tensor subclass kept the dense weight alive
    # (measured: 36 MB of RssAnon not given back); the dict is written directly, as load_state_dict's
    # assign does, so the module's parameters() still yield it.
    store[leaf] = cls(t.detach(), label, requires_grad=t.requires_grad)
    return t.numel() * t.element_size()


def discard(runner: Any) -> int:
    """Drop every discardable weight of ``runner``'s module now (a runner bound without
    :data:`DISCARDING`: tests; ``offload: model`` binds at its first call, so it binds here first); the
    bytes dropped."""
    with runner.lock:
        runner.discarding = set(discardable(runner))
        if runner.bound is None:
            runner._bind()
        dropped = sum(drop(runner.module, fqn, f"{runner.component}.{fqn}") for fqn in sorted(runner.discarding))
        runner.dropped += dropped
        runner.forget_dense()
    return runner.dropped


def refit(module: Any, state_dict: Mapping[str, Any]) -> int:
    """Change the weights of ``module`` (a served component, ``pipe.unet``) to ``state_dict``'s (names
    as ``module.state_dict()``'s; any subset): a discarded weight's prepacked constants are replayed from
    the given tensor, a weight the module still holds is copied into it in place (its runner follows, as
    for any in-place write). A LoRA: fuse it into the base weights first (``W + scale * B @ A``, or peft's
    ``merge_and_unload`` on a CPU copy of the base checkpoint) and refit the merged tensors. Returns how
    many prepacked constants were replayed."""
    import torch

    runners = []
    for path, sub in module.named_modules():
        for d in _own_dispatchers(sub):
            for route in d.routes.values():
                runner = getattr(route, "runner", None)
                if runner is not None and all(runner is not r for _, r in runners):
                    runners.append((path, runner))
    known = set(module.state_dict(keep_vars=True))
    unknown = sorted(set(state_dict) - known)
    if unknown:
        raise UsageError(f"refit: {len(unknown)} names are not {type(module).__name__}'s (e.g. {unknown[0]!r}); "
                         f"use the names of module.state_dict()")
    for path, runner in runners:  # int8static: only the weights calibrated on, refused before anything changes
        prefix = f"{path}." if path else ""
        why = runner.calibrated_problem({name[len(prefix):]: value for name, value in state_dict.items()
                                         if name.startswith(prefix)})
        if why:
            raise PackageMismatch(f"{runner.component}: refit: its AOT package {why}")
    replayed = 0
    with torch.no_grad():
        for name, value in state_dict.items():  # the weights the module still holds: in place
            live = _tensor(module, name)
            if live is not None and not is_discarded(live):
                live.copy_(value)
        for path, runner in runners:  # then every recipe that reads a given weight, from it
            prefix = f"{path}." if path else ""
            given = {fqn: state_dict[prefix + fqn] for fqn in runner.derived_from if prefix + fqn in state_dict}
            replayed += runner.refit(given)
    return replayed


def _own_dispatchers(module: Any) -> list[Any]:
    from aotbuild import forwards

    return forwards.layers(module, forwards.DISPATCH)


def _tensor(module: Any, name: str) -> Any:
    *path, leaf = name.split(".")
    owner = module.get_submodule(".".join(path)) if path else module
    t = owner._parameters.get(leaf)
    return t if t is not None else owner._buffers.get(leaf)
