"""Target registry: the one place that maps a recipe's ``target:`` name to its implementation."""

from __future__ import annotations

from aotbuild.registry import Registry
from aotbuild.targets.base import Availability, InstallResult, Target

__all__ = ["Availability", "InstallResult", "Target", "get_target", "target_names"]

_REGISTRY: Registry[Target] = Registry("target", {
    "inductor": ("aotbuild.targets.inductor", "InductorTarget"),
    "neuron": ("aotbuild.targets.neuron", "NeuronTarget"),
    "tpu": ("aotbuild.targets.tpu", "TPUTarget"),
})
target_names = _REGISTRY.names
get_target = _REGISTRY.get
