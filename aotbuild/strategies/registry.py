"""Strategy registry: the one place that maps a recipe's ``strategy:`` name to its implementation.

It is a module of its own, not the package's ``__init__``, so that importing ``aotbuild.strategies.base``
(the interface, a lower layer) does not import the table of every implementation (a higher one): the
import-linter contracts in pyproject.toml hold the two layers apart."""

from __future__ import annotations

from pathlib import Path

from aotbuild.cache.manifest import Manifest
from aotbuild.cache.store import Store
from aotbuild.strategies.base import Strategy
from aotbuild.utils.registry import Registry

__all__ = ["get_strategy", "strategy_names", "records_problem", "checked_store"]

_REGISTRY: Registry[Strategy] = Registry("strategy", {
    "jit-cache": ("aotbuild.strategies.jit_cache", "JitCache"),
    "aot-package": ("aotbuild.strategies.aot_package", "AotPackage"),
    "aot-compile": ("aotbuild.strategies.aot_compile", "AotCompile"),
    "auto": ("aotbuild.strategies.auto", "Auto"),
})
strategy_names = _REGISTRY.names
get_strategy = _REGISTRY.get


def records_problem(manifest: Manifest) -> str:
    """Why ``manifest``'s records are malformed for its strategy (``Strategy.check_records``), or "".
    A strategy this aotbuild does not know has nothing to check: no recipe can name it, so no
    reader uses its records."""
    if manifest.strategy not in strategy_names():
        return ""
    return get_strategy(manifest.strategy).check_records(manifest.packages)


def checked_store(root: Path | str, trusted: dict[str, bytes] | None = None) -> Store:
    """The store at ``root``, every manifest it hands out checked by its strategy as well (and, with
    ``trusted`` public keys, signed by one of them)."""
    return Store(Path(root), records=records_problem, trusted=trusted)
