"""aotbuild: ahead-of-time compile-and-cache for PyTorch and diffusers pipelines.

A recipe (a YAML file, or a dict) names a model, the components to compile, the shapes and the
target. ``aotbuild build RECIPE`` (or :func:`build`) compiles every job and stores it in a cache;
:func:`load_compiled` installs the entries in a fresh process, whose first call then compiles
nothing. From a clone, after ``aotbuild build recipes/tiny_sd_cpu.yaml``::

    import aotbuild

    pipe = aotbuild.load_compiled("recipes/tiny_sd_cpu.yaml", on_miss="error")
    image = pipe(prompt="a cat", height=64, width=64, num_inference_steps=2, guidance_scale=0.0).images[0]
    print(pipe.aotbuild_report)  # what hit, what missed and why

load_compiled(recipe, *, pipe=None, cache=None, remote=None, on_miss='compile', strict_shapes=False,
              trusted_keys=None, discard_weights=False)
    One recipe's pipeline (or ``pipe``) with its cached entries installed; ``on_miss``: "compile",
    "eager" or "error" (raise CacheMiss); ``pipe.aotbuild_report`` says what hit and what missed.
build(recipes, *, cache=None, progress=None, shard=None, remote=None, max_size=None, sign_key=None,
      pipe=None, retry_failed=False)
    Build every job of ``recipes`` the cache lacks, each proven by a fresh process: a BuildReport.
plan(recipes, *, cache=None, remote=None, trusted_keys=None, signatures=True, failures=None)
    Every job of ``recipes`` (its key, hit or miss and why), building nothing: a list of Job.

``recipe``: a recipe file (str or os.PathLike), a dict of recipe keys, or a Recipe. ``recipes``
(build, plan, push, pull, sign): one of those or a folder of recipe files, or a list or tuple of
them; a str is always one path. ``cache``: the cache root (default: AOTBUILD_CACHE, then
``[tool.aotbuild] cache`` in the nearest pyproject.toml, then ~/.cache/aotbuild). ``remote``: a
URL (file://, hf://, s3://, gs://, az://: help(aotbuild.load_compiled) lists them) or a Remote.

Also: push, pull and sign (entries to and from a remote), parse_recipe, load_recipe, parse_remote,
refresh and refit (weights changed after a load); every error is an AotbuildError. The command line
is ``aotbuild --help``; docs/runtime.md and docs/cli.md say the rest.

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
