"""Call signatures and the dispatcher that stands in a compiled component's ``forward``.

A *signature* is what a static-shape compile specializes on: every tensor's shape, dtype and device
kind, and the value of every non-float Python argument (floats are not specialized by Dynamo). The
builder records the signatures each warmup produced; at runtime the dispatcher sends a call whose
signature was built to the compiled forward, and any other call to the policy the user chose:
compile it (plain ``torch.compile`` behaviour), run it eagerly, or raise ``ShapeNotBuilt``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aotbuild.errors import ShapeNotBuilt


def _encode(value: Any) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", list(value.shape), str(value.dtype).replace("torch.", ""), value.device.type]
    if isinstance(value, float):
        return ["float"]
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _encode(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return ["object", type(value).__qualname__]


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    return json.dumps({"args": _encode(list(args)), "kwargs": _encode(kwargs)}, sort_keys=True)


def describe(sig: str) -> str:
    """Tensor shapes of a signature, short enough for an error message."""
    data = json.loads(sig)
    parts = []

    def walk(name: str, v: Any) -> None:
        if isinstance(v, list) and v[:1] == ["tensor"]:
            parts.append(f"{name}={'x'.join(map(str, v[1])) or 'scalar'}:{v[2]}")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                walk(f"{name}[{i}]", x)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(k, x)

    walk("arg", data["args"])
    walk("", data["kwargs"])
    return ", ".join(p.lstrip("[") for p in parts) or "no tensors"


class Dispatcher:
    """Replaces ``module.forward``: built signatures run compiled, others follow ``on_unbuilt``.

    ``on_unbuilt``: ``"record"`` (build: every call is compiled and its signature kept),
    ``"compile"`` (compile it now, as torch.compile would), ``"eager"``, or ``"error"``.
    """

    def __init__(self, component: str, eager: Callable[..., Any], compiled: Callable[..., Any],
                 built: set[str], on_unbuilt: str):
        self.component = component
        self.eager = eager
        self.compiled = compiled
        self.built = set(built)
        self.on_unbuilt = on_unbuilt
        self.calls = {"built": 0, "unbuilt": 0}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        sig = signature(args, kwargs)
        if sig in self.built:
            self.calls["built"] += 1
            return self.compiled(*args, **kwargs)
        self.calls["unbuilt"] += 1
        if self.on_unbuilt == "record":
            self.built.add(sig)
            return self.compiled(*args, **kwargs)
        if self.on_unbuilt == "error":
            raise ShapeNotBuilt(f"{self.component} was called with {describe(sig)}, a shape this cache did not "
                                f"build (strict_shapes=True); add it to the recipe's shapes and rebuild")
        if self.on_unbuilt == "eager":
            import torch

            with torch.compiler.set_stance("force_eager"):
                return self.eager(*args, **kwargs)
        return self.compiled(*args, **kwargs)


def install_dispatcher(module: Any, component: str, compiled: Callable[..., Any], built: set[str],
                       on_unbuilt: str) -> Dispatcher:
    """Put a dispatcher in ``module.forward`` (an instance attribute: the class is untouched)."""
    eager = module.forward
    dispatcher = Dispatcher(component, eager, compiled, built, on_unbuilt)
    module.forward = dispatcher
    return dispatcher
