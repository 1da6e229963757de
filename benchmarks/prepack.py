"""Freezing's prepacked CPU kernels served from a weight-free AOT package (issue 39), against eager and
against plain ``torch.compile`` with freezing, on UNets of two sizes. Never used by tests.

    python benchmarks/prepack.py [--models tiny,mid] [--calls 10] [--save prepack.json]

tiny  the built-in tiny-sd UNet (``builtin:tiny-sd``), 64x64 images (8x8 latents)
mid   a UNet2DConditionModel at a quarter of SD 1.5's widths (80/160/320/320), 256x256 images
      (32x32 latents)
sd15  the SD 1.5 UNet config (860M parameters; benchmarks/scale.py's), 256x256 images: heavy

Per model, in one process (the modes' steady calls are what is compared; load and first call are
benchmarks/scale.py's business): eager; ``torch.compile(unet, options={"freezing": True})``;
aot-package's package (aotbuild.strategies.aoti, as the strategy builds it) without and with
freezing. Both packages are built with weights A and served with **weights B** (A perturbed): the
output is compared with B's eager output. Batch 1, no guidance, fp32; medians of ``--calls`` calls
after 2 warm calls, the modes' calls interleaved.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scale import SD15_UNET  # noqa: E402 - benchmarks/ (this script's folder) is on sys.path

#: the SD 1.5 UNet at a quarter of its widths (57M parameters): a mid-size model that compiles in minutes
QUARTER = {**SD15_UNET, "sample_size": 32, "block_out_channels": (80, 160, 320, 320), "norm_num_groups": 16}


def make(kind: str):
    import torch
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    if kind == "tiny":
        from aotbuild import builtin

        folder = builtin.ensure("builtin:tiny-sd", Path(tempfile.gettempdir()) / "aotbuild-prepack-models")
        unet = UNet2DConditionModel.from_pretrained(folder / "unet")
        latents, text = 8, (1, 77, unet.config.cross_attention_dim)
    elif kind == "mid":
        unet = UNet2DConditionModel(**QUARTER)
        latents, text = 32, (1, 77, 768)
    else:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from scale import SD15_UNET

        unet = UNet2DConditionModel(**SD15_UNET)
        latents, text = 32, (1, 77, 768)
    unet.eval()
    args = (torch.randn(1, 4, latents, latents), torch.tensor(10))
    kwargs = {"encoder_hidden_states": torch.randn(*text), "return_dict": False}
    return unet, args, kwargs


def other_weights(unet):
    import torch

    other = copy.deepcopy(unet)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1 + 0.05 * torch.randn(p.shape, generator=g))
    return other


def interleaved(fns: dict, args, kwargs, calls: int) -> dict[str, float]:
    """Median seconds per call of each function, their calls interleaved (one of each per round): a
    shared, busy machine slows every mode alike instead of whichever ran during a burst."""
    import torch

    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(2):
                fn(*args, **kwargs)
        for _ in range(calls):
            for name, fn in fns.items():
                t = time.perf_counter()
                fn(*args, **kwargs)
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def package(unet, args, kwargs, work: Path, options: dict, served) -> tuple[object, dict, float, float]:
    """Build aot-package's package for the call with ``unet``'s weights; serve it with ``served``'s."""
    from aotbuild.dispatch import signature
    from aotbuild.strategies import aoti
    from aotbuild.strategies.calls import snapshot

    calls = {signature(args, kwargs): snapshot(args, kwargs)}
    t = time.perf_counter()
    record, = aoti.build_packages(unet, calls, work, options)
    built = time.perf_counter() - t
    t = time.perf_counter()
    routes = aoti.load_packages(served, "unet", [(record, {record["path"]: work / record["path"]})], "cpu")
    bound = time.perf_counter() - t
    return routes[""][record["signature"]], record, built, bound


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


MODES = ("compile_freezing", "aot_package", "aot_package_freezing")


def measure(kind: str, calls: int, modes: tuple[str, ...] = MODES) -> dict:
    import torch

    unet, args, kwargs = make(kind)
    served = other_weights(unet)
    weights = sum(t.numel() * t.element_size() for t in unet.state_dict().values())
    out = {"model": kind, "parameters": sum(p.numel() for p in unet.parameters()), "weight_bytes": weights,
           "threads": torch.get_num_threads()}
    with torch.no_grad():
        expected = served(*args, **kwargs)[0]
    fns = {"eager": served}
    if "compile_freezing" in modes:
        compiled = torch.compile(copy.deepcopy(served), options={"freezing": True, "cpp.dynamic_threads": True})
        t = time.perf_counter()
        with torch.no_grad():
            got = compiled(*args, **kwargs)[0]
        out["compile_freezing"] = {"compile_s": time.perf_counter() - t, "rel_err": rel(got, expected)}
        fns["compile_freezing"] = compiled
        print(kind, "torch.compile freezing", out["compile_freezing"], flush=True)

    for name, options in (("aot_package", {}), ("aot_package_freezing", {"freezing": True})):
        if name not in modes:
            continue
        work = Path(tempfile.mkdtemp(prefix=f"prepack-{kind}-{name}-"))
        run, record, built, bound = package(unet, args, kwargs, work, {**options, "cpp.dynamic_threads": True},
                                            served)
        (work / "record.json").write_text(json.dumps(record))
        with torch.no_grad():
            got = run(*args, **kwargs)[0]
        runner = run.runner  # type: ignore[attr-defined]
        prepacked = sum(torch.ops.mkldnn._nbytes(t) if t.is_mkldnn else 0 for t in runner.derived_values.values())
        out[name] = {"build_s": built, "bind_s": bound, "rel_err_other_weights": rel(got, expected),
                     "package_bytes": os.path.getsize(work / record["path"]), "prepacked_bytes": prepacked,
                     "derived": len(record.get("derived", {})), "work": str(work)}
        fns[name] = run
        print(kind, name, out[name], flush=True)
    for name, seconds in interleaved(fns, args, kwargs, calls).items():
        if name == "eager":
            out["eager_s"] = seconds
        else:
            out[name]["steady_s"] = seconds
    print(kind, {k: v for k, v in out.items()}, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,mid")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--modes", default=",".join(MODES), help="of " + ", ".join(MODES))
    parser.add_argument("--save")
    opts = parser.parse_args()
    results = [measure(kind, opts.calls, tuple(opts.modes.split(","))) for kind in opts.models.split(",")]
    for r in results:
        e = r["eager_s"]
        print(f"\n{r['model']}: {r['parameters'] / 1e6:.1f}M parameters, {r['threads']} threads, steady call (median)")
        print(f"  eager                        {e * 1e3:9.1f} ms  1.00x")
        for key, label in (("compile_freezing", "torch.compile + freezing"), ("aot_package", "aot-package"),
                           ("aot_package_freezing", "aot-package + freezing")):
            if key not in r:
                continue
            s = r[key]["steady_s"]
            extra = ""
            if "package_bytes" in r[key]:
                extra = (f"  entry {r[key]['package_bytes'] / 1e6:.1f} MB vs weights {r['weight_bytes'] / 1e6:.1f} MB,"
                         f" prepacked {r[key]['prepacked_bytes'] / 1e6:.1f} MB,"
                         f" other weights rel err {r[key]['rel_err_other_weights']:.1e}")
            print(f"  {label:28s} {s * 1e3:9.1f} ms  {s / e:.2f}x{extra}")
    if opts.save:
        Path(opts.save).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
