"""Why a job is not in the cache, and what building it will cost: both from the nearest entry.

A miss is explained by comparing its factors with the nearest cached entry for the same component
(``plan`` and ``load_compiled`` print the differing factors), and a miss's build time and size are
estimated from the nearest entry of the same kind of compile. Both read manifests only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from aotbuild import advice, keys
from aotbuild.cache.manifest import Manifest

__all__ = ["explain_miss", "estimate", "ESTIMATE_SAME", "Entries"]


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
    compared = 0
    for manifest in sorted(manifests, key=lambda m: m.recipe != recipe_name):
        cached = dict(manifest.factors)
        if any(_factor(cached, p) != _factor(factors, p) for p in ESTIMATE_SAME):
            continue
        compared += 1
        if compared > MAX_CANDIDATES:
            break
        seconds = manifest.build.get("seconds") if isinstance(manifest.build, Mapping) else None
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
            continue  # an entry without a recorded build time cannot estimate one
        rank = (len(keys.differences(cached, factors)), manifest.recipe != recipe_name, manifest.key)
        if best is None or rank < best[0]:
            best = (rank, float(seconds), manifest.size)
    return None if best is None else (best[1], best[2])


#: Entries compared per miss at most (those of the same recipe first): plan stays near-linear in jobs
#: and entries (1,000 shapes against 501 entries took 96 s when every pair was compared in full).
MAX_CANDIDATES = 128


class Entries:
    """The store's manifests for explaining many misses: grouped by component name and class, each
    one's factors flattened once."""

    def __init__(self, manifests: Iterable[Manifest]):
        self.all: list[Manifest] = []
        self.count = 0
        self.groups: dict[tuple[str, Any], list[tuple[Manifest, dict[str, Any]]]] = {}
        for manifest in manifests:
            self.count += 1
            self.all.append(manifest)
            factors = dict(manifest.factors)
            group = (manifest.component, _factor(factors, ("component", "class")))
            self.groups.setdefault(group, []).append((manifest, keys.flatten(factors)))

    def nearest(self, recipe_name: str, component: str, factors: dict[str, Any]) -> Manifest | None:
        """The entry of the same component and class with the fewest differing factors (one of the same
        recipe wins a tie), among at most MAX_CANDIDATES of them."""
        here = keys.flatten(factors)
        group = self.groups.get((component, _factor(factors, ("component", "class"))), [])
        candidates = sorted(group, key=lambda item: item[0].recipe != recipe_name)[:MAX_CANDIDATES]
        best: tuple[tuple[int, bool], Manifest] | None = None
        for manifest, flat in candidates:
            rank = (sum(flat.get(k, _ABSENT) != here.get(k, _ABSENT) for k in flat.keys() | here.keys()),
                    manifest.recipe != recipe_name)
            if best is None or rank < best[0]:
                best = (rank, manifest)
        return best[1] if best else None


_ABSENT = object()


def explain_miss(manifests: Iterable[Manifest] | Entries, recipe_name: str, component: str,
                 factors: dict[str, Any], root: Path | None = None) -> str:
    """Why a job is not built: the factors that differ from the nearest entry of the same component
    and component class (an entry of the same recipe wins a tie; a renamed or copied recipe still
    finds its entries); an entry of another class is never compared (its whole config differs)."""
    entries = manifests if isinstance(manifests, Entries) else Entries(manifests)
    nearest = entries.nearest(recipe_name, component, factors)
    if nearest is None and not entries.count and root is not None:  # the classic: built into another root
        return f"not built: the cache at {root} is empty ({advice.another_root()})"
    if nearest is None:
        cls = _factor(factors, ("component", "class"))
        return f"not built: the cache has no entry for a {component} of class {cls} yet"
    diff = keys.differences(dict(nearest.factors), factors)
    if not diff:  # same factors, another key: an entry written by another aotbuild key format
        return "not built: an entry with these factors has another key (written by another aotbuild version?)"
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    built_with = _factor(dict(nearest.factors), ("target", "strategy"))
    if _factor(factors, ("target", "strategy")) == keys.AUTO and built_with != keys.AUTO:
        # most often an entry built before auto became the default (it was jit-cache)
        from aotbuild.utils.text import printable

        shown += (f" (a recipe naming no strategy is strategy: auto, the default; the nearest entry was built "
                  f"with {printable(built_with)}: name it in the recipe to serve that entry)")
    if any(line.startswith("compile.cpu_threads: ") and "absent" not in line for line in diff):
        shown += (" (the recipe's kernels hold the build's thread count, compile.options.cpp.dynamic_threads: "
                  "false: serve with torch.set_num_threads() at the cache's count, or drop that setting and build "
                  "again)")
    return f"not built: {shown}"
