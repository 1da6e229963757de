"""What a text range costs: tiny-qwenimage's transformer built static and with ``text_length``, side by side.

    python benchmarks/text_length.py [--calls 100] [--rounds 3] [--work DIR]

Builds recipes/tiny_qwenimage_cpu.yaml twice into one temporary cache (jit-cache): as it is
(``text_length: {min: 2, max: 512}``, one symbolic graph) and without ``text_length`` (the warmup's
length only, the graph static). Then, for several rounds, alternating, a fresh process per build:

* first image: ``load_compiled(on_miss="error")`` plus the first pipeline call at the warmup's prompt
  (what a replica's first request costs: Dynamo traces, the kernels load from the cache);
* steady call: the median of ``--calls`` transformer calls at the warmup's length through the loaded
  entry (and, for the range, at lengths 2, 257 and 512 as well: the static build cannot serve those).

Prints each round and the medians over rounds. ``--work DIR`` keeps the builds there (a second run
finds them cached and only measures).
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
RECIPE = REPO / "recipes" / "tiny_qwenimage_cpu.yaml"


def child(recipe_path: str, cache: str, calls: int) -> None:
    import torch

    from aotbuild import load_compiled
    from aotbuild.dispatch import dispatchers
    from aotbuild.pipeline import textlen
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from aotbuild.recipe.rules import load_recipe

    recipe = load_recipe(recipe_path)
    pipe = load_pipeline(recipe, resolve_model(recipe, Path(cache)), "float32", quiet=True)
    captured = {}
    handle = pipe.transformer.register_forward_pre_hook(
        lambda m, a, k: captured.setdefault("call", (a, k)), with_kwargs=True)
    pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe))  # eager: the call to time, not timed
    handle.remove()
    t0 = time.perf_counter()
    load_compiled(recipe, pipe=pipe, cache=cache, on_miss="error")
    pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe))
    first = time.perf_counter() - t0
    args, kwargs = captured["call"]
    lengths = {"warmup": (args, kwargs)}
    pattern = next((p for d in dispatchers(pipe.transformer) for p in d.patterns), None)
    if pattern is not None:
        lengths.update({str(n): textlen.call_at(pattern, args, kwargs, n) for n in (2, 257, 512)})
    steady = {}
    with torch.no_grad():
        for name, (a, k) in lengths.items():
            pipe.transformer(*a, **k)
            times = []
            for _ in range(calls):
                t = time.perf_counter()
                pipe.transformer(*a, **k)
                times.append(time.perf_counter() - t)
            steady[name] = statistics.median(times)
    print("RESULT " + json.dumps({"first_image": first, "steady": steady,
                                  "length": int(kwargs["encoder_hidden_states"].shape[1])}))


def run(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, *args], env={**os.environ, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-3000:])
    return proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", help="folder for the builds (kept; reused when they are there)")
    ap.add_argument("--child", nargs=3)
    opts = ap.parse_args()
    if opts.child:
        child(opts.child[0], opts.child[1], int(opts.child[2]))
        return
    work = Path(opts.work) if opts.work else Path(tempfile.mkdtemp(prefix="aottext."))
    work.mkdir(parents=True, exist_ok=True)
    ranged = work / "ranged.yaml"
    ranged.write_text(RECIPE.read_text())
    static = work / "static.yaml"
    static.write_text("\n".join(line for line in RECIPE.read_text().splitlines()
                                if not line.startswith("text_length:")) + "\n")
    cache = work / "cache"
    for recipe in (ranged, static):
        t = time.perf_counter()
        run(["-m", "aotbuild.cli", "build", "--cache", str(cache), str(recipe)],
            {"TORCHINDUCTOR_CACHE_DIR": str(work / "build-inductor"), "AOTBUILD_CACHE": ""})
        print(f"built {recipe.stem} in {time.perf_counter() - t:.0f} s (compile + proof)", flush=True)
    results: dict[str, list[dict]] = {"static": [], "ranged": []}
    for r in range(opts.rounds):
        for name, recipe in (("static", static), ("ranged", ranged)):
            out = run([__file__, "--child", str(recipe), str(cache), str(opts.calls)],
                      {"TORCHINDUCTOR_CACHE_DIR": str(work / f"serve-{name}-{r}"), "AOTBUILD_CACHE": ""})
            data = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
            results[name].append(data)
            steady = ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in data["steady"].items())
            print(f"round {r + 1} {name}: first image {data['first_image']:.2f} s; transformer call: {steady} "
                  f"(warmup length {data['length']})", flush=True)
    print()
    for name, rows in results.items():
        first = statistics.median(row["first_image"] for row in rows)
        steady = {k: statistics.median(row["steady"][k] for row in rows) for k in rows[0]["steady"]}
        print(f"{name}: first image {first:.2f} s; steady call "
              + ", ".join(f"{k} {v * 1000:.2f} ms" for k, v in steady.items()))


if __name__ == "__main__":
    main()
