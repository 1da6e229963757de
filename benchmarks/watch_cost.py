"""What the per-call dependency check (aotbuild/pipeline/dependencies.py ``Watch``, issue 31) costs a steady call.

    python benchmarks/watch_cost.py                       # tiny-sd UNet, eager stand-in; SD 1.5-size check alone
    python benchmarks/watch_cost.py --recipe R --cache C  # tiny-sd UNet served from a built entry
    python benchmarks/watch_cost.py --sd15 cuda           # SD 1.5-size UNet on a GPU: eager and compiled calls

Prints, side by side, the steady call with the check and without it (the same dispatcher, its
``watch`` set to None), and the check alone. Calls alternate between the two modes so drift on a
shared machine hits both alike; each figure is the median of ``--repeats`` timed calls.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def side_by_side(label: str, dispatcher, call, repeats: int, sync=lambda: None) -> None:
    """The steady call with the dispatcher's watch and without, alternating, and the check alone."""
    watch = dispatcher.watch
    on, off = [], []
    for _ in range(repeats):
        for mode, bucket in ((watch, on), (None, off)):
            dispatcher.watch = mode
            sync()
            t = time.perf_counter()
            call()
            sync()
            bucket.append(time.perf_counter() - t)
    dispatcher.watch = watch
    check = _median_us(watch.check, max(repeats, 200))
    with_ms, without_ms = statistics.median(on) * 1e3, statistics.median(off) * 1e3
    print(f"{label}: steady call with the check {with_ms:.3f} ms, without {without_ms:.3f} ms; the check alone "
          f"{check:.0f} us = {check / 1e3 / without_ms * 100:.2f}% of the call")


def tiny(recipe_path: str | None, cache: str | None, repeats: int) -> None:
    import torch

    from aotbuild import builtin
    from aotbuild.dispatch import Dispatcher, install_dispatcher, signature
    from aotbuild.pipeline import dependencies
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from aotbuild.recipe.rules import load_recipe, parse_recipe

    if recipe_path:
        recipe = load_recipe(recipe_path)
        root = Path(cache)
    else:
        root = Path("/tmp/aotbuild-watch-cost")
        builtin.ensure("builtin:tiny-sd", root / "models")
        recipe = parse_recipe({"model": {"id": "builtin:tiny-sd", "dtype": "float32"}, "target": "inductor",
                               "device": "cpu", "strategy": "aot-package", "compile": {"components": ["unet"]},
                               "shapes": [{"height": 64, "width": 64}],
                               "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0}})
    pipe = load_pipeline(recipe, resolve_model(recipe, root), "float32")
    seen = []
    handle = pipe.unet.register_forward_pre_hook(lambda m, a, k: seen.append((a, k)) or None, with_kwargs=True)
    pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe), output_type="pt")
    handle.remove()
    args, kwargs = seen[0]
    if cache:
        from aotbuild import load_compiled

        load_compiled(recipe, pipe=pipe, cache=cache, on_miss="error")
        label = f"tiny-sd UNet served by {recipe.strategy}"
    else:  # the eager forward as the route: the dispatcher and check are the same, the call is slower
        eager = pipe.unet.forward
        install_dispatcher(pipe.unet, "unet", {signature(args, kwargs): eager}, None, "error")
        with torch.no_grad():  # as the pipeline calls it
            snap = {**dependencies.snapshot(pipe.unet), "globals": [dependencies.call_state()]}
        pipe.unet.forward.watch = dependencies.Watch(pipe.unet, snap, "unet")
        label = "tiny-sd UNet, eager route (stand-in)"
    d = pipe.unet.forward
    assert isinstance(d, Dispatcher) and d.watch is not None
    with torch.no_grad():
        for _ in range(3):
            pipe.unet(*args, **kwargs)
        side_by_side(label, d, lambda: pipe.unet(*args, **kwargs), repeats)


def sd15(device: str, repeats: int, compiled: bool) -> None:
    import torch
    from diffusers import UNet2DConditionModel

    from aotbuild.dispatch import install_dispatcher, signature
    from aotbuild.pipeline import dependencies
    from benchmarks.scale import SD15_UNET

    where = "meta" if device == "meta" else device
    dtype = torch.float16 if where.startswith("cuda") else torch.float32
    with torch.device(where):
        unet = UNet2DConditionModel(**SD15_UNET).to(dtype).eval()
    snap = {**dependencies.snapshot(unet), "globals": []}
    print(f"SD 1.5-size UNet: {sum(1 for _ in unet.modules())} modules, {len(snap['items'])} recorded items")
    if where == "meta":
        watch = dependencies.Watch(unet, snap, "unet")
        print(f"SD 1.5-size UNet: the check alone {_median_us(watch.check, max(repeats, 200)):.0f} us (no call: "
              f"meta tensors)")
        return
    args = (torch.randn(2, 4, 64, 64, device=where, dtype=dtype), torch.tensor(10.0, device=where))
    kwargs = {"encoder_hidden_states": torch.randn(2, 77, 768, device=where, dtype=dtype), "return_dict": False}
    route = torch.compile(unet.forward) if compiled else unet.forward
    install_dispatcher(unet, "unet", {signature(args, kwargs): route}, None, "error")
    unet.forward.watch = dependencies.Watch(unet, {**snap, "globals": []}, "unet")
    sync = torch.cuda.synchronize if where.startswith("cuda") else (lambda: None)
    with torch.no_grad():
        for _ in range(3):
            unet(*args, **kwargs)
        side_by_side(f"SD 1.5-size UNet {'compiled' if compiled else 'eager'} on {where} ({dtype}, 2x4x64x64)",
                     unet.forward, lambda: unet(*args, **kwargs), repeats, sync)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe")
    parser.add_argument("--cache")
    parser.add_argument("--sd15", default="meta", help="meta (the check alone), cpu or cuda")
    parser.add_argument("--compiled", action="store_true", help="with --sd15 cuda: torch.compile the UNet")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--skip-tiny", action="store_true")
    args = parser.parse_args()
    if not args.skip_tiny:
        tiny(args.recipe, args.cache, args.repeats)
    sd15(args.sd15, args.repeats, args.compiled)


if __name__ == "__main__":
    main()
