"""The protocol every feature implements (aotbuild/features/registry.py lists them): what a recipe
section checks at plan time, adds to a key, does to the pipeline before and after it loads, guards
after ``load_compiled``, and adds to the proof; and how many ranks a job needs. Every hook defaults to
nothing, so a feature implements only what it changes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aotbuild.recipe.schema import Recipe

__all__ = ["Feature", "Where"]


@dataclass(frozen=True)
class Where:
    """One job's place, as a feature's key factor needs it: the component (its name and class, as
    loaded or planned), the device, and the rank of a sharded job (None: unsharded)."""

    component: str
    component_class: str
    device: str
    rank: int | None = None


class Feature:
    """What a recipe section does to a pipeline. Every hook has a default that does nothing, so a
    feature implements only what it changes. ``section`` is the recipe's section and, where the
    feature adds one, the name of its key factor."""

    section: str = ""

    # -- planning and keying --------------------------------------------------------------------
    def check_recipe(self, recipe: Recipe, model: Any, pipeline_class: str) -> None:
        """Plan time, against the model's files (``model``: a ``models.ResolvedModel``; no weights
        loaded): ``recipe.error(...)`` for what this model cannot do."""

    def factors(self, recipe: Recipe, where: Where) -> dict[str, Any] | None:
        """The key factor this feature adds to one job (its ``section``), or None to add none (the key
        is then what it was without the section)."""
        return None

    def compile_settings(self, recipe: Recipe, settings: dict[str, Any]) -> dict[str, Any]:
        """The job's compile settings (a key factor) as this feature changes them."""
        return settings

    def ranks(self, recipe: Recipe) -> int:
        """How many ranks (processes, one entry each) one job of the recipe needs."""
        return 1

    # -- the pipeline -----------------------------------------------------------------------------
    def before_load(self, recipe: Recipe, device: str) -> None:
        """In a process about to load the pipeline (a build job, a proof, a replica), before its weights."""

    def prepare(self, pipe: Any, recipe: Recipe) -> None:
        """After the pipeline is loaded and placed: the change itself (build jobs, proofs, loads)."""

    def split(self, pipe: Any, recipe: Recipe, device: str) -> int | None:
        """In a process that is one rank of a job of ``ranks`` > 1 (a build's worker or proof, a
        replica under torchrun), after :meth:`prepare`: join the ranks and give this process its share
        of the compiled components. Returns this process's rank; None: this feature splits nothing."""
        return None

    def after_load(self, pipe: Any, recipe: Recipe) -> None:
        """At the end of ``load_compiled``, entries installed: guards on what the served pipe may change."""

    def changes_modules(self, recipe: Recipe, component: str) -> bool:
        """Whether the change puts other modules in ``component`` (torchao's, peft's), so its
        structure is not its config's meta twin's."""
        return False

    # -- the proof --------------------------------------------------------------------------------
    def tolerance(self, recipe: Recipe) -> float:
        """The compile noise this feature adds to a served output (magnitude 1): the proof's bound is at
        least this (0: the dtype's bound alone)."""
        return 0.0

    def relative_tolerance(self, recipe: Recipe) -> float:
        """A bound on each served output's ``|served - eager| / |eager|`` that replaces the absolute one, for a
        feature whose compiled kernels compute in another format than its eager reference (int8static: int8
        kernels that requantize each output, against quantize/dequantize around float ones); 0: none."""
        return 0.0

    def reference(self, pipe: Any, recipe: Recipe, component: str, calls: list[tuple[Any, Any, list[Any]]],
                  folder: Path) -> tuple[Path, list[tuple[Any, Any, list[Any]]]] | None:
        """The proof's extra reference, recorded on the eager pipeline: what the served entry must
        also reproduce after this feature's runtime change (a hot-swapped adapter), or None."""
        return None


