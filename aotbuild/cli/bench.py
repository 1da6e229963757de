"""``aotbuild bench``: eager vs cold compile vs warm load for one recipe, on the user's machine.

Each mode runs in a fresh process (``python -m aotbuild.cli.bench --child ...``), timed from the moment
the parent starts it (interpreter start and imports included) to the pipeline's first output, then
``calls`` more calls for the steady state:

- ``eager``: the pipeline as loaded, nothing compiled;
- ``cold``: the recipe's compile applied to each component (``target.compile``: what torch.compile
  costs a fresh process without any cache), with the compiler caches pointed at empty folders;
- ``warm``: ``load_compiled(recipe, on_miss="error")`` from the aotbuild cache, compiler caches again
  empty, so everything the first call needs comes from the aotbuild cache.

When ``warm`` is measured, jobs the cache lacks for the measured shape are built first, as
``aotbuild build`` would, and the build is reported apart. The parent plans (which imports torch for
the key factors) but never loads a pipeline: only the children do.
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from aotbuild import forwards
from aotbuild.errors import AotbuildError, UsageError
from aotbuild.recipe.schema import Shape

MODES = ("eager", "cold", "warm")
LABELS = {"eager": "eager (no compile)", "cold": "cold compile", "warm": "aotbuild warm load"}


@dataclass(frozen=True)
class Run:
    """One fresh process of one mode."""

    first: float  # seconds from process start to the first pipeline output
    steady: float  # seconds, median of the calls after the first
    rss_mb: float  # peak resident memory of the process
    graphs: int  # Dynamo graphs traced in the process (0: no torch.compile at all)
    cache_hits: int  # Inductor FX graph cache hits / misses
    cache_misses: int


@dataclass
class BenchReport:
    recipe: str
    source: str
    model: str
    target: str
    strategy: str
    scope: str
    components: list[str]
    shape: str
    machine: dict[str, Any]
    repeats: int  # fresh processes for eager and warm
    calls: int
    runs: dict[str, list[Run]] = field(default_factory=dict)
    cold_repeats: int = 1  # fresh processes for cold (each pays a full compile)
    load_average: float | None = None  # the 1-minute load average when measuring began
    built: list[dict[str, Any]] = field(default_factory=list)  # jobs built before measuring

    def median(self, mode: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs[mode])

    def spread(self, mode: str, attr: str) -> dict[str, float]:
        values = [getattr(r, attr) for r in self.runs[mode]]
        return {"min": min(values), "median": statistics.median(values), "max": max(values)}

    def ratios(self) -> list[tuple[str, float, str]]:
        """(label, value, what it means) for every pair of modes measured."""
        out = []
        if "warm" in self.runs and "cold" in self.runs:
            warm, cold = self.median("warm", "first"), self.median("cold", "first")
            out.append(("warm load / cold compile", warm / cold,
                        f"saves {cold - warm:.1f} s per fresh process"))
        if "warm" in self.runs and "eager" in self.runs:
            out.append(("warm load / eager", self.median("warm", "first") / self.median("eager", "first"),
                        "the price of starting compiled"))
            out.append(("warm steady / eager steady",
                        self.median("warm", "steady") / self.median("eager", "steady"), "< 1: compiling pays"))
        if "cold" in self.runs and "eager" in self.runs and "warm" not in self.runs:
            out.append(("cold compile / eager", self.median("cold", "first") / self.median("eager", "first"), ""))
        return out

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["medians"] = {m: {a: self.median(m, a) for a in ("first", "steady", "rss_mb")} for m in self.runs}
        data["spread"] = {m: {a: self.spread(m, a) for a in ("first", "steady")} for m in self.runs}
        data["ratios"] = {label: value for label, value, _ in self.ratios()}
        return data

    def text(self) -> str:
        from aotbuild.utils.text import printable

        m = self.machine
        scope = f", scope {self.scope}" if self.scope != "full" else ""
        # the model's id is the recipe's (a folder's name may hold a newline): on one line, escaped
        lines = [printable(f"{self.recipe} ({self.model}): {', '.join(self.components)} at {self.shape}; "
                           f"{self.target} on {m.get('device', '?')}, {self.strategy}{scope}"),
                 f"machine: {machine_text(m)}",
                 f"{self._processes_text()}; times are min / median / max over the processes; steady = "
                 f"median of {self.calls} call(s) after the first", ""]
        header = ["mode", "runs", "load -> first output", "steady call", "peak RSS", "Dynamo graphs",
                  "Inductor FX cache"]
        rows = []
        for mode, runs in self.runs.items():
            cache = "-" if mode == "eager" else f"{runs[0].cache_hits} hit, {runs[0].cache_misses} miss"
            first = self.spread(mode, "first")
            steady = {k: v * 1000 for k, v in self.spread(mode, "steady").items()}
            rows.append([LABELS[mode], str(len(runs)), _three(first, "{:.2f}", "s"), _three(steady, "{:.1f}", "ms"),
                         f"{self.median(mode, 'rss_mb'):.0f} MB",
                         "-" if mode == "eager" else str(runs[0].graphs), cache])
        if not any(r.cache_hits or r.cache_misses for runs in self.runs.values() for r in runs):
            # no run touched Inductor's FX graph cache (another backend, or aot-package): no column for it
            header, rows = header[:-1], [r[:-1] for r in rows]
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        for row in [header, *rows]:
            cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
            lines.append("  ".join(cells).rstrip())
        if self.ratios():
            lines.append("")
            width = max(len(label) for label, _, _ in self.ratios())
            for label, value, meaning in self.ratios():
                lines.append(f"{label:<{width}} = {value:.3f}" + (f"  ({meaning})" if meaning else ""))
        warm = self.runs.get("warm", [])
        if warm and warm[0].graphs and warm[0].cache_hits and not warm[0].cache_misses:
            lines.append(f"The warm load traced with Dynamo ({warm[0].graphs} graphs) but compiled no kernel (0 miss); "
                         f"strategies aot-compile and aot-package skip the trace too.")
        return "\n".join(lines)


    def _processes_text(self) -> str:
        counts = {mode: len(runs) for mode, runs in self.runs.items()}
        if len(set(counts.values())) <= 1:
            return f"{next(iter(counts.values()), self.repeats)} fresh process(es) per mode"
        return "fresh processes: " + ", ".join(f"{n} {mode}" for mode, n in counts.items())


def _three(values: dict[str, float], fmt: str, unit: str) -> str:
    """``1.20 / 1.31 / 1.45 s`` (min / median / max), or one value for a single run."""
    if values["min"] == values["max"]:
        return f"{fmt.format(values['median'])} {unit}"
    return " / ".join(fmt.format(values[k]) for k in ("min", "median", "max")) + f" {unit}"


def load_warning() -> str:
    """One line when the 1-minute load average is above half the cores (the timings are then
    unreliable: other processes take the CPU), else ""."""
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):  # not on every platform
        return ""
    cores = os.cpu_count() or 1
    if load <= cores / 2:
        return ""
    return (f"warning: the load average is {load:.1f} on {cores} cores: other processes compete for the CPU, "
            "so these timings may be unreliable (and spread widely); measure on an idle machine")


def machine_text(m: dict[str, Any]) -> str:
    parts = [f"{m.get('cpus')} CPUs", m.get("cpu_model") or m.get("arch", "?")]
    if m.get("capability"):
        parts.append(f"ISA {m['capability']}")
    if m.get("device_name"):
        parts.append(m["device_name"])
    parts.append(f"torch {m.get('torch')}, Python {m.get('python')}")
    return ", ".join(str(p) for p in parts)


def pick_shape(recipe: Any, text: str | None) -> Any:
    """The recipe's shape that ``text`` labels (as ``str(shape)`` prints it: aotbuild/recipe/schema.py's
    ``Shape.parse``), or its first shape when ``text`` is None."""
    if text is None:
        return recipe.shapes[0]
    try:
        wanted = Shape.parse(text)
    except ValueError as exc:
        raise UsageError(f"--shape {exc}") from None
    if wanted in recipe.shapes:
        return wanted
    raise UsageError(f"--shape {text}: {recipe.source} does not build it (its shapes: "
                     f"{', '.join(map(str, recipe.shapes))}); add it to the recipe's shapes first")


#: How to install the plot extra; README.md and docs/ say it in these words (tests/test_bench.py).
PLOT_INSTALL = "pip install 'aotbuild[plot]' (from a clone: pip install -e '.[plot]')"


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError(f"--plot needs matplotlib: {PLOT_INSTALL}") from None


def plot(report: BenchReport, path: str | Path) -> Path:
    """Draw the report as a PNG: load -> first output and steady call time per mode."""
    series = [(LABELS[m], [r.first for r in runs], [r.steady for r in runs], COLORS[m])
              for m, runs in report.runs.items()]
    title = (f"{report.recipe}: {', '.join(report.components)} at {report.shape} ({report.strategy}); "
             f"{machine_text(report.machine)}")
    return draw(path, title, series)


COLORS = {"eager": "#8c8c8c", "cold": "#d62728", "warm": "#2ca02c"}


def draw(path: str | Path, title: str, series: list[tuple[str, list[float], list[float], str]]) -> Path:
    """Two bar panels, one bar per (label, first-output seconds, steady-call seconds, colour): the
    median, with the min-max range when there are several runs. Shared with benchmarks/."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 1.2 + 0.55 * len(series)), constrained_layout=True)
    for ax, col, unit, scale, name in ((axes[0], 1, "s", 1.0, "process start -> first output"),
                                       (axes[1], 2, "ms", 1000.0, "steady call")):
        samples = [[v * scale for v in s[col]] for s in series]
        values = [statistics.median(x) for x in samples]
        spread = [[v - min(x) for v, x in zip(values, samples, strict=True)],
                  [max(x) - v for v, x in zip(values, samples, strict=True)]]
        ax.barh([s[0] for s in series], values, color=[s[3] for s in series],
                xerr=spread if any(len(x) > 1 for x in samples) else None, capsize=3)
        for i, (v, x) in enumerate(zip(values, samples, strict=True)):  # right of the bar and its range
            ax.text(max(x), i, f"  {v:.1f} {unit}" if v >= 10 else f"  {v:.2f} {unit}", va="center", fontsize=9)
        ax.set_xlabel(unit)
        ax.set_title(name, fontsize=10)
        ax.invert_yaxis()
        ax.margins(x=0.25)
    axes[1].set_yticklabels([])
    fig.suptitle(title, fontsize=9)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def bench(recipe_path: str | Path | Any, cache: str | Path | None = None, *, shape: str | None = None,
          repeats: int = 3, calls: int = 3, modes: tuple[str, ...] = MODES, cold_repeats: int = 1,
          progress: Callable[[str], None] | None = None, build_progress: Any = None,
          warn: Callable[[str], None] | None = None) -> BenchReport:
    """Measure ``modes`` for one shape of ``recipe_path`` (a path, a dict or a Recipe): eager and
    warm in ``repeats`` fresh processes each, cold (a full compile each) in ``cold_repeats``.

    ``progress`` gets a line per step; ``build_progress`` is passed to :func:`aotbuild.build`;
    ``warn`` gets :func:`load_warning`'s line when the machine is busy."""
    from aotbuild import advice
    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.planner import JobStatus, plan
    from aotbuild.recipe.rules import as_recipe

    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        raise UsageError(f"--modes: {', '.join(unknown) or 'none given'}: allowed: {', '.join(MODES)}")
    say = progress or (lambda text: None)
    recipe = as_recipe(recipe_path, "bench")
    chosen = pick_shape(recipe, shape)
    one = replace(recipe, shapes=(chosen,))
    root = resolve_cache_root(cache)
    jobs = plan([one], cache=root)
    blocked = [j for j in jobs if j.status == JobStatus.UNAVAILABLE]
    if blocked:
        assert blocked[0].cause is not None  # TargetUnavailable, or ModelUnavailable for a model (exit 2)
        raise blocked[0].cause.error(f"cannot bench {recipe.source}: {blocked[0].reason}")
    report = BenchReport(recipe.name, recipe.source, recipe.model.id, recipe.target, recipe.strategy,
                         recipe.compile.scope, list(recipe.compile.components), str(chosen), {}, repeats, calls,
                         cold_repeats=cold_repeats)
    if "warm" in modes:  # build also re-hashes what plan counted as hits (plan checks sizes only)
        from aotbuild.builder.build import ResultStatus, build

        missing = sum(j.status != JobStatus.HIT for j in jobs)
        if missing:
            say(f"building {missing} job(s) the cache lacks for {chosen} first (as `aotbuild build` would) ...")
        built = build([one], cache=root, progress=build_progress)
        report.built = [{"job": r.job.label, "status": r.status, "seconds": round(r.seconds, 1), "reason": r.reason}
                        for r in built.results if r.status != ResultStatus.CACHED]
        if built.failed:
            r = built.failed[0]
            raise AotbuildError(f"cannot bench: building {r.job.label} failed: {r.reason}; run "
                                f"`{advice.build_command(advice.Situation((recipe.source,), root))}` to see the "
                                f"whole log")
    from aotbuild.strategies.order import is_auto

    if is_auto(recipe):  # the header says what auto chose, as plan does ("auto: aot-package+freezing")
        held = sorted({j.chosen for j in plan([one], cache=root) if j.status == JobStatus.HIT and j.chosen})
        if held:
            report.strategy = f"auto: {', '.join(held)}"
    index = list(recipe.shapes).index(chosen)
    counts = {mode: cold_repeats if mode == "cold" else repeats for mode in modes}
    rounds = max(counts.values())
    warning = load_warning()
    if warning and warn:
        warn(warning)
    if hasattr(os, "getloadavg"):
        report.load_average = round(os.getloadavg()[0], 2)
    work = Path(tempfile.mkdtemp(prefix="aotbuild-bench."))
    try:
        for i in range(rounds):  # interleaved: a slow spell of the machine hits every mode alike
            for mode in modes:
                if i >= counts[mode]:
                    continue
                say(f"round {i + 1}/{rounds}: {LABELS[mode]} in a fresh process ...")
                run, machine = _run_child(mode, recipe, index, root, calls, work / f"{mode}-{i}")
                report.runs.setdefault(mode, []).append(run)
                report.machine = report.machine or machine
                say(f"  first output after {run.first:.2f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _run_child(mode: str, recipe: Any, index: int, root: Path, calls: int, workdir: Path) -> tuple[Run, dict]:
    """One measured process (aotbuild/builder/child.py's protocol), timed from before it starts."""
    from aotbuild.builder import child as protocol
    from aotbuild.recipe.schema import recipe_spec
    from aotbuild.targets.registry import get_target

    workdir.mkdir(parents=True)
    env = get_target(recipe.target).capture_env(workdir)  # empty compiler caches
    # The recipe's data: the child never re-reads the recipe file.
    spec = {"mode": mode, "recipe": recipe_spec(recipe), "index": index, "cache": str(root), "calls": calls,
            "start": time.time()}
    code, data = protocol.spawn("aotbuild.cli.bench", spec, workdir / "bench.json", workdir / "bench.log", env=env)
    if "run" in data:  # measured, even if the process then failed on its way out
        return Run(**data["run"]), data["machine"]
    raise AotbuildError(f"bench: the {LABELS[mode]} process failed (exit {code}): {data.get('error', 'no output')}")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """The measured process: load, (compile), first call, ``calls`` steady calls. An aotbuild error
    goes back whole, on one line (a CacheMiss spans lines), for the parent to show."""
    try:
        return _measure(spec["mode"], spec["recipe"], spec["index"], spec["cache"], spec["calls"], spec["start"])
    except AotbuildError as exc:
        return {"error": " ".join(str(exc).split())}


def _measure(mode: str, recipe_data: dict[str, Any], index: int, cache: str, calls: int,
             start: float) -> dict[str, Any]:
    from aotbuild.pipeline import models, pipecall
    from aotbuild.recipe.rules import recipe_from_spec

    recipe = recipe_from_spec(recipe_data)
    shape = recipe.shapes[index]
    recipe = replace(recipe, shapes=(shape,))
    from aotbuild.context import Context

    ctx = Context.create(recipe, Path(cache), resolve_model=mode != "warm")  # warm: load_compiled resolves it
    if ctx.cause is not None:  # TargetUnavailable, ModelUnavailable or ModelUnreachable, as load_compiled raises
        raise ctx.cause.error(ctx.problem)
    if mode == "warm":
        from aotbuild.runtime import load_compiled

        pipe = load_compiled(recipe, cache=cache, on_miss="error")
        pipe.set_progress_bar_config(disable=True)  # as the other modes: timings, not bars
    else:
        assert ctx.model is not None
        pipe = models.load_pipeline(recipe, ctx.model, ctx.dtype, quiet=True)
        models.place_pipeline(pipe, recipe, ctx.device)
        from aotbuild.context import prepare_pipeline

        prepare_pipeline(pipe, recipe)
        pipecall.check_recipe(recipe, pipecall.CallSignature.of(pipe))  # as a build job does
        if mode == "cold":
            for component in recipe.compile.components:
                module = getattr(pipe, component)
                forwards.wrap(module, forwards.COMPILED,
                              lambda _inner, m=module: ctx.target.compile(m, recipe, ctx.device))
    kwargs = pipecall.warmup_kwargs(recipe, shape, pipe, defaults=ctx.target.warmup_defaults)
    pipe(**kwargs)
    first = time.time() - start
    times = []
    for _ in range(calls):
        kwargs = pipecall.warmup_kwargs(recipe, shape, pipe, defaults=ctx.target.warmup_defaults)
        t = time.perf_counter()
        pipe(**kwargs)
        times.append(time.perf_counter() - t)
    import resource

    import torch
    from torch._dynamo.utils import counters

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)
    machine = {"cpus": os.cpu_count(), "arch": platform.machine(), "cpu_model": _cpu_model(),
               "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__,
               "python": platform.python_version(), "device": ctx.device,
               "device_name": torch.cuda.get_device_name(ctx.device) if ctx.device.startswith("cuda") else ""}
    run = Run(first=first, steady=statistics.median(times), rss_mb=rss,
              graphs=int(counters["stats"].get("unique_graphs", 0)),
              cache_hits=int(counters["inductor"].get("fxgraph_cache_hit", 0)),
              cache_misses=int(counters["inductor"].get("fxgraph_cache_miss", 0)))
    return {"run": asdict(run), "machine": machine}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":  # a measured process: python -m aotbuild.cli.bench SPEC.json
    from aotbuild.builder import child as protocol

    sys.exit(protocol.main(sys.argv[1:], child))
