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
    WeightsDiscarded,
)

__version__ = VERSION

#: name -> the module it is imported from on first use. tests/test_facade.py keeps this table, ``__all__``,
#: the ``TYPE_CHECKING`` block below and ``dir(aotbuild)`` in step (huggingface_hub's ``check_static_imports``).
_LAZY = {
    "load_compiled": "aotbuild.runtime",
    "LoadReport": "aotbuild.runtime",
    "refresh": "aotbuild.runtime",
    "refit": "aotbuild.runtime",
    "build": "aotbuild.builder.build",
    "BuildReport": "aotbuild.builder.build",
    "JobResult": "aotbuild.builder.build",
    "ResultStatus": "aotbuild.builder.build",
    "plan": "aotbuild.planner",
    "Job": "aotbuild.planner",
    "JobStatus": "aotbuild.planner",
    "load_recipe": "aotbuild.recipe.rules",
    "Recipe": "aotbuild.recipe.schema",
    "Shape": "aotbuild.recipe.schema",
    "parse_recipe": "aotbuild.recipe.rules",
    "push": "aotbuild.remote.sync",
    "PushReport": "aotbuild.remote.sync",
    "pull": "aotbuild.remote.sync",
    "PullReport": "aotbuild.remote.sync",
    "PullItem": "aotbuild.remote.sync",
    "PullStatus": "aotbuild.remote.sync",
    "sign": "aotbuild.remote.sync",
    "parse_remote": "aotbuild.remote.schemes",
    "Remote": "aotbuild.remote.base",
}

__all__ = ["AotbuildError", "CacheMiss", "ModelUnavailable", "PackageMismatch", "RecipeError", "RemoteError",
           "ShapeNotBuilt", "StaleGraph", "StoreError", "TargetUnavailable", "UsageError", "WeightsDiscarded",
           "__version__", "load_compiled", "LoadReport", "refresh", "refit", "build", "BuildReport", "JobResult",
           "ResultStatus", "plan", "Job", "JobStatus", "load_recipe", "parse_recipe", "Recipe", "Shape", "push",
           "PushReport", "pull", "PullReport", "PullItem", "PullStatus", "sign", "parse_remote", "Remote"]

if TYPE_CHECKING:
    from aotbuild.builder.build import BuildReport, JobResult, ResultStatus, build
    from aotbuild.planner import Job, JobStatus, plan
    from aotbuild.recipe.rules import load_recipe, parse_recipe
    from aotbuild.recipe.schema import Recipe, Shape
    from aotbuild.remote.base import Remote
    from aotbuild.remote.schemes import parse_remote
    from aotbuild.remote.sync import PullItem, PullReport, PullStatus, PushReport, pull, push, sign
    from aotbuild.runtime import LoadReport, load_compiled, refit, refresh


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'aotbuild' has no attribute {name!r}")


def __dir__() -> list[str]:
    """What tab completion and ``dir(aotbuild)`` offer: the lazy names too, before their first use."""
    return sorted(set(globals()) | set(_LAZY))
