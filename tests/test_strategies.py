"""What every strategy promises, held to the same test: an entry built by ``aotbuild build``, its cache
moved elsewhere, is served by a fresh process in another directory with an empty compiler folder,
with 0 compiles (the strategy's own counter, and Inductor's), output equal to eager, and a call at a
shape that was not built refused under ``strict_shapes``. Parametrized over the registry: a new
strategy is tested here as soon as it is registered."""

from __future__ import annotations

import shutil

import pytest

from aotbuild.strategies.registry import strategy_names
from tests.serving import assert_served, serve_fresh

pytestmark = pytest.mark.slow


#: jit-cache's replica is tests/test_e2e.py's test_copied_cache_from_another_cwd_compiles_nothing: the
#: same entry (STRATEGY_RECIPE's jit-cache key is built_cache's 64x64 job's, tests/conftest.py), a
#: moved cache served by the same helper, held to assert_served and more (assert_warm). Served twice
#: it proved nothing more for a fresh process's cost (issue 30, item 4).
SERVED_ELSEWHERE = {"jit-cache"}


@pytest.mark.parametrize("strategy", [s for s in strategy_names() if s not in SERVED_ELSEWHERE])
def test_a_fresh_process_serves_a_moved_cache_with_no_compile(strategy, strategy_build, tmp_path):
    recipe, cache, _ = strategy_build(strategy)
    moved = tmp_path / "moved" / "cache"
    shutil.copytree(cache, moved)
    assert_served(serve_fresh(recipe, moved, tmp_path))
