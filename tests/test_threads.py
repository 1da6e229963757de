"""Entries serve any intra-op thread count (issue 36 item 3).

Every strategy's entry of the tiny UNet, built once per run by the shared builds (tests/conftest.py:
``strategy_build``) in a process with this machine's default thread count (2 on the 2-core host),
serves fresh processes with another count, 0 compiles by the strategy's own counter, output equal to
eager. jit-cache traces at load, so it is served by fresh processes started with 1 thread and with
twice the build's count (``torch.set_num_threads`` first thing). The AOT strategies trace
nothing at load: one fresh process started with twice the build's count serves the UNet's calls, then
again after ``torch.set_num_threads(1)``. Before, aot-compile kept Dynamo's global-state guard, which
holds the thread count, and keyed the count: the same entry missed. Where kernels do bake the count in
(``compile.options.cpp.dynamic_threads: false``) the target keys it, so another count is a miss whose
reason names it. Without the guard, what it held that changes results is checked per call by
aotbuild: a grad-mode or default-dtype change after load is refused by name and runs eagerly, never
served by a graph traced without it.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

from tests import serving
from tests.conftest import run_python
from tests.serving import assert_served, serve_fresh

#: The shared builds' thread count: what a fresh process starts with here (read when this module is
#: collected, before any test sets one).
BUILT_WITH = torch.get_num_threads()
#: Fewer and more threads than the build had (1 and 4 on the 2-core host).
SERVED_WITH = {"fewer": 1, "more": 2 * BUILT_WITH}


def with_threads(script: str, threads: int) -> str:
    """``script`` run with ``threads`` intra-op threads from its start, and failing if the count changed
    by its end. torch.set_num_threads: torch caps OMP_NUM_THREADS at the cores (4 read as 2 here)."""
    return (f"import torch\ntorch.set_num_threads({threads})\n{script}\n"
            f"assert torch.get_num_threads() == {threads}, torch.get_num_threads()\n")


def omp_regions(cache: Path) -> dict[str, int]:
    """The OpenMP parallel regions in the C++ sources of a cache's entries (an AOTInductor package's
    inside its zip): ``baked`` name a thread count (``num_threads(N)``), ``dynamic`` ask at run time."""
    import re
    import zipfile

    found = {"baked": 0, "dynamic": 0}
    for path in (p for p in cache.rglob("*") if p.is_file() and "models" not in p.relative_to(cache).parts):
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                texts = [z.read(n) for n in z.namelist() if n.endswith(".cpp")]
        else:
            texts = [path.read_bytes()]
        for text in texts:
            found["baked"] += len(re.findall(rb"#pragma omp parallel num_threads\(", text))
            found["dynamic"] += len(re.findall(rb"#pragma omp parallel\s*\n", text))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["jit-cache"])
@pytest.mark.parametrize("served_with", sorted(SERVED_WITH))
def test_jit_cache_serves_a_fresh_process_with_another_thread_count(strategy_build, strategy, served_with, tmp_path,
                                                                    monkeypatch):
    """Dynamo traces at the serving process's count; Inductor's graph cache still hits and no kernel is
    rebuilt (the CPU kernels ask OpenMP for the count at each call: cpp.dynamic_threads)."""
    recipe, cache, _ = strategy_build(strategy)
    monkeypatch.setattr(serving, "SERVE", with_threads(serving.SERVE, SERVED_WITH[served_with]))
    result = serve_fresh(recipe, cache, tmp_path)
    assert_served(result)  # every entry hit, 0 compiles (the strategy's counter), equal to eager
    assert result["counters"].get("fxgraph_cache_hit", 0) >= 1
    assert result["kernels_after_call"] == result["kernels_after_install"], "a C++ kernel was rebuilt"
    regions = omp_regions(cache)
    assert regions["baked"] == 0 and regions["dynamic"] > 0, regions


SERVE_CALLS = textwrap.dedent("""
    import json, sys, warnings
    import torch
    from aotbuild import load_compiled, load_recipe
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from aotbuild.strategies.registry import get_strategy
    from aotbuild.targets.registry import get_target

    recipe_path, cache = sys.argv[1:3]
    r = load_recipe(recipe_path)
    pipe = load_compiled(recipe_path, cache=cache, on_miss="eager")
    unet, seen = pipe.unet, []
    hook = unet.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)), with_kwargs=True)
    pipe(**warmup_kwargs(r, r.shapes[0], pipe), output_type="pt")  # a call the entry was built for
    hook.remove()
    args, kwargs = seen[0]
    dispatcher = unet.forward
    _, count = get_strategy(r.strategy).compile_counter(get_target(r.target))
    sample = lambda out: out[0] if isinstance(out, tuple) else out.sample

    def call(label):
        before, calls = count(), dict(dispatcher.calls)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = sample(unet(*args, **kwargs))
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            eager = sample(dispatcher.eager(*args, **kwargs))
        return {"label": label, "threads": torch.get_num_threads(), "compiles": count() - before,
                "built": dispatcher.calls["built"] - calls["built"],
                "stale": dispatcher.calls.get("stale", 0) - calls.get("stale", 0),
                "warnings": [str(w.message) for w in caught], "grad_fn": out.grad_fn is not None,
                "max_diff": (out.detach() - eager).abs().max().item()}

    results = []
    with torch.no_grad():
        results.append(call("started with another count"))
        torch.set_num_threads(1)
        results.append(call("1 thread"))
    with torch.enable_grad():
        results.append(call("grad on"))
    torch.set_default_dtype(torch.float64)
    with torch.no_grad():
        results.append(call("default dtype float64"))
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        results.append(call("back as built"))
    torch.set_num_threads(results[0]["threads"])
    print("RESULT " + json.dumps(results))
""")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["aot-package", "aot-compile"])
def test_aot_entries_serve_any_thread_count_and_check_grad_mode_and_default_dtype_per_call(
        strategy_build, strategy, tmp_path):
    """A fresh process started with twice the build's threads serves the UNet compiled, and again after
    ``torch.set_num_threads(1)``. aot-compile's artifacts keep no global-state guard, so what it held
    and changes results is aotbuild's per-call check (both strategies): a call with grad on, or with
    another default dtype, after a load in no_grad is refused by name and runs eagerly (an output with
    a grad_fn); the next call as built is served compiled again."""
    recipe, cache, _ = strategy_build(strategy)
    script = tmp_path / "serve_calls.py"
    script.write_text(with_threads(SERVE_CALLS, SERVED_WITH["more"]))
    proc = run_python(f"import runpy, sys; sys.argv = ['serve', {str(recipe)!r}, {str(cache)!r}]; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-inductor"), "AOTBUILD_CACHE": ""},
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    more, one, grad, dtype, back = json.loads(
        next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])
    assert more["threads"] == SERVED_WITH["more"] and one["threads"] == 1  # the counts took
    for served in (more, one, back):
        assert (served["built"], served["stale"], served["compiles"]) == (1, 0, 0), served
        assert served["warnings"] == [] and served["max_diff"] <= 1e-5, served
    for refused, words in ((grad, "grad on"), (dtype, "default dtype float64")):
        assert (refused["built"], refused["stale"], refused["compiles"]) == (0, 1, 0), refused
        assert len(refused["warnings"]) == 1 and words in refused["warnings"][0], refused
        assert "the call runs eagerly" in refused["warnings"][0]
    assert grad["grad_fn"] and grad["max_diff"] <= 1e-5  # eager's autograd graph, eager's values
    assert not more["grad_fn"]
    regions = omp_regions(cache)  # the kernels served ask OpenMP for the count at each call
    assert regions["baked"] == 0 and regions["dynamic"] > 0, regions


@pytest.mark.parametrize("strategy", ["jit-cache", "aot-package", "aot-compile"])
def test_only_kernels_that_bake_the_thread_count_miss_at_another_and_the_miss_names_it(cache, fake_compiles,
                                                                                        strategy, monkeypatch):
    """cpp.dynamic_threads (aotbuild's CPU default) keeps the count out of every strategy's key;
    ``cpp.dynamic_threads: false`` bakes it into the kernels, so the target keys it: at another count
    plan (and load_compiled, which explains a miss the same way) says which count each side has."""
    from aotbuild import plan
    from aotbuild.builder import build as builder
    from tests.conftest import TINY_DICT

    default = {**TINY_DICT, "strategy": strategy}
    pinned = {**default, "compile": {"options": {"cpp.dynamic_threads": False}}}
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    for recipe in (default, pinned):
        assert [r.status for r in builder.build(recipe, cache).results] == ["built"]
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    (served,), (missed,) = plan(default, cache), plan(pinned, cache)
    assert served.status == "hit", served.reason
    assert missed.status == "miss"
    assert missed.reason.startswith("not built: compile.cpu_threads: 2 in the cache, 4 here"), missed.reason
    assert "torch.set_num_threads()" in missed.reason
