"""One registry of what aotbuild puts in a module's ``forward`` (diffusers' ``HookRegistry`` is the model).

aotbuild wraps a module's forward in six places: a serving process's dispatcher (aotbuild/dispatch.py:
built calls to their artifacts, the others by the load's policy), a build job's recorders (which
calls the warmup makes), the proof's recorder, a text-length probe that stops the pipeline at a
component's first call, bench's compiled forward, and the export of a package computing in another
dtype than its weights' (aoti.computing_in). Each is a *layer*, put on and taken off here and nowhere else:

* :func:`wrap` puts a layer in ``module.forward`` (an instance attribute: the class is untouched) and
  remembers what was there before: nothing (the class's ``forward``), an aotbuild layer, or another
  library's wrapper (accelerate's offload hook, a diffusers hook), which the layer calls in turn;
* :func:`unwrap` puts back exactly what was below the layer: another library's wrapper survives
  aotbuild's layers coming and going (``del module.forward`` used to drop accelerate's offload hook
  along with a dispatcher). Layers come off in the reverse order they went on; a layer someone
  wrapped over since (offload enabled after ``load_compiled``) stays, and :func:`unwrap` says so;
* :func:`unwrapped` and :func:`class_forward` run a block with the forward below aotbuild's layers,
  or with the class's own, and put every layer back after: what a compile or an export traces.

The registry lives beside the modules (a weak mapping), not in them: a module's attributes, which
the dependency record compares (aotbuild/pipeline/dependencies.py), are what they were before.
"""

from __future__ import annotations

import contextlib
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["DISPATCH", "RECORD", "PROOF", "PROBE", "COMPILED", "COMPUTE", "wrap", "unwrap", "layers", "unwrapped",
           "class_forward", "copied"]

#: The layers' names.
DISPATCH = "dispatch"  # a serving dispatcher (aotbuild/dispatch.py), or a build's recording one
RECORD = "record"  # aot-compile's warmup recorder
PROOF = "proof"  # the proof's warmup recorder
PROBE = "probe"  # textlen.probe: stops the pipeline at the component's first call
COMPILED = "compiled"  # bench: the module's forward compiled in its process
COMPUTE = "compute"  # aoti.computing_in: an export computing in another dtype than the weights'

#: Stands for "no instance attribute ``forward``": the class's own forward runs.
_NONE = object()


def _weak(value: Any) -> Any:
    """A reference to ``value`` that does not keep it alive (``_NONE`` as it is; a bound method by its
    object and function); ``value`` itself where it takes no weak reference."""
    if value is _NONE:
        return value
    if isinstance(value, types.MethodType):
        return weakref.WeakMethod(value)
    try:
        return weakref.ref(value)
    except TypeError:
        return lambda: value


class _Layer:
    """One layer: its name, its forward and what was below it, held weakly. The registry is keyed weakly
    by module, but a value that held the layer's forward strongly (a dispatcher, whose eager forward is
    the module's bound method) kept its key, the module, alive: every served module, and so every
    pipeline ``del``-ed for a reload, stayed in memory (issue 52). The module holds its layers itself
    (its ``forward`` and what that calls); the registry only remembers them."""

    __slots__ = ("name", "_forward", "_below")

    def __init__(self, name: str, forward: Callable[..., Any], below: Any):
        self.name = name
        self._forward = _weak(forward)
        self._below = _weak(below)

    @property
    def forward(self) -> Any:
        return self._forward()

    @property
    def below(self) -> Any:
        """``vars(module)["forward"]`` before this layer, or ``_NONE``."""
        if self._below is _NONE:
            return _NONE
        below = self._below()
        return _NONE if below is None else below


#: module -> its layers, innermost first
_LAYERS: weakref.WeakKeyDictionary[Any, list[_Layer]] = weakref.WeakKeyDictionary()


def _current(module: Any) -> Any:
    return vars(module).get("forward", _NONE)


def _put(module: Any, forward: Any) -> None:
    if forward is _NONE:
        vars(module).pop("forward", None)
    else:
        module.forward = forward


def wrap(module: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Callable[..., Any]:
    """Put ``make(module.forward)`` on ``module`` as the layer ``name`` (outermost); return it."""
    below = _current(module)
    forward = make(module.forward)
    module.forward = forward
    _LAYERS.setdefault(module, []).append(_Layer(name, forward, below))
    return forward


def unwrap(module: Any, name: str) -> bool:
    """Take off the outermost layer ``name``, putting back what was below it. False when ``module``
    has no such layer, or when something else is wrapped over it (the layer stays where it is: taking
    it off would drop what is above it)."""
    stack = _LAYERS.get(module) or []
    layer = next((la for la in reversed(stack) if la.name == name), None)
    if layer is None or _current(module) is not layer.forward:
        return False
    stack.remove(layer)
    _put(module, layer.below)
    if not stack:
        _LAYERS.pop(module, None)
    return True


def layers(module: Any, name: str | None = None) -> list[Callable[..., Any]]:
    """The forwards of ``module``'s layers (only those named ``name``), innermost first."""
    return [la.forward for la in _LAYERS.get(module) or [] if name is None or la.name == name]


def copied(module: Any, memo: dict[int, Any]) -> None:
    """Register, for the copy ``copy.deepcopy`` is making of ``module`` (``memo``), the copies of
    ``module``'s layers that it has made so far (a layer's ``__deepcopy__`` calls this once its own copy
    is in ``memo``): ``unwrap`` and ``layers`` then work on the copy as on the original."""
    import copy

    twin = memo.get(id(module))
    if twin is None or twin is module:
        return
    stack = []
    for layer in _LAYERS.get(module) or []:
        if id(layer.forward) not in memo:
            break  # the layers above it are not copied yet
        below = layer.below if layer.below is _NONE else copy.deepcopy(layer.below, memo)
        stack.append(_Layer(layer.name, memo[id(layer.forward)], below))
    if stack:
        _LAYERS[twin] = stack


@contextlib.contextmanager
def unwrapped(module: Any) -> Iterator[None]:
    """Within it, ``module.forward`` is what was there before aotbuild's first layer (another
    library's wrapper stays): a compile of the module's own forward (a dispatcher's lazy fallback)."""
    stack = _LAYERS.get(module) or []
    top = _current(module)
    _put(module, stack[0].below if stack else top)
    try:
        yield
    finally:
        _put(module, top)


@contextlib.contextmanager
def class_forward(module: Any) -> Iterator[None]:
    """Within it, ``module`` has no instance ``forward`` at all, aotbuild's or another library's: its
    class's ``forward`` runs, as ``torch.export`` and ``aot_compile`` trace the module itself."""
    top = _current(module)
    _put(module, _NONE)
    try:
        yield
    finally:
        _put(module, top)


class _Probed(Exception):
    """Stops the pipeline at the component's first call: what it was called with is all a probe needs."""


def first_call(pipe: Any, module: Any, call: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The component's first call when the pipeline is called with ``call``: the pipeline runs (text
    encoding, latents) up to that call, which is stopped before it runs (its inputs as the pipeline made
    them: stopped there, it changes none of them again). What the text-length and timestep probes read
    (aotbuild/pipeline/textlen.py, aotbuild/pipeline/timesteps.py)."""
    seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def stop(*args: Any, **kwargs: Any) -> Any:
        seen.append((args, kwargs))
        raise _Probed

    wrap(module, PROBE, lambda _inner: stop)
    try:
        pipe(**call)
    except _Probed:
        pass
    finally:
        unwrap(module, PROBE)
    if not seen:
        raise RuntimeError("the pipeline never called the component")
    args, kwargs = seen[0]
    return tuple(args), dict(kwargs)

