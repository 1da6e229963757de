"""aotbuild at real size: a Stable Diffusion 1.5-size UNet, and a depth sweep of a tiny-width Flux.

    python benchmarks/scale.py [--parts sd15,flux] [--strategies ...] [--repeats 3] [--depths 2,8,16]
                               [--save scale.json]

Nothing is downloaded: every model is made here with random weights from diffusers' own classes.

sd15   The SD 1.5 UNet config (860M parameters, fp32; cross-attention width 768) in the built-in
       tiny-sd pipeline, whose text encoder is widened to 768 (1 layer) and whose VAE stays tiny.
       256x256 images (32x32 latents), 2 steps, no guidance. Built once per strategy of --strategies
       (jit-cache with two shapes, to show one pipeline load shared by a recipe's jobs; aot-compile,
       aot-package and auto, the recipe naming no strategy, with the first shape), each served by a
       fresh process from a moved copy of the cache (--build-repeats N: each built N times in turn, again
       at the first shape only, for the medians of its job); ``torch.compile`` in --strategies adds plain
       torch.compile's row (a cold compile in the serving process: its steady call is the reference
       for issue 36's "within 5% of torch.compile's").
flux   FluxTransformer2DModel at the built-in tiny-flux's width with D double and D single blocks
       for each --depths D, full vs regional scope (jit-cache) and the recipe naming no strategy
       (auto, full scope), each served likewise, and the ceiling: plain torch.compile with Inductor's
       freezing, a cold compile in the serving process (--flux-rows chooses among the four).
dtype  The SD 1.5-size pipeline's fp32 checkpoint loaded by the build's own load (the loader's
       context.cpu_pipeline) as float32 and as bfloat16, on 1 thread (as the loader runs) and on
       every core, each in a fresh process: the peak anonymous RSS (the process's own copies) and
       the peak file-backed RSS (checkpoint pages mapped by safetensors: page cache, reclaimable)
       against the UNet's bytes in each dtype, sampled every 5 ms.

Per build: the job's phases (the worker's load or its share of the loader's, compile+warmup, proof),
the pipeline loads of the build (report.loads), the peak RSS of every process of the build (its
process tree sampled from /proc every 0.2 s, by role: builder, loader, forked job, worker, proof,
compile workers; a forked job's RSS counts the pages it shares with the loader), and the entry's
bytes against the weights'. Models are made in a child process (a process's ru_maxrss survives
fork and exec, so this one stays small and each served child's peak RSS is its own). Per served
strategy: load -> first image against eager's, the steady call against eager's, and what the load
compiled (FX graph cache misses, Dynamo graphs traced). Fresh processes throughout
(benchmarks/cold_vs_warm.py's child). Never used by tests.
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
import threading
import time
from pathlib import Path

from harness import REPO, child_env, fmt, run_child, table  # noqa: E402

COLD_VS_WARM = str(Path(__file__).with_name("cold_vs_warm.py"))

#: runwayml/stable-diffusion-v1-5's unet/config.json (the fields that set its architecture).
SD15_UNET = dict(sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
                 block_out_channels=(320, 640, 1280, 1280), cross_attention_dim=768, attention_head_dim=8,
                 down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                   "DownBlock2D"),
                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
                 norm_num_groups=32)

#: cold_vs_warm.py's child mode for each strategy
MODES = {"jit-cache": "aotbuild", "aot-compile": "aot-compile", "aot-package": "aot-package", "auto": "auto"}
#: the rows compiled in the serving process (a cold compile of minutes: the first round only)
COMPILE_MODES = {"torch.compile": "cold", "torch.compile+freezing": "cold-freezing"}


# -- models -------------------------------------------------------------------------------------------


def make_sd15(folder: Path, work: Path, seed: int = 0) -> Path:
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    from aotbuild import builtin

    tiny = builtin.ensure("builtin:tiny-sd", work / "models")
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny))
    torch.manual_seed(seed)  # another seed: other weights of the same structure (--other-weights)
    pipe.unet = UNet2DConditionModel(**SD15_UNET)
    old = pipe.text_encoder.config
    torch.manual_seed(0)
    pipe.text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=old.vocab_size, hidden_size=768, intermediate_size=1536, num_attention_heads=12,
        num_hidden_layers=1, max_position_embeddings=77, projection_dim=768, bos_token_id=old.bos_token_id,
        eos_token_id=old.eos_token_id, pad_token_id=old.pad_token_id))
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder


def make_flux(folder: Path, work: Path, depth: int) -> Path:
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from aotbuild import builtin

    tiny = builtin.ensure("builtin:tiny-flux", work / "models")
    pipe = FluxPipeline.from_pretrained(str(tiny))
    torch.manual_seed(0)
    pipe.transformer = FluxTransformer2DModel(**{**pipe.transformer.config, "num_layers": depth,
                                                 "num_single_layers": depth})
    pipe.save_pretrained(str(folder), safe_serialization=True)
    return folder


def make(kind: str, folder: Path, work: Path, depth: int = 0) -> Path:
    """make_sd15 / make_flux in a child process: Linux keeps a process's peak RSS (ru_maxrss) across
    fork and exec, so a model made in this process would show as every served child's peak."""
    code = subprocess.run([sys.executable, __file__, "--make", kind, str(folder), str(work), str(depth)], cwd=REPO)
    if code.returncode != 0:
        sys.exit(f"making the {kind} model failed (exit {code.returncode})")
    return folder


PEAK = """
import json, sys, threading, time
import torch
from pathlib import Path
from aotbuild.context import cpu_pipeline
from aotbuild.recipe.rules import load_recipe

recipe_path, cache, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
torch.set_num_threads(threads)
peak = {"RssAnon": 0, "RssFile": 0}
done = threading.Event()

def rss():
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f
                if line.startswith(("RssAnon", "RssFile"))}

def sample():
    while not done.is_set():
        for k, v in rss().items():
            peak[k] = max(peak[k], v)
        time.sleep(0.005)

before = rss()
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
pipe = cpu_pipeline(load_recipe(recipe_path), Path(cache))
seconds = time.perf_counter() - start
done.set()
time.sleep(0.01)
after = rss()
unet = sum(t.numel() * t.element_size() for t in (*pipe.unet.parameters(), *pipe.unet.buffers()))
print("RESULT " + json.dumps({"seconds": seconds, "unet_bytes": unet, "anon_before": before["RssAnon"],
                              "peak_anon": peak["RssAnon"], "peak_file": peak["RssFile"],
                              "anon_after": after["RssAnon"], "file_after": after["RssFile"]}))
"""


def load_peak(recipe_path: Path, cache: Path, threads: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", PEAK, str(recipe_path), str(cache), str(threads)], cwd=REPO,
                          env=child_env(cache.parent / "dtype-compilers"), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the load failed:\n{proc.stderr[-3000:]}")
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def report_dtype(rows: list[tuple[str, int, dict]]) -> list[str]:
    gb = lambda n: f"{n / 1e9:.2f}"  # noqa: E731
    body = [[dtype, str(threads), fmt(r["seconds"], ".1f"), gb(r["unet_bytes"]), gb(r["peak_anon"] - r["anon_before"]),
             f"{(r['peak_anon'] - r['anon_before']) / r['unet_bytes']:.2f}", gb(r["peak_file"]),
             gb(r["file_after"])] for dtype, threads, r in rows]
    return ["", "## fp32 checkpoint loaded by the build (context.cpu_pipeline), SD 1.5-size", "",
            table(["dtype", "threads", "load s", "UNet GB", "anon peak GB over start", "/ UNet",
                   "file peak GB", "file after GB"], body, text_columns=2)]


def weight_bytes(folder: Path, component: str) -> int:
    return sum(p.stat().st_size for p in (folder / component).glob("*.safetensors"))


def recipe(path: Path, model: Path, component: str, strategy: str, scope: str, shapes: list[dict],
           warmup: dict, dtype: str = "float32", quant_type: str | None = None) -> Path:
    import yaml

    quantized = {"quantization": {"backend": "torchao", "quant_type": quant_type}} if quant_type else {}
    data = {"model": {"id": str(model), "dtype": dtype, **quantized}, "target": "inductor", "device": "cpu",
            **({} if strategy == "auto" else {"strategy": strategy}),  # auto: the recipe naming none
            "compile": {"components": [component], "scope": scope}, "shapes": shapes, "warmup": warmup}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# -- the process tree's memory ------------------------------------------------------------------------


def _role(pid: int, cmdline: str, roots: dict[str, int]) -> str:
    if "aotbuild.builder.loader" in cmdline:
        first = roots.setdefault("loader", pid)
        return "loader" if pid == first else "forked job"
    for needle, role in (("aotbuild.builder.worker", "worker"), ("aotbuild.builder.proof", "proof"),
                         ("compile_worker", "compile workers"),
                         ("aotbuild.cli.commands", "builder"), ("cc1plus", "C++ compiler"), ("g++", "C++ compiler")):
        if needle in cmdline:
            return role
    return "other"


class TreeRSS:
    """Peak RSS (MB) per role over the process tree under ``pid``, sampled every 0.2 s."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop, self._roots = pid, {}, threading.Event(), {}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        out, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            try:
                for task in os.listdir(f"/proc/{pid}/task"):
                    todo += [int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()]
            except OSError:
                pass
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            for pid in self._tree():
                try:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    rss = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                               if line.startswith("VmRSS:")) / 1024
                except (OSError, StopIteration, ValueError):
                    continue
                role = _role(pid, cmd, self._roots)
                self.peak[role] = max(self.peak.get(role, 0.0), rss)
            time.sleep(0.2)

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return self.peak


# -- build and serve ----------------------------------------------------------------------------------


def build(recipe_path: Path, cache: Path, workdir: Path) -> dict:
    env = child_env(workdir / "build-caches")
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "aotbuild.cli", "build", "--json", "--cache", str(cache),
                             str(recipe_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=REPO)
    rss = TreeRSS(proc.pid)
    out, err = proc.communicate()
    peak = rss.stop()
    wall = time.perf_counter() - started
    try:
        report = json.loads(out)
    except ValueError:
        return {"ok": False, "reason": f"exit {proc.returncode}: {err.strip().splitlines()[-3:]}", "wall": wall}
    jobs = []
    for job in report["jobs"]:
        manifest = None
        if job["status"] == "built":
            shown = subprocess.run([sys.executable, "-m", "aotbuild.cli", "show", "--json", "--cache", str(cache),
                                    job["key"]], env=env, capture_output=True, text=True, cwd=REPO)
            manifest = json.loads(shown.stdout)
        jobs.append({"label": f"{job['shape']['height']}x{job['shape']['width']}", "status": job["status"],
                     "seconds": job["seconds"], "reason": job["reason"],
                     "phases": (manifest or {}).get("build", {}).get("phases", {}),
                     "bytes": (manifest or {}).get("size") or job["size"]})
    return {"ok": all(j["status"] == "built" for j in jobs), "wall": wall, "jobs": jobs, "loads": report.get("loads"),
            "rss": peak, "reason": "; ".join(j["reason"] for j in jobs if j["reason"])}


def serve(mode: str, recipe_path: Path, cache: Path, workdir: Path, env: dict[str, str] | None = None) -> dict:
    """One fresh process of cold_vs_warm.py's child ``mode`` (eager, or a load_compiled mode), with
    ``env`` added to its environment (AOTBENCH_PASS_PIPE, AOTBENCH_OUTPUT, THP_MEM_ALLOC_ENABLE)."""
    return run_child(COLD_VS_WARM, [mode, str(recipe_path), str(cache)], {**child_env(workdir), **(env or {})})


def relative_difference(path: Path, reference: Path) -> float | None:
    """max |a - b| / max |b| of two saved first images, None where either is missing."""
    import numpy

    if not (path.exists() and reference.exists()):
        return None
    a, b = numpy.load(path).astype("float64"), numpy.load(reference).astype("float64")
    return float(numpy.abs(a - b).max() / max(numpy.abs(b).max(), 1e-12))


def median_run(runs: list[dict]) -> dict:
    """One run's figures with ``first`` and ``steady`` replaced by their medians over ``runs`` (the
    counters and RSS are the run whose first image is the median's); an error if every run failed."""
    ok = [r for r in runs if "first" in r]
    if not ok:
        return runs[0] if runs else {"error": "not run"}
    mid = sorted(ok, key=lambda r: r["first"])[(len(ok) - 1) // 2]
    return {**mid, "first": statistics.median(r["first"] for r in ok),
            "steady": statistics.median(r["steady"] for r in ok), "runs": len(ok)}


def served_copy(cache: Path, work: Path, name: str) -> Path:
    copy = work / f"copy-{name}" / "cache"
    shutil.copytree(cache, copy, ignore=shutil.ignore_patterns("models"))
    os.symlink(cache / "models", copy / "models") if (cache / "models").exists() else None
    return copy


def report_builds(builds: dict[str, list[dict]], repeats: int) -> str:
    """Each strategy's job at the first shape over its builds (interleaved by round): medians, each run,
    and each strategy's median against jit-cache's."""
    def jobs(runs: list[dict]) -> list[dict]:
        return [r["jobs"][0] for r in runs if r["ok"]]

    med = {k: statistics.median(j["seconds"] for j in jobs(v)) for k, v in builds.items() if jobs(v)}
    parts = []
    for k, v in builds.items():
        if k not in med:
            parts.append(f"{k} failed")
            continue
        phases = {p: statistics.median(j["phases"].get(p, 0.0) for j in jobs(v))
                  for p in ("compile_and_warmup", "proof")}
        ratio = f", {med[k] / med['jit-cache']:.2f}x jit-cache's" if "jit-cache" in med and k != "jit-cache" else ""
        each = ", ".join(f"{j['seconds']:.1f}" for j in jobs(v))
        parts.append(f"{k} {med[k]:.1f} s (runs {each}; compile {phases['compile_and_warmup']:.1f}, "
                     f"proof {phases['proof']:.1f}){ratio}")
    return f"builds, the job at the first shape, medians of {repeats} interleaved by round: " + "; ".join(parts)


def report_part(title: str, weights: int, eager: dict, cells: list[tuple[str, dict, dict | None]]) -> list[str]:
    lines = [f"\n== {title}: weights {weights / 1e6:.1f} MB; eager: pipeline load "
             f"{fmt(eager.get('phases', {}).get('pipeline'), '.1f')} s, load -> first image "
             f"{fmt(eager.get('first'), '.1f')} s, steady call {fmt(eager.get('steady'), '.2f')} s"]
    rows = []
    for name, b, s in cells:
        if b is None:  # plain torch.compile: nothing built, compiled in the serving process
            rows.append([name, "-", *[""] * 7,
                         fmt(s["first"] / eager["first"] if "first" in s and "first" in eager else None, ".2f"),
                         fmt(s["steady"] / eager["steady"] if "steady" in s and "steady" in eager else None, ".2f"),
                         str(s["counters"].get("fxgraph_cache_miss", 0)) + "/" + str(s["unique_graphs"])
                         if "counters" in s else s.get("error", "-")[:40], fmt(s.get("rss_mb"), ".0f")])
            continue
        if not b["ok"]:
            rows.append([name, "failed", b.get("reason", "")[:80]] + [""] * 10)
            continue
        for j in b["jobs"]:
            ph = j["phases"]
            rows.append([name, j["label"], f"{j['seconds']:.1f}", fmt(ph.get("load"), ".1f"),
                         fmt(ph.get("shared_load"), ".1f"), fmt(ph.get("compile_and_warmup"), ".1f"),
                         fmt(ph.get("proof"), ".1f"), f"{j['bytes'] / 1e6:.1f}", f"{j['bytes'] / weights * 100:.2f}",
                         fmt(s["first"] / eager["first"] if s and "first" in s and "first" in eager else None, ".2f"),
                         fmt(s["steady"] / eager["steady"] if s and "steady" in s and "steady" in eager else None,
                             ".2f"),
                         str(s["counters"].get("fxgraph_cache_miss", 0)) + "/" + str(s["unique_graphs"])
                         if s and "counters" in s else (s or {}).get("error", "-")[:40],
                         fmt(s.get("rss_mb") if s else None, ".0f")])
            s = None  # served once: the first shape
    lines.append(table(["build", "shape", "job s", "load s", "loader s", "compile s", "proof s", "entry MB",
                        "% weights", "first/eager", "steady/eager", "misses/graphs", "serve RSS MB"], rows,
                       text_columns=2))
    for name, b, _ in cells:
        if b is not None and b["ok"]:
            loads = b.get("loads") or {}
            rss = ", ".join(f"{role} {mb:.0f}" for role, mb in sorted(b["rss"].items(), key=lambda x: -x[1]))
            lines.append(f"{name}: build {b['wall']:.0f} s wall; loads: {loads.get('build')} to compile "
                         f"{loads.get('jobs')} jobs, {loads.get('proof')} by proofs; peak RSS MB: {rss}"
                         + (f"; {b['reason']}" if str(b.get("reason", "")).startswith("auto:") else ""))
    return lines



# -- formats: fp32, bf16, int8 side by side (issue 57) ---------------------------------------------------

#: the formats part's rows: name -> (recipe dtype, model.quantization quant_type)
FORMATS = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8dq": ("float32", "int8dq"),
           "int8wo": ("float32", "int8wo"), "int8static": ("float32", "int8static")}
#: formats calibrated on the build's weights (PT2E): nothing is quantized eagerly (their eager row would be
#: fp32 eager's) and a package serves only the weights it was calibrated on (never --other-weights)
CALIBRATED = ("int8static",)


def cpu_flags() -> str:
    """The CPU's flags that matter to bf16 and int8 kernels (/proc/cpuinfo)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return "unknown"
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
              "amx_bf16", "amx_int8", "amx_tile")
    have = set(flags.split(":", 1)[1].split())
    return " ".join(f for f in wanted if f in have) + " (absent: " + " ".join(f for f in wanted if f not in have) + ")"


def image_error(path: Path, reference: Path) -> tuple[float | None, float | None]:
    """(max |a - b| / max |b|, PSNR in dB of the image in [0, 1], clamped, peak 1.0) of two saved arrays."""
    import numpy

    if not (path.exists() and reference.exists()):
        return None, None
    a, b = numpy.load(path).astype("float64"), numpy.load(reference).astype("float64")
    rel = float(numpy.abs(a - b).max() / max(numpy.abs(b).max(), 1e-12))
    mse = float(((a.clip(0, 1) - b.clip(0, 1)) ** 2).mean())
    return rel, (float("inf") if mse == 0 else 10 * numpy.log10(1.0 / mse))


def run_formats(args: argparse.Namespace, work: Path) -> tuple[list[str], dict]:
    """The SD 1.5-size UNet in each format of --formats, eager and served by the default (the recipe naming
    no strategy), fresh processes interleaved by round; the checkpoint is float32 (a bf16 recipe casts it at
    load), served with other weights (B) than the build's (A) where --other-weights is given."""
    calibrated = [n for n in args.formats.split(",") if n in CALIBRATED]
    if args.other_weights and calibrated:
        sys.exit(f"{calibrated[0]} serves only the weights it was calibrated on: run it without --other-weights")
    print("making the SD 1.5-size pipeline ...", flush=True)
    model = make("sd15", work / "sd15", work)
    served_model = make("sd15", work / "sd15-b", work, 1) if args.other_weights else model
    warm = {"num_inference_steps": args.steps, "guidance_scale": 0.0}
    shape = [{"height": 256, "width": 256}]
    names = args.formats.split(",")
    built, recipes, eager_recipes = {}, {}, {}
    for name in names:
        dtype, quant = FORMATS[name]
        r = recipe(work / f"fmt_{name}.yaml", model, "unet", "auto", "full", shape, warm, dtype, quant)
        eager_recipes[name] = recipe(work / f"fmt_{name}_served.yaml", served_model, "unet", "auto", "full", shape,
                                     warm, dtype, quant)
        recipes[name] = eager_recipes[name] if args.other_weights else r
        print(f"building {name} (auto) ...", flush=True)
        built[name] = build(r, work / f"cache-fmt-{name}", work / f"b-fmt-{name}")
        print(f"  {built[name].get('reason') or built[name].get('ok')}", flush=True)
    passed = {"AOTBENCH_PASS_PIPE": "1"} if args.other_weights else {}
    out_dir = work / "formats"
    out_dir.mkdir()
    rows = [f"{n} eager" for n in names if n not in CALIBRATED] + [f"{n} served" for n in names if built[n]["ok"]]
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    errors: dict[str, list[tuple]] = {row: [] for row in rows}
    for i in range(args.repeats):
        print(f"serving, round {i + 1}/{args.repeats} ...", flush=True)
        for row in rows:
            name, mode = row.split()
            image, latents = out_dir / f"{name}-{mode}-{i}.npy", out_dir / f"{name}-{mode}-{i}-latents.npy"
            env = {"AOTBENCH_OUTPUT": str(image), "AOTBENCH_LATENTS": str(latents)}
            if mode == "eager":
                res = serve("eager", eager_recipes[name], work / f"cache-fmt-{name}", work / f"e-{name}-{i}", env)
            else:
                res = serve("auto", recipes[name], served_copy(work / f"cache-fmt-{name}", work, f"{name}-{i}"),
                            work / f"s-{name}-{i}", {**env, **passed})
            runs[row].append(res)
            ref_image, ref_latents = out_dir / f"fp32-eager-{i}.npy", out_dir / f"fp32-eager-{i}-latents.npy"
            errors[row].append((*image_error(image, ref_image), relative_difference(latents, ref_latents)))
        print("  " + ", ".join(f"{k} {fmt(v[-1].get('first'), '.1f')}/{fmt(v[-1].get('steady'), '.2f')} s"
                               for k, v in runs.items()), flush=True)
    med = {row: median_run(v) for row, v in runs.items()}
    base = med.get("fp32 eager", {})
    table_rows = []
    for row in rows:
        m, errs = med[row], [e for e in errors[row] if e[0] is not None]
        name, mode = row.split()
        held = ""
        if mode == "served":
            reason = built[name].get("reason", "")
            held = reason.split(":", 1)[1].split(" built")[0].strip() if reason.startswith("auto:") else "?"
        psnr = statistics.median(e[1] for e in errs) if errs else None
        table_rows.append([
            row, FORMATS[name][0] if not FORMATS[name][1] else f"float32+{FORMATS[name][1]}", "float32", held or "-",
            fmt(m.get("first"), ".2f"), fmt(m.get("steady"), ".3f"),
            fmt(m["steady"] / base["steady"] if "steady" in m and "steady" in base else None, ".2f"),
            fmt(m.get("rss_mb"), ".0f"),
            fmt(m["rss_mb"] / base["rss_mb"] if "rss_mb" in m and "rss_mb" in base else None, ".2f"),
            (str(m["counters"].get("fxgraph_cache_miss", 0)) + "/" + str(m["unique_graphs"])) if "counters" in m
            else m.get("error", "-")[:30],
            fmt(statistics.median(e[2] for e in errs) if errs and errs[0][2] is not None else None, ".1e"),
            fmt(statistics.median(e[0] for e in errs) if errs else None, ".1e"),
            "inf" if psnr == float("inf") else fmt(psnr, ".1f")])
    import torch

    weights = "other weights (B) than the build's (A), the pipeline passed to load_compiled" \
        if args.other_weights else "the build's weights"
    lines = [f"\n== formats: SD 1.5-size UNet (860M), 256x256, {args.steps} steps, guidance off; medians of "
             f"{args.repeats} fresh processes interleaved by round; served with {weights}; "
             f"random weights: errors show the format's arithmetic, not what it does to a trained model's images",
             f"CPU flags: {cpu_flags()}; torch.backends.cpu.get_cpu_capability(): "
             f"{torch.backends.cpu.get_cpu_capability()}; ONEDNN_MAX_CPU_ISA="
             f"{os.environ.get('ONEDNN_MAX_CPU_ISA', '(unset)')}, ATEN_CPU_CAPABILITY="
             f"{os.environ.get('ATEN_CPU_CAPABILITY', '(unset)')}",
             table(["row", "format", "checkpoint", "served by", "first s", "steady s", "steady/fp32 eager",
                    "peak RSS MB", "RSS/fp32 eager", "misses/graphs", "latents err", "image err", "PSNR dB"],
                   table_rows, text_columns=4),
             "  errors against fp32 eager with the same weights (max |a - b| / max |b|; PSNR of the image in [0, 1]); "
             "first s: a fresh process's start to its first image"]
    lines += ["  builds: " + "; ".join(f"{n} {b['wall']:.0f} s ({b.get('reason', '')[:120]})"
                                       for n, b in built.items())]
    return lines, {"runs": runs, "errors": errors, "builds": built}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="sd15,flux,dtype")
    ap.add_argument("--depths", default="2,8,16")
    ap.add_argument("--flux-rows", default="full,regional,auto,torch.compile+freezing",
                    help="flux: full and regional scope under jit-cache; auto: full scope, the recipe naming no "
                         "strategy (on a CPU: prepacked aot-package where its proof times it faster than eager); "
                         "torch.compile, torch.compile+freezing: a cold compile in the serving process")
    ap.add_argument("--strategies", default="jit-cache,aot-compile,aot-package,auto,torch.compile,"
                                            "torch.compile+freezing",
                    help="the sd15 part's rows, in order (torch.compile, torch.compile+freezing: a cold compile "
                         "in the serving process, plain and with Inductor's freezing)")
    ap.add_argument("--other-weights", action="store_true",
                    help="sd15: serve a second model of the same structure with other weights (B) from the caches "
                         "built with A, passing its pipeline to load_compiled (eager runs B too)")
    ap.add_argument("--thp", action="store_true",
                    help="sd15: serve every row again with THP_MEM_ALLOC_ENABLE=1 (huge pages for PyTorch's "
                         "CPU allocations of 2 MB and more)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="sd15 and flux: fresh served processes per mode, interleaved by round (medians)")
    ap.add_argument("--build-repeats", type=int, default=1,
                    help="sd15: build each strategy this many times in turn (again at the first shape only) and "
                         "report the medians of its job's seconds against jit-cache's")
    ap.add_argument("--formats", default="fp32,bf16,int8dq",
                    help="the formats part's rows (fp32, bf16, int8dq, int8wo, int8static), each eager and served "
                         "by auto (int8static served only: nothing is quantized eagerly)")
    ap.add_argument("--steps", type=int, default=2, help="formats: the pipeline's steps per image")
    ap.add_argument("--save", metavar="FILE.json")
    ap.add_argument("--keep", action="store_true", help="keep the work folder (models, caches)")
    ap.add_argument("--make", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make:
        kind, folder, work_dir, depth = args.make
        if kind == "sd15":
            make_sd15(Path(folder), Path(work_dir), int(depth))  # depth: the UNet's seed
        else:
            make_flux(Path(folder), Path(work_dir), int(depth))
        return
    import torch

    from aotbuild.cli.bench import _cpu_model

    machine = (f"{os.cpu_count()} CPUs, {_cpu_model()}, ISA {torch.backends.cpu.get_cpu_capability()}, "
               f"torch {torch.__version__}")
    work = Path(tempfile.mkdtemp(prefix="aotscale."))
    out: list[str] = [f"machine: {machine}"]
    saved: dict = {"machine": machine}
    try:
        if "sd15" in args.parts:
            print("making the SD 1.5-size pipeline ...", flush=True)
            model = make("sd15", work / "sd15", work)
            served_model = model
            if args.other_weights:  # served with weights B; built with A
                print("making a second SD 1.5-size pipeline (other weights, same structure) ...", flush=True)
                served_model = make("sd15", work / "sd15-b", work, 1)
            warm = {"num_inference_steps": 2, "guidance_scale": 0.0}
            shapes = [{"height": 256, "width": 256}, {"height": 256, "width": 320}]
            eager_recipe = recipe(work / "sd15_eager.yaml", served_model, "unet", "jit-cache", "full", shapes[:1],
                                  warm)
            built: dict[str, tuple[dict | None, Path | None]] = {}  # strategy -> (build, served recipe)
            first_shape: dict[str, Path] = {}  # strategy -> its recipe at the first shape alone
            for strategy in args.strategies.split(","):
                if strategy in COMPILE_MODES:
                    built[strategy] = (None, None)
                    continue
                name = f"sd15_{strategy}".replace("-", "_")
                r = recipe(work / f"{name}.yaml", model, "unet", strategy, "full",
                           shapes if strategy == "jit-cache" else shapes[:1], warm)
                print(f"building sd15 {strategy} ...", flush=True)
                b = build(r, work / f"cache-sd15-{strategy}", work / f"b-{strategy}")
                print(f"  {b}", flush=True)
                served = r if served_model == model else recipe(
                    work / f"{name}_served.yaml", served_model, "unet", strategy, "full", shapes[:1], warm)
                built[strategy] = (b, served)
                first_shape[strategy] = r if strategy != "jit-cache" else recipe(
                    work / f"{name}_first.yaml", model, "unet", strategy, "full", shapes[:1], warm)
            # --build-repeats: each strategy built again, in turn, at the first shape (medians of its job)
            builds = {k: [b] for k, (b, _) in built.items() if b is not None}
            for i in range(1, args.build_repeats):
                for strategy in builds:
                    print(f"building sd15 {strategy} again ({i + 1}/{args.build_repeats}) ...", flush=True)
                    builds[strategy].append(build(first_shape[strategy], work / f"cache-sd15-{strategy}-{i}",
                                                  work / f"b-{strategy}-{i}"))
            if args.build_repeats > 1:
                out += [report_builds(builds, args.build_repeats)]
            # Served side by side: each round one fresh process of eager and of every strategy built
            # (plain torch.compile, a cold compile of minutes, in the first round only); --thp: each
            # again with THP_MEM_ALLOC_ENABLE=1.
            passed = {"AOTBENCH_PASS_PIPE": "1"} if args.other_weights else {}
            variants = [("", {})] + ([(" +THP", {"THP_MEM_ALLOC_ENABLE": "1"})] if args.thp else [])
            rows = ["eager", *built]
            runs: dict[str, list[dict]] = {f"{k}{v}": [] for k in rows for v, _ in variants}
            images = work / "images"
            images.mkdir()
            diffs: dict[str, list[float | None]] = {k: [] for k in runs}
            for i in range(args.repeats):
                print(f"serving, round {i + 1}/{args.repeats} ...", flush=True)
                for suffix, extra in variants:
                    for row in rows:
                        key = f"{row}{suffix}"
                        out_file = images / f"{key.replace(' ', '')}-{i}.npy"
                        env = {**extra, "AOTBENCH_OUTPUT": str(out_file)}
                        if row == "eager":
                            res = serve("eager", eager_recipe, work / "cache-sd15", work / f"eager-sd15-{key}-{i}",
                                        env)
                        elif row in COMPILE_MODES:
                            if i > 0 or suffix:  # minutes of compile: once
                                continue
                            res = serve(COMPILE_MODES[row], eager_recipe, work / "cache-sd15",
                                        work / f"s-{row}{suffix}".replace(" ", ""), env)
                        else:
                            b, r = built[row]
                            if not b["ok"]:
                                continue
                            res = serve(MODES[row], r, served_copy(work / f"cache-sd15-{row}", work, f"{key}-{i}"),
                                        work / f"s-{key}-{i}".replace(" ", ""), {**env, **passed})
                        runs[key].append(res)
                        reference = images / f"eager{suffix.replace(' ', '')}-{i}.npy"
                        diffs[key].append(relative_difference(out_file, reference))
                print("  " + ", ".join(f"{k} {fmt(v[-1].get('first'), '.1f')} s" for k, v in runs.items() if v),
                      flush=True)
            eager = median_run(runs["eager"])
            cells = []
            for suffix, _ in variants:
                for k in rows:
                    key = f"{k}{suffix}"
                    b = built[k][0] if k in built and not suffix else None  # the build's figures once
                    if key != "eager" and (b is not None or runs[key]):
                        cells.append((key, b, median_run(runs[key]) if runs[key] else None))
            weights = "other weights (B) than the build's (A), the pipeline passed to load_compiled" \
                if args.other_weights else "the build's weights"
            title = (f"SD 1.5-size UNet (860M), 256x256, 2 steps; medians of {args.repeats} fresh processes; "
                     f"served with {weights}")
            out += report_part(title, weight_bytes(model, "unet"), eager, cells)
            out += ["  runs, load -> first image (s): " + "; ".join(
                f"{k} {', '.join(fmt(r.get('first'), '.1f') for r in v)}" for k, v in runs.items())]
            out += ["  first image vs eager's with the same weights (max |a - b| / max |b|): " + "; ".join(
                f"{k} {', '.join(fmt(d, '.1e') for d in v)}" for k, v in diffs.items() if v and k != "eager")]
            out += ["  install s (load_compiled's replay of prepacked recipes): " + "; ".join(
                f"{k} {', '.join(fmt(r.get('phases', {}).get('install'), '.2f') for r in v)}"
                for k, v in runs.items() if any('install' in r.get('phases', {}) for r in v))]
            saved["sd15"] = {"eager": eager, "cells": cells, "runs": runs, "diffs": diffs}
        if "formats" in args.parts:
            lines, saved["formats"] = run_formats(args, work)
            out += lines
        if "flux" in args.parts:
            saved["flux"] = {}
            for depth in (int(d) for d in args.depths.split(",")):
                print(f"making the tiny-width Flux at depth {depth} ...", flush=True)
                model = make("flux", work / f"flux{depth}", work, depth)
                warm = {"num_inference_steps": 2, "guidance_scale": 3.5}
                shapes = [{"height": 64, "width": 64}]
                eager_recipe = recipe(work / f"flux{depth}_eager.yaml", model, "transformer", "jit-cache", "full",
                                      shapes, warm)
                rows = args.flux_rows.split(",")  # "full", "regional": jit-cache; "auto": no strategy
                built: dict[str, tuple[dict, Path, str, Path]] = {}  # row -> (build, recipe, strategy, cache)
                for row in rows:
                    if row in COMPILE_MODES:  # compiled in the serving process: nothing built
                        continue
                    scope, strategy = ("full", "auto") if row == "auto" else (row, "jit-cache")
                    r = recipe(work / f"flux{depth}_{row}.yaml", model, "transformer", strategy, scope, shapes,
                               warm)
                    print(f"building flux depth {depth} {row} ...", flush=True)
                    cache = work / f"cache-flux{depth}-{row}"
                    built[row] = (build(r, cache, work / f"b-f{depth}-{row}"), r, strategy, cache)
                    print(f"  {row}: build {built[row][0].get('wall', 0):.0f} s", flush=True)
                # Served side by side: each round one fresh process of eager and of every row (the cold
                # compiles in the first round only), so a busy spell slows every row alike.
                runs: dict[str, list[dict]] = {row: [] for row in ["eager", *rows]}
                for i in range(args.repeats):
                    runs["eager"].append(serve("eager", eager_recipe, work / f"cache-flux{depth}",
                                               work / f"e-f{depth}-{i}"))
                    for row in rows:
                        if row in COMPILE_MODES:
                            if i == 0:
                                runs[row].append(serve(COMPILE_MODES[row], eager_recipe, work / f"cache-flux{depth}",
                                                       work / f"s-f{depth}-{row}"))
                            continue
                        b, r, strategy, cache = built[row]
                        if b["ok"]:
                            runs[row].append(serve(MODES[strategy], r, served_copy(cache, work, f"f{depth}-{row}-{i}"),
                                                   work / f"s-f{depth}-{row}-{i}"))
                    print(f"  round {i + 1}/{args.repeats}: " + ", ".join(
                        f"{k} steady {fmt(v[-1].get('steady'), '.3f')} s" for k, v in runs.items() if v), flush=True)
                eager = median_run(runs["eager"])
                cells = [(row, built[row][0] if row in built else None,
                          median_run(runs[row]) if runs[row] else None) for row in rows]
                out += report_part(f"tiny-width Flux, {depth} double + {depth} single blocks, 64x64, 2 steps; medians "
                                   f"of {args.repeats} fresh processes",
                                   weight_bytes(model, "transformer"), eager, cells)
                saved["flux"][depth] = {"eager": eager, "cells": cells}
        if "dtype" in args.parts:
            model = work / "sd15"
            if not model.exists():
                print("making the SD 1.5-size pipeline ...", flush=True)
                make("sd15", model, work)
            rows = []
            for dtype in ("float32", "bfloat16"):
                r = recipe(work / f"dtype_{dtype}.yaml", model, "unet", "jit-cache", "full",
                           [{"height": 256, "width": 256}], {"num_inference_steps": 2, "guidance_scale": 0.0},
                           dtype)
                for threads in (1, os.cpu_count() or 1):
                    rows.append((dtype, threads, load_peak(r, work / "cache-dtype", threads)))
                    print(f"  {dtype} on {threads} threads: {rows[-1][2]}", flush=True)
            out += report_dtype(rows)
            saved["dtype"] = rows
        print("\n".join(out))
        if args.save:
            Path(args.save).write_text(json.dumps(saved, indent=1, default=str))
    finally:
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
