"""Schedulers declared in a recipe (issue 56, item 2): ``schedulers: [DPMSolverMultistepScheduler, ...]``.

A scheduler decides the timestep's dtype and rank the denoiser sees; where the build cannot prove a
timestep of another dtype alike (aotbuild/pipeline/timesteps.py: a model that reads it as an index,
a value no conversion writes exactly), a recipe lists the schedulers it serves. Each is made as users
swap one, ``Class.from_config(pipe.scheduler.config)``; the build runs the warmup once with the
pipeline's own scheduler and once with each listed one (:func:`each`: the strategies' warmup and the
proof's eager recording alike), so the entry holds every call they make; the sorted class names are
a key factor (aotbuild/context.py). The names are checked when the recipe is read (a diffusers
scheduler class, with "did you mean") and, at plan time, each is made from the model's own scheduler
config (:func:`check_model`), so a class that cannot take it fails the plan, not the build.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from aotbuild.utils.suggest import suggest
from aotbuild.utils.text import printable


def known() -> list[str]:
    """diffusers' scheduler classes (its lazy table: nothing is imported but diffusers itself)."""
    import diffusers

    return sorted(n for n in dir(diffusers) if n.endswith("Scheduler") and not n.startswith(("Flax", "Scheduler")))


def check_names(recipe: Any) -> None:
    """Each of the recipe's ``schedulers`` is a diffusers scheduler class ("did you mean")."""
    if recipe.schedulers is None:
        return
    names = known()
    for i, name in enumerate(recipe.schedulers):
        if name not in names:
            raise recipe.error(f"schedulers[{i}]", f"{printable(name)[:80]!r} is not a diffusers scheduler class"
                                                   f"{suggest(name, names)} (e.g. DPMSolverMultistepScheduler, "
                                                   f"UniPCMultistepScheduler: diffusers' *Scheduler classes)")


def make(name: str, config: Mapping[str, Any]) -> Any:
    """``name``'s scheduler made from ``config`` (a pipeline's scheduler's), as users swap one."""
    import diffusers

    return getattr(diffusers, name).from_config(config)


def check_model(recipe: Any, config: Mapping[str, Any] | None) -> None:
    """Plan time: each listed scheduler made from the model's scheduler config (``config``: its
    ``scheduler_config.json``; None where the model has none), as the build will make it."""
    if not recipe.schedulers:
        return
    if config is None:
        raise recipe.error("schedulers", "the model has no scheduler (no scheduler/scheduler_config.json) to make "
                                         "these from: remove schedulers")
    import warnings

    for i, name in enumerate(recipe.schedulers):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # diffusers' notes on config keys the class does not take
                make(name, config)
        except Exception as exc:  # noqa: BLE001 - a missing library (scipy, torchsde), a config it cannot take
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise recipe.error(f"schedulers[{i}]", f"{name}.from_config(pipe.scheduler.config) fails for this model: "
                                                   f"{type(exc).__name__}: {first}") from None


@contextlib.contextmanager
def swapped(pipe: Any, name: str) -> Iterator[Any]:
    """``pipe`` with ``name``'s scheduler (made from its own scheduler's config) while inside; its own after."""
    own = pipe.scheduler
    pipe.scheduler = make(name, own.config)
    try:
        yield pipe.scheduler
    finally:
        pipe.scheduler = own


def each(pipe: Any, recipe: Any) -> Iterator[str]:
    """The pipeline with its own scheduler, then with each of the recipe's other ``schedulers`` in turn (the
    class name each time): a warmup runs once per scheduler class. The pipeline's own class, listed, is not
    run again: ``from_config`` of its own config makes the scheduler it has. Its own is put back after."""
    own = type(pipe.scheduler).__name__
    yield own
    for name in dict.fromkeys(recipe.schedulers or ()):
        if name == own:
            continue
        with swapped(pipe, name):
            yield name


def warm_up(pipe: Any, recipe: Any, call: Mapping[str, Any]) -> None:
    """``pipe(**call)`` once per scheduler (:func:`each`)."""
    for _ in each(pipe, recipe):
        pipe(**call)
