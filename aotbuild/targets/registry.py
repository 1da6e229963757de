"""Target registry: the one place that maps a recipe's ``target:`` name to its implementation.

It is a module of its own, not the package's ``__init__``, so that importing ``aotbuild.targets.base``
(the interface, a lower layer) does not import the table of every implementation (a higher one): the
import-linter contracts in pyproject.toml hold the two layers apart."""

from __future__ import annotations

from aotbuild.targets.base import Target
from aotbuild.utils.registry import Registry

__all__ = ["get_target", "target_names"]

_REGISTRY: Registry[Target] = Registry("target", {
    "inductor": ("aotbuild.targets.inductor", "InductorTarget"),
    "neuron": ("aotbuild.targets.neuron", "NeuronTarget"),
    "tpu": ("aotbuild.targets.tpu", "TPUTarget"),
})
target_names = _REGISTRY.names
get_target = _REGISTRY.get
