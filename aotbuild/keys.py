"""Cache keys: sha256 of a canonical JSON of explicit, readable factors; and how two sets of factors differ.

What the factors are, and the one place they are assembled, is aotbuild/context.py
(``job_factors``). Here: the canonical JSON (sorted keys, no spaces, ASCII, no NaN), its sha256,
and :func:`differences`, which writes a miss's "``env.torch: X in the cache, Y here``".
"""

from __future__ import annotations

import hashlib
import json
from typing import Any


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
