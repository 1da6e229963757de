"""Cold compile vs warm loads on builtin:tiny-sd, measured side by side in fresh processes.

    python benchmarks/cold_vs_warm.py [--repeats 3] [--plot benchmarks/cold_vs_warm.png]

Modes (each a fresh process, load -> first image timed from the top of the process):
  eager      no compile at all
  cold       plain torch.compile(unet.forward, fullgraph=True, dynamic=False), empty Inductor cache
  pt-warm    the same, on the Inductor cache folder a cold run left (PyTorch's own warm cache)
  aotbuild   load_compiled() from a copy of an aotbuild cache in a new folder, empty Inductor cache
  aot-package  the same with strategy: aot-package (AOTInductor packages, no Dynamo at load)
  aot-regional aot-package with compile.scope: regional (one package per repeated block and
               signature, shared by the block's instances; the rest of the UNet runs eagerly)
Steady state is the median of 10 calls after the first (aotbuild builds CPU kernels with
cpp.dynamic_threads; plain torch.compile does not). Peak RSS is each process's ru_maxrss.
Prints medians and the ratios the core issue sets as goals. Never used by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "tiny_sd_cpu.yaml"


def child(mode: str, recipe: str, cache: str) -> None:
    import torch

    from aotbuild.layout import resolve_cache_root
    from aotbuild.models import load_pipeline, resolve_model, warmup_kwargs
    from aotbuild.recipe import load_recipe

    r = load_recipe(recipe)
    shape = r.shapes[0]
    if mode in ("aotbuild", "aot-package", "aot-regional"):
        from aotbuild import load_compiled

        pipe = load_compiled(recipe, cache=cache, on_miss="error")
    else:
        pipe = load_pipeline(r, resolve_model(r, resolve_cache_root(cache)), "float32")
        if mode != "eager":
            pipe.unet.forward = torch.compile(pipe.unet.forward, fullgraph=True, dynamic=False)
    pipe(**warmup_kwargs(r, shape))
    first = time.perf_counter() - T0
    times = []
    for _ in range(10):
        t = time.perf_counter()
        pipe(**warmup_kwargs(r, shape))
        times.append(time.perf_counter() - t)
    import resource

    from torch._dynamo.utils import counters

    print("RESULT " + json.dumps({"first": first, "steady": statistics.median(times),
                                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                  "counters": dict(counters["inductor"]),
                                  "unique_graphs": counters["stats"].get("unique_graphs", 0)}))


def run_child(mode: str, recipe: Path, cache: Path, inductor: Path) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(inductor), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, "--child", mode, str(recipe), str(cache)], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{mode} failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", default="eager,cold,pt-warm,aotbuild,aot-package,aot-regional",
                    help="comma-separated subset, for a quick look (ratios need their modes)")
    ap.add_argument("--plot", metavar="FILE.png", help="also draw the medians (needs matplotlib)")
    ap.add_argument("--save", metavar="FILE.json", help="also write every run's figures")
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.plot:
        from aotbuild.bench import require_matplotlib

        require_matplotlib()
    work = Path(tempfile.mkdtemp(prefix="aotbench."))
    try:
        recipe = work / "tiny_sd_cpu.yaml"  # one shape: each cold compile costs a minute here
        text = RECIPE.read_text().replace("  - {height: 64, width: 96}\n", "")
        recipe.write_text(text)
        aot_recipe = work / "tiny_sd_aot.yaml"
        aot_recipe.write_text(text.replace("strategy: jit-cache", "strategy: aot-package"))
        regional_recipe = work / "tiny_sd_aot_regional.yaml"
        regional_recipe.write_text(text.replace("strategy: jit-cache", "strategy: aot-package")
                                   .replace("scope: full", "scope: regional"))
        cache = work / "cache"
        modes = args.modes.split(",")
        builds = {"aotbuild": recipe, "aot-package": aot_recipe, "aot-regional": regional_recipe}
        to_build = [str(builds[m]) for m in modes if m in builds]
        if to_build:
            print(f"building the aotbuild caches once ({', '.join(m for m in modes if m in builds)}) ...", flush=True)
            subprocess.run([sys.executable, "-m", "aotbuild.cli", "build", "--cache", str(cache), *to_build],
                           check=True, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / "build-ind")},
                           capture_output=True)
        results: dict[str, list[dict]] = {m: [] for m in modes}
        for i in range(args.repeats):
            print(f"round {i + 1}/{args.repeats} ...", flush=True)
            shared = work / f"pt-{i}"
            copy = work / f"copy-{i}" / "cache"
            shutil.copytree(cache, copy)
            runs = {"eager": (recipe, cache, work / f"eager-{i}"), "cold": (recipe, cache, shared),
                    "pt-warm": (recipe, cache, shared), "aotbuild": (recipe, copy, work / f"aot-ind-{i}"),
                    "aot-package": (aot_recipe, copy, work / f"pkg-ind-{i}"),
                    "aot-regional": (regional_recipe, copy, work / f"reg-ind-{i}")}
            for mode in results:  # in this order: pt-warm reuses the folder cold left
                results[mode].append(run_child(mode, *runs[mode]))
        med = {m: statistics.median(r["first"] for r in rs) for m, rs in results.items()}
        steady = {m: statistics.median(r["steady"] for r in rs) for m, rs in results.items()}
        import torch

        from aotbuild.bench import _cpu_model

        machine = (f"{os.cpu_count()} CPUs, {_cpu_model()}, ISA {torch.backends.cpu.get_cpu_capability()}, "
                   f"torch {torch.__version__}")
        print(f"\nbuiltin:tiny-sd, 64x64, 2 steps; {machine}; median of {args.repeats}")
        rss = {m: statistics.median(r["rss_mb"] for r in rs) for m, rs in results.items()}
        print(f"{'mode':<12} {'load->first output (s)':>24} {'steady call (ms)':>18} {'peak RSS (MB)':>15}")
        for m in results:
            print(f"{m:<12} {med[m]:>24.2f} {steady[m] * 1000:>18.1f} {rss[m]:>15.0f}")
        print()
        ratios = [
            ("aotbuild warm / cold compile", "aotbuild", "cold", med, "<= 0.20"),
            ("aotbuild warm / PyTorch warm cache", "aotbuild", "pt-warm", med, "<= 1.05"),
            ("aotbuild steady / torch.compile", "aotbuild", "pt-warm", steady, "within 5%; dynamic_threads on vs off"),
            ("aot-package load / eager load", "aot-package", "eager", med, "<= 1.25"),
            ("aot-package load / cold compile", "aot-package", "cold", med, "<= 0.06"),
            ("aot-package steady / torch.compile", "aot-package", "pt-warm", steady, "within 5%"),
            ("aot-package peak RSS / eager", "aot-package", "eager", rss, "<= 1.10"),
            ("aot-regional load / eager load", "aot-regional", "eager", med, "<= 1.25"),
            ("aot-regional steady / eager", "aot-regional", "eager", steady, "< 1: pays"),
            ("aot-regional steady / aot-package", "aot-regional", "aot-package", steady, ""),
        ]
        for label, a, b, table, goal in ratios:
            if a in table and b in table:
                print(f"{label:<36} = {table[a] / table[b]:.3f}" + (f"  (goal {goal})" if goal else ""))
        if args.save:
            Path(args.save).write_text(json.dumps({"machine": machine, "repeats": args.repeats, "runs": results},
                                                  indent=1))
        if args.plot:
            from aotbuild.bench import draw

            names = {"eager": "eager", "cold": "cold torch.compile", "pt-warm": "PyTorch warm cache",
                     "aotbuild": "aotbuild jit-cache", "aot-package": "aotbuild aot-package",
                     "aot-regional": "aot-package regional"}
            colors = {"eager": "#8c8c8c", "cold": "#d62728", "pt-warm": "#ff7f0e", "aotbuild": "#2ca02c",
                      "aot-package": "#1f77b4", "aot-regional": "#17becf"}
            draw(args.plot, f"builtin:tiny-sd UNet, 64x64, 2 steps, fresh processes; {machine}",
                 [(names[m], [r["first"] for r in rs], [r["steady"] for r in rs], colors[m])
                  for m, rs in results.items()])
            print(f"plot: {args.plot}")
        if "aotbuild" in results:
            print(f"fxgraph counters, aotbuild runs: {[r['counters'] for r in results['aotbuild']]}")
        for m in ("aot-package", "aot-regional"):
            if m in results:
                print(f"Dynamo graphs, {m} runs: {[r['unique_graphs'] for r in results[m]]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
