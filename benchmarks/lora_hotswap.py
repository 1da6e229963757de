"""A LoRA hot-swap against a cold compile with the adapter, side by side in fresh processes.

    python benchmarks/lora_hotswap.py [--repeats 3] [--strategy jit-cache]

Makes two LoRA adapters for the built-in tiny SD UNet locally (peft and diffusers'
``save_lora_weights``: ``style``, rank 4, and ``other``, rank 2, both on the attention projections),
builds a recipe with ``lora: {rank: 8, adapters: [style]}``, then per round, each in a fresh process
with empty compiler caches:

  eager     the pipeline with ``other`` loaded, no compile: one image (the reference)
  cold      the pipeline with ``other`` loaded, ``torch.compile(unet.forward, fullgraph=True,
            dynamic=False)``: the first image (what serving a new adapter costs without aotbuild)
  hot-swap  ``load_compiled`` (serving ``style``), one image, then
            ``pipe.load_lora_weights(other, adapter_name="style", hotswap=True)`` and the next image:
            the swap's seconds and that image's, what they compiled (the strategy's own counter),
            and the image's difference from eager with ``other``

Prints medians and the ratio (swap + next image) / (cold compile's first image). Never used by tests.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

T0 = time.perf_counter()
sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

CALL = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 0.0,
        "output_type": "pt"}
TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]


def make_adapter(model: Path, folder: Path, rank: int, seed: int) -> Path:
    """The suite's LoRA maker (tests/loras.py), alpha equal to rank, on the attention projections."""
    sys.path.insert(0, str(harness.REPO))
    from tests.loras import make_adapter as make

    return make(model, folder, rank, rank, TARGETS, seed)


def image(pipe):
    import torch

    return pipe(**CALL, generator=torch.Generator("cpu").manual_seed(0)).images


def child(mode: str, recipe: str, cache: str, model: str, other: str, strategy: str) -> None:
    import torch
    from diffusers import StableDiffusionPipeline

    if mode == "hot-swap":
        from aotbuild import load_compiled
        from aotbuild.strategies.registry import get_strategy
        from aotbuild.targets.registry import get_target

        _, count = get_strategy(strategy).compile_counter(get_target("inductor"))
        pipe = load_compiled(recipe, cache=cache, on_miss="error", strict_shapes=True)
        pipe.set_progress_bar_config(disable=True)
        image(pipe)
        first = time.perf_counter() - T0
        before = count()
        t = time.perf_counter()
        pipe.load_lora_weights(other, adapter_name="style", hotswap=True)
        swap = time.perf_counter() - t
        t = time.perf_counter()
        out = image(pipe)
        after = time.perf_counter() - t
        result = {"first": first, "swap": swap, "next_image": after, "compiles": count() - before}
    else:
        pipe = StableDiffusionPipeline.from_pretrained(model)
        pipe.set_progress_bar_config(disable=True)
        pipe.load_lora_weights(other, adapter_name="other")
        if mode == "cold":
            pipe.unet.forward = torch.compile(pipe.unet.forward, fullgraph=True, dynamic=False)
        out = image(pipe)
        result = {"first": time.perf_counter() - T0}
    torch.save(out, Path(cache).parent / f"{mode}.pt")
    print("RESULT " + json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--strategy", default="jit-cache", help="the recipe's strategy (jit-cache or aot-compile)")
    ap.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch
    import yaml

    from aotbuild import builtin

    work = Path(tempfile.mkdtemp(prefix="aotbuild-lora-bench-"))
    try:
        cache = work / "cache"
        model = builtin.ensure("builtin:tiny-sd", cache / "models")
        repo = work / "repo"
        make_adapter(model, repo / "loras" / "style", 4, 1)
        other = make_adapter(model, repo / "loras" / "other", 2, 2)
        recipe = repo / "tiny_sd_lora.yaml"
        recipe.write_text(yaml.safe_dump({
            "model": {"id": "builtin:tiny-sd", "dtype": "float32"}, "target": "inductor", "device": "cpu",
            "strategy": args.strategy, "compile": {"components": ["unet"]}, "shapes": [{"height": 64, "width": 64}],
            "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0},
            "lora": {"rank": 8, "adapters": [{"path": "loras/style", "adapter_name": "style"}]}}, sort_keys=False))
        (repo / "pyproject.toml").write_text("[project]\nname = 'bench'\n")
        print(f"building {recipe.name} (strategy {args.strategy}) ...", flush=True)
        built = harness.build(recipe, cache, work / "build")
        if built.status != "built":
            sys.exit(f"the build failed: {built.reason}")
        runs: dict[str, list[dict]] = {"eager": [], "cold": [], "hot-swap": []}
        diffs = []
        for i in range(args.repeats):
            print(f"round {i + 1}/{args.repeats} ...", flush=True)
            for mode in runs:
                result = harness.run_child(__file__, [mode, str(recipe), str(cache), str(model), str(other),
                                                      args.strategy], harness.child_env(work / f"{mode}-{i}"))
                if "error" in result:
                    sys.exit(f"{mode} failed: {result['error']}")
                runs[mode].append(result)
            diffs.append((torch.load(work / "hot-swap.pt") - torch.load(work / "eager.pt")).abs().max().item())
        med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
        hot = med["hot-swap"]
        print(f"\ntiny SD UNet, LoRA rank 8 (served: style, rank 4; swapped in: other, rank 2), 64x64, "
              f"strategy {args.strategy}; build {built.seconds:.1f} s; median of {args.repeats}")
        print(harness.table(["mode", "process start -> image (s)", "swap (s)", "next image (s)", "compiles"], [
            ["eager", f"{med['eager']['first']:.2f}", "-", "-", "-"],
            ["cold compile", f"{med['cold']['first']:.2f}", "-", "-", "-"],
            ["hot-swap", f"{hot['first']:.2f}", f"{hot['swap']:.3f}", f"{hot['next_image']:.3f}",
             str(max(r["compiles"] for r in runs["hot-swap"]))]]))
        print(f"\nhot-swap (swap + next image) / cold compile's first image = "
              f"{(hot['swap'] + hot['next_image']) / med['cold']['first']:.4f}")
        print(f"hot-swap's first image / eager's = {hot['first'] / med['eager']['first']:.3f}")
        print(f"image after the swap vs eager with that adapter: max abs diff {max(diffs):.2e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
