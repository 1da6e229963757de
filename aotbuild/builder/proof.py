"""The proof: no entry is stored until a fresh process has served it with 0 compiles, equal to eager.

Build side (``builder.build._prove``, called once a job's workers have finished): the job's files go
into a throwaway store inside the job's staging folder, and a fresh process
(``python -m aotbuild.builder.proof SPEC.json``) is started with every compiler cache pointed at an empty
folder (the target's ``capture_env``) and another working directory. That process

1. loads the pipeline and runs the recipe's warmup call eagerly, recording every call of the
   component (its inputs and outputs) and which module instances ran (every repeated block instance,
   for regional scope);
2. loads the entry from the throwaway store with ``load_compiled(on_miss="error",
   strict_shapes=True)``: exactly what a serving process does;
3. calls the component again with every recorded input and compares each output with eager's
   (max absolute difference), while the strategy counts what the load and the calls compiled
   (``Strategy.compile_counter``: for jit-cache, the target's count: FX graph cache misses and
   kernels built on Inductor, files the compiler wrote to its cache folder on Neuron and TPU; for
   aot-package, Dynamo graphs, since every call must be routed to a package; for aot-compile,
   Dynamo graphs traced plus the target's count).

Any compile, any difference above the dtype's tolerance, or any error fails the job with the reason
and the fix, and nothing is stored. What it measured is the manifest's ``proof``; its ``served``
section keeps what a replica would see beyond the verdict (:func:`served`): the load's hits, Dynamo
graphs and FX graph cache counts, each dispatcher's calls, the packages' weight swaps and rebinds,
the offload hook, and the refusal of a call at a shape the entry was not built for. The tests read
those instead of serving every entry a second time (issue 30, item 4).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from aotbuild import forwards
from aotbuild.utils.text import printable

#: The largest |compiled - eager| accepted, per dtype. float32: the issue's bound, 1e-4, about 800
#: ulps at magnitude 1: Inductor reorders and fuses reductions, so a few ulps per op add up over a
#: network, and measured differences on the tiny models are below 1e-5. Half precisions round every
#: intermediate to 11 (float16) or 8 (bfloat16) bits of mantissa, so the same reordering moves a
#: result by ~1e-3 (float16) and ~1e-2 (bfloat16) at magnitude 1; the bounds leave a margin of
#: about 5x over that (docs/cache.md, "The proof").
TOLERANCE = {"float32": 1e-4, "float64": 1e-6, "float16": 5e-3, "bfloat16": 5e-2}


#: Calls kept per call signature (their inputs and eager outputs are held in memory until replayed):
#: every signature, through every instance, without holding a long warmup's every step.
CALLS_PER_SIGNATURE = 2


def tolerance(dtype: str) -> float:
    return TOLERANCE.get(dtype, 1e-4)


# -- the fresh process ------------------------------------------------------------------------

def tensors(value: Any) -> list[Any]:
    """Every tensor in an output (a tensor, a tuple, a diffusers BaseOutput, a dict), in order."""
    import torch
    from torch.utils._pytree import tree_leaves

    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def _clone(value: Any) -> Any:
    """A copy of a call's inputs, each tensor in exactly its layout: a replayed call must be the call the
    pipeline made. (PixArt passes its timestep as ``t.expand(batch)``, stride 0: a contiguous copy is
    another signature to Dynamo's guards, which a serving process never sees, and it recompiled.)"""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: clone_layout(t) if isinstance(t, torch.Tensor) else t, value)


def clone_layout(t: Any) -> Any:
    """A copy of ``t`` with its exact shape and strides, expanded (stride 0) dimensions included."""
    t = t.detach()
    if t.numel() == 0:
        return t.clone()
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return t.as_strided((span,), (1,)).clone().as_strided(t.shape, t.stride())


def block_instances(module: Any, recipe: Any) -> list[tuple[str, Any]]:
    """(name, instance) of every repeated block a regional recipe compiles; [("", module)] for full."""
    if recipe.compile.scope != "regional":
        return [("", module)]
    from aotbuild.pipeline.blocks import select_blocks

    return select_blocks(module, recipe.compile.blocks, recipe)


def record_eager(pipe: Any, recipe: Any, component: str, warmup: dict[str, Any],
                 every: list[tuple[str, Any, Any]] | None = None) -> tuple[list[tuple[Any, Any, list[Any]]], set[str]]:
    """The pipeline's eager warmup call, recorded: every call of ``component`` (inputs, outputs; at
    most CALLS_PER_SIGNATURE per signature) and the names of the block instances a regional entry
    must serve (``{""}``: the component whole), each checked to have run; RuntimeError if not.
    ``every``: gets (signature, args, kwargs) of every call of the component, uncapped (what a
    calibrated quantization was calibrated on)."""
    from aotbuild.dispatch import signature
    from aotbuild.strategies.calls import Watch

    module = getattr(pipe, component)
    calls: list[tuple[Any, Any, list[Any]]] = []
    ran: set[str] = set()
    instances = block_instances(module, recipe)

    per_signature: dict[str, int] = {}

    def record(name: str, _: Any, forward: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        ran.add(name)
        top = not name  # the component itself; a block's calls only say that it ran
        sig = signature(args, kwargs) if top else ""
        if top and every is not None:
            every.append((sig, _clone(args), _clone(kwargs)))
        if not top or per_signature.get(sig, 0) >= CALLS_PER_SIGNATURE:
            return forward(*args, **kwargs)
        per_signature[sig] = per_signature.get(sig, 0) + 1
        inputs = (_clone(args), _clone(kwargs))
        out = forward(*args, **kwargs)
        calls.append((*inputs, [t.detach().clone() for t in tensors(out)]))
        return out

    # What a module's forward was before the recording (accelerate's offload hook puts one on the
    # component) comes back afterwards (Watch.remove), so the entry is served through it as a
    # replica's would be.
    watch = Watch([(name, block) for name, block in instances if block is not module] + [("", module)],
                  forwards.PROOF, record)
    try:
        from aotbuild.pipeline.schedulers import warm_up

        warm_up(pipe, recipe, warmup)  # with each scheduler the recipe declares too (issue 56)
    finally:
        watch.remove()
    if not calls:
        raise RuntimeError(f"the warmup never called {component}")
    expected = {n for n, b in instances if b is not module} or {""}
    if ran & expected != expected:
        missing = sorted(expected - ran)
        raise RuntimeError(f"the warmup never ran {len(missing)} of the blocks (e.g. {missing[0]})")
    return calls, expected


def serve(spec: dict[str, Any]) -> dict[str, Any]:
    """Run in the fresh process: returns the proof's figures, or raises with the reason."""
    from aotbuild.context import job_pipeline
    from aotbuild.features import registry as features
    from aotbuild.pipeline import pipecall
    from aotbuild.recipe.rules import recipe_from_spec
    from aotbuild.recipe.schema import Shape
    from aotbuild.runtime import load_compiled

    shape = Shape(**spec["shape"])
    component = spec["component"]
    full = recipe_from_spec(spec["recipe"])
    # This job alone: the entry holds one component at one shape (neither is a key factor).
    recipe = replace(full, shapes=(shape,), compile=replace(full.compile, components=(component,)))
    ctx, pipe = job_pipeline(recipe, Path(spec["cache_root"]))
    module = getattr(pipe, component)

    # 1. Eager: what the component is called with, what it returns, which instances run.
    calibrated = features.calibrated(recipe, component)
    every: list[tuple[str, Any, Any]] | None = [] if calibrated else None
    calls, expected = record_eager(pipe, recipe, component, pipecall.warmup_kwargs(
        recipe, shape, pipe, defaults=ctx.target.warmup_defaults), every)
    floats = _quantized_reference(module, calls, every, ctx.target.int8_reduce_range(ctx.device)) \
        if calibrated else None
    from_float: list[float] = []
    swap = _swap_reference(pipe, recipe, component, calls, Path(spec["result"]).parent / "swap")

    # 2. Load the entry the way a serving process does. Counted from before the load: an artifact can
    #    compile while it loads (an aot-compile function rebuilds missing kernels then).
    counter_name, count = ctx.strategy.compile_counter(ctx.target)
    before = count()
    seen = _compiler_counts()
    t0 = time.perf_counter()
    load_compiled(recipe, pipe=pipe, cache=spec["store"], on_miss="error", strict_shapes=True)

    # 3. Every recorded call through the loaded entry, compared with eager; with text_length, also each
    #    call made at the range's ends and middle (its text dimensions resized; eager computed now).
    t_first: list[float] = []
    rel: list[float] | None = [] if features.relative_tolerance(recipe) else None
    worst = _replay(module, component, calls, lambda: t_first.append(time.perf_counter() - t0), rel)
    lengths, refused = _text_calls(module, calls)
    if lengths:
        worst = max(worst, _replay(module, component, lengths, lambda: None, rel))
    # 4. With lora: another adapter (other weights, a lower rank) hot-swapped in must serve too.
    swaps = 0
    if swap is not None:
        file, swapped_calls = swap
        pipe.load_lora_weights(str(file.parent), weight_name=file.name, hotswap=True,
                               adapter_name=recipe.lora.adapters[0].adapter_name)  # the guard load_compiled put
        worst = max(worst, _replay(module, component, swapped_calls, lambda: None, rel))
        swaps = 1
    # 5. Prepacked kernels (auto's first try on a CPU) are taken only where they serve faster than eager.
    speed = _speed(module, calls[0]) if spec.get("faster_than_eager") else None
    record = served(pipe, module, seen)
    # 6. The first call with its timestep in each dtype and rank the build proved alike (issue 56): each
    #    converted by the dispatcher to the built one and served, 0 compiles, as eager gives it (after
    #    ``served``, whose dispatcher counts are the recorded calls').
    converted, timestep = _timestep_calls(module, calls)
    if converted:
        # (int8static: eager here is the float model's, so these count toward the figure, not the bound: the
        # dispatcher converts the timestep and calls the package the recorded calls proved)
        worst = max(worst, _replay(module, component, converted, lambda: None, rel if floats is None else from_float))
    compiles = int(count() - before)
    # 7. A call at a shape this entry was not built for is refused (strict_shapes), never compiled.
    record["strict"] = _strict_refusal(pipe, recipe, shape, ctx)
    if lengths:  # what the text range served, and the refusal of a length past its end
        record["text"] = {"calls": len(lengths), "lengths": sorted({n for n, _ in refused[1:]}),
                          "refused": refused[0]}
    if speed is not None:
        record["speed"] = speed
    if rel is not None:  # held to a relative bound in place of the absolute one (Feature.relative_tolerance)
        record["relative"] = {"max_rel_diff": max(rel, default=0.0), "tolerance": features.relative_tolerance(recipe)}
    if floats is not None:  # int8static: what the served quantized model is from the float one
        served_from_float: list[float] = []
        _replay(module, component, floats, lambda: None, served_from_float)
        record["relative"]["from_float"] = max(from_float + served_from_float, default=0.0)
        record["relative"].update(_calibrated_gaps(rel or [], served_from_float, calls, floats))
    if timestep:
        record["timestep"] = timestep
    # 8. Smaller batches padded up to this entry's: proven exact, or padding to it refused (never the entry).
    bound = features.tolerance(recipe, tolerance(ctx.dtype))
    padding = prove_padding(module, recipe, shape, calls, count, bound,
                            recipe.warmup_factors(ctx.target.warmup_defaults)["prompt"]["texts"])
    return {"compiles": compiles, "counter": counter_name, "max_abs_diff": worst,
            "tolerance": bound, "instances": len(expected), "calls": len(calls),
            "load_s": round(t_first[0] if t_first else 0.0, 3), "swaps": swaps, "served": record,
            "padding": padding}


def prove_padding(module: Any, recipe: Any, shape: Any, calls: list[tuple[Any, Any, list[Any]]], count: Any,
                  bound: float, prompts: int = 1) -> dict[str, Any]:
    """``proof.padding`` (issue 56, item 3): each recorded call at a batch of 2 or more, cut to every smaller
    batch (``batch.proof_sizes``) and checked twice:

    * that padding leaks nothing into the real samples, exactly: eager at the padded batch, once padded with
      copies of the last real sample (what serving pads with) and once with other rows (``batch.pad_other``),
      gives the real samples bit for bit the same output (one batch size: the same kernels, so any difference
      is the samples seeing each other: a statistic or a dynamic quantization's scale over the batch). No
      dtype's tolerance loosens this: a half precision's compile noise is no licence to mix samples;
    * that the call served through the dispatcher's own padding gives each real sample eager's output at its
      own batch, within ``bound`` relative to the sample (the dtype's tolerance, as any served call: 1e-4 for
      float32).

    Every output must be tensors of the padded batch (``batch.output_problem``: a 0-d result, an object torch
    cannot see into or no tensor at all would be served with the padding in it). Any difference, an error or a
    compile refuses padding to this entry, with the reason; the entry itself is stored as proven."""
    import torch

    from aotbuild.dispatch import signature
    from aotbuild.pipeline import batch

    top = forwards.layers(module, forwards.DISPATCH)
    if recipe.compile.scope != "full" or recipe.tensor_parallel > 1 or recipe.text_length is not None or not top:
        return {"signatures": [], "sizes": [], "max_rel_diff": 0.0, "tolerance": bound,
                "refused": "not proven under regional scope, tensor parallelism or text_length (pad_batch refuses "
                           "those recipes)"}
    dispatcher = top[-1]
    records: dict[str, dict[str, Any] | None] = {}
    padded: list[tuple[Any, Any, dict[str, Any]]] = []
    for args, kwargs, _ in calls:
        sig = signature(args, kwargs)
        if sig not in records:
            records[sig] = batch.record(sig)
            if records[sig] is not None:
                padded.append((args, kwargs, records[sig]))
    verdict = batch.Verdict()
    if padded:
        served_before, routes = dispatcher.padding, dispatcher.routes
        before = count()
        try:
            with torch.no_grad():
                for args, kwargs, r in padded:
                    _prove_padded(module, dispatcher, shape, args, kwargs, r, routes, verdict, bound, prompts)
        except Exception as exc:  # noqa: BLE001 - whatever stops a padded call refuses padding, not the entry
            verdict.refuse(f"a padded call failed: {type(exc).__name__}: {str(exc)[:500]}")
        finally:
            dispatcher.padding, dispatcher.routes = served_before, routes
        compiled = int(count() - before)
        if compiled:
            verdict.refuse(f"padded calls compiled {compiled} time(s): the padded inputs are not the built ones")
    return {"signatures": [r for r in records.values() if r is not None], "sizes": sorted(set(verdict.sizes)),
            "max_rel_diff": verdict.max_rel_diff, "tolerance": bound, "refused": printable(verdict.refused)[:2000]}


def _prove_padded(module: Any, dispatcher: Any, shape: Any, args: Any, kwargs: Any, r: dict[str, Any],
                  routes: dict[str, Any], verdict: Any, bound: float, prompts: int) -> None:
    """:func:`prove_padding` for one recorded call of the entry's batch: every smaller batch of it."""
    from aotbuild.pipeline import batch

    inputs = tuple(tuple(p) for p in r["inputs"])
    # this signature alone is built while its smaller calls are made: each one is padded to it
    built = batch.Built(r["signature"], r["batch"], shape.batch_size * prompts, str(shape), "", inputs)
    dispatcher.routes = {r["signature"]: routes[r["signature"]]}
    dispatcher.padding = batch.Padding(dispatcher.component, [built], True)
    for size in batch.proof_sizes(r["batch"]):
        a, k = batch.take(args, kwargs, inputs, size)
        fit = batch.Fit(size, "", (built,), inputs, built)
        own = _detached(dispatcher.eager(*a, **k))
        pa, pk = batch.pad(a, k, fit)
        copies = _detached(dispatcher.eager(*pa, **pk))
        problem = batch.output_problem(copies, r["batch"])
        if problem:
            verdict.refuse(f"padding is not proven: {problem}")
            return
        other_args, other_kwargs = batch.pad_other(a, k, fit)
        other = batch.first_difference(copies, dispatcher.eager(*other_args, **other_kwargs), size)
        if other:
            again = batch.first_difference(copies, dispatcher.eager(*pa, **pk), size)
            verdict.refuse(
                f"padding changes a sample's output: {other} of a call at batch {size} padded to {r['batch']} changed "
                f"with the padding rows' values (eager, one batch size: the samples see each other, as a statistic "
                f"or a dynamic quantization's scale over the batch makes them)" if not again else
                f"padding is not proven: the component's eager output at batch {r['batch']} is not the same twice "
                f"for the same inputs ({again}), so whether padding leaks into a sample cannot be told")
            return
        routed = dispatcher.calls.get("padded", 0)
        out = module(*a, **k)
        if dispatcher.calls.get("padded", 0) != routed + 1:
            verdict.refuse(f"a call at batch {size} was not padded")
        batch.compare(out, own, size, verdict, bound)
        verdict.sizes.append(size)


def _detached(value: Any) -> Any:
    """An output with every tensor detached and copied (a later call may reuse a compiled graph's buffers)."""
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


#: Rounds of the speed comparison: one served and one eager call each, interleaved (a busy spell of
#: the machine slows both alike); the medians are compared. The first three rounds settle it when every
#: served call beat every eager one, or lost to every one (three against three fall in one of those two
#: orders by chance once in ten); otherwise it goes on to five. At SD 1.5 size a round is a served and an
#: eager UNet call, ~2.7 s on 2 cores: the usual clear case saves two of them per build.
SPEED_ROUNDS = (3, 5)


def settled(served_s: list[float], eager_s: list[float]) -> bool:
    """Whether the calls timed so far order themselves: every served faster than every eager, or slower."""
    return max(served_s) < min(eager_s) or min(served_s) > max(eager_s)


def _speed(module: Any, call: tuple[Any, Any, list[Any]]) -> dict[str, Any]:
    """The first recorded call, served and eager, timed in turn (:func:`speed_record`)."""
    import torch

    from aotbuild.dispatch import dispatchers

    eager = dispatchers(module)[0].eager  # the module's own forward, around which the entry was installed
    args, kwargs, _ = call
    with torch.no_grad():
        return speed_record(*timed_rounds(lambda: module(*args, **kwargs), lambda: eager(*args, **kwargs)))


def speed_record(served: list[tuple[float, float]], eager: list[tuple[float, float]]) -> dict[str, Any]:
    """What the proof stores of a speed comparison (``proof.served.speed``): per side the medians and the
    minimums of the wall seconds, the medians of the CPU seconds (the process's, every thread's), and each
    median's noise (the spread of the rounds, max - min, over the median). ``measure`` names the figures
    the verdict compares: the fastest of the interleaved rounds on each side (``wall-min``). A busy
    machine slows some rounds, rarely all (issue 52: an auto build on a heavily loaded machine dropped its
    prepacked try on wall medians); CPU seconds, which another process's load leaves alone, count the
    OpenMP threads' spinning too (tiny-sd: prepacked 42.9 ms of CPU against eager's 39.7 ms, while
    faster by the wall clock), so they are recorded, not judged."""
    import statistics

    def noise(xs: list[float]) -> float:
        median = statistics.median(xs)
        return round((max(xs) - min(xs)) / median, 3) if median > 0 else 0.0

    walls = {"served": [w for w, _ in served], "eager": [w for w, _ in eager]}
    cpus = {"served": [c for _, c in served], "eager": [c for _, c in eager]}
    record: dict[str, Any] = {"rounds": len(served), "measure": "wall-min", "noise": {}}
    for side in ("served", "eager"):
        record[f"{side}_s"] = round(statistics.median(walls[side]), 6)
        record[f"{side}_min_s"] = round(min(walls[side]), 6)
        record[f"{side}_cpu_s"] = round(statistics.median(cpus[side]), 6)
        record["noise"][f"{side}_s"] = noise(walls[side])
        record["noise"][f"{side}_cpu_s"] = noise(cpus[side])
    return record


def faster(speed: Any) -> bool:
    """The verdict of a stored speed record: the served call faster than eager's, by the measure it names
    (the wall medians for a record without one, from before issue 52)."""
    if not isinstance(speed, dict):
        return True
    if speed.get("measure") == "wall-min":
        return float(speed["served_min_s"]) < float(speed["eager_min_s"])
    return float(speed["served_s"]) < float(speed["eager_s"])


def timed_rounds(served: Any, eager: Any, clock: Any = time.perf_counter,
                 cpu_clock: Any = time.process_time) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """(wall, CPU) seconds of each call of ``served`` and ``eager``, in turn, for :data:`SPEED_ROUNDS`
    rounds; settled early by the wall clock."""
    served_s: list[tuple[float, float]] = []
    eager_s: list[tuple[float, float]] = []
    least, most = SPEED_ROUNDS
    while len(served_s) < most and not (len(served_s) >= least and settled([w for w, _ in served_s],
                                                                             [w for w, _ in eager_s])):
        for run, out in ((served, served_s), (eager, eager_s)):
            started, cpu = clock(), cpu_clock()
            run()
            out.append((clock() - started, cpu_clock() - cpu))
    return served_s, eager_s


def _text_calls(module: Any, calls: list[tuple[Any, Any, list[Any]]]) -> tuple[list[Any], list[Any]]:
    """With a text pattern served (``text_length``): each recorded call that fits it, made at the range's
    ends and middle, with its eager output; and [the refusal of a call one past the range's end, then
    (length, call index) of each made call]. ([], []) without a pattern."""
    import torch

    from aotbuild.dispatch import dispatchers, signature
    from aotbuild.errors import ShapeNotBuilt
    from aotbuild.pipeline import textlen

    served = next((d for d in dispatchers(module) if d.patterns), None)
    if served is None:
        return [], []
    made: list[tuple[Any, Any, list[Any]]] = []
    which: list[Any] = []
    refused = "not tried"
    for i, (args, kwargs, _) in enumerate(calls):
        pattern = next((p for p in served.patterns if p.sizes(signature(args, kwargs))), None)
        if pattern is None:
            continue
        for n in textlen.proof_lengths(pattern.lo, pattern.hi):
            a, k = textlen.call_at(pattern, args, kwargs, n)
            with torch.no_grad():
                eager = [t.detach().clone() for t in tensors(served.eager(*a, **k))]
            made.append((_clone(a), _clone(k), eager))
            which.append((n, i))
        if refused == "not tried":
            a, k = textlen.call_at(pattern, args, kwargs, pattern.hi + 1)
            try:
                with torch.no_grad():
                    module(*a, **k)
                refused = "not refused: the call ran"
            except ShapeNotBuilt as exc:
                refused = str(exc)[:2000]
    return made, [refused, *which]


def _timestep_calls(module: Any, calls: list[tuple[Any, Any, list[Any]]]) -> tuple[list[Any], dict[str, Any]]:
    """The first recorded call with its timestep in each dtype and rank the entry's record proved alike
    (aotbuild/pipeline/timesteps.py ``variants``), with eager's output for each; and what ``served.timestep``
    says of them ({} where nothing was proven)."""
    import torch

    from aotbuild.pipeline import timesteps

    top = forwards.layers(module, forwards.DISPATCH)
    conversions = top[-1].timesteps if top else None
    if conversions is None or not calls:
        return [], {}
    made = []
    args, kwargs, _ = calls[0]
    labels = []
    for label, a, k in timesteps.variants(conversions, args, kwargs):
        with torch.no_grad():
            eager = [t.detach().clone() for t in tensors(top[-1].eager(*a, **k))]
        made.append((_clone(a), _clone(k), eager))
        labels.append(label)
    return made, {"calls": len(made), "converted": labels}


def _compiler_counts() -> dict[str, int]:
    """Dynamo's graphs and Inductor's FX graph cache hits and misses so far in this process."""
    from torch._dynamo.utils import counters

    return {"dynamo_graphs": int(counters["stats"].get("unique_graphs", 0)),
            "fxgraph_cache_hit": int(counters["inductor"].get("fxgraph_cache_hit", 0)),
            "fxgraph_cache_miss": int(counters["inductor"].get("fxgraph_cache_miss", 0))}


def served(pipe: Any, module: Any, before: dict[str, int]) -> dict[str, Any]:
    """What serving the loaded entry did, counted since ``before`` (:func:`_compiler_counts`): the
    load's hits and misses, this process's rank and tensor-parallel degree, the compiler's counts,
    every dispatcher's calls ("" for the component, a block's name for regional scope), the weight
    swaps and rebinds of aot-package runners, and the type of the offload hook on the component
    ("NoneType" without offload)."""
    now = _compiler_counts()
    dispatchers = {name: found[-1] for name, m in module.named_modules()
                   if (found := forwards.layers(m, forwards.DISPATCH))}
    runners = [getattr(route, "runner", None) for d in dispatchers.values() for route in d.routes.values()]
    report = pipe.aotbuild_report
    return {"hits": len(report.hits), "misses": len(report.misses), "rank": report.rank, "tensor": report.tensor,
            **{name: now[name] - before[name] for name in now},
            "dispatch": {name: dict(d.calls) for name, d in dispatchers.items()},
            "package_swaps": sum(getattr(r, "swaps", 0) for r in runners),
            "rebinds": sum(getattr(r, "rebinds", 0) for r in runners),
            "offload_hook": type(getattr(module, "_hf_hook", None)).__name__}


def strict_shape(shape: Any) -> Any:
    """A shape no job of the entry's recipe needs: half the height (a multiple of 8 where the built
    one is a multiple of 16), the same width, frames and batch. The proof's store holds this job's
    entry only, so any other shape is one it was not built for."""
    return replace(shape, height=shape.height // 2)


def _strict_refusal(pipe: Any, recipe: Any, shape: Any, ctx: Any) -> str:
    """The pipeline called at :func:`strict_shape`: the ShapeNotBuilt message that refused it, or
    what happened instead (``"not refused: ..."``). Skipped for tensor-parallel ranks (a refusal on
    one rank and not the other would leave a collective waiting)."""
    from aotbuild.errors import ShapeNotBuilt
    from aotbuild.pipeline import pipecall

    if recipe.tensor_parallel > 1:
        return "not tried: tensor parallel"
    try:
        pipe(**pipecall.warmup_kwargs(recipe, strict_shape(shape), pipe, defaults=ctx.target.warmup_defaults))
    except ShapeNotBuilt as exc:
        return str(exc)[:2000]
    except Exception as exc:  # the pipeline refused the shape itself: recorded, not a failed proof
        return f"not refused: {type(exc).__name__}: {exc}"[:2000]
    return "not refused: the call ran"


def _replay(module: Any, component: str, calls: list[tuple[Any, Any, list[Any]]], first: Any,
            relative: list[float] | None = None) -> float:
    """Every recorded call through the module as it is now; the largest difference from its output.
    ``relative``: gets each floating output's ``|served - eager| / |eager|`` (norms over the tensor)."""
    import torch

    worst = 0.0
    with torch.no_grad():
        for i, (args, kwargs, eager) in enumerate(calls):
            out = tensors(module(*args, **kwargs))
            if i == 0:
                first()
            if len(out) != len(eager):
                raise RuntimeError(f"{component} returned {len(out)} tensors served, {len(eager)} eager")
            for a, b in zip(out, eager, strict=True):
                if a.shape != b.shape:
                    raise RuntimeError(f"{component} returned shape {list(a.shape)} served, {list(b.shape)} eager")
                # max(worst, nan) keeps worst: a NaN or Inf output would pass as "0 difference".
                if a.is_floating_point() and not bool(torch.isfinite(b).all()):
                    raise RuntimeError(f"{component}'s eager output holds NaN or Inf: the warmup cannot prove "
                                       f"anything (check the warmup arguments: sigmas, guidance)")
                if a.is_floating_point() and not bool(torch.isfinite(a).all()):
                    raise RuntimeError(f"{component} served NaN or Inf where eager's output is finite")
                if a.numel():
                    worst = max(worst, float((a.float() - b.float()).abs().max()))
                    if relative is not None and a.is_floating_point():
                        relative.append(float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)))
    return worst


def _calibrated_gaps(rel: list[float], served_from_float: list[float], calls: list[tuple[Any, Any, list[Any]]],
                     floats: list[tuple[Any, Any, list[Any]]]) -> dict[str, Any]:
    """int8static: which outputs over the relative bound are accounted for by the format itself
    (calibrate.accepted: the package as far from the float model as the quantized model run eagerly is,
    within calibrate.FLOAT_MARGIN). ``rel`` starts with the recorded calls' outputs (from the quantized
    model), ``served_from_float`` holds the same outputs' distances from the float model; later entries of
    ``rel`` (text lengths) are held to the bound alone. ``unaccounted``: the largest gap of an output
    accepted by neither (0.0: none), which the verdict holds to the bound."""
    from aotbuild.strategies import calibrate

    def figure(value: float | None) -> float | None:  # a manifest holds no inf (a float output of zeros)
        return value if value is None or math.isfinite(value) else None

    quantized = [calibrate.relative(q, f) for (_, _, qs), (_, _, fs) in zip(calls, floats, strict=True)
                 for q, f in zip(qs, fs, strict=True) if q.is_floating_point() and q.numel()]
    n = len(served_from_float)
    if len(quantized) != n or len(rel) < n:
        raise RuntimeError(f"the proof paired {len(rel)} relative gaps, {n} from the float model and "
                           f"{len(quantized)} of the quantized model: not the same outputs")
    paired = list(zip(rel[:n], served_from_float, quantized, strict=True))
    refused = [(g, s, q) for g, s, q in paired if not calibrate.accepted(g, s, q)]
    refused += [(g, None, None) for g in rel[n:] if not g <= calibrate.EAGER_BOUND]
    out: dict[str, Any] = {"quantized_from_float": figure(max(quantized, default=0.0)),
                           "over_bound_within_format": sum(g > calibrate.EAGER_BOUND and calibrate.accepted(g, s, q)
                                                           for g, s, q in paired),
                           "unaccounted": max((g for g, _, _ in refused), default=0.0)}
    worst = max(refused, key=lambda r: r[0], default=None)
    if worst is not None and worst[1] is not None:  # that output's own distances, for the refusal's message
        out["unaccounted_from_float"] = figure(worst[1])
        out["unaccounted_quantized_from_float"] = figure(worst[2])
    return out


def _quantized_reference(module: Any, calls: list[tuple[Any, Any, list[Any]]], every: list[tuple[str, Any, Any]],
                         reduce_range: bool) -> list[tuple[Any, Any, list[Any]]]:
    """int8static (strategies/calibrate.py): each recorded call's expected outputs replaced, in place, by the
    quantized model's run eagerly, calibrated as the build calibrated it: on every call of the warmup with
    its signature (the same pipeline, weights and seed: the same calls, so the same scales). Returns the
    calls with their float outputs, for the figure of how far the format is from the float model."""
    import torch

    from aotbuild.dispatch import signature
    from aotbuild.strategies import calibrate

    floats = list(calls)
    by_signature: dict[str, list[tuple[Any, Any]]] = {}
    for sig, args, kwargs in every:
        by_signature.setdefault(sig, []).append((args, kwargs))
    with torch.no_grad():
        for sig, recorded in by_signature.items():
            quantized = calibrate.convert(module, recorded, reduce_range)
            for i, (args, kwargs, _) in enumerate(calls):
                if signature(args, kwargs) == sig:
                    calls[i] = (args, kwargs, [t.detach().clone() for t in tensors(quantized(*args, **kwargs))])
            del quantized
    return floats


def _swap_reference(pipe: Any, recipe: Any, component: str, calls: list[tuple[Any, Any, list[Any]]],
                    folder: Path) -> tuple[Path, list[tuple[Any, Any, list[Any]]]] | None:
    """A feature's extra reference (``Feature.reference``: with lora, a second adapter swapped in and
    the recorded calls' eager outputs with it), or None."""
    from aotbuild.features.registry import used

    return next((found for feature in used(recipe)
                 if (found := feature.reference(pipe, recipe, component, calls, folder)) is not None), None)


def main(argv: list[str]) -> int:
    from aotbuild.builder import child

    return child.main(argv, serve)


# -- the build side ---------------------------------------------------------------------------

def verdict(result: dict[str, Any], label: str) -> Any:
    """The Proof for a passing result; ProofFailed, with the reason and the fix, for any other."""
    from aotbuild.cache.manifest import Proof
    from aotbuild.errors import ProofFailed

    if "error" in result:
        raise ProofFailed(f"a fresh process could not serve the entry, so nothing was stored: {result['error']}")
    proof = Proof(load_s=float(result["load_s"]), compiles=int(result["compiles"]),
                  max_abs_diff=float(result["max_abs_diff"]), tolerance=float(result["tolerance"]),
                  instances=int(result["instances"]), calls=int(result["calls"]), counter=str(result["counter"]),
                  swaps=int(result.get("swaps", 0)), served=dict(result.get("served", {})),
                  padding=result.get("padding"))
    if proof.compiles:
        raise ProofFailed(f"a fresh process loading the entry compiled {proof.compiles} time(s) "
                          f"({proof.counter}) for {label}: the artifacts do not cover every call, so nothing was "
                          f"stored; the log has the compiler's reasons")
    relative = proof.served.get("relative")
    if relative is not None:
        # int8static: an output over the bound as far from the float model as its quantized model is
        # (calibrate.accepted) is not held to it: "unaccounted" is the largest gap of the others
        gap, allowed = float(relative.get("unaccounted", relative["max_rel_diff"])), float(relative["tolerance"])
        if not gap <= allowed:
            pair = (relative.get("unaccounted_from_float"), relative.get("unaccounted_quantized_from_float"))
            beside = (f", and {pair[0]:.3g} from the float model where the quantized model is {pair[1]:.3g}"
                      if all(isinstance(v, float) for v in pair) else "")
            raise ProofFailed(f"the served {label} differs from eager by {gap:.3g} relative (|served - eager| / "
                              f"|eager|; tolerance {allowed:.2g}; int8static: against its quantized model run "
                              f"eagerly{beside}): nothing was stored; its kernels compute too far from that "
                              f"reference on this warmup's calls")
    elif not proof.max_abs_diff <= proof.tolerance:
        raise ProofFailed(f"the served {label} differs from eager by {proof.max_abs_diff:.3g} (tolerance "
                          f"{proof.tolerance:.0e}): nothing was stored; compile options that trade accuracy "
                          f"for speed are the usual cause (compile.options)")
    speed = proof.served.get("speed")
    if not faster(speed):
        fastest = speed.get("measure") == "wall-min"
        served, eager = ((speed["served_min_s"], speed["eager_min_s"]) if fastest
                         else (speed["served_s"], speed["eager_s"]))
        raise ProofFailed(f"the served {label} was not faster than eager in the proof ({served * 1e3:.1f} ms against "
                          f"{eager * 1e3:.1f} ms, {'the fastest' if fastest else 'medians'} of {speed['rounds']} "
                          f"calls each, interleaved): prepacked kernels are kept only where they serve faster")
    return proof


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
