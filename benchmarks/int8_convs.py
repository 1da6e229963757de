"""int8 that reaches the convolutions: PyTorch 2 export quantization (torchao's X86InductorQuantizer)
on a UNet, against float32 eager and bfloat16, each compiled by Inductor with freezing in a fresh
process (issue 57, item 2; not a format aotbuild serves yet: docs/recipes.md, "Quantized denoisers").

Each row is one child process with its own empty Inductor cache: the UNet (random weights, seed 0),
one denoiser call's inputs (seeded), the format made and compiled, one warm call, then the median
of ``--repeats`` timed calls; its output is saved, and the parent prints each row's steady call
against float32 eager's (measured in the same run) and its relative error against float32 eager's
output (``|out - ref| / |ref|``, the whole tensor).

- ``fp32 eager``: the reference.
- ``bf16 compiled``: the UNet cast to bfloat16, ``torch.compile`` with freezing (prepacked bf16 kernels
  where oneDNN has AVX512-BF16 or AMX).
- ``int8 static compiled``: exported (``torch.export``), ``prepare_pt2e`` with the default static config
  (activations uint8 per tensor, weights int8 per channel), calibrated on ``--calibration`` calls at
  other timesteps and inputs, ``convert_pt2e``, compiled with freezing: Inductor lowers each pattern to
  ``onednn.qconv_pointwise`` / ``qlinear_pointwise`` with the calibrated activation scales written into
  the compiled code as literals.
- ``int8 dynamic compiled``: the same with ``is_dynamic=True`` (each activation's scale computed as it
  runs): in torch 2.13 / torchao 0.18 Inductor lowers no dynamic pattern of a convolution to an int8
  kernel; it dequantizes and runs the float32 convolution (the row shows what that costs).
- ``int8 static eager``: the converted graph run eagerly (quantize/dequantize in float32): the model a
  proof would compare the compiled one with.

``python benchmarks/int8_convs.py --size sd15`` (the SD 1.5 UNet of scale.py, 32x32 latents, batch 1:
minutes of compile per int8 row on 2 cores); ``--size tiny`` for a quick check of the script.
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

from harness import REPO, fmt, table  # noqa: E402

ROWS = ["fp32 eager", "bf16 compiled", "int8 static compiled", "int8 dynamic compiled", "int8 static eager"]

#: A small UNet of the same classes (the script's own check: seconds, not minutes).
TINY_UNET = dict(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
                 cross_attention_dim=32, attention_head_dim=4, norm_num_groups=8,
                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"))


def unet_and_inputs(size: str):
    import torch
    from diffusers import UNet2DConditionModel
    from scale import SD15_UNET

    config = SD15_UNET if size == "sd15" else TINY_UNET
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**config).eval()
    side, width = (32, 768) if size == "sd15" else (16, 32)
    g = torch.Generator().manual_seed(1)

    def call(t: int):
        return (torch.randn(1, 4, side, side, generator=g), torch.tensor(t), torch.randn(1, 77, width, generator=g))

    return unet, call


def child(row: str, size: str, repeats: int, calibration: int, out: Path, reduce_range: bool = False) -> None:
    import torch

    torch.manual_seed(0)
    unet, call = unet_and_inputs(size)
    calls = [call(999 - 997 * i // max(calibration, 1)) for i in range(calibration)]
    x = call(250)

    class Denoiser(torch.nn.Module):  # positional in, the noise prediction out: what export and PT2E take
        def __init__(self, unet):
            super().__init__()
            self.unet = unet

        def forward(self, sample, t, states):
            return self.unet(sample, t, states, return_dict=False)[0]

    made = time.perf_counter()
    with torch.no_grad():
        model = Denoiser(unet)
        if row.startswith("int8"):
            import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
            from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

            config = xiq.get_default_x86_inductor_quantization_config(is_dynamic="dynamic" in row,
                                                                      reduce_range=reduce_range)
            quantizer = xiq.X86InductorQuantizer().set_global(config)
            prepared = prepare_pt2e(torch.export.export(model, x).module(), quantizer)
            for c in calls:
                prepared(*c)
            model = convert_pt2e(prepared)
        elif row.startswith("bf16"):
            model = model.to(torch.bfloat16)
            x = (x[0].bfloat16(), x[1], x[2].bfloat16())
        made = time.perf_counter() - made
        if "compiled" in row:
            import torch._inductor.config as inductor_config

            inductor_config.freezing = True
            model = torch.compile(model)
        start = time.perf_counter()
        first = model(*x)
        first_s = time.perf_counter() - start
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model(*x)
            times.append(time.perf_counter() - start)
    torch.save(first.float(), out / f"{row}.pt")
    (out / f"{row}.json").write_text(json.dumps({"made_s": made, "first_s": first_s,
                                                 "steady_s": statistics.median(times)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=["sd15", "tiny"], default="sd15")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per row (the median is shown)")
    parser.add_argument("--calibration", type=int, default=2, help="calls the static rows are calibrated on")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of: {', '.join(ROWS)}")
    parser.add_argument("--reduce-range", action="store_true",
                        help="int8 activations of 7 bits (torchao's advice for a CPU without VNNI; what aotbuild's "
                             "int8static does there)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.size, args.repeats, args.calibration, Path(args.out), args.reduce_range)
        return
    import torch

    rows = [r for r in args.rows.split(",") if r]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown rows {unknown}; choose from {ROWS}")
    if "fp32 eager" not in rows:
        rows.insert(0, "fp32 eager")  # every ratio and error is against it
    out = Path(tempfile.mkdtemp(prefix="int8-convs-"))
    results = {}
    for row in rows:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(out / f"inductor-{row.replace(' ', '-')}"),
               "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH", "")])}
        print(f"{row} ...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, __file__, "--child", row, "--out", str(out), "--size", args.size,
                               "--repeats", str(args.repeats), "--calibration", str(args.calibration),
                               *(["--reduce-range"] if args.reduce_range else [])],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(f"{row} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        results[row] = json.loads((out / f"{row}.json").read_text())
    ref = torch.load(out / "fp32 eager.pt")
    base = results["fp32 eager"]["steady_s"]
    lines = []
    for row, r in results.items():
        got = torch.load(out / f"{row}.pt")
        err = float((got - ref).norm() / ref.norm())
        lines.append([row, fmt(r["made_s"], ".1f"), fmt(r["first_s"], ".1f"), fmt(r["steady_s"], ".3f"),
                      fmt(r["steady_s"] / base, ".2f"), fmt(err, ".1e")])
    static = out / "int8 static eager.pt"
    if static.is_file() and (out / "int8 static compiled.pt").is_file():
        q, c = torch.load(static), torch.load(out / "int8 static compiled.pt")
        print(f"int8 static compiled against int8 static eager: {float((c - q).norm() / q.norm()):.1e} relative")
    print(table(["row", "made s", "first call s", "steady call s", "steady / fp32 eager", "error vs fp32 eager"],
                lines))
    print(f"torch {torch.__version__}, cpu capability {torch.backends.cpu.get_cpu_capability()}, "
          f"{os.cpu_count()} CPUs, size {args.size}, int8 activations of {7 if args.reduce_range else 8} bits")


if __name__ == "__main__":
    main()
