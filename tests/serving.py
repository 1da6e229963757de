"""The one fresh-process helper of the suite: serve a built cache as a new replica would, and report.

``serve_fresh(recipe, cache, workdir)`` starts a fresh interpreter in another directory with an
empty Inductor cache and no AOTBUILD_CACHE, which

1. runs the recipe's warmup eagerly at every shape (the reference, same seed), with a fresh temp
   folder (where Inductor keeps its precompiled headers, outside its cache folder);
2. loads with ``load_compiled(on_miss="error", strict_shapes=True)`` (``remote=`` when given);
3. runs the warmup again at every shape through the loaded pipeline, counting what compiled (the
   strategy's own counter, Inductor's counters, Dynamo's graphs and frames) and which C++ kernels
   appeared in the Inductor folder, and compares the images and every output of the component
   (the denoiser) with eager's;
4. calls at 32x32 (``strict_shape``; a video's frames as its first shape's), a shape no test recipe
   builds, expecting ``ShapeNotBuilt``.
"""

from __future__ import annotations

import json
import tempfile
import textwrap
from pathlib import Path

from tests.conftest import run_python

SERVE = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    from aotbuild import ShapeNotBuilt, load_compiled, load_recipe
    from aotbuild.dispatch import Dispatcher
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from aotbuild.recipe.schema import Shape
    from aotbuild.strategies.registry import get_strategy
    from aotbuild.targets.registry import get_target

    recipe_path, cache, component, strict_shape = sys.argv[1:5]
    remote = sys.argv[5] if len(sys.argv) > 5 else None
    strict_h, strict_w = map(int, strict_shape.split("x"))
    r = load_recipe(recipe_path)

    def run_all(pipe):
        # The images at every shape, and every output of the component (watched outside whatever
        # aotbuild put in its forward, so the watch adds no graph).
        seen, module = [], getattr(pipe, component)
        inner = module.forward
        def watch(*args, **kwargs):
            out = inner(*args, **kwargs)
            seen.append((out[0] if isinstance(out, tuple) else out.sample).detach().clone())
            return out
        module.forward = watch
        try:
            outs = [pipe(**warmup_kwargs(r, s, pipe), output_type="pt") for s in r.shapes]
            images = [o.images if hasattr(o, "images") else o.frames for o in outs]  # a video pipeline's frames
        finally:
            module.forward = inner
        return images, seen

    refs, eager_outputs = run_all(load_pipeline(r, resolve_model(r, Path(cache)), "float32"))

    import tempfile
    headers = Path(tempfile.gettempdir())  # a fresh temp folder, as on a fresh machine
    assert not any(headers.rglob("*.gch")), "the temp folder must start without precompiled headers"
    inductor = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert not inductor.exists() or not any(inductor.iterdir()), "the Inductor cache must start empty"
    kernels = lambda: sorted(p.relative_to(inductor).as_posix() for p in inductor.rglob("*")
                             if p.suffix in (".so", ".cpp"))
    pipe = load_compiled(recipe_path, cache=cache, on_miss="error", strict_shapes=True, remote=remote)
    kernels_after_install = kernels()
    # what serves is each entry's strategy (a recipe without one is auto: its report names the chosen one)
    served_by = sorted({e.strategy for e in pipe.aotbuild_report.hits if e.strategy} or {r.strategy})
    counter, count = get_strategy(served_by[0]).compile_counter(get_target(r.target))
    before = count()
    outs, outputs = run_all(pipe)
    compiles = count() - before
    kernels_after_call = kernels()
    strict = None
    try:
        pipe(**warmup_kwargs(r, Shape(height=strict_h, width=strict_w, num_frames=r.shapes[0].num_frames), pipe))
    except ShapeNotBuilt as exc:
        strict = str(exc)
    import torch._dynamo.utils as dynamo_utils

    c = dynamo_utils.counters
    # every dispatcher aotbuild installed: the component's own ("") or, for scope: regional, its blocks'
    dispatchers = {n: m.forward for n, m in getattr(pipe, component).named_modules()
                   if isinstance(vars(m).get("forward"), Dispatcher)}
    report = pipe.aotbuild_report
    print("RESULT " + json.dumps({
        "hits": len(report.hits), "misses": len(report.misses), "shapes": len(r.shapes),
        "pulled": sum(e.pulled for e in report.entries),
        "counter": counter, "compiles": compiles, "counters": dict(c["inductor"]),
        "unique_graphs": c["stats"].get("unique_graphs", 0), "frames": c["frames"].get("total", 0),
        "max_diff": max((o - e).abs().max().item() for o, e in zip(outs, refs)),
        "component_calls": len(outputs), "component_max_diff": max(
            (a - b).abs().max().item() for a, b in zip(outputs, eager_outputs, strict=True)),
        "kernels_after_install": kernels_after_install, "kernels_after_call": kernels_after_call,
        "strict": strict, "calls": {n: d.calls for n, d in dispatchers.items()},
        "swaps": sum(getattr(getattr(x, "runner", None), "swaps", 0)
                     for d in dispatchers.values() for x in d.routes.values()),
        "rebinds": sum(getattr(getattr(x, "runner", None), "rebinds", 0)
                       for d in dispatchers.values() for x in d.routes.values()),
        "precompiled_headers": sorted(p.name for p in headers.rglob("*.gch")),
        "timings": report.timings, "first_calls": report.first_calls, "report": str(report),
        "component": component, "remote": remote is not None,
        "offload_hook": type(getattr(getattr(pipe, component), "_hf_hook", None)).__name__,  # offload: model
    }))
""")


def serve_fresh(recipe: Path, cache: Path, workdir: Path, *, component: str = "unet", cwd: Path | None = None,
                remote: str | None = None, strict_shape: str = "32x32") -> dict:
    """What SERVE measured in a fresh process (in ``cwd``, default a new folder under ``workdir``)."""
    cwd = cwd or workdir / "elsewhere"
    cwd.mkdir(parents=True, exist_ok=True)
    # Inductor keeps precompiled headers in the temp folder, not its cache: a new one per replica
    temp = Path(tempfile.mkdtemp(prefix="serve-tmp.", dir=workdir))
    script = workdir / "serve.py"
    script.write_text(SERVE)
    argv = [str(recipe), str(cache), component, strict_shape] + ([remote] if remote else [])
    proc = run_python(f"import runpy, sys; sys.argv = ['serve', *{argv!r}]; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(workdir / "empty-inductor"), "AOTBUILD_CACHE": "",
                           "TMPDIR": str(temp)},
                      cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def assert_served(result: dict) -> None:
    """What every strategy promises: every entry hit, nothing compiled, output equal to eager, an
    unbuilt shape refused (tests/test_strategies.py)."""
    assert result["hits"] == result["shapes"] and result["misses"] == 0
    assert result["compiles"] == 0, result["counter"]
    assert result["precompiled_headers"] == []  # a fresh machine's load compiles no C++ header either
    assert result["counters"].get("fxgraph_cache_miss", 0) == 0  # whatever the strategy counts
    assert result["max_diff"] <= 1e-4 and result["component_max_diff"] <= 1e-5
    assert result["strict"] and "1x4x4x4" in result["strict"]  # 32x32 pixels = a 4x4 latent
    # the load's phases, and the first compiled call of the component, timed (docs/runtime.md)
    assert set(result["timings"]) == {"pipeline", "verify", "install"} | ({"pull"} if result["remote"] else set())
    assert all(s >= 0 for s in result["timings"].values()) and set(result["first_calls"]) == {result["component"]}
    assert "  load: pipeline " in result["report"]


def assert_warm(result: dict) -> None:
    """A jit-cache warm load (serve_fresh's result): every FX graph hits, and no C++ kernel is rebuilt."""
    assert_served(result)
    assert result["shapes"] == 2 and result["counters"].get("fxgraph_cache_hit", 0) >= 1
    assert result["kernels_after_install"], "the install should have put compiled kernels in place"
    assert result["kernels_after_call"] == result["kernels_after_install"], "a C++ kernel was rebuilt"
    assert result["calls"] == {"": {"built": 4, "unbuilt": 1}}  # 2 shapes x 2 steps, then the strict call


# -- a server's use of a served pipeline (issue 52): tests/test_server_pipelines.py, tests/test_regional.py --

SERVER = textwrap.dedent("""
    import copy, io, json, sys, tempfile, threading, warnings
    from pathlib import Path
    import torch
    import aotbuild
    from aotbuild import load_compiled, load_recipe
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs

    recipe_path, cache, component = sys.argv[1:4]
    r = load_recipe(recipe_path)
    shape = r.shapes[0]

    def eager():
        return load_pipeline(r, resolve_model(r, Path(cache)), "float32")

    def image(pipe, seed=0):
        with torch.no_grad():
            return pipe(**warmup_kwargs(r, shape, pipe, seed=seed), output_type="pt").images

    def off(a, b):
        return (a - b).abs().max().item()

    reference = eager()
    refs = {seed: image(reference, seed) for seed in range(4)}
    pipe = load_compiled(recipe_path, cache=cache, on_miss="error")
    report = str(pipe.aotbuild_report)
    out = {"served": off(image(pipe), refs[0])}

    # 4 request-scoped pipelines at once (diffusers' server example: from_pipe with its own scheduler and
    # tokenizer: a fast tokenizer's padding state is not thread-safe), with a tiny switch interval so that
    # the threads interleave inside every call
    sys.setswitchinterval(1e-6)
    barrier, diffs, errors = threading.Barrier(4), {}, []
    def request(seed):
        try:
            scoped = type(pipe).from_pipe(pipe, scheduler=pipe.scheduler.from_config(pipe.scheduler.config),
                                          tokenizer=copy.deepcopy(pipe.tokenizer))
            barrier.wait()
            diffs[seed] = off(image(scoped, seed), refs[seed])
        except Exception as exc:
            errors.append(repr(exc))
    threads = [threading.Thread(target=request, args=(s,)) for s in range(4)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    sys.setswitchinterval(0.005)
    out["threads"] = max(diffs.values()) if len(diffs) == 4 else None
    out["thread_errors"] = errors

    out["copy.copy"] = off(image(copy.copy(pipe)), refs[0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twin = copy.deepcopy(pipe)
        other = {k: v * -1.0 if v.is_floating_point() else v
                 for k, v in getattr(twin, component).state_dict().items()}
        getattr(twin, component).load_state_dict(other)
        twin_image = image(twin)
    getattr(reference, component).load_state_dict(other)
    out["deepcopy"] = off(twin_image, image(reference))
    out["deepcopy_warnings"] = [str(w.message) for w in caught if "aotbuild" in str(w.message)]
    out["original_after_copy"] = off(image(pipe), refs[0])
    del twin
    reference = eager()

    buffer = io.BytesIO()
    torch.save(getattr(pipe, component), buffer)
    buffer.seek(0)
    pipe_from_save = eager()
    setattr(pipe_from_save, component, torch.load(buffer, weights_only=False))
    out["torch.save"] = off(image(pipe_from_save), refs[0])
    folder = Path(tempfile.mkdtemp())
    pipe.save_pretrained(folder)
    out["save_pretrained"] = off(image(type(pipe).from_pretrained(folder)), refs[0])

    # one middle output channel of the first weight a dispatcher serves (the UNet's conv_in; a regional
    # entry's first block's) doubled through .data (no version bump), after a call
    from aotbuild.dispatch import Dispatcher
    served = next(n for n, m in getattr(pipe, component).named_modules()
                  if isinstance(vars(m).get("forward"), Dispatcher))
    for p in (pipe, reference):
        with torch.no_grad():
            w = next(t for t in getattr(p, component).get_submodule(served).parameters() if t.dim() >= 2)
            w.data[w.shape[0] // 2] *= 2
    out[".data write"] = off(image(pipe), image(reference))
    out["refreshed"] = aotbuild.refresh(pipe)
    out["after refresh"] = off(image(pipe), image(reference))
    out["report"] = report
    print("RESULT " + json.dumps(out))
""")


def serve_as_a_server(recipe, cache, tmp_path, component: str = "unet") -> dict:
    """What SERVER measured in a fresh process serving ``recipe`` from ``cache``."""
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    proc = run_python(f"import runpy, sys; sys.argv = ['server', {str(recipe)!r}, {str(cache)!r}, {component!r}]; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "AOTBUILD_CACHE": ""},
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def assert_like_eager(result: dict) -> None:
    print(json.dumps({k: v for k, v in result.items() if k != "report"}))  # the figures of docs/runtime.md
    assert result["thread_errors"] == [], result
    for what in ("served", "threads", "copy.copy", "deepcopy", "original_after_copy", "torch.save",
                 "save_pretrained", ".data write", "after refresh"):
        assert result[what] is not None and result[what] <= 1e-4, (what, result)
