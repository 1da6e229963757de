"""A long-lived server's memory and outputs, step by step (issue 52): one process serves a weight-free AOT
package built with freezing (prepacked weights, what ``strategy: auto`` chooses on a CPU) through weight
swaps, replaced weights, reloads, a partial write, a copy and threads, and compares every output with eager.

    python benchmarks/soak.py                      # four Conv2d(512, 512, 3): 37.7 MB of weights, ~1 min
    python benchmarks/soak.py --model sd15         # the SD 1.5-size UNet (860M, 3.4 GB): heavy
    python benchmarks/soak.py --leaky              # negative control: hand over the tensors themselves
    python benchmarks/soak.py --json out.json      # every step's figures as JSON (tests/test_soak.py)
    python benchmarks/soak.py --peaks              # and peak RSS served vs eager, fresh processes
    python benchmarks/soak.py --baseline ../main-before  # load -> first call, steady call vs another checkout
    python benchmarks/soak.py --linears            # and the same model with no linear weight packed, side by side

The package is built as the strategy builds it (aotbuild.strategies.aoti) with weights A, in a fresh
process, and served here with a dispatcher in the module's forward, as ``load_compiled`` installs it.
``--rounds`` rounds, each: a swap (``load_state_dict`` of the other checkpoint, in place), a call; the
weights replaced by new tensors (``load_state_dict(..., assign=True)``), a call; every
``--reload-every`` rounds a reload (a new module with the same weights served, the old one and its
package dropped, ``gc.collect()``), a call. Then a one-channel write through ``.data``, a
``copy.deepcopy`` served with other weights, and ``--threads`` threads calling at once. After each step:
``gc.collect()``, then VmRSS, RssAnon and RssFile (/proc/self/status; the criterion is on RssAnon: mapped
files count in VmRSS). Growth is judged from the
middle of the rounds on (the allocator settles in the first rounds): ``growth_after_middle`` is RssAnon at
the end of the rounds minus at their middle, in units of the weights' bytes. Also: what a served call
checks before it runs (the runner's own identity, version and sample checks, and the dispatcher's
dependency watch), alone, against a steady call.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BUILD = """
import json, sys, torch
sys.path.insert(0, {repo!r}); sys.path.insert(0, {bench!r})
from soak import make
from aotbuild.dispatch import signature
from aotbuild.strategies import aoti, prepack
from aotbuild.strategies.calls import snapshot
from pathlib import Path
if {small_linear!r} is not None:  # --linears: the package that packs no linear weight
    prepack.SMALL_LINEAR = {small_linear!r}
module, args = make({model!r})
calls = {{signature(args, {{}}): snapshot(args, {{}})}}
record, = aoti.build_packages(module, calls, Path({work!r}), {{"freezing": True}})
Path({work!r}, "record.json").write_text(json.dumps(record))
"""


PEAK = """
import json, sys, torch
sys.path.insert(0, {repo!r}); sys.path.insert(0, {bench!r})
from pathlib import Path
from soak import make, first
module, args = make({model!r})
if {served!r}:
    from aotbuild.dispatch import install_dispatcher
    from aotbuild.strategies import aoti
    from aotbuild.strategies.discard import DISCARDING
    record = json.loads(Path({work!r}, "record.json").read_text())
    DISCARDING.set({discard!r})  # as load_compiled(..., discard_weights=True) installs
    routes = aoti.load_packages(module, "net", [(record, {{record["path"]: Path({work!r}) / record["path"]}})], "cpu",
                                built_by=torch.__version__)
    install_dispatcher(module, "net", routes[""], None, "error")
with torch.no_grad():
    for _ in range(3):
        first(module(*args))
status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
print("PEAK", int(status["VmHWM"].split()[0]) * 1024)
"""


TIMED = """
import json, statistics, sys, time, torch
sys.path.insert(0, {repo!r}); sys.path.insert(0, {bench!r})
from pathlib import Path
from soak import make, first
from aotbuild.dispatch import install_dispatcher
from aotbuild.strategies import aoti
module, args = make({model!r})
record = json.loads(Path({work!r}, "record.json").read_text())
packages = [(record, {{record["path"]: Path({work!r}) / record["path"]}})]
started = time.perf_counter()
try:
    routes = aoti.load_packages(module, "net", packages, "cpu", built_by=torch.__version__)
except TypeError:  # a checkout from before issue 52
    routes = aoti.load_packages(module, "net", packages, "cpu")
install_dispatcher(module, "net", routes[""], None, "error")
loaded = time.perf_counter()
with torch.no_grad():
    first(module(*args))
    first_call = time.perf_counter()
    steady = []
    for _ in range(3):
        t = time.perf_counter()
        first(module(*args))
        steady.append(time.perf_counter() - t)
print("TIMED " + json.dumps({{"load_s": loaded - started, "first_s": first_call - started,
                            "steady_s": statistics.median(steady)}}))
"""


def timed(model: str, work: Path, checkout: Path) -> dict[str, float]:
    """Load -> first call and the steady call of the package served by ``checkout``'s aotbuild, in a fresh
    process (the model made in it first, as a server's pipeline load)."""
    code = TIMED.format(repo=str(checkout), bench=str(REPO / "benchmarks"), model=model, work=str(work))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=checkout).stdout
    return json.loads(next(x for x in out.splitlines() if x.startswith("TIMED"))[len("TIMED "):])


def compare(model: str, work: Path, baseline: Path, repeats: int) -> dict[str, Any]:
    """This checkout against ``baseline`` (another checkout, e.g. a git worktree of main before a change),
    fresh processes interleaved, medians of ``repeats``: the ratio of each figure."""
    runs: dict[str, list[dict[str, float]]] = {"this": [], "baseline": []}
    for _ in range(repeats):
        for name, checkout in (("this", REPO), ("baseline", baseline)):
            runs[name].append(timed(model, work, checkout))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratios = {k: med["this"][k] / med["baseline"][k] for k in med["this"]}
    print(f"\nthis checkout against {baseline}, fresh processes interleaved, medians of {repeats}:")
    for k in med["this"]:
        print(f"  {k:<9} {med['this'][k]:8.3f} s against {med['baseline'][k]:8.3f} s: {ratios[k]:.3f}x")
    return {"medians": med, "ratios": ratios, "runs": runs}


def build(model: str, work: Path, small_linear: int | None = None) -> None:
    """The package with freezing, as the strategy builds it, in a fresh process (``small_linear``: pack only
    linear weights of more elements; None: aotbuild's own :data:`aotbuild.strategies.prepack.SMALL_LINEAR`)."""
    code = BUILD.format(repo=str(REPO), bench=str(REPO / "benchmarks"), model=model, work=str(work),
                        small_linear=small_linear)
    subprocess.run([sys.executable, "-c", code], check=True)


def linears(model: str, work: Path, repeats: int) -> dict[str, Any]:
    """Issue 52, item 2: the package as built (``work``) against the same model built with no linear weight
    packed (only convolutions prepacked: a smaller prepacked set), fresh processes interleaved, medians of
    ``repeats``: load -> first call, steady call, and peak RSS of 3 calls against eager's."""
    other = work / "linears-unpacked"
    other.mkdir(exist_ok=True)
    if not (other / "record.json").is_file():
        build(model, other, small_linear=2**62)
    builds = {"packed": work, "unpacked": other}
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in builds}
    for _ in range(repeats):
        for name, folder in builds.items():
            runs[name].append(timed(model, folder, REPO))
    med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    eager = peak(model, work, False)
    peaks = {name: peak(model, folder, True) for name, folder in builds.items()}
    print(f"\nlinear weights packed (as built) against none packed, fresh processes interleaved, medians of "
          f"{repeats}; peak RSS of 3 calls, eager {eager / 2**20:.0f} MB:")
    for name in builds:
        print(f"  {name:<9} first call {med[name]['first_s']:7.3f} s, steady call {med[name]['steady_s']:7.3f} s, "
              f"peak {peaks[name] / 2**20:7.0f} MB ({peaks[name] / eager:.2f}x eager)")
    print(f"  unpacked / packed: steady call {med['unpacked']['steady_s'] / med['packed']['steady_s']:.3f}x, "
          f"first call {med['unpacked']['first_s'] / med['packed']['first_s']:.3f}x", flush=True)
    return {"medians": med, "runs": runs, "peak_eager": eager, "peaks": peaks}


def peak(model: str, work: Path, served: bool, discard: bool = False) -> int:
    """Peak RSS (VmHWM) of a fresh process that makes the model and calls it 3 times, eagerly or served
    (``discard``: with its dense prepacked weights dropped after load, ``discard_weights=True``)."""
    code = PEAK.format(repo=str(REPO), bench=str(REPO / "benchmarks"), model=model, work=str(work), served=served,
                       discard=discard)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return int(next(x for x in out.splitlines() if x.startswith("PEAK")).split()[1])


def make(model: str):
    """The module (weights A: seed 0) and one call's inputs."""
    import torch

    torch.manual_seed(0)
    if model == "convs":
        module = torch.nn.Sequential(*[layer for _ in range(4) for layer in (
            torch.nn.Conv2d(512, 512, 3, padding=1), torch.nn.SiLU())])
        args = (torch.randn(1, 512, 16, 16),)
    else:
        from diffusers import UNet2DConditionModel
        from scale import SD15_UNET

        module = UNet2DConditionModel(**SD15_UNET)
        args = (torch.randn(1, 4, 32, 32), torch.tensor(999.0), torch.randn(1, 77, 768))
    return module.eval(), args


def memory() -> dict[str, int]:
    """This process's VmRSS, RssAnon and RssFile in bytes, after a full collection."""
    gc.collect()
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def first(out):
    return out[0] if isinstance(out, tuple) else getattr(out, "sample", out)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("convs", "sd15"), default="convs")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--reload-every", type=int, default=2)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--leaky", action="store_true", help="as before issue 52: hand over new tensors, as they are, "
                                                              "at every rebind (the negative control)")
    parser.add_argument("--work", type=Path, help="build folder (reused when it holds a record.json)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--peaks", action="store_true", help="also the peak RSS of a fresh process serving "
                                                              "3 calls (with and without discard_weights) against "
                                                              "an eager one's")
    parser.add_argument("--baseline", type=Path, help="another checkout (a git worktree of main before a "
                                                         "change): first call and steady call of each, side by side")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per checkout with --baseline "
                                                                "or per build with --linears")
    parser.add_argument("--linears", action="store_true", help="also build the model with no linear weight "
                                                                "packed: first call, steady call and peak RSS "
                                                                "side by side with the package as built")
    opts = parser.parse_args(argv)

    import torch

    from aotbuild.dispatch import install_dispatcher
    from aotbuild.strategies import aoti, handover, runner

    if opts.leaky:  # as before issue 52: every rebind hands over new tensors, as they are
        handover.prepare = lambda tensors, pinning: dict(tensors)
        handover.reuse = lambda value: value
        runner._same_layout = lambda a, b: False
    work = opts.work or Path(tempfile.mkdtemp(prefix="aotbuild-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not (work / "record.json").is_file():
        build(opts.model, work)
    built_s = time.perf_counter() - started
    record = json.loads((work / "record.json").read_text())
    before: dict[str, Any] = {}  # fresh processes first, while this one holds nothing (SD 1.5: 20 GB later)
    if opts.linears:
        before["linears"] = linears(opts.model, work, opts.repeats)
    if opts.peaks:
        before["peak_eager"] = peak(opts.model, work, False)
        before["peak_served"] = peak(opts.model, work, True)
        before["peak_discarded"] = peak(opts.model, work, True, discard=True)
        print(f"peak RSS of 3 calls in a fresh process: eager {before['peak_eager'] / 2**20:.0f} MB; served "
              f"{before['peak_served'] / 2**20:.0f} MB ({before['peak_served'] / before['peak_eager']:.2f}x), with "
              f"discard_weights {before['peak_discarded'] / 2**20:.0f} MB "
              f"({before['peak_discarded'] / before['peak_eager']:.2f}x)", flush=True)
    if opts.baseline:
        before["baseline"] = compare(opts.model, work, opts.baseline, opts.repeats)
    module, args = make(opts.model)
    weights = sum(t.numel() * t.element_size() for t in module.state_dict().values())
    state_a = {k: v.clone() for k, v in module.state_dict().items()}
    torch.manual_seed(1)
    state_b = {k: v + 0.01 * torch.randn_like(v) for k, v in state_a.items()}

    def load() -> None:
        routes = aoti.load_packages(module, "net", [(record, {record["path"]: work / record["path"]})], "cpu",
                                    built_by=torch.__version__)
        install_dispatcher(module, "net", routes[""], None, "error")

    def check(what: str, served=None) -> float:
        served = served or module
        with torch.no_grad():
            out = first(served(*args))
            ref = first(served.forward.eager(*args))
        diff = ((out - ref).abs().max() / ref.abs().max()).item()
        if not diff <= 1e-4:
            raise AssertionError(f"{what}: served output {diff:.3g} off eager")
        return diff

    steps = []

    def step(name: str, diff: float) -> None:
        steps.append({"step": name, "diff": diff, **memory()})
        print(f"{name:<22} {steps[-1]['RssAnon'] / 2**20:9.1f} MB anon {steps[-1]['RssFile'] / 2**20:8.1f} MB file"
              f"  diff {diff:.2g}", flush=True)

    load()
    step("load + first call", check("first call"))
    for r in range(opts.rounds):
        module.load_state_dict(state_b if r % 2 == 0 else state_a)
        step(f"round {r + 1}: swap", check("swap"))
        module.load_state_dict({k: v.clone() for k, v in (state_a if r % 2 == 0 else state_b).items()}, assign=True)
        step(f"round {r + 1}: replace", check("replace"))
        if (r + 1) % opts.reload_every == 0:  # as a server reloads: a new module, the old one dropped
            fresh, _ = make(opts.model)
            fresh.load_state_dict(module.state_dict())
            module = fresh
            del fresh
            gc.collect()
            load()
            step(f"round {r + 1}: reload", check("reload"))
    half = max(1, opts.rounds // 2)
    middle = next(s for s in steps if s["step"].startswith(f"round {half}:") and "replace" in s["step"])
    end = steps[-1]
    with torch.no_grad():
        weight = next(p for p in module.parameters() if p.dim() == 4)
        weight.data[weight.shape[0] // 2] *= 2  # one output channel, through .data: no version bump
    step("one-channel .data write", check(".data write"))
    twin = copy.deepcopy(module)
    twin.load_state_dict(state_b)
    step("deepcopy, other weights", max(check("copy", twin), check("original after copy")))
    del twin
    gc.collect()  # the copy's runner goes: its freed weights are given back at the next call of a package
    step("copy dropped", check("after copy"))
    errors: list[str] = []
    barrier = threading.Barrier(opts.threads)

    def serve() -> None:
        barrier.wait()
        try:
            for _ in range(3):
                check("thread")
        except AssertionError as exc:
            errors.append(str(exc))

    pool = [threading.Thread(target=serve) for _ in range(opts.threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    if errors:
        raise AssertionError(errors[0])
    step(f"{opts.threads} threads", check("after threads"))

    served = module.forward.routes[record["signature"]].runner
    dispatcher = module.forward
    with torch.no_grad():
        calls = []
        for _ in range(5):
            t = time.perf_counter()
            dispatcher(*args)
            calls.append(time.perf_counter() - t)
    from aotbuild.pipeline import dependencies

    # what a served call checks before it runs: the dispatcher's dependency watch (as load_compiled arms it)
    # and the runner's own identity, version and sample checks
    watch = dependencies.Watch(module, {**dependencies.snapshot(module), "globals": [dependencies.call_state()]},
                               "net")
    checks, watches = [], []
    for _ in range(200):
        t = time.perf_counter()
        served._changed()
        checks.append(time.perf_counter() - t)
        t = time.perf_counter()
        assert watch.check() == ""
        watches.append(time.perf_counter() - t)
    result = {
        "model": opts.model, "leaky": opts.leaky, "torch": torch.__version__, "weights_bytes": weights,
        "build_s": round(built_s, 1), "pinning": served.pinning, "rounds": opts.rounds,
        "growth_after_middle": (end["RssAnon"] - middle["RssAnon"]) / weights,
        "growth_all": (end["RssAnon"] - steps[0]["RssAnon"]) / weights,
        "check_us": statistics.median(checks) * 1e6, "watch_us": statistics.median(watches) * 1e6,
        "steady_call_ms": statistics.median(calls) * 1e3,
        "watched_tensors": len(served.watched), "steps": steps,
    }
    result["check_share"] = (result["check_us"] + result["watch_us"]) / 1e3 / result["steady_call_ms"]
    result.update(before)
    print(f"\n{opts.model}: weights {weights / 2**20:.1f} MB, torch {torch.__version__}, pinning runtime: "
          f"{served.pinning}{', LEAKY' if opts.leaky else ''}\n"
          f"RssAnon growth: {result['growth_all']:.3f}x the weights over the run, "
          f"{result['growth_after_middle']:.3f}x from round {opts.rounds // 2} to round {opts.rounds}\n"
          f"per-call check {result['check_us']:.0f} us over {len(served.watched)} tensors, and the dependency watch "
          f"{result['watch_us']:.0f} us = "
          f"{100 * result['check_share']:.3f} % of a steady call ({result['steady_call_ms']:.1f} ms)")
    if opts.json:
        opts.json.write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
