"""``strategy: auto`` (the default): the registry's name for "choose per job" (aotbuild/strategies/order.py).

Auto is not a way to store an entry: the builder tries, per job, the strategies that can serve the
recipe in a fixed order and stores the first that builds and passes the proof; the entry's manifest
names that strategy, which serves it. This class only gives the name a place in the registry: it
adds no key factor of its own (the key of an auto job holds the strategy-independent factors and
``strategy: auto``), accepts every recipe some strategy accepts, and never builds or installs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from aotbuild.keys import AUTO
from aotbuild.strategies.base import Strategy

if TYPE_CHECKING:
    from aotbuild.targets.base import Target


class Auto(Strategy):
    name = AUTO
    # what `aotbuild targets` prints is strategies/order.summary(): the order, made from the order itself
    summary = "the default: per job, the first strategy of auto's order that builds and passes the proof"

    def compile_counter(self, target: Target) -> tuple[str, Callable[[], int]]:
        """No count of its own: what counts as a compile is the chosen strategy's (the entry's manifest
        names it; ``load_compiled``'s report too). Asking auto would count the wrong thing, silently."""
        raise TypeError("strategy auto serves each entry with the strategy its manifest names: ask that "
                        "strategy for its compile counter (pipe.aotbuild_report's hits name it)")
