"""The features: the changes a recipe makes to a pipeline, behind one protocol (issue 33 item 2).

A *feature* is a recipe section that changes the pipeline a build compiles and a replica serves:
quantization (``model.quantization``, features/quantization.py), LoRA hot-swap (``lora``,
features/lora.py), tensor parallelism (``parallel``, features/parallel.py) and the declared
pipeline changes (``changes``, aotbuild/pipeline/changes.py). Each implements :class:`Feature`; planning,
keying, building, proving and loading iterate :func:`used` instead of calling each by hand, and a
feature's module is imported only when a recipe uses it (a plain recipe's ``load_compiled`` imports
none: tests/test_imports.py).

Adding one (an IP-Adapter, a ControlNet, an attention backend) is one module with a ``Feature``
subclass (aotbuild/features/base.py) and one line in :data:`FEATURES`: its recipe section, module and
class, and the cheap test of whether a recipe uses it (recipe data only: nothing is imported to answer it).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aotbuild.features.base import Feature

if TYPE_CHECKING:
    from aotbuild.recipe.schema import Recipe

__all__ = ["FEATURES", "used", "names", "tolerance", "relative_tolerance", "calibrated", "changes_modules",
           "detect_changes"]


@dataclass(frozen=True)
class _Entry:
    section: str
    module: str
    cls: str
    uses: Callable[[Recipe], bool]


#: Every feature, in the order their hooks run (quantization before LoRA: peft wraps the quantized
#: layers). ``uses`` reads the recipe's data only.
FEATURES: tuple[_Entry, ...] = (
    _Entry("quantization", "aotbuild.features.quantization", "Quantization",
           lambda r: r.model.quantization is not None),
    _Entry("lora", "aotbuild.features.lora", "Lora", lambda r: r.lora is not None),
    _Entry("parallel", "aotbuild.features.parallel", "TensorParallel", lambda r: r.tensor_parallel > 1),
    _Entry("changes", "aotbuild.pipeline.changes", "DeclaredChanges", lambda r: r.changes is not None),
)

_instances: dict[str, Feature] = {}


def _get(entry: _Entry) -> Feature:
    if entry.section not in _instances:
        _instances[entry.section] = getattr(importlib.import_module(entry.module), entry.cls)()
    return _instances[entry.section]


def used(recipe: Recipe) -> list[Feature]:
    """The features ``recipe`` uses, in :data:`FEATURES` order; only their modules are imported."""
    return [_get(e) for e in FEATURES if e.uses(recipe)]


def names() -> tuple[str, ...]:
    return tuple(e.section for e in FEATURES)


def tolerance(recipe: Recipe, dtype_bound: float) -> float:
    """The proof's bound for ``recipe``: the dtype's, or the largest a feature it uses needs."""
    return max([dtype_bound, *(f.tolerance(recipe) for f in used(recipe))])


def relative_tolerance(recipe: Recipe) -> float:
    """The proof's relative bound for ``recipe`` (the largest a feature it uses asks for), or 0: none."""
    return max([0.0, *(f.relative_tolerance(recipe) for f in used(recipe))])


def calibrated(recipe: Recipe, component: str) -> bool:
    """Whether ``component`` is quantized by a type calibrated at build (int8static): the proof's eager
    reference is then the quantized model, calibrated as the build calibrated it."""
    from aotbuild.recipe.schema import CALIBRATED_QUANT_TYPES

    q = recipe.model.quantization
    if q is None or q.quant_type not in CALIBRATED_QUANT_TYPES:
        return False
    return component in (q.components if q.components is not None else recipe.compile.components)


def changes_modules(recipe: Recipe, component: str) -> bool:
    """Whether a feature ``recipe`` uses puts other modules in ``component`` (torchao's, peft's)."""
    return any(f.changes_modules(recipe, component) for f in used(recipe))


def detect_changes(pipe: Any, recipe: Recipe) -> Any:
    """``changes.detect`` of ``pipe`` with what ``recipe``'s features put in its components (a
    ``changes.Detected``)."""
    from aotbuild.pipeline import changes

    return changes.detect(pipe, recipe, changed_modules=lambda component: changes_modules(recipe, component))

