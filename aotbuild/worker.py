"""One build job, run in a fresh subprocess: ``python -m aotbuild.worker JOB.json``.

A fresh process per job means the job's compiler caches (pointed at an empty folder by the parent
through the target's ``capture_env``) hold exactly what this job compiled, and a crash or an
out-of-memory kill loses one job, not the build. The result (signatures seen, timings, compiler
counters) is written as JSON to the path the job file names.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path


def _phase(job: dict, text: str) -> None:
    """Tell the parent what the job is doing (it shows it next to the elapsed time)."""
    Path(job["result"]).with_name("phase").write_text(text)


def run(job: dict) -> dict:
    t0 = time.perf_counter()
    _phase(job, "loading the pipeline")
    from aotbuild import keys, models
    from aotbuild.dispatch import install_dispatcher
    from aotbuild.planner import Context
    from aotbuild.recipe import Shape, load_recipe

    recipe = load_recipe(job["recipe"])
    shape = Shape(**job["shape"])
    component = job["component"]
    ctx = Context.create(recipe, Path(job["cache_root"]))
    if ctx.problem:
        raise RuntimeError(ctx.problem)
    assert ctx.model is not None
    pipe = models.load_pipeline(recipe, ctx.model, ctx.dtype)
    models.place_pipeline(pipe, recipe, ctx.device)
    models.check_warmup_arguments(pipe, recipe)
    module = getattr(pipe, component)
    cls_name, config = models.module_config(module)
    factors = ctx.factors(component, cls_name, config, shape, type(pipe).__name__)
    key = keys.key_of(factors)
    if key != job["key"]:
        diff = "; ".join(keys.differences(job["factors"], factors)) or "unknown"
        raise RuntimeError(f"the loaded model gives another key than the plan ({diff})")
    t_load = time.perf_counter()
    _phase(job, "compiling and warming up")
    warmup = models.warmup_kwargs(recipe, shape, defaults=ctx.target.warmup_defaults)
    extra: dict = {}
    if recipe.strategy == "aot-package":
        from aotbuild.targets import aoti

        options = ctx.target.compile_settings(recipe, ctx.device)["options"]
        workdir = Path(job["result"]).parent
        if recipe.compile.scope == "regional":  # one package per repeated block class x signature
            recorder = aoti.BlockRecorder(module, component, recipe.compile.blocks, recipe)
            pipe(**warmup)  # eager: records the exact calls the pipeline makes to each block
            _phase(job, "exporting and packaging")
            extra["packages"] = recorder.build(workdir, options)
            signatures = recorder.signatures
        else:
            calls: dict = {}
            dispatcher = install_dispatcher(module, component, {}, module.forward, "record",
                                            on_record=lambda sig, a, k: calls.setdefault(sig, aoti.snapshot(a, k)))
            pipe(**warmup)  # eager: records the exact calls the pipeline makes
            _phase(job, "exporting and packaging")
            extra["packages"] = aoti.build_packages(module, calls, workdir, options)
            signatures = sorted(dispatcher.built)
    else:
        compiled = ctx.target.compile(module, recipe, ctx.device)
        dispatcher = install_dispatcher(module, component, {}, compiled, "record")
        # Called exactly as a user calls it (the pipeline's own no_grad, no inference_mode): grad
        # mode is part of what a compiled graph is guarded and cached on.
        pipe(**warmup)
        signatures = sorted(dispatcher.built)
    t_warm = time.perf_counter()
    from torch._dynamo.utils import counters

    return {
        **extra,
        "key": key,
        "signatures": signatures,
        "seconds": {"load": round(t_load - t0, 3), "compile_and_warmup": round(t_warm - t_load, 3)},
        "counters": {k: int(v) for k, v in counters["inductor"].items() if "cache" in k},
        "pipeline_class": type(pipe).__name__,
    }


def main(argv: list[str]) -> int:
    job_file = Path(argv[0])
    job = json.loads(job_file.read_text())
    try:
        result = run(job)
    except BaseException as exc:  # the parent reads the reason from the result file
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}".strip()}
        Path(job["result"]).write_text(json.dumps(result))
        return 1
    Path(job["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
