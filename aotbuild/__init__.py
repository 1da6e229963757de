"""aotbuild: ahead-of-time compile-and-cache for PyTorch and diffusers pipelines.

``import aotbuild`` is light: the public functions are imported on first use (huggingface_hub's
lazy ``__init__``), so a serving process that only calls :func:`load_compiled` never loads the CLI,
YAML writers or the Hub client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aotbuild.constants import VERSION
from aotbuild.errors import (
    AotbuildError,
    CacheMiss,
    ModelUnavailable,
    PackageMismatch,
    RecipeError,
    RemoteError,
    ShapeNotBuilt,
    StaleGraph,
    StoreError,
    TargetUnavailable,
    UsageError,
)

__version__ = VERSION

_LAZY = {
    "load_compiled": "aotbuild.runtime",
    "LoadReport": "aotbuild.runtime",
    "build": "aotbuild.builder",
    "plan": "aotbuild.planner",
    "load_recipe": "aotbuild.recipes",
    "Recipe": "aotbuild.recipe",
    "parse_recipe": "aotbuild.recipes",
    "push": "aotbuild.sync",
    "pull": "aotbuild.sync",
    "sign": "aotbuild.sync",
    "parse_remote": "aotbuild.remote",
}

__all__ = ["AotbuildError", "CacheMiss", "ModelUnavailable", "PackageMismatch",
           "RecipeError", "RemoteError", "ShapeNotBuilt", "StaleGraph", "StoreError",
           "TargetUnavailable", "UsageError", "__version__", "load_compiled", "LoadReport", "build", "plan",
           "load_recipe", "parse_recipe", "Recipe", "push", "pull", "sign", "parse_remote"]

if TYPE_CHECKING:
    from aotbuild.builder import build
    from aotbuild.planner import plan
    from aotbuild.recipe import Recipe
    from aotbuild.recipes import load_recipe, parse_recipe
    from aotbuild.remote import parse_remote
    from aotbuild.runtime import LoadReport, load_compiled
    from aotbuild.sync import pull, push, sign


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'aotbuild' has no attribute {name!r}")
