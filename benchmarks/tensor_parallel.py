"""Tensor parallelism side by side: the tiny Flux built unsharded and with ``parallel: {tensor: 2}``.

    python benchmarks/tensor_parallel.py [--strategy jit-cache,aot-compile] [--json FILE]

For each strategy, in one run:

1. ``recipes/tiny_flux_cpu.yaml`` (one shape) built unsharded, then with ``parallel: {tensor: 2}``
   (two ranks started by ``aotbuild build`` itself, gloo, one shared Inductor folder), each into a
   fresh cache with an empty Inductor cache: the job's seconds and phases (the two ranks' jobs are
   one launch: their figures are the launch's), the proof's share, and each rank's FX graph cache
   hits and misses while it compiled (a hit: a graph the other rank had compiled into the shared
   folder first);
2. each cache moved and served as a new replica would: a fresh process (unsharded) or two fresh
   ranks started with ``torch.distributed.run`` (sharded), another working directory, empty compiler
   caches, ``load_compiled(on_miss="error", strict_shapes=True)`` then one image: seconds from the
   process's start to the image, what the load compiled (the proof's counter), the image's
   difference from the unsharded eager pipeline run in the same process.

Prints the figures and the ratios sharded / unsharded. Never used by tests.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

CALL = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 3.5,
        "output_type": "pt"}


def child(recipe: str, cache: str, model: str, strategy: str) -> None:
    """In a fresh process (or each rank): load, one image, compare with unsharded eager."""
    import torch
    from diffusers import DiffusionPipeline

    from aotbuild import load_compiled
    from aotbuild.strategies.registry import get_strategy
    from aotbuild.targets.registry import get_target

    _, count = get_strategy(strategy).compile_counter(get_target("inductor"))
    before = count()
    t = time.perf_counter()
    pipe = load_compiled(recipe, cache=cache, on_miss="error", strict_shapes=True)
    image = pipe(**CALL, generator=torch.Generator("cpu").manual_seed(0)).images
    first = time.perf_counter()
    compiles = count() - before
    eager = DiffusionPipeline.from_pretrained(model)
    reference = eager(**CALL, generator=torch.Generator("cpu").manual_seed(0)).images
    report = pipe.aotbuild_report
    print("RESULT " + json.dumps({"rank": report.rank, "start_to_image_s": round(first - T0, 3),
                                  "load_and_image_s": round(first - t, 3), "compiles": compiles,
                                  "hits": len(report.hits), "diff": float((image - reference).abs().max())}))


def serve(recipe: Path, cache: Path, workdir: Path, strategy: str, ranks: int) -> list[dict]:
    env = harness.child_env(workdir / "serve-caches")
    cwd = workdir / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    args = [str(Path(__file__).resolve()), "--child", str(recipe), str(cache), str(cache / "models" / "tiny-flux-v1"),
            strategy]
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), *args]
           if ranks > 1 else [sys.executable, *args])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace", cwd=cwd)
    found = [json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if len(found) != ranks:
        tail = " | ".join(x.strip() for x in proc.stderr.strip().splitlines()[-3:])
        return [{"error": f"exit {proc.returncode}: {tail}"}]
    return sorted(found, key=lambda r: r["rank"] or 0)


def cell(strategy: str, tensor: int, root: Path) -> dict:
    import yaml

    work = root / f"{strategy}-tp{tensor}"
    recipe = harness.derive_recipe(harness.ARCHS["tiny-flux"], work / "recipe.yaml", strategy=strategy)
    if tensor > 1:
        data = yaml.safe_load(recipe.read_text())
        data["parallel"] = {"tensor": tensor}
        recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    cache = work / "build" / "cache"
    built = harness.build(recipe, cache, work / "build")
    out = {"strategy": strategy, "tensor": tensor, "build": built.as_json()}
    if not built.ok:
        return out
    counters = []
    for manifest in sorted(cache.glob("manifests/*/*.json")):
        data = json.loads(manifest.read_text())
        c = data["build"].get("counters") or {}
        counters.append({"rank": (data["factors"].get("parallel") or {}).get("rank"),
                         "fx_hit": c.get("fxgraph_cache_hit", 0), "fx_miss": c.get("fxgraph_cache_miss", 0)})
    out["compile_counters"] = sorted(counters, key=lambda c: c["rank"] or 0)
    moved = work / "serving" / "cache"
    shutil.move(str(cache), str(moved))
    out["serve"] = serve(recipe, moved, work / "serving", strategy, tensor)
    return out


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:6])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", default="jit-cache,aot-compile")
    parser.add_argument("--json")
    args = parser.parse_args()
    import torch

    root = Path(tempfile.mkdtemp(prefix="aotbuild-tp."))
    cells = []
    started = time.perf_counter()
    for strategy in args.strategy.split(","):
        for tensor in (1, 2):
            print(f"{strategy} tensor {tensor}: building and serving ...", file=sys.stderr, flush=True)
            cells.append(cell(strategy, tensor, root))
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__}; {len(cells)} builds in "
          f"{(time.perf_counter() - started) / 60:.1f} min\n")
    rows = []
    for c in cells:
        b = c["build"]
        phases = b.get("phases") or {}
        for i, s in enumerate(c.get("serve") or [{"error": b.get("reason", "not built")}]):
            counters = c.get("compile_counters") or []
            cnt = counters[i] if i < len(counters) else {}
            rows.append([c["strategy"], str(c["tensor"]), "-" if s.get("rank") is None else str(s["rank"]),
                         b["status"], harness.fmt(b.get("seconds"), ".1f"),
                         harness.fmt(phases.get("compile_and_warmup"), ".1f"), harness.fmt(phases.get("proof"), ".1f"),
                         f"{cnt.get('fx_hit', '-')}/{cnt.get('fx_miss', '-')}",
                         harness.fmt(s.get("start_to_image_s"), ".1f"), harness.fmt(s.get("load_and_image_s"), ".1f"),
                         str(s.get("compiles", s.get("error", "-"))), harness.fmt(s.get("diff"), ".1e")])
    print(harness.table(["strategy", "tensor", "rank", "build", "job s", "compile s", "proof s", "build FX hit/miss",
                         "start->image s", "load+image s", "load compiles", "diff vs unsharded eager"], rows, 4))
    print()
    for strategy in args.strategy.split(","):
        one = next((c for c in cells if c["strategy"] == strategy and c["tensor"] == 1), None)
        two = next((c for c in cells if c["strategy"] == strategy and c["tensor"] == 2), None)
        if not one or not two or not one.get("serve") or not two.get("serve") or "error" in two["serve"][0] \
                or "error" in one["serve"][0]:
            continue
        ratio_build = two["build"]["seconds"] / one["build"]["seconds"]
        ratio_load = max(s["start_to_image_s"] for s in two["serve"]) / one["serve"][0]["start_to_image_s"]
        print(f"{strategy}: sharded/unsharded build {ratio_build:.2f}x (both ranks in one launch), "
              f"first image {ratio_load:.2f}x (slowest rank)")
    if args.json:
        Path(args.json).write_text(json.dumps({"cells": cells}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
