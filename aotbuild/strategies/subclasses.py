"""Tensor-subclass weights (torchao's quantized ``Int8Tensor``) as an AOT package reads them (issue 57).

torch.export cannot hand a package a tensor subclass: torch 2.13's ``unwrap_tensor_subclass_parameters``
registers a parametrization on each module holding one, whose ``right_inverse`` lists the subclass's
plain inner tensors depth-first, so a package asks for ``<module>.parametrizations.<weight>.original<i>``
(the int8 values, the scale, the zero point). These helpers name a live module's inner tensors that way
(runner.named_tensors, runner.lookup) and rebuild subclass weights around given inner tensors for
``torch.func.functional_call`` (prepack.check_other_weights' eager reference).
"""

from __future__ import annotations

import re
from typing import Any

from aotbuild.errors import PackageMismatch

#: torch.export's name for the i-th plain tensor of a tensor-subclass weight (torchao's quantized
#: ``Int8Tensor``: qdata, scale, zero_point): torch 2.13's ``unwrap_tensor_subclass_parameters``
#: registers a parametrization on the module whose ``right_inverse`` lists the subclass's inner tensors
#: depth-first, so an AOT package asks for ``<module>.parametrizations.<weight>.original<i>``.
_UNWRAPPED = re.compile(r"^(?:(.*)\.)?parametrizations\.([^.]+)\.original(\d+)$")


def unwrapped(fqn: str) -> tuple[str, str, int] | None:
    """(module path, weight name, index) of an inner tensor's name (:data:`_UNWRAPPED`), else None."""
    m = _UNWRAPPED.match(fqn)
    return None if m is None else (m.group(1) or "", m.group(2), int(m.group(3)))


def store_key(fqn: str) -> str:
    """The key ``fqn``'s tensor is under in its module's dict: an inner tensor's is its subclass weight's."""
    parts = unwrapped(fqn)
    return fqn.rsplit(".", 1)[-1] if parts is None else parts[1]


def is_subclass(t: Any) -> bool:
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    return is_traceable_wrapper_subclass(t)


def inner_tensors(t: Any) -> list[Any]:
    """A tensor-subclass weight's plain tensors, depth-first in ``__tensor_flatten__``'s order (what
    torch.export lifts, :data:`_UNWRAPPED`); a plain tensor: itself. A value that is not a tensor
    (an opaque object) is refused: no package of such a weight is served."""
    import torch

    if not is_subclass(t):
        return [t]
    out: list[Any] = []
    for attr in t.__tensor_flatten__()[0]:
        value = getattr(t, attr)
        if not isinstance(value, torch.Tensor):
            raise PackageMismatch(f"a {type(t).__name__} weight holds {attr!r}, which is not a tensor: an AOT "
                                  f"package cannot be handed it")
        out.extend(inner_tensors(value))
    return out


def wrapped(module: Any, flat: dict[str, Any]) -> dict[str, Any]:
    """``flat`` (tensors by runner.named_tensors' names) as ``torch.func.functional_call`` takes them:
    each subclass weight with an inner tensor in ``flat`` rebuilt around it (its other inner tensors as
    ``module`` holds them), under its own name."""
    out = {k: v for k, v in flat.items() if unwrapped(k) is None}
    groups: dict[tuple[str, str], dict[int, Any]] = {}
    for k, v in flat.items():
        parts = unwrapped(k)
        if parts is not None:
            groups.setdefault(parts[:2], {})[parts[2]] = v
    for (prefix, leaf), given in groups.items():
        name = f"{prefix}.{leaf}" if prefix else leaf
        owner = module.get_submodule(prefix) if prefix else module
        outer = owner._parameters.get(leaf)
        out[name] = _rebuilt(outer if outer is not None else owner._buffers[leaf], given, [0])
    return out


def _rebuilt(t: Any, given: dict[int, Any], at: list[int]) -> Any:
    if not is_subclass(t):
        value = given.get(at[0], t)
        at[0] += 1
        return value
    attrs, meta = t.__tensor_flatten__()
    inner = {attr: _rebuilt(getattr(t, attr), given, at) for attr in attrs}
    return type(t).__tensor_unflatten__(inner, meta, t.size(), t.stride())
