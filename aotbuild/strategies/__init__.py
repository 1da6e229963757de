"""Strategy registry: the one place that maps a recipe's ``strategy:`` name to its implementation."""

from __future__ import annotations

import importlib

from aotbuild.errors import UsageError
from aotbuild.strategies.base import BuildJob, Built, Planned, Strategy

__all__ = ["BuildJob", "Built", "Planned", "Strategy", "get_strategy", "strategy_names"]

_FACTORIES = {
    "jit-cache": ("aotbuild.strategies.jit_cache", "JitCache"),
    "aot-package": ("aotbuild.strategies.aot_package", "AotPackage"),
    "aot-compile": ("aotbuild.strategies.aot_compile", "AotCompile"),
}
_instances: dict[str, Strategy] = {}


def strategy_names() -> tuple[str, ...]:
    return tuple(_FACTORIES)


def get_strategy(name: str) -> Strategy:
    if name not in _instances:
        try:
            module_name, class_name = _FACTORIES[name]
        except KeyError:
            raise UsageError(f"unknown strategy {name!r}; known: {', '.join(_FACTORIES)}") from None
        _instances[name] = getattr(importlib.import_module(module_name), class_name)()
    return _instances[name]
