"""Recorded calls and module structure: what the AOT strategies (aot-package, aot-compile) share.

Both run the warmup eagerly while the component (or each repeated block) records its calls, then
compile from those recordings. Here: a call's snapshot (its inputs, copied, each tensor in its own
layout), its leaves, tensors, strides and float arguments (``torch.utils._pytree``, kwargs in name
order), the tensor-layout helpers (:func:`copyable`, :func:`relayout`), :func:`where_called` (a
block on its call's device while it is compiled, for ``offload: model``), and :func:`structure`:
what must be equal for one artifact to serve two module instances.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from aotbuild import forwards

if TYPE_CHECKING:
    pass

Call = tuple[tuple[Any, ...], dict[str, Any]]


@contextlib.contextmanager
def where_called(owner: Any, call: Any) -> Iterator[None]:
    """The module on the device its recorded call ran on, while it is compiled or exported. Under
    ``offload: model`` the warmup ran each block on the execution device, and the offload hook has
    moved the component back to the CPU since; what is compiled must see the block's parameters where
    the call will find them (aot-compile guards their device; an AOTInductor package is built for
    one device), so it is moved there, one block at a time (never the whole pipeline), and put back."""
    import torch
    from torch.utils._pytree import tree_leaves

    called = {t.device for t in tree_leaves(call) if isinstance(t, torch.Tensor) and t.device.type != "cpu"}
    held = {t.device for t in (*owner.parameters(), *owner.buffers())}
    if len(called) != 1 or len(held) != 1 or held == called:
        yield
        return
    try:
        owner.to(next(iter(called)))  # inside: a move that fails half-way (out of memory) is undone too
        yield
    finally:
        owner.to(next(iter(held)))


def flatten_call(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[list[Any], Any]:
    """The call's leaves, kwargs in name order (a package reorders kwargs to its own spec, so the order a
    caller writes them in must not matter here either), and the spec to rebuild it."""
    from torch.utils._pytree import tree_flatten

    return tree_flatten((args, dict(sorted(kwargs.items()))))


def call_tensors(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    import torch

    return [t for t in flatten_call(args, kwargs)[0] if isinstance(t, torch.Tensor)]


def call_strides(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[list[int]]:
    return [list(t.stride()) for t in call_tensors(args, kwargs)]


def floats_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[float]:
    """Float arguments: not in a signature (Dynamo does not specialize on them), but torch.export and
    aot_compile bake their values into what they compile."""
    return [x for x in flatten_call(args, kwargs)[0] if isinstance(x, float)]


def snapshot(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Call:
    """A copy of the call's inputs to compile from later. Each tensor keeps the caller's layout (a slice
    stays strided: the artifact is built for what the pipeline passes); a layout where elements share
    memory (expand) is made dense instead, so an artifact never expects one and every input can be
    copied into what it was built for."""
    import torch
    from torch.utils._pytree import tree_map

    def copy(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        t = value.detach()
        if copyable(t.shape, t.stride()):
            return relayout(t, t.stride())
        return t.clone(memory_format=torch.contiguous_format)

    return tree_map(copy, (tuple(args), dict(kwargs)))


def copyable(shape: Any, strides: Any) -> bool:
    """Whether a tensor of ``shape`` can be given ``strides`` by copying into them: no two elements
    share memory (a dimension of size 1 or an empty tensor excepted). Expanded tensors (stride 0)
    and overlapping views cannot; strided slices and permutations can."""
    if len(shape) != len(strides):
        return False
    if 0 in shape:
        return True
    span = 0  # highest offset reachable through the smaller strides
    for n, s in sorted(((n, s) for n, s in zip(shape, strides, strict=True) if n != 1), key=lambda d: d[1]):
        if s <= span:
            return False
        span += s * (n - 1)
    return True


def relayout(t: Any, strides: Any) -> Any:
    """A copy of ``t`` with exactly ``strides`` (``.contiguous()`` would keep a size-1 dimension's
    stride, and could not make a strided layout); ``strides`` must be :func:`copyable`."""
    import torch

    out = torch.empty_strided(tuple(t.shape), tuple(strides), dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


def structure(module: Any) -> str:
    """What must be equal for two instances to share one package: every tensor's name, shape and
    dtype, and every submodule's class, attention processor and plain attributes (a forward chunk
    size, a flag) that could change the code the block runs without adding a tensor."""
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    tensors = sorted((k, list(t.shape), str(t.dtype)) for k, t in state.items())
    parts = []
    for name, sub in module.named_modules():
        plain = {k: v for k, v in sorted(vars(sub).items())
                 if isinstance(v, (bool, int, float, str, type(None))) and k != "training"}
        processor = getattr(sub, "processor", None)
        parts.append([name, type(sub).__qualname__, type(processor).__qualname__ if processor else None, plain])
    return json.dumps([tensors, parts], default=str)


def structure_digest(module: Any) -> str:
    """:func:`structure` as 32 hex digits: what aot-compile's records name an instance's group by."""
    return hashlib.sha256(structure(module).encode()).hexdigest()[:32]


#: What a :class:`Watch` calls for every call of a watched module: (name, module, forward, args,
#: kwargs) -> the call's output (it calls ``forward(*args, **kwargs)`` itself).
OnCall = Callable[[str, Any, Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


class Watch:
    """Every call of each of ``modules`` ((name, module) pairs) goes through ``on_call``, in the layer
    ``layer`` of the forwards registry (aotbuild/forwards.py), until :meth:`remove` puts back what was
    below each: the one way a build's recorder (aot-compile's, :class:`aotbuild.strategies.aot_compile.
    CallRecorder`) and the proof's reference recording watch a warmup. (aot-package's recorders go
    through the dispatcher's record mode instead: their signatures must be the serving dispatcher's.)"""

    def __init__(self, modules: list[tuple[str, Any]], layer: str, on_call: OnCall) -> None:
        self.modules = list(modules)
        self.layer = layer
        for name, module in self.modules:
            forwards.wrap(module, layer, lambda inner, n=name, m=module: _through(on_call, n, m, inner))

    def remove(self) -> None:
        for _, module in reversed(self.modules):
            forwards.unwrap(module, self.layer)


def _through(on_call: OnCall, name: str, module: Any, forward: Callable[..., Any]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        return on_call(name, module, forward, args, kwargs)

    return run
