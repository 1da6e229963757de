"""What every strategy promises, held to the same test: an entry built by ``aotbuild build``, its cache
moved elsewhere, is served by a fresh process in another directory with an empty compiler folder,
with 0 compiles (the strategy's own counter, and Inductor's), output equal to eager, and a call at a
shape that was not built refused under ``strict_shapes``. Parametrized over the registry: a new
strategy is tested here as soon as it is registered."""

from __future__ import annotations

import json
import shutil
import textwrap

import pytest

from aotbuild.strategies import strategy_names
from tests.conftest import TINY_RECIPE, run_python

pytestmark = pytest.mark.slow

SERVE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    from aotbuild import ShapeNotBuilt, load_compiled, load_recipe
    from aotbuild.models import load_pipeline, resolve_model, warmup_kwargs
    from aotbuild.strategies import get_strategy
    from aotbuild.targets import get_target
    recipe_path, cache = sys.argv[1:3]
    r = load_recipe(recipe_path)
    eager = load_pipeline(r, resolve_model(r, Path(cache)), "float32")
    refs = [eager(**warmup_kwargs(r, s), output_type="pt").images for s in r.shapes]
    pipe = load_compiled(recipe_path, cache=cache, on_miss="error", strict_shapes=True)
    counter, count = get_strategy(r.strategy).compile_counter(get_target(r.target))
    import torch._dynamo.utils as dynamo_utils
    before = count()
    outs = [pipe(**warmup_kwargs(r, s), output_type="pt").images for s in r.shapes]
    compiles = count() - before
    strict = None
    try:
        pipe(prompt="x", height=32, width=32, num_inference_steps=1, guidance_scale=0.0)
    except ShapeNotBuilt as exc:
        strict = str(exc)
    report = pipe.aotbuild_report
    c = dynamo_utils.counters
    print("RESULT " + json.dumps({
        "counter": counter, "compiles": compiles, "hits": len(report.hits), "misses": len(report.misses),
        "shapes": len(r.shapes), "max_diff": max((o - e).abs().max().item() for o, e in zip(outs, refs)),
        "fx_miss": c["inductor"].get("fxgraph_cache_miss", 0), "strict": strict}))
""")


@pytest.fixture(scope="session")
def served(strategy_build, built_cache):
    """(recipe file, cache) built for a strategy: jit-cache shares tests/test_e2e.py's two-shape build."""

    def get(strategy: str):
        if strategy == "jit-cache":
            return TINY_RECIPE, built_cache[0]
        recipe, cache, _ = strategy_build(strategy)
        return recipe, cache

    return get


@pytest.mark.parametrize("strategy", strategy_names())
def test_a_fresh_process_serves_a_moved_cache_with_no_compile(strategy, served, tmp_path):
    recipe, cache = served(strategy)
    moved = tmp_path / "moved" / "cache"
    shutil.copytree(cache, moved)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = tmp_path / "serve.py"
    script.write_text(SERVE)
    proc = run_python(f"import runpy, sys; sys.argv = ['s', {str(recipe)!r}, {str(moved)!r}]; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-inductor"), "AOTBUILD_CACHE": ""},
                      cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert result["hits"] == result["shapes"] and result["misses"] == 0
    assert result["compiles"] == 0, result["counter"]
    assert result["fx_miss"] == 0  # whatever the strategy counts, Inductor compiled no graph
    assert result["max_diff"] <= 1e-4
    assert result["strict"] and "1x4x4x4" in result["strict"]  # 32x32 pixels = a 4x4 latent
