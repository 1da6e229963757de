"""Strategy registry: the one place that maps a recipe's ``strategy:`` name to its implementation."""

from __future__ import annotations

from aotbuild.registry import Registry
from aotbuild.strategies.base import BuildJob, Built, Planned, Strategy

__all__ = ["BuildJob", "Built", "Planned", "Strategy", "get_strategy", "strategy_names"]

_REGISTRY: Registry[Strategy] = Registry("strategy", {
    "jit-cache": ("aotbuild.strategies.jit_cache", "JitCache"),
    "aot-package": ("aotbuild.strategies.aot_package", "AotPackage"),
    "aot-compile": ("aotbuild.strategies.aot_compile", "AotCompile"),
})
strategy_names = _REGISTRY.names
get_strategy = _REGISTRY.get
