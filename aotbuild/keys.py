"""Cache keys: sha256 of a canonical JSON of explicit, readable factors; and how two sets of factors differ.

What the factors are, and the one place they are assembled, is aotbuild/context.py
(``job_factors``). Here: the canonical JSON (sorted keys, no spaces, ASCII, no NaN), its sha256,
and :func:`differences`, which writes a miss's "``env.torch: X in the cache, Y here``".
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from aotbuild.utils.text import printable

#: The ``strategy`` a key holds for a job whose strategy the build chooses (``strategy: auto``, the
#: default, aotbuild/strategies/order.py): the strategy-independent factors plus this name; the chosen
#: strategy's own factors are in the entry (``Manifest.auto``), not the key.
AUTO = "auto"


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
    """Readable factor differences, e.g. ``env.torch: 2.13.0 in the cache, 2.14.1 here``.

    Factors come from files other people write (a model folder's ``config.json``), so a value is
    shown only when it is short and plainly not a secret; else only its length (what differs is
    named by its key either way). Keys and values are printed escaped, on one line."""
    a, b = flatten(cached), flatten(here)
    lines = []
    for path in sorted(set(a) | set(b)):
        if a.get(path, _ABSENT) != b.get(path, _ABSENT):
            lines.append(f"{printable(path)}: {_show(path, a.get(path, _ABSENT))} in the cache, "
                         f"{_show(path, b.get(path, _ABSENT))} here")
    return lines


_ABSENT = object()
#: The longest value a miss reason prints.
MAX_SHOWN = 64
#: A factor key that names a secret: its value is never printed.
_SECRET_KEY = re.compile(r"secret|token|passw|credential|private|api.?key|access.?key|auth", re.IGNORECASE)
_TOKEN_RUN = re.compile(r"[A-Za-z0-9+/=_\-]{16,}")


def secret_shaped(text: str) -> bool:
    """A run of 16+ characters shaped like a key, a token, a digest or a signature: base64's ``+/=``,
    more than four digits, or more than 40% capitals (``AKIA...``, ``hf_...``), unlike the names
    configs hold (``UNet2DConditionModel``, ``FluxSingleTransformerBlock``, ``rms_norm_across_heads``)."""
    for run in _TOKEN_RUN.findall(text):
        letters = [c for c in run if c.isalpha()]
        capitals = sum(c.isupper() for c in letters)
        if any(c in "+/=" for c in run) or sum(c.isdigit() for c in run) > 4 or (
                letters and capitals / len(letters) > 0.4):
            return True
    return False


def _show(path: str, value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    text = value if isinstance(value, str) else json.dumps(value)
    if len(text) > MAX_SHOWN or _SECRET_KEY.search(path) or (isinstance(value, str) and secret_shaped(text)):
        return f"a value of {len(text)} characters"
    return printable(text)
