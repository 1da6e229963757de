"""Target registry: the one place that maps a recipe's ``target:`` name to its implementation."""

from __future__ import annotations

from aotbuild.errors import UsageError
from aotbuild.targets.base import Availability, InstallResult, Target

__all__ = ["Availability", "InstallResult", "Target", "get_target", "target_names"]

_FACTORIES = {
    "inductor": ("aotbuild.targets.inductor", "InductorTarget"),
    "neuron": ("aotbuild.targets.neuron", "NeuronTarget"),
    "tpu": ("aotbuild.targets.tpu", "TPUTarget"),
}
_instances: dict[str, Target] = {}


def target_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def get_target(name: str) -> Target:
    if name not in _instances:
        try:
            module_name, class_name = _FACTORIES[name]
        except KeyError:
            raise UsageError(f"unknown target {name!r}; known: {', '.join(_FACTORIES)}") from None
        import importlib

        _instances[name] = getattr(importlib.import_module(module_name), class_name)()
    return _instances[name]
