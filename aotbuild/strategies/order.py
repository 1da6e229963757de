"""``strategy: auto``, the default: which strategies a job tries, in which order, and what each did.

For each job the builder (aotbuild/builder/build.py) tries, in a fixed order per device kind
(:data:`ORDER`), the strategies that can serve the recipe here (:func:`choice`: those whose
``validate`` accepts it and whose ``availability`` is met; the others are excluded with their
words), builds with each until one builds *and passes the proof* (for every shape of the job's
component: see below), and stores that entry under the job's auto key. Auto never changes the
recipe's scope or ``fullgraph``: a model no strategy can capture as written fails with every
attempt's reason.

Why this order (docs/recipes.md, "Which strategy"): a fresh process's first image on the tiny UNet
(2 CPU cores, benchmarks/README.md) is 0.97x eager's with aot-package, 1.23x with aot-compile and
1.96x with jit-cache, and 1.17x / 1.37x / 2.41x on the SD 1.5-size UNet. No GPU was measured here;
what those figures measure (a Dynamo trace at every load, which the ahead-of-time strategies skip)
is host-side Python work, the same whatever the device, so CUDA keeps the order. A target no
ahead-of-time strategy accepts (neuron, tpu: both are inductor-only) has jit-cache alone.

Keys: the key of an auto job holds the strategy-independent factors and ``strategy: auto``
(aotbuild/strategies/auto.py adds no compile factor); each attempt is also one *concrete* job, the
recipe with that strategy named, whose key is exactly an explicit recipe's. A failed attempt is
remembered under that concrete key (the store's one rule for failures: skipped until
``--retry-failed``), so a rebuild goes straight to the strategy that worked. What the chosen
strategy adds to the key (its ``compile_factors``) is recorded in the entry (``Manifest.auto``) and
checked at load (aotbuild/runtime.py). No strategy adds one today: aot-compile keyed the CPU thread
count until its entries served any count (413934f, issue 36 item 3), and the count the inductor
target keys under ``cpp.dynamic_threads: false`` is strategy-independent, so it is in the auto key.

One strategy serves a component (its dispatcher is that strategy's), so the builder chooses per
component, for all its shapes (``builder.build._build_component``): a shape that fails a strategy takes the
whole component to the next one (:attr:`Outcome.DROPPED` on the shapes it had built).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from aotbuild.constants import Vocabulary
from aotbuild.errors import AotbuildError
from aotbuild.keys import AUTO
from aotbuild.strategies.registry import get_strategy

if TYPE_CHECKING:
    from aotbuild.context import Context
    from aotbuild.recipe.schema import Recipe
    from aotbuild.strategies.base import Strategy
    from aotbuild.targets.base import Target

#: The strategies auto tries, first to last, per device kind (the device's type); any other kind
#: (a neuron or tpu device) takes :data:`DEFAULT_ORDER`, where validate leaves jit-cache alone.
ORDER = {
    "cpu": ("aot-package", "aot-compile", "jit-cache"),
    "cuda": ("aot-package", "aot-compile", "jit-cache"),
}
DEFAULT_ORDER = ("aot-package", "aot-compile", "jit-cache")
#: On a CPU, auto's first try for a recipe that leaves ``compile.options.freezing`` unset: aot-package
#: with Inductor's freezing, its prepacked weights re-derived at load from the served pipeline's own
#: (docs/prepack.md, issue 39). Its proof must also show the served call faster than eager's
#: (aotbuild/builder/proof.py), else the component falls back to plain aot-package. Its concrete job is the
#: recipe naming ``strategy: aot-package`` and ``compile.options.freezing: true``.
PREPACKED = "aot-package+freezing"
#: A try's strategy and the compile options it adds to the recipe.
VARIANTS = {PREPACKED: ("aot-package", {"freezing": True})}


class Outcome(Vocabulary):
    """An attempt's outcome (``Attempt.outcome``; the manifest's ``attempts``, ``build --json``)."""

    BUILT = "built"
    #: failed now (its failure is recorded under the attempt's key, unless the pipeline did not load)
    FAILED = "failed"
    #: failed before (a failure record): not tried again until ``--retry-failed``
    FAILED_BEFORE = "failed before"
    #: not kept, or not tried, because another shape of the same component failed with that strategy
    #: (one strategy serves every shape of a component: the builder falls back for the whole component)
    DROPPED = "dropped"


def is_auto(recipe: Recipe) -> bool:
    """Whether the build chooses ``recipe``'s strategy per job."""
    return recipe.strategy == AUTO


def order(device: str) -> tuple[str, ...]:
    return ORDER.get(device.split(":")[0], DEFAULT_ORDER)


def strategy_of(name: str) -> str:
    """The strategy a try builds with (a try is a strategy, or :data:`PREPACKED`)."""
    return VARIANTS.get(name, (name, {}))[0]


def tried_recipe(recipe: Recipe, name: str) -> Recipe:
    """``recipe`` as the try ``name`` builds it: naming its strategy (and a variant's options)."""
    strategy, options = VARIANTS.get(name, (name, {}))
    if options:
        recipe = replace(recipe, compile=replace(recipe.compile, options={**recipe.compile.options, **options}))
    return replace(recipe, strategy=strategy)


def _tries(recipe: Recipe, device: str) -> tuple[str, ...]:
    """What auto considers for ``recipe`` on ``device``, in order, before validation (:func:`tries_on`)."""
    return tries_on(device, prepacked=not any(key.replace("-", "_") == "freezing" for key in recipe.compile.options))


def tries_on(device: str, prepacked: bool = True) -> tuple[str, ...]:
    """What auto tries on ``device``, in order, before validation: on a CPU, prepacked aot-package first
    where the recipe leaves freezing unset (``prepacked``; ``compile.options.freezing: false`` turns it
    off, ``true`` makes plain aot-package the prepacked one)."""
    names = order(device)
    if prepacked and device.split(":")[0] == "cpu" and strategy_of(PREPACKED) in names:
        return (PREPACKED, *names)
    return names


def summary(strategy: Strategy) -> str:
    """What ``aotbuild targets`` says of ``strategy``: its own summary; for auto, the order it tries,
    made from :func:`tries_on` (its summary once gave the CPU order without aot-package+freezing, the
    first try there: issue 55)."""
    if strategy.name != AUTO:
        return strategy.summary
    cpu, cuda, other = tries_on("cpu"), tries_on("cuda"), DEFAULT_ORDER
    orders = f"{', '.join(cpu)} on a CPU ({PREPACKED} unless the recipe sets compile.options.freezing)"
    orders += f"; {', '.join(cuda)} on CUDA" if cuda != other else ""
    return f"the default: per job, the first that builds and passes the proof of {orders}; {', '.join(other)} " \
           f"{'elsewhere' if cuda != other else 'on any other device'}"


@dataclass(frozen=True)
class Choice:
    """What auto would try for one recipe here, in order, and what it excludes and why."""

    tries: tuple[str, ...]
    #: (strategy, why it cannot serve this recipe here: its validate's or availability's words)
    excluded: tuple[tuple[str, str], ...]

    def text(self) -> str:
        out = f"tries {', '.join(self.tries) or 'nothing'}"
        if self.excluded:
            out += "; excluded: " + "; ".join(f"{name} ({why})" for name, why in self.excluded)
        return out

    def as_json(self) -> dict[str, Any]:
        return {"tries": list(self.tries), "excluded": [{"strategy": n, "reason": w} for n, w in self.excluded]}


def choice(recipe: Recipe, target: Target, device: str) -> Choice:
    """The strategies that can serve ``recipe`` on ``target`` and ``device``, in the order tried, and
    the ones excluded, each with why (its ``validate``, which includes ``availability``)."""
    tries, excluded = [], []
    for name in _tries(recipe, device):
        try:
            get_strategy(strategy_of(name)).validate(tried_recipe(recipe, name), target)
        except AotbuildError as exc:
            excluded.append((name, getattr(exc, "message", str(exc))))
        else:
            tries.append(name)
    return Choice(tuple(tries), tuple(excluded))


def concrete(ctx: Context, strategy: str) -> Context:
    """``ctx`` (an auto recipe's) as the same recipe naming ``strategy`` (a try: :data:`PREPACKED` adds
    its options): what one attempt builds with, and what serves an entry whose manifest names
    ``strategy`` (an entry's own records say how it serves: a prepacked package carries its recipes)."""
    return replace(ctx, recipe=tried_recipe(ctx.recipe, strategy), strategy=get_strategy(strategy_of(strategy)))


def held_by(manifest: Any) -> str:
    """The try that built an auto entry (:data:`PREPACKED` or its strategy): the last attempt that
    built it, where it names a try of this strategy; else the strategy the manifest names."""
    for attempt in reversed(list((manifest.auto or {}).get("attempts", ()))):
        if isinstance(attempt, dict) and attempt.get("outcome") == Outcome.BUILT:
            name = str(attempt.get("strategy", ""))
            return name if strategy_of(name) == manifest.strategy else manifest.strategy
    return manifest.strategy


def strategy_factors(ctx: Context) -> dict[str, Any]:
    """What ``ctx``'s strategy adds to the key's compile settings here (``Strategy.compile_factors``):
    recorded in an auto entry, compared at load."""
    return dict(ctx.strategy.compile_factors(ctx.target, ctx.device, ctx.recipe))


@dataclass
class Attempt:
    """One strategy tried for an auto job: its outcome, the first line of its reason (the model's
    file:line where export or Dynamo said it), and its seconds."""

    strategy: str
    outcome: Outcome | str  # str: read from a manifest of a later aotbuild with other outcomes
    reason: str = ""
    seconds: float = 0.0
    #: the concrete job's key (the recipe with this strategy named): where its failure is recorded
    key: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "outcome": self.outcome, "reason": self.reason,
                "seconds": round(self.seconds, 3), "key": self.key}

    @classmethod
    def from_json(cls, data: Any) -> Attempt:
        outcome = str(data.get("outcome", "?"))  # a manifest's: one this aotbuild does not know stays text
        return cls(str(data.get("strategy", "?")), Outcome(outcome) if outcome in Outcome._value2member_map_
                   else outcome, str(data.get("reason", "")),
                   float(data.get("seconds", 0.0)), str(data.get("key", "")))

    def text(self) -> str:
        seconds = f", {self.seconds:.1f} s" if self.seconds else ""
        reason = f": {self.reason}" if self.reason else ""
        return f"{self.strategy} {self.outcome}{seconds}{reason}"


def attempts_text(attempts: list[Attempt] | list[dict[str, Any]]) -> str:
    """``aot-package failed, 12.0 s: ...; aot-compile built, 30.1 s``: one line for a table's note."""
    return "; ".join((a if isinstance(a, Attempt) else Attempt.from_json(a)).text() for a in attempts)


__all__ = ["ORDER", "DEFAULT_ORDER", "PREPACKED", "VARIANTS", "Outcome",
           "Choice", "Attempt", "choice", "concrete", "held_by", "is_auto", "order", "strategy_of",
           "strategy_factors", "tried_recipe", "attempts_text", "tries_on", "summary"]
