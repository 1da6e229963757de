"""Cold compile vs warm loads on one recipe, measured side by side in fresh processes.

    python benchmarks/cold_vs_warm.py [--recipe tiny-sd] [--repeats 3] [--plot benchmarks/cold_vs_warm.png]

--recipe is a recipe file or a built-in architecture (tiny-sd, the default, tiny-sdxl, tiny-sd3,
tiny-flux: recipes/tiny_<arch>_cpu.yaml); its first shape is measured, and the aotbuild modes load
recipes derived from it (harness.derive_recipe). Modes (each a fresh process, load -> first image
timed from the top of the process):
  eager      no compile at all
  cold       plain torch.compile(component.forward, fullgraph=True, dynamic=False) on each of the
             recipe's components, empty Inductor cache
  cold-freezing  the same with options={"freezing": True} (Inductor's prepacked CPU weights)
  pt-warm    the same, on the Inductor cache folder a cold run left (PyTorch's own warm cache)
  aotbuild   load_compiled() from a copy of an aotbuild cache in a new folder, empty Inductor cache
             (strategy jit-cache; ``jit-cache`` is accepted as its name in --modes)
  auto       the same with the recipe naming no strategy (strategy auto, the default: each job
             stores the first strategy that builds and passes the proof), built into a cache of
             its own (in the shared one it would take aot-package's entry and compile nothing)
  aot-package  the same with strategy: aot-package (AOTInductor packages, no Dynamo at load)
  aot-regional aot-package with compile.scope: regional (one package per repeated block and
               signature, shared by the block's instances; the rest of the denoiser runs eagerly)
  aot-compile  the same with strategy: aot-compile (torch's aot_compile functions, no Dynamo tracing)
  aotc-regional aot-compile with compile.scope: regional (one function per block class and signature)
In a child, AOTBENCH_PASS_PIPE=1 loads the pipeline first and passes it to load_compiled(pipe=...)
(a user's pipeline, e.g. other weights of the same structure), AOTBENCH_OUTPUT=FILE.npy saves
the first image (output_type="np", for every call of the child) to compare with eager's, and
AOTBENCH_LATENTS=FILE.npy the first call's final latents (what the VAE decodes). Eager, and a pipeline
passed to load_compiled, are loaded in the recipe's dtype and quantized as its model.quantization says.
Steady state is the median of 10 calls after the first (aotbuild builds CPU kernels with
cpp.dynamic_threads; plain torch.compile does not). Peak RSS is each process's ru_maxrss.
Prints medians, each mode against eager and the cold compile, where each mode's first output goes
(start-up, pipeline load, and load_compiled's own phases from pipe.aotbuild_report.timings), the
ratios the issues set as goals (issue 36's for auto: first output within 1.05x eager's, steady call
within 5% of torch.compile's, build no slower than jit-cache's), and each aotbuild build's phases
with the proof's share of it. torch.compile's steady call is pt-warm's where it ran, else jit-cache's
(the same kernels, aotbuild's settings: cpp.dynamic_threads on).
Never used by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()

from harness import ARCHS, REGIONAL_BLOCKS, build, child_env, derive_recipe, fmt, table  # noqa: E402
from harness import run_child as run_script_child  # noqa: E402

from aotbuild.recipe.rules import load_recipe  # noqa: E402


def child(mode: str, recipe: str, cache: str) -> None:
    import torch

    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs

    r = load_recipe(recipe)
    shape = r.shapes[0]
    phases = {"start": time.perf_counter() - T0}  # the interpreter, torch, diffusers, aotbuild, the recipe
    passed = os.environ.get("AOTBENCH_PASS_PIPE") == "1"  # the user's own pipeline, given to load_compiled
    if mode in BUILDS and not passed:
        from aotbuild import load_compiled

        pipe = load_compiled(recipe, cache=cache, on_miss="error")
        phases.update(pipe.aotbuild_report.timings)
    else:
        from aotbuild.context import prepare_pipeline

        t = time.perf_counter()
        # as the recipe serves it: its dtype, its model.quantization (what load_compiled does to a pipeline
        # it loads itself; a pipeline passed to it is the user's, already quantized)
        pipe = load_pipeline(r, resolve_model(r, resolve_cache_root(cache)), r.model.dtype)
        prepare_pipeline(pipe, r)
        phases["pipeline"] = time.perf_counter() - t
        if mode in BUILDS:
            from aotbuild import load_compiled

            pipe = load_compiled(recipe, pipe=pipe, cache=cache, on_miss="error")
            phases.update({k: v for k, v in pipe.aotbuild_report.timings.items() if k != "pipeline"})
        elif mode != "eager":
            options = {"freezing": True} if mode == "cold-freezing" else None
            for name in r.compile.components:
                module = getattr(pipe, name)
                module.forward = torch.compile(module.forward, fullgraph=True, dynamic=False, options=options)
    saved = os.environ.get("AOTBENCH_OUTPUT")  # where to write the first image as an array (.npy)
    extra = {"output_type": "np"} if saved else {}
    latents = os.environ.get("AOTBENCH_LATENTS")  # where to write the first call's final latents (.npy)
    if latents:
        decode = pipe.vae.decode

        def keep(z, *args, **kwargs):
            import numpy

            if not os.path.exists(latents):
                numpy.save(latents, z.detach().float().cpu().numpy())
            return decode(z, *args, **kwargs)

        pipe.vae.decode = keep
    t = time.perf_counter()
    image = pipe(**warmup_kwargs(r, shape, pipe), **extra)
    if saved:
        import numpy

        numpy.save(saved, numpy.asarray(image.images[0] if hasattr(image, "images") else image[0]))
    first = time.perf_counter() - T0
    phases["first image"] = time.perf_counter() - t
    if mode in BUILDS:  # of which the components' first compiled calls
        phases["first component calls"] = sum(pipe.aotbuild_report.first_calls.values())
    times = []
    for _ in range(10):
        t = time.perf_counter()
        pipe(**warmup_kwargs(r, shape, pipe), **extra)
        times.append(time.perf_counter() - t)
    import resource

    from torch._dynamo.utils import counters

    print("RESULT " + json.dumps({"first": first, "steady": statistics.median(times), "phases": phases,
                                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                  "counters": dict(counters["inductor"]),
                                  "unique_graphs": counters["stats"].get("unique_graphs", 0),
                                  "frames": counters["frames"].get("total", 0)}))


def run_child(mode: str, recipe: Path, cache: Path, workdir: Path) -> dict:
    """One fresh process of ``mode``; its compiler caches under ``workdir`` (empty, unless a
    previous process of this round left them there: pt-warm after cold)."""
    result = run_script_child(__file__, [mode, str(recipe), str(cache)], child_env(workdir))
    if "error" in result:
        sys.exit(f"{mode} failed: {result['error']}")
    return result


#: mode -> (strategy, scope) of the aotbuild recipe it loads; the other modes load the base recipe.
BUILDS = {"aotbuild": ("jit-cache", "full"), "auto": ("auto", "full"), "aot-package": ("aot-package", "full"),
          "aot-regional": ("aot-package", "regional"), "aot-compile": ("aot-compile", "full"),
          "aotc-regional": ("aot-compile", "regional")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="tiny-sd", help=f"a recipe file or one of {', '.join(ARCHS)} "
                                                        "(recipes/tiny_<arch>_cpu.yaml); its first shape is measured")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="eager,cold,pt-warm,aotbuild,auto,aot-package,aot-regional,aot-compile,"
                                       "aotc-regional",
                    help="comma-separated subset, for a quick look (ratios need their modes)")
    ap.add_argument("--plot", metavar="FILE.png", help="also draw the medians (needs matplotlib)")
    ap.add_argument("--save", metavar="FILE.json", help="also write every run's figures")
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.plot:
        from aotbuild.cli.bench import require_matplotlib

        require_matplotlib()
    base = ARCHS.get(args.recipe) or Path(args.recipe).absolute()
    work = Path(tempfile.mkdtemp(prefix="aotbench."))
    try:
        modes = ["aotbuild" if m == "jit-cache" else m for m in args.modes.split(",")]
        stem = base.stem.removesuffix("_cpu")
        blocks = REGIONAL_BLOCKS.get(args.recipe)
        recipes = {mode: derive_recipe(base, work / f"{stem}_{strategy}_{scope}.yaml".replace("-", "_"),
                                       strategy=strategy, scope=scope, blocks=blocks if scope == "regional" else None)
                   for mode, (strategy, scope) in BUILDS.items()}
        recipe = recipes["aotbuild"]  # the base recipe at one shape: eager, cold and pt-warm load it
        model = load_recipe(recipe).model.id
        cache = work / "cache"
        caches = {mode: work / "cache-auto" if mode == "auto" else cache for mode in BUILDS}
        builds = {}
        for mode in (m for m in modes if m in BUILDS):
            print(f"building the {mode} cache (strategy {BUILDS[mode][0]}, scope {BUILDS[mode][1]}) ...", flush=True)
            builds[mode] = build(recipes[mode], caches[mode], work / f"build-{mode}")
            if not builds[mode].ok:  # the other modes are still measured
                print(f"  not measured: building {recipes[mode].name} failed: {builds[mode].reason}\n"
                      f"  the log's tail:\n{builds[mode].log_tail}", flush=True)
        results: dict[str, list[dict]] = {m: [] for m in modes if m not in builds or builds[m].ok}
        for i in range(args.repeats):
            print(f"round {i + 1}/{args.repeats} ...", flush=True)
            shared = work / f"pt-{i}"
            copy = work / f"copy-{i}" / "cache"
            cache.mkdir(parents=True, exist_ok=True)  # where only auto was built
            shutil.copytree(cache, copy)
            copy_auto = work / f"copy-{i}" / "cache-auto"
            if "auto" in builds:
                shutil.copytree(caches["auto"], copy_auto)
            runs = {"auto": (recipes["auto"], copy_auto, work / f"auto-ind-{i}"),
                    "eager": (recipe, cache, work / f"eager-{i}"), "cold": (recipe, cache, shared),
                    "cold-freezing": (recipe, cache, work / f"cf-{i}"),
                    "pt-warm": (recipe, cache, shared), "aotbuild": (recipe, copy, work / f"aot-ind-{i}"),
                    "aot-package": (recipes["aot-package"], copy, work / f"pkg-ind-{i}"),
                    "aot-regional": (recipes["aot-regional"], copy, work / f"reg-ind-{i}"),
                    "aot-compile": (recipes["aot-compile"], copy, work / f"aotc-ind-{i}"),
                    "aotc-regional": (recipes["aotc-regional"], copy, work / f"aotcr-ind-{i}")}
            for mode in results:  # in this order: pt-warm reuses the folder cold left
                results[mode].append(run_child(mode, *runs[mode]))
        med = {m: statistics.median(r["first"] for r in rs) for m, rs in results.items()}
        steady = {m: statistics.median(r["steady"] for r in rs) for m, rs in results.items()}
        import torch

        from aotbuild.cli.bench import _cpu_model

        machine = (f"{os.cpu_count()} CPUs, {_cpu_model()}, ISA {torch.backends.cpu.get_cpu_capability()}, "
                   f"torch {torch.__version__}")
        shape = load_recipe(recipe).shapes[0]
        print(f"\n{model} ({', '.join(load_recipe(recipe).compile.components)}), {shape}; {machine}; "
              f"median of {args.repeats}")
        rss = {m: statistics.median(r["rss_mb"] for r in rs) for m, rs in results.items()}
        print(f"{'mode':<12} {'load->first output (s)':>24} {'/ eager':>8} {'/ cold':>7} {'steady call (ms)':>18} "
              f"{'peak RSS (MB)':>15}")
        for m in results:
            vs = [fmt(med[m] / med[b] if b in med else None, ".3f") for b in ("eager", "cold")]
            print(f"{m:<12} {med[m]:>24.2f} {vs[0]:>8} {vs[1]:>7} {steady[m] * 1000:>18.1f} {rss[m]:>15.0f}")
        names = ["start", "pipeline", "verify", "install", "first image", "first component calls"]
        print("\nwhere each mode's first output goes (median seconds; start = the interpreter and imports "
              "before the load; install includes the compiler's imports):")
        print(table(["mode", *names], [[m, *(fmt(statistics.median(r["phases"][n] for r in rs) if n in rs[0]["phases"]
                                                 else None, ".2f") for n in names)] for m, rs in results.items()],
                    text_columns=1))
        if builds:
            print("\nthe builds (one job each), and the proof's share of each:")
            print(table(["build", "status", "job s", "load s", "compile+warmup s", "proof s", "proof share %"],
                        [[m, b.status, f"{b.seconds:.1f}", fmt(b.phases.get("load"), ".1f"),
                          fmt(b.phases.get("compile_and_warmup"), ".1f"), fmt(b.proof_s, ".1f"),
                          fmt(b.proof_share * 100 if b.proof_share is not None else None, ".0f")]
                         for m, b in builds.items()], text_columns=2))
        print()
        ratios = [
            ("aotbuild warm / cold compile", "aotbuild", "cold", med, "<= 0.20"),
            ("aotbuild warm / PyTorch warm cache", "aotbuild", "pt-warm", med, "<= 1.05"),
            ("aotbuild steady / torch.compile", "aotbuild", "pt-warm", steady, "within 5%; dynamic_threads on vs off"),
            ("auto load / eager load", "auto", "eager", med, "<= 1.05 (issue 36)"),
            ("auto steady / torch.compile (pt-warm)", "auto", "pt-warm", steady, "within 5%"),
            ("auto steady / jit-cache (same kernels)", "auto", "aotbuild", steady, "within 5%"),
            ("auto peak RSS / eager", "auto", "eager", rss, ""),
            ("aot-package load / eager load", "aot-package", "eager", med, "<= 1.1"),
            ("aot-package load / cold compile", "aot-package", "cold", med, "<= 0.06"),
            ("aot-package steady / torch.compile", "aot-package", "pt-warm", steady, "within 5%"),
            ("aot-package peak RSS / eager", "aot-package", "eager", rss, "<= 1.10"),
            ("aot-regional load / eager load", "aot-regional", "eager", med, "<= 1.25"),
            ("aot-regional steady / eager", "aot-regional", "eager", steady, "< 1: pays"),
            ("aot-regional steady / aot-package", "aot-regional", "aot-package", steady, ""),
            ("aot-compile load / eager load", "aot-compile", "eager", med, "<= 1.3"),
            ("aot-compile load / cold compile", "aot-compile", "cold", med, ""),
            ("aot-compile load / jit-cache warm", "aot-compile", "aotbuild", med, "< 1: skips Dynamo's trace"),
            ("aot-compile steady / torch.compile", "aot-compile", "pt-warm", steady, "within 5%"),
            ("aot-compile peak RSS / eager", "aot-compile", "eager", rss, ""),
            ("aotc-regional load / eager load", "aotc-regional", "eager", med, ""),
            ("aotc-regional steady / eager", "aotc-regional", "eager", steady, "< 1: pays"),
        ]
        built_s = {m: b.seconds for m, b in builds.items() if b.status == "built"}
        ratios.append(("auto build / jit-cache build", "auto", "aotbuild", built_s, "<= 1 (issue 36)"))
        for label, a, b, figures, goal in ratios:
            if a in figures and b in figures:
                print(f"{label:<38} = {figures[a] / figures[b]:.3f}" + (f"  (goal {goal})" if goal else ""))
        if args.save:
            Path(args.save).write_text(json.dumps({"machine": machine, "model": model, "shape": str(shape),
                                                   "repeats": args.repeats, "runs": results,
                                                   "builds": {m: b.as_json() for m, b in builds.items()}}, indent=1))
        if args.plot:
            from aotbuild.cli.bench import draw

            names = {"eager": "eager", "cold": "cold torch.compile", "pt-warm": "PyTorch warm cache",
                     "aotbuild": "aotbuild jit-cache", "auto": "aotbuild auto", "aot-package": "aotbuild aot-package",
                     "aot-regional": "aot-package regional", "aot-compile": "aotbuild aot-compile",
                     "aotc-regional": "aot-compile regional"}
            colors = {"eager": "#8c8c8c", "cold": "#d62728", "pt-warm": "#ff7f0e", "aotbuild": "#2ca02c",
                      "auto": "#bcbd22", "aot-package": "#1f77b4", "aot-regional": "#17becf", "aot-compile": "#9467bd",
                      "aotc-regional": "#e377c2"}
            draw(args.plot, f"{model}, {shape}, fresh processes; {machine}",
                 [(names[m], [r["first"] for r in rs], [r["steady"] for r in rs], colors[m])
                  for m, rs in results.items()])
            print(f"plot: {args.plot}")
        if "aotbuild" in results:
            print(f"fxgraph counters, aotbuild runs: {[r['counters'] for r in results['aotbuild']]}")
        for m in ("auto", "aot-package", "aot-regional", "aot-compile", "aotc-regional"):
            if m in results:
                print(f"Dynamo graphs, {m} runs: {[r['unique_graphs'] for r in results[m]]}; "
                      f"frames traced: {[r['frames'] for r in results[m]]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
