"""One build job, run in a fresh subprocess: ``python -m aotbuild.worker JOB.json``.

A fresh process per job means the job's compiler caches (pointed at an empty folder by the parent
through the target's ``capture_env``) hold exactly what this job compiled, and a crash or an
out-of-memory kill loses one job, not the build. The result (signatures seen, timings, compiler
counters) is written as JSON to the path the job file names.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from aotbuild import child


def run(job: dict) -> dict:
    t0 = time.perf_counter()
    child.phase(job, "loading the pipeline")
    from aotbuild import keys, models
    from aotbuild.context import job_pipeline
    from aotbuild.recipe import Shape
    from aotbuild.recipes import recipe_from_spec
    from aotbuild.strategies import BuildJob

    recipe = recipe_from_spec(job["recipe"])  # the recipe's data: the file may have changed since the plan
    shape = Shape(**job["shape"])
    component = job["component"]
    ctx, pipe = job_pipeline(recipe, Path(job["cache_root"]))
    models.check_warmup_arguments(pipe, recipe)
    module = getattr(pipe, component)
    cls_name, config = models.module_config(module)
    factors = ctx.factors(component, cls_name, config, shape, type(pipe).__name__)
    key = keys.key_of(factors)
    if key != job["key"]:
        diff = "; ".join(keys.differences(job["factors"], factors)) or "unknown"
        raise RuntimeError(f"the loaded model gives another key than the plan ({diff})")
    t_load = time.perf_counter()
    child.phase(job, "compiling and warming up")
    warmup = models.warmup_kwargs(recipe, shape, defaults=ctx.target.warmup_defaults)
    batches: list[int] = []
    watch = module.register_forward_pre_hook(lambda _, args, kwargs: batches.append(_batch_of(args, kwargs)),
                                             with_kwargs=True)
    job_spec = BuildJob(ctx, pipe, component, module, warmup, Path(job["workdir"]),
                        phase=lambda text: child.phase(job, text))
    built = ctx.strategy.build(job_spec)
    t_warm = time.perf_counter()
    watch.remove()
    _check_batch(pipe, recipe, component, shape, warmup, batches)
    from torch._dynamo.utils import counters

    return {
        **({"packages": built.records} if built.records else {}),
        "key": key,
        "signatures": built.signatures,
        "seconds": {"load": round(t_load - t0, 3), "compile_and_warmup": round(t_warm - t_load, 3)},
        "counters": {k: int(v) for k, v in counters["inductor"].items() if "cache" in k},
        "pipeline_class": type(pipe).__name__,
    }


def _batch_of(args: tuple, kwargs: dict) -> int:
    """The batch a denoiser is called at: its latents' first dimension (``sample`` for UNets,
    ``hidden_states`` for transformers, else the first tensor argument); -1 if it has none."""
    import torch

    for value in (*args[:1], kwargs.get("sample"), kwargs.get("hidden_states"), *args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return -1


def _check_batch(pipe, recipe, component: str, shape, warmup: dict, batches: list[int]) -> None:
    """The batch the component saw must be what the key's factors imply: prompts x images per prompt
    (x 2 where classifier-free guidance runs both halves at once). Otherwise an argument changes the
    batch behind the key's back, and the entry would be served to calls it does not fit."""
    from aotbuild.recipe import prompt_count

    seen = sorted({b for b in batches if b > 0})
    if not seen:
        return
    prompts = prompt_count(warmup.get("prompt"))
    guided = bool(getattr(pipe, "do_classifier_free_guidance", False))
    expected = prompts * shape.batch_size * (2 if guided else 1)
    if seen != [expected]:
        why = f"{prompts} prompt text(s) x batch_size {shape.batch_size}" + (" x 2 for guidance" if guided else "")
        suspects = [f"warmup.{k}" for k, v in recipe.warmup.items() if isinstance(v, (list, tuple, int))
                    and not isinstance(v, bool) and k not in ("num_inference_steps",)] or ["an argument the pipeline "
                                                                                        "sets itself"]
        raise RuntimeError(f"the {component} ran at batch {', '.join(map(str, seen))} but the key's factors imply "
                           f"{expected} ({why}): {', '.join(suspects)} changes the batch in a way the key does not "
                           f"record; set it in the shape (batch_size) or leave it out of the warmup")


def main(argv: list[str]) -> int:
    return child.main(argv, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
