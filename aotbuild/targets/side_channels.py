"""No compiler side channel in a build job: torch's and Triton's remote caches stay out.

A remote compile cache set in a build worker's environment (``TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE``
with ``TORCHINDUCTOR_REDIS_URL``, ``TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE``, ``TRITON_CACHE_MANAGER``,
...: constants.REMOTE_COMPILER_CACHE_VARIABLES) can fill what an entry captures from somewhere the
entry does not record, or skip compiling what it should capture: every child a build starts (worker,
loader, proof, the AOTI and bench children) gets an environment without them (:func:`scrub`, called
where aotbuild/builder/child.py makes a child's environment). ``AOTBUILD_ALLOW_REMOTE_COMPILER_CACHE=1``
keeps them; the variables kept are then a key factor (:func:`factors`), so such entries never mix
with the others, and their manifests say so.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, MutableMapping
from typing import Any

from aotbuild import constants

__all__ = ["is_side_channel", "scrub", "factors"]


def is_side_channel(name: str) -> bool:
    return name in constants.REMOTE_COMPILER_CACHE_VARIABLES or name.startswith(
        constants.REMOTE_COMPILER_CACHE_PREFIXES)


def scrub(env: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    """Remove every remote compiler cache variable from ``env`` (in place; returned), unless
    AOTBUILD_ALLOW_REMOTE_COMPILER_CACHE=1."""
    if not constants.env_allow_remote_compiler_cache():
        for name in [n for n in env if is_side_channel(n)]:
            del env[name]
    return env


def factors(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """The key factor of a build that keeps its remote compiler cache (opted in): each variable kept,
    by name, with a digest of its value (a URL may hold a password: the value itself is never
    recorded). None (no factor, keys unchanged) when not opted in or none is set."""
    env = os.environ if environ is None else environ
    if not constants.env_allow_remote_compiler_cache():
        return None
    kept = {name: hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:16]
            for name, value in sorted(env.items()) if is_side_channel(name)}
    return kept or None
