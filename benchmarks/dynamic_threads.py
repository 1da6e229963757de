"""Steady-state cost of ``cpp.dynamic_threads`` on the tiny UNet, measured side by side.

    python benchmarks/dynamic_threads.py [--calls 200] [--rounds 3]

Compiles the UNet of builtin:tiny-sd (64x64, guidance 0) with Inductor twice, with
``cpp.dynamic_threads`` off (PyTorch's default: kernels bake in torch.get_num_threads()) and on
(aotbuild's default for CPU), each in its own process with its own warm cache, then times UNet
calls alternating between the two configurations for several rounds. Prints the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(dynamic: bool, calls: int, cache: str) -> None:
    import torch

    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from aotbuild.recipe.rules import load_recipe

    recipe = load_recipe(REPO / "recipes" / "tiny_sd_cpu.yaml")
    pipe = load_pipeline(recipe, resolve_model(recipe, Path(cache)), "float32")
    captured = {}

    def grab(module, args, kwargs):
        captured.setdefault("call", (args, kwargs))

    handle = pipe.unet.register_forward_pre_hook(grab, with_kwargs=True)
    pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe))
    handle.remove()
    args, kwargs = captured["call"]
    fn = torch.compile(pipe.unet.forward, fullgraph=True, dynamic=False,
                       options={"cpp.dynamic_threads": dynamic})
    with torch.no_grad():
        fn(*args, **kwargs)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            fn(*args, **kwargs)
            times.append(time.perf_counter() - t)
    print("RESULT " + json.dumps({"median": statistics.median(times), "threads": torch.get_num_threads()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", nargs=3)
    args = ap.parse_args()
    if args.child:
        child(args.child[0] == "1", int(args.child[1]), args.child[2])
        return
    work = Path(tempfile.mkdtemp(prefix="aotdyn."))
    results: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(args.rounds):
        for name, flag in (("off", "0"), ("on", "1")):
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(work / f"ind-{name}"), "PYTHONPATH": str(REPO)}
            proc = subprocess.run([sys.executable, __file__, "--child", flag, str(args.calls), str(work / "c")],
                                  env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.exit(proc.stderr[-3000:])
            data = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
            results[name].append(data["median"])
            print(f"round {r + 1} dynamic_threads={name}: {data['median'] * 1000:.2f} ms "
                  f"({data['threads']} threads)", flush=True)
    off, on = statistics.median(results["off"]), statistics.median(results["on"])
    print(f"\nUNet call, median over rounds: off {off * 1000:.2f} ms, on {on * 1000:.2f} ms, "
          f"on/off = {on / off:.3f}")


if __name__ == "__main__":
    main()
