"""What padding a batch costs (issue 56, item 3): 3 images padded to a built 4, against eager at 3, side by side.

    python benchmarks/batch_padding.py [--calls 50] [--rounds 5] [--guidance 0.0] [--work DIR]

Builds tiny-sd for ``batch_size: [1, 4]`` with ``pad_batch: true`` under the default strategy (the
recipe names none: auto) into a cache (``--work DIR`` keeps it; a second run finds it cached). Then one
fresh process (empty compiler caches) loads the entries with ``load_compiled(on_miss="error")`` beside an
eager pipeline and, round after round, times these in turn, call by call (so a busy spell of the machine
slows all of them alike), each round's figure the median of its ``--calls`` calls (pipeline: a tenth):

* the UNet at 3 images: eager, and served (padded to 4, the padding dropped from the output);
* the UNet at 4 images: eager, and served (the built batch: what the padded call runs);
* the whole pipeline (2 steps, latents out) at 3 images: eager, and served padded.

Prints each round, the medians over rounds, and the ratios: served at 3 (padded) / eager at 3 (the cost
of padding as a caller sees it), served at 3 / served at 4 (what padding adds to the built call), served
at 4 / eager at 4 (the compiled call itself). ``--guidance 7.5``: SD batches guidance's two halves, so the
UNet runs 6 rows padded to 8. Also checks each padded sample against eager at its own batch.
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
RECIPE = """\
model: {{id: builtin:tiny-sd, dtype: float32}}
target: inductor
device: cpu
compile: {{components: [unet]}}
shapes: [{{height: 64, width: 64, batch_size: [1, 4]}}]
pad_batch: true
warmup: {{num_inference_steps: 2, guidance_scale: {guidance}}}
"""


def child(recipe_path: str, cache: str, calls: int, rounds: int, guidance: float) -> None:
    import torch

    from aotbuild import load_compiled
    from aotbuild.dispatch import dispatchers
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.recipe.rules import load_recipe

    recipe = load_recipe(recipe_path)
    eager = load_pipeline(recipe, resolve_model(recipe, Path(cache)), "float32", quiet=True)
    served = load_pipeline(recipe, resolve_model(recipe, Path(cache)), "float32", quiet=True)
    load_compiled(recipe, pipe=served, cache=cache, on_miss="error")
    strategy = ", ".join(sorted({e.strategy for e in served.aotbuild_report.hits}))

    def pipeline(pipe, n):
        return pipe(prompt="a photo of a cat", height=64, width=64, num_inference_steps=2, guidance_scale=guidance,
                    num_images_per_prompt=n, generator=torch.Generator().manual_seed(0), output_type="latent").images

    unet_calls = {}
    for n in (3, 4):  # the UNet's first call at n images, as the pipeline makes it
        handle = eager.unet.register_forward_pre_hook(lambda m, a, k, n=n: unet_calls.setdefault(n, (a, k)),
                                                      with_kwargs=True)
        pipeline(eager, n)
        handle.remove()
    worst = 0.0
    with torch.no_grad():
        for n in (3, 4):  # every sample against eager at its own batch (relative to the sample)
            a, k = unet_calls[n]
            want, got = eager.unet(*a, **k)[0], served.unet(*a, **k)[0]
            worst = max([worst, *(float((got[i] - want[i]).abs().max() / want[i].abs().max())
                                  for i in range(len(want)))])
    padded_before = dispatchers(served.unet)[0].calls.get("padded", 0)

    def unet(pipe, n):
        a, k = unet_calls[n]
        return lambda: pipe.unet(*a, **k)

    cases = {"unet eager @3": unet(eager, 3), "unet served @3 (padded to 4)": unet(served, 3),
             "unet eager @4": unet(eager, 4), "unet served @4 (built)": unet(served, 4),
             "pipeline eager @3": lambda: pipeline(eager, 3),
             "pipeline served @3 (padded)": lambda: pipeline(served, 3)}
    per_round: list[dict[str, float]] = []
    with torch.no_grad():
        for fn in cases.values():  # one call each first: nothing timed loads lazily
            fn()
        for _ in range(rounds):
            times: dict[str, list[float]] = {name: [] for name in cases}
            for i in range(calls):  # the cases in turn, call by call: a busy spell slows each alike
                for name, fn in cases.items():
                    if name.startswith("pipeline") and i % 10:
                        continue  # a pipeline call is ten UNet calls and more: a tenth as many
                    t = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - t)
            per_round.append({name: statistics.median(ts) for name, ts in times.items()})
    padded = dispatchers(served.unet)[0].calls.get("padded", 0) - padded_before
    print("RESULT " + json.dumps({"rounds": per_round, "strategy": strategy, "worst_rel_diff": worst,
                                  "padded_calls": padded, "threads": torch.get_num_threads()}))


def run(args: list[str], env: dict[str, str]) -> str:
    proc = subprocess.run([sys.executable, *args], env={**os.environ, "PYTHONPATH": str(REPO), **env},
                          capture_output=True, text=True)
    if proc.returncode:
        sys.exit(proc.stdout[-2000:] + proc.stderr[-3000:])
    return proc.stdout


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=50, help="UNet calls per median (pipeline calls: a tenth)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--guidance", type=float, default=0.0, help="7.5: the UNet runs 6 rows padded to 8")
    ap.add_argument("--work", help="folder for the build (kept; reused when it is there)")
    ap.add_argument("--child", nargs=5)
    opts = ap.parse_args()
    if opts.child:
        path, cache, calls, rounds, guidance = opts.child
        child(path, cache, int(calls), int(rounds), float(guidance))
        return
    work = Path(opts.work) if opts.work else Path(tempfile.mkdtemp(prefix="aotpad."))
    work.mkdir(parents=True, exist_ok=True)
    recipe = work / f"tiny_sd_batches_g{opts.guidance:g}.yaml"
    recipe.write_text(RECIPE.format(guidance=opts.guidance))
    cache = work / "cache"
    t = time.perf_counter()
    run(["-m", "aotbuild.cli", "build", "--cache", str(cache), str(recipe)],
        {"TORCHINDUCTOR_CACHE_DIR": str(work / "build-inductor"), "AOTBUILD_CACHE": ""})
    print(f"build (or cached): {time.perf_counter() - t:.0f} s", flush=True)
    out = run([__file__, "--child", str(recipe), str(cache), str(opts.calls), str(opts.rounds), str(opts.guidance)],
              {"TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="aotpad-serve."), "AOTBUILD_CACHE": ""})
    data = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
    print(f"served by {data['strategy']}, {data['threads']} threads; each padded sample vs eager at its own batch: "
          f"{data['worst_rel_diff']:.2g} relative at most; {data['padded_calls']} padded UNet calls timed")
    for i, row in enumerate(data["rounds"], 1):
        print(f"round {i}: " + "; ".join(f"{k} {v * 1000:.2f} ms" for k, v in row.items()), flush=True)
    med = {k: statistics.median(r[k] for r in data["rounds"]) for k in data["rounds"][0]}
    print()
    for name, value in med.items():
        print(f"{name:<32} {value * 1000:8.2f} ms")
    print()
    for label, a, b in (("unet: served @3 (padded) / eager @3", "unet served @3 (padded to 4)", "unet eager @3"),
                        ("unet: served @3 (padded) / served @4", "unet served @3 (padded to 4)",
                         "unet served @4 (built)"),
                        ("unet: served @4 / eager @4", "unet served @4 (built)", "unet eager @4"),
                        ("unet: eager @4 / eager @3", "unet eager @4", "unet eager @3"),
                        ("pipeline: served @3 (padded) / eager @3", "pipeline served @3 (padded)",
                         "pipeline eager @3")):
        per = [r[a] / r[b] for r in data["rounds"]]
        print(f"{label:<42} {med[a] / med[b]:.2f}  (per round {min(per):.2f} to {max(per):.2f})")


if __name__ == "__main__":
    main()
