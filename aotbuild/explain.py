"""Why a job is not in the cache, and what building it will cost: both from the nearest entry.

A miss is explained by comparing its factors with the nearest cached entry for the same component
(``plan`` and ``load_compiled`` print the differing factors), and a miss's build time and size are
estimated from the nearest entry of the same kind of compile. Both read manifests only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aotbuild import keys
from aotbuild.manifest import Manifest

__all__ = ["explain_miss", "estimate", "ESTIMATE_SAME"]


#: The factors an entry must share with a job to estimate its cost: the same kind of compile of the
#: same kind of module on the same kind of device (differing shapes, dtypes, versions are fine).
ESTIMATE_SAME = (("component", "class"), ("target", "name"), ("target", "strategy"), ("compile", "scope"),
                 ("device",))


def _factor(factors: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        factors = factors.get(part) if isinstance(factors, dict) else None
    return factors


def estimate(manifests: Iterable[Manifest], factors: dict[str, Any],
             recipe_name: str = "") -> tuple[float, int] | None:
    """(build seconds, entry bytes) of the nearest cached entry: the same component class, target,
    strategy, scope and device fingerprint, then the fewest differing factors (an entry of the same
    recipe, then the smaller key, wins a tie); None when no entry qualifies."""
    best: tuple[tuple[int, bool, str], float, int] | None = None
    for manifest in manifests:
        cached = dict(manifest.factors)
        if any(_factor(cached, p) != _factor(factors, p) for p in ESTIMATE_SAME):
            continue
        seconds = manifest.build.get("seconds") if isinstance(manifest.build, Mapping) else None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            continue  # an entry without a recorded build time cannot estimate one
        rank = (len(keys.differences(cached, factors)), manifest.recipe != recipe_name, manifest.key)
        if best is None or rank < best[0]:
            best = (rank, float(seconds), manifest.size)
    return None if best is None else (best[1], best[2])


def explain_miss(manifests: Iterable[Manifest], recipe_name: str, component: str,
                 factors: dict[str, Any], root: Path | None = None) -> str:
    """Why a job is not built: the factors that differ from the nearest entry for the same component
    (an entry of the same recipe wins a tie; a renamed or copied recipe still finds its entries)."""
    best: tuple[int, int, list[str]] | None = None
    seen = 0
    for manifest in manifests:
        seen += 1
        if manifest.component != component:
            continue
        diff = keys.differences(dict(manifest.factors), factors)
        rank = (len(diff), manifest.recipe != recipe_name)
        if best is None or rank < best[:2]:
            best = (*rank, diff)
    if best is None and not seen and root is not None:  # the classic: built into another cache root
        return f"not built: the cache at {root} is empty (built into another? pass --cache or set AOTBUILD_CACHE)"
    if best is None:
        return f"not built: the cache has no entry for a {component}"
    diff = best[2]
    if not diff:  # same factors, another key: an entry written by another aotbuild key format
        return "not built: an entry with these factors has another key (written by another aotbuild version?)"
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    return f"not built: {shown}"
