"""Cache keys: sha256 of a canonical JSON of explicit, readable factors.

The factors are everything that can change a compiled artifact and nothing that cannot:

==================  ===================================================================================
``format``          aotbuild's key/manifest format version
``model``           pipeline class, weights variant, built-in model version (for ``builtin:`` ids)
``component``       component name, class, architecture config (``config.json`` without paths or
                    versions), dtype
``target``          target name and ``strategy``
``compile``         the exact compile settings (scope, mode, fullgraph, dynamic, options, backend)
``shape``           height, width, batch_size (images per prompt)
``warmup``          every warmup argument but the prompt text; prompts only as ``{"texts": N}`` (guidance
                    and a list of prompts change the denoiser's batch)
``env``             torch version and git build, diffusers, transformers, python major.minor
``device``          the target's fingerprint: device kind and, for CPU Inductor, machine and vector
                    ISA; for CUDA the compute capability, CUDA and Triton versions
``weights``         only when the target's artifacts embed weights (none do yet)
==================  ===================================================================================

Never an absolute path, hostname, user, cwd, rank or device index: peers lose caches to exactly
that. The factors are written into each manifest so a miss can be explained later.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from aotbuild import constants
from aotbuild.recipe import Recipe, Shape


def environment_factors() -> dict[str, Any]:
    import torch

    return {
        "torch": torch.__version__,
        "torch_build": getattr(torch.version, "git_version", None),
        "diffusers": _version("diffusers"),
        "transformers": _version("transformers"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def job_factors(recipe: Recipe, component: str, component_class: str, config: dict[str, Any], shape: Shape,
                *, pipeline_class: str, builtin_version: int | None, dtype: str, compile_settings: dict[str, Any],
                environment: dict[str, Any], device_fingerprint: dict[str, Any],
                warmup_defaults: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        "format": constants.FORMAT_VERSION,
        "model": {"pipeline": pipeline_class, "variant": recipe.model.variant, "builtin_version": builtin_version},
        "component": {"name": component, "class": component_class, "config": config, "dtype": dtype},
        "target": {"name": recipe.target, "strategy": recipe.strategy},
        "compile": compile_settings,
        "shape": shape.as_dict(),
        "warmup": recipe.warmup_factors(warmup_defaults),
        "env": environment,
        "device": device_fingerprint,
    }


def canonical_json(factors: dict[str, Any]) -> str:
    return json.dumps(factors, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def key_of(factors: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_json(factors).encode("ascii")).hexdigest()


def flatten(factors: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in factors.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, path + "."))
        else:
            out[path] = v
    return out


def differences(cached: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """Readable factor differences, e.g. ``env.torch: 2.13.0 in the cache, 2.14.1 here``."""
    a, b = flatten(cached), flatten(here)
    lines = []
    for path in sorted(set(a) | set(b)):
        if a.get(path, _ABSENT) != b.get(path, _ABSENT):
            lines.append(f"{path}: {_show(a.get(path, _ABSENT))} in the cache, {_show(b.get(path, _ABSENT))} here")
    return lines


_ABSENT = object()


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    return json.dumps(value) if not isinstance(value, str) else value
