"""``strategy: auto`` (the default): the registry's name for "choose per job" (aotbuild/auto.py).

Auto is not a way to store an entry: the builder tries, per job, the strategies that can serve the
recipe in a fixed order and stores the first that builds and passes the proof; the entry's manifest
names that strategy, which serves it. This class only gives the name a place in the registry: it
adds no key factor of its own (the key of an auto job holds the strategy-independent factors and
``strategy: auto``), accepts every recipe some strategy accepts, and never builds or installs.
"""

from __future__ import annotations

from aotbuild.keys import AUTO
from aotbuild.strategies.base import Strategy


class Auto(Strategy):
    name = AUTO
    summary = ("the default: per job, the first of aot-package, aot-compile, jit-cache (CPU order) that builds "
               "and passes the proof")
