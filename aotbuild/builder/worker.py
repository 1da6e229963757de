"""One build job, run in a fresh subprocess: ``python -m aotbuild.builder.worker JOB.json``.

A fresh process per job means the job's compiler caches (pointed at an empty folder by the parent
through the target's ``capture_env``) hold exactly what this job compiled, and a crash or an
out-of-memory kill loses one job, not the build. The result (signatures seen, timings, compiler
counters) is written as JSON to the path the job file names.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from aotbuild import constants
from aotbuild.builder import child
from aotbuild.utils.text import printable


def run(job: dict, loaded: tuple[Any, float] | None = None) -> dict:
    """``loaded``: the pipeline a build's loader process loaded for this job's recipe (this process
    was forked from it, aotbuild/builder/loader.py) and the seconds that load took; None: load it here."""
    t0 = time.perf_counter()
    child.phase(job, "loading the pipeline" if loaded is None else "placing the shared pipeline")
    from aotbuild.context import job_pipeline, shard_pipeline
    from aotbuild.pipeline import pipecall
    from aotbuild.recipe.rules import recipe_from_spec
    from aotbuild.recipe.schema import Shape

    recipe = recipe_from_spec(job["recipe"])  # the recipe's data: the file may have changed since the plan
    shape = Shape(**job["shape"])
    component = job["component"]
    try:
        ctx, pipe = job_pipeline(recipe, Path(job["cache_root"]), loaded[0] if loaded else None)
    except Exception as exc:  # before any strategy's code: every strategy would fail the same way
        try:
            setattr(exc, constants.LOAD_FAILED, True)
        except AttributeError:  # an exception class with slots: left unmarked, auto tries on
            pass
        raise
    pipecall.check_recipe(recipe, pipecall.CallSignature.of(pipe))
    # Tensor parallelism: this process is one rank (of the launch the builder started); its entry is
    # its own, in its own folder; the compiler's cache folder is the ranks' shared one.
    rank = shard_pipeline(pipe, ctx)
    workdir = Path(job["workdir"]) / f"rank{rank or 0}"
    module = getattr(pipe, component)
    key = _checked_key(job["ranks"][rank or 0], ctx, pipe, component, shape, rank)
    t_load = time.perf_counter()
    child.phase(job, "compiling and warming up")
    # What the component is called with is the pipeline's business (guidance may double the batch, or
    # call twice, or be an input): the strategy records every call's signature, and loads dispatch on them.
    warmup = pipecall.warmup_kwargs(recipe, shape, pipe, defaults=ctx.target.warmup_defaults)
    # Which input dimensions follow the prompt: measured, never listed (issue 34; aotbuild/pipeline/textlen.py).
    child.phase(job, "measuring the text length")
    text, pattern = measure_text(recipe, component, module, pipe, rank,
                                 lambda: pipecall.warmup_kwargs(recipe, shape, pipe,
                                                                defaults=ctx.target.warmup_defaults))
    # Which timestep dtypes and ranks the component treats alike: measured, then proven served (issue 56).
    child.phase(job, "measuring the timestep")
    timestep = measure_timestep(recipe, module, pipe, rank, lambda: pipecall.warmup_kwargs(
        recipe, shape, pipe, defaults=ctx.target.warmup_defaults))
    child.phase(job, "compiling and warming up")
    built, structure = _compile(job, ctx, recipe, pipe, component, module, warmup, workdir, pattern)
    t_warm = time.perf_counter()
    from torch._dynamo.utils import counters

    return {
        **({"packages": built.records} if built.records else {}),
        "key": key,
        "signatures": built.signatures,
        "structure": structure,
        # "shared_load": the loader's one load, which this job's recipe paid at its first job.
        "seconds": {"load": round(t_load - t0, 3), **({"shared_load": loaded[1]} if loaded else {}),
                    "compile_and_warmup": round(t_warm - t_load, 3)},
        # Which process loaded the weights: this one, or the loader it was forked from (one per recipe).
        "loaded_by": "loader" if loaded is not None else "worker",
        "counters": {k: int(v) for k, v in counters["inductor"].items() if "cache" in k},
        "pipeline_class": type(pipe).__name__,
        "facts": ctx.target.build_facts(ctx.device),
        **({"text": text} if text else {}),
        **({"timestep": timestep} if timestep else {}),
        **({"rank": rank} if rank is not None else {}),
    }


def _checked_key(planned: dict[str, Any], ctx: Any, pipe: Any, component: str, shape: Any, rank: int | None) -> str:
    """The key of the job as loaded here, which must be the one the plan computed (``planned``: this
    rank's key and factors)."""
    from aotbuild import keys
    from aotbuild.pipeline import models

    cls_name, config = models.module_config(getattr(pipe, component))
    factors = ctx.factors(component, cls_name, config, shape, type(pipe).__name__, rank)
    key = keys.key_of(factors)
    if key != planned["key"]:
        diff = "; ".join(keys.differences(planned["factors"], factors)) or "unknown"
        raise RuntimeError(f"the loaded model gives another key than the plan ({diff})")
    return key


def _compile(job: dict, ctx: Any, recipe: Any, pipe: Any, component: str, module: Any, warmup: dict[str, Any],
             workdir: Path, pattern: Any) -> tuple[Any, dict[str, Any]]:
    """The strategy's build of ``module`` (compile and warm up) and the module's structure, recorded
    before the strategy puts anything in it, with what its graphs depend on."""
    from aotbuild.pipeline import dependencies
    from aotbuild.pipeline.structure import record
    from aotbuild.strategies.base import BuildJob

    structure = record(module, ctx.target.global_settings())  # before the strategy puts anything in it
    # What the graphs depend on beyond their inputs (issue 31), also before the strategy's wrappers;
    # the global state of the component's calls is seen by the strategy's recorders during the warmup.
    depends = dependencies.snapshot(module)
    dependencies.record_calls(module)
    workdir.mkdir(parents=True, exist_ok=True)
    ctx.target.prepare_build(ctx.device)
    from aotbuild.features import registry as features

    job_spec = BuildJob(ctx, pipe, component, module, warmup, workdir,
                        phase=lambda text: child.phase(job, text), text=pattern,
                        noise=features.tolerance(recipe, 0.0))
    try:
        built = ctx.strategy.build(job_spec)
    except Exception as exc:
        why = capture_failure(exc, ctx.strategy, recipe)
        if why:
            raise RuntimeError(why) from exc  # the whole traceback stays in the job's log
        raise
    # The per-call check compares with what the modules held at their first call (a pipeline may set
    # an attention processor for its calls, PAG does); the load-time check with ``depends``.
    structure["dependencies"] = {**depends, "globals": dependencies.observed(),
                                 "calls": dependencies.call_time(depends)}
    dependencies.reset_observed()
    return built, structure


def measure_text(recipe: Any, component: str, module: Any, pipe: Any, rank: int | None,
                 call: Any) -> tuple[dict[str, Any], Any]:
    """What the build records of the component's text length (``prompt_dependent``: the dimensions that
    follow the prompt, and how the recipe serves them) and, with ``text_length``, the text pattern the
    strategy builds. Not measured under model offload or tensor parallelism (a stopped pipeline call
    would leave an offload hook's device or a collective half-way): those record nothing."""
    from aotbuild.pipeline import textlen

    if recipe.offload != "none" or rank is not None:
        if recipe.text_length is not None:
            raise RuntimeError("text_length cannot be measured under offload or tensor parallelism yet")
        return {}, None
    from aotbuild.dispatch import signature

    limits = recipe.text_length
    try:
        measured = textlen.detect(pipe, module, call(), signature)
    except Exception as exc:  # noqa: BLE001 - only what plan reports is lost, unless the recipe needs it
        if limits is not None:
            raise
        return {"why": f"not measured: {type(exc).__name__}: {str(exc)[:200]}"}, None
    found = measured.as_json()
    if limits is None:
        found["served"] = "static: the warmup's length only" if measured.dims else "any prompt (a fixed length)"
        return found, None
    if not measured.dims:
        why = f" ({measured.why})" if measured.why else ""
        raise RuntimeError(f"text_length is set, but no input of {component} follows the prompt's length (measured "
                           f"with two prompt lengths{why}): every prompt is already served; remove text_length")
    length = measured.length
    if not limits.min <= length <= limits.max:
        raise RuntimeError(f"the warmup's prompt is {length} tokens long as {component} sees it, outside text_length "
                           f"({limits.min} to {limits.max}): widen the range or change warmup.prompt")
    pattern = textlen.Pattern(textlen.generalize(measured.warmup_sig, list(measured.dims), limits.min, limits.max))
    found["served"] = f"text_length {limits.min} to {limits.max}"
    return found, pattern


def measure_timestep(recipe: Any, module: Any, pipe: Any, rank: int | None, call: Any) -> dict[str, Any]:
    """Which dtypes and ranks of the component's timestep give the warmup's first call its output
    (aotbuild/pipeline/timesteps.py): the record a load converts a scheduler's timestep by. {} under regional
    scope (its blocks take no timestep: nothing to convert); under offload and tensor parallelism, as for the
    text length, a record that says it was not measured (a refusal then says why nothing is converted)."""
    from aotbuild import forwards
    from aotbuild.pipeline import timesteps

    if recipe.compile.scope != "full":
        return {}
    if recipe.offload != "none" or rank is not None:
        return {"version": timesteps.VERSION, "why": "its build did not measure the timestep (not measured under "
                                                     "offload or tensor parallelism yet)"}
    try:
        args, kwargs = forwards.first_call(pipe, module, call())
        # besides the first call's timestep, the schedule's middle and last step (set by the stopped call)
        return timesteps.measure(module, args, kwargs, values=timesteps.schedule_values(pipe, module, args, kwargs))
    except Exception as exc:  # noqa: BLE001 - a load then converts nothing: a refusal names this
        # printed into refusals and warnings, and checked so by the manifest's reader: one printable line
        return {"version": timesteps.VERSION,
                "why": printable(f"not measured: {type(exc).__name__}: {str(exc)[:200]}")}


#: What Dynamo and torch.export raise when they cannot take a module whole (data-dependent Python,
#: an unsupported call), by class name: their module paths moved between torch releases.
CAPTURE_ERRORS = ("Unsupported", "UserError", "UncapturedHigherOrderOpError", "GuardOnDataDependentSymNode",
                  "DataDependentOutputException", "TorchRuntimeError")
#: Where torch.export and Dynamo trace a model: an error raised in the model's own code under one of
#: them (a plain RuntimeError, say: ``.numpy() is not supported for tensor subclasses`` when export's
#: fake tensors meet numpy) is the tracer refusing the model, a capture failure too (issue 36).
TRACERS = ("torch/export/", "torch/_export/", "torch/_dynamo/")


def capture_failure(exc: BaseException, strategy: object, recipe: object) -> str:
    """One line for a component the compiler could not capture whole: the cause (the error's first
    line and the model's file:line) and the fix; "" for any other failure. (A 60-line Dynamo error
    was cut before its useful part; export said only "unhashable type: non-nested SymInt".)"""
    chain = _chain(exc)
    capture = next((e for e in chain if type(e).__name__ in CAPTURE_ERRORS
                    or "SymInt" in str(e) or "data-dependent" in str(e).lower()), None)
    capture = capture or next((e for e in chain if _raised_in_model_under_tracer(e)), None)
    if capture is None:
        return ""
    first = next((line.strip() for line in str(capture).splitlines() if line.strip()), type(capture).__name__)
    where = next((w for w in map(model_frame, chain) if w), "")
    where = f" at {where}" if where else ""
    if getattr(strategy, "graph_breaks", False) and getattr(recipe.compile, "fullgraph", True):
        fix = "set compile.fullgraph: false (several graphs, each proven) or compile.scope: regional"
    elif getattr(strategy, "graph_breaks", False):
        fix = "use compile.scope: regional"
    else:
        fix = "use compile.scope: regional, or strategy jit-cache with compile.fullgraph: false"
    return f"the component cannot be captured whole: {type(capture).__name__}: {first[:200]}{where}; {fix}"


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the errors it was raised from or during, innermost last (at most 8, no cycles)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain and len(chain) < 8:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


def _ours(filename: str) -> bool:
    """Whether a frame is torch's, aotbuild's or the standard library's: not the model's code."""
    import sysconfig

    import torch

    roots = [str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve().parent),  # torch, aotbuild
             str(Path(sysconfig.get_paths()["stdlib"]).resolve())]
    path = str(Path(filename).resolve()) if not filename.startswith("<") else filename
    generated = "/torchinductor" in path  # Inductor's generated code (its cache folder), not the model's
    return filename.startswith("<") or generated or any(path == r or path.startswith(r + "/") for r in roots)


def _raised_in_model_under_tracer(exc: BaseException) -> bool:
    """Whether ``exc`` went up through torch.export's or Dynamo's tracing from the model's own code:
    its traceback holds a tracer's frame and, inside it, a frame of the model's code."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    # eval_frame.py only calls what Dynamo already compiled: an error raised running it (an index out
    # of range, out of memory) is no capture failure, whatever code it went through
    tracing = next((i for i, f in enumerate(frames) if any(t in f.filename for t in TRACERS)
                    and not f.filename.endswith("torch/_dynamo/eval_frame.py")), None)
    return tracing is not None and any(not _ours(f.filename) for f in frames[tracing + 1:])


def model_frame(exc: BaseException) -> str:
    """``file:line`` of the innermost frame of the model's code where ``exc`` was raised, or "":
    Dynamo's stack of the code it traced (``real_stack``: Python's own traceback shows only Dynamo),
    else the innermost frame of the traceback that is not torch's, aotbuild's or the stdlib's."""
    import traceback

    real = getattr(exc, "real_stack", None) or ()
    frames = [*[f for f in real if not _ours(f.filename)][-1:]] or \
        [f for f in traceback.extract_tb(exc.__traceback__) if not _ours(f.filename)][-1:]
    return f"{frames[0].filename}:{frames[0].lineno}" if frames else ""


def main(argv: list[str]) -> int:
    return child.main(argv, run)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
