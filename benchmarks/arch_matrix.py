"""Every built-in architecture x strategy x scope: built, proven, then served by a new replica.

    python benchmarks/arch_matrix.py [--arch tiny-flux,tiny-sd] [--strategy jit-cache]
                                     [--scope full] [--json FILE] [--keep DIR]

For each cell (every built-in: tiny-sd, tiny-sdxl, tiny-sd3, tiny-flux, tiny-pixart-sigma, tiny-wan,
tiny-wan22 x every registered strategy (jit-cache, aot-package, aot-compile, auto) x full, regional):

1. a recipe derived from the built-in's recipe in recipes/ (its first shape; SD3's and PixArt's
   transformers declare no ``_repeated_blocks``, so their regional cells name ``compile.blocks``),
   with classifier-free guidance on (the SD recipes turn it off; the matrix turns it on: their
   denoisers then run at twice the batch; Flux takes guidance as an input, PixArt batches it, Wan
   runs two calls; tiny-wan22 builds both of its denoisers, one job each);
2. ``aotbuild build --json`` into a fresh cache with an empty Inductor cache; the entry's manifest
   (``aotbuild show --json KEY``) gives the build's phases and what its proof measured;
3. the cache is moved to another folder and served, as a new replica would, by a fresh process in
   another working directory with empty compiler caches: ``load_compiled(recipe, on_miss="error",
   strict_shapes=True)``, the pipeline run once (``output_type="pt"``), and an eager pipeline run in
   the same process on the same inputs (a fixed generator). It counts what the load compiled
   (Dynamo graphs, FX graph cache hits and misses, and the strategy's own compile counter, the one the
   proof uses: for ``auto``, the counter of the strategy the load report's hits name) and compares
   the denoiser's outputs (captured by forward hooks on both components:
   a hook runs in ``Module.__call__``, outside the compiled or dispatched ``forward``, so it adds no
   graph) and the final images.

An ``auto`` cell (the default: no strategy named) also shows what auto chose, and why the faster
strategies were not taken: the ones excluded before any build (each with its reason) and the
attempts its entry's manifest records (a failed attempt's first line names the model's file:line).

A cell is ok when it built, the replica compiled nothing and both differences are within the
proof's tolerance for the dtype. A cell that cannot work prints the build's reason (and the log's
tail with --json). Exits 1 if any cell failed. Never used by tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness

from aotbuild.strategies.registry import strategy_names

STRATEGIES = strategy_names()
SCOPES = ("full", "regional")
RESULT = "ARCH-MATRIX-RESULT "


@dataclass
class Cell:
    arch: str
    strategy: str
    scope: str
    build: harness.Build | None = None
    serve: dict[str, Any] = field(default_factory=dict)  # what the replica measured (serve() below)
    #: an auto cell's choice: "chosen", "attempts" (the manifest's), "excluded" ([strategy, why])
    auto: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.arch} {self.strategy} {self.scope}"

    @property
    def reason(self) -> str:
        """Why the cell failed; "" when it is ok."""
        b = self.build
        if b is None:
            return "not run"
        if not b.ok:
            return f"build {b.status}: {b.reason}"
        s = self.serve
        if "error" in s:
            return f"fresh replica failed: {s['error']}"
        if s["compiles"]:
            return f"fresh replica compiled {s['compiles']} time(s) ({s['counter']})"
        worst = max(s["denoiser_diff"], s["image_diff"])
        if not worst <= s["tolerance"]:
            return f"fresh replica differs from eager by {worst:.3g} (tolerance {s['tolerance']:.0e})"
        return ""

    @property
    def strategy_text(self) -> str:
        """The strategy, and for auto the one it chose: ``auto: aot-compile``."""
        return f"auto: {self.auto['chosen']}" if self.auto.get("chosen") else self.strategy

    def why_text(self) -> str:
        """An auto cell's choice in one line: chosen, every attempt, every strategy excluded and why."""
        from aotbuild.strategies.order import attempts_text

        out = [f"{self.name}: chose {self.auto.get('chosen') or 'nothing'}"]
        if self.auto.get("attempts"):
            out.append(f"attempts: {attempts_text(self.auto['attempts'])}")
        out += [f"{name} excluded: {why}" for name, why in self.auto.get("excluded", ())]
        return "; ".join(out)

    def row(self) -> list[str]:
        b, s, f = self.build, self.serve, harness.fmt
        proof = (b.proof or {}) if b else {}
        return [self.arch, self.strategy_text, self.scope, "ok" if not self.reason else "FAILED",
                b.status if b else "-",
                f(b.seconds if b and b.ok else None, ".1f"), f(b.proof_s if b else None, ".1f"),
                f(b.proof_share * 100 if b and b.proof_share is not None else None, ".0f"),
                f(proof.get("compiles"), "d"), f(proof.get("max_abs_diff"), ".1e"),
                f(s.get("compiles"), "d"), f(s.get("graphs"), "d"),
                f"{s['fx_hits']}/{s['fx_misses']}" if "fx_hits" in s else "-",
                f(s.get("denoiser_diff"), ".1e"), f(s.get("image_diff"), ".1e")]

    def as_json(self) -> dict[str, Any]:
        return {"arch": self.arch, "strategy": self.strategy, "scope": self.scope, "ok": not self.reason,
                "reason": self.reason, "build": self.build.as_json() if self.build else None, "serve": self.serve,
                **({"auto": self.auto} if self.auto else {})}


HEADER = ["arch", "strategy", "scope", "cell", "build", "build s", "proof s", "proof %", "proof compiles", "proof diff",
          "fresh compiles", "fresh graphs", "fresh FX hit/miss", "fresh denoiser diff", "fresh image diff"]


def run_cell(cell: Cell, work: Path, say: Any) -> None:
    folder = work / f"{cell.arch}-{cell.strategy}-{cell.scope}"
    blocks = harness.REGIONAL_BLOCKS.get(cell.arch) if cell.scope == "regional" else None
    recipe = harness.derive_recipe(harness.ARCHS[cell.arch],
                                   folder / f"{cell.arch.replace('-', '_')}_{cell.strategy.replace('-', '_')}_"
                                            f"{cell.scope}.yaml",
                                   strategy=cell.strategy, scope=cell.scope, blocks=blocks,
                                   warmup=harness.GUIDED.get(cell.arch))
    say(f"{cell.name}: building into a fresh cache ...")
    cell.build = harness.build(recipe, folder / "build" / "cache", folder / "build")
    if cell.strategy == "auto":
        cell.auto = auto_choice(recipe, folder / "build" / "cache", cell.build.key if cell.build.ok else None)
        say(f"  {cell.why_text()}")
    if not cell.build.ok:
        say(f"  build {cell.build.status} after {cell.build.wall_s:.0f} s: {cell.build.reason}")
        return
    say(f"  built in {cell.build.seconds:.1f} s (proof {harness.fmt(cell.build.proof_s, '.1f')} s); "
        "serving from a moved cache in a fresh process ...")
    replica = folder / "replica"
    (replica / "cwd").mkdir(parents=True)
    shutil.move(str(folder / "build" / "cache"), str(replica / "cache"))  # a new replica's copy
    cell.serve = harness.run_child(__file__, [str(recipe), str(replica / "cache")],
                                   harness.child_env(replica / "caches"), cwd=replica / "cwd", marker=RESULT)
    say(f"  {'ok' if not cell.reason else cell.reason}")


def auto_choice(recipe_path: Path, cache: Path, key: str | None) -> dict[str, Any]:
    """What auto excluded before building (aotbuild/strategies/order.py ``choice``: each strategy that cannot
    serve the recipe here, with why) and, once built, the strategy its entry holds and the attempts
    its manifest records (a failed build's reason lists them too)."""
    from aotbuild.cache.store import Store
    from aotbuild.recipe.rules import load_recipe
    from aotbuild.strategies import order as auto
    from aotbuild.targets.registry import get_target

    recipe = load_recipe(str(recipe_path))
    target = get_target(recipe.target)
    choice = auto.choice(recipe, target, recipe.device or target.default_device())
    out: dict[str, Any] = {"tries": list(choice.tries), "excluded": [list(x) for x in choice.excluded]}
    manifest = Store(cache).read_manifest(key) if key else None
    if manifest is not None and manifest.auto is not None:
        out.update(chosen=manifest.strategy, attempts=list(manifest.auto.get("attempts") or []))
    return out


def serve(recipe_path: str, cache: str) -> dict[str, Any]:
    """The replica: an eager pipeline and the served one, the same inputs, what the load compiled."""
    from torch._dynamo.utils import counters

    from aotbuild import load_compiled
    from aotbuild.builder.proof import tensors, tolerance
    from aotbuild.context import Context
    from aotbuild.pipeline import models, pipecall
    from aotbuild.recipe.rules import load_recipe

    recipe = load_recipe(recipe_path)
    shape = recipe.shapes[0]
    ctx = Context.create(recipe, Path(cache))
    if ctx.problem:
        raise RuntimeError(ctx.problem)
    assert ctx.model is not None
    eager = models.load_pipeline(recipe, ctx.model, ctx.dtype)
    models.place_pipeline(eager, recipe, ctx.device)
    counting = _counters(ctx)

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    def fx(kind: str) -> int:
        return int(counters["inductor"][f"fxgraph_cache_{kind}"])

    def run(pipe: Any) -> tuple[Any, list[list[Any]]]:
        """The final image and every output of the denoiser(s), in call order."""
        seen: list[list[Any]] = []
        hooks = [getattr(pipe, c).register_forward_hook(
            lambda module, args, out: seen.append([t.detach().float().clone() for t in tensors(out)]))
            for c in recipe.compile.components]
        try:
            kwargs = pipecall.warmup_kwargs(recipe, shape, pipe, defaults=ctx.target.warmup_defaults)
            out = pipe(**kwargs, output_type="pt")
            image = out.images if hasattr(out, "images") else out.frames  # a video pipeline's frames
        finally:
            for hook in hooks:
                hook.remove()
        return image, seen

    def max_diff(a: list[Any], b: list[Any]) -> float:
        if len(a) != len(b):
            raise RuntimeError(f"{len(a)} tensors served, {len(b)} eager")
        return max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b, strict=True) if x.numel()),
                   default=0.0)

    eager_image, eager_calls = run(eager)
    counted = {name: fn() for name, (_, fn) in counting.items()}
    before = graphs(), fx("hit"), fx("miss")
    t0 = time.perf_counter()
    served = load_compiled(recipe, cache=cache, on_miss="error", strict_shapes=True)
    load_s = time.perf_counter() - t0
    image, calls = run(served)
    first_s = time.perf_counter() - t0
    after = graphs(), fx("hit"), fx("miss")
    if len(calls) != len(eager_calls):
        raise RuntimeError(f"the denoiser ran {len(calls)} times served, {len(eager_calls)} eager")
    report = served.aotbuild_report
    # What serves: the recipe's strategy; for auto, the one each hit names (its entry's manifest).
    serving = sorted({e.strategy for e in report.entries if e.strategy} or set(counting))
    compiles = sum(counting[name][1]() - counted[name] for name in serving)
    counter = ", ".join(counting[name][0] for name in serving)
    return {"compiles": compiles, "counter": counter, "served_by": serving, "graphs": after[0] - before[0],
            "fx_hits": after[1] - before[1], "fx_misses": after[2] - before[2],
            "denoiser_diff": max((max_diff(a, b) for a, b in zip(calls, eager_calls, strict=True)), default=0.0),
            "image_diff": max_diff([image], [eager_image]), "tolerance": tolerance(ctx.dtype),
            "denoiser_calls": len(calls), "hits": len(report.entries) - len(report.misses),
            "load_s": round(load_s, 3), "load_to_first_image_s": round(first_s, 3)}


def _counters(ctx: Any) -> dict[str, tuple[str, Any]]:
    """Each strategy that may serve ``ctx``'s recipe -> (its compile counter's name, the counter).
    Auto has no counter of its own (it raises): what counts is the chosen strategy's, known only
    once the load reports its hits, so every strategy auto could choose is read before the load."""
    from aotbuild.strategies import order as auto
    from aotbuild.strategies.registry import get_strategy

    if not auto.is_auto(ctx.recipe):
        return {ctx.strategy.name: ctx.strategy.compile_counter(ctx.target)}
    names = auto.choice(ctx.recipe, ctx.target, ctx.device).tries
    return {name: get_strategy(name).compile_counter(ctx.target) for name in names}


def machine() -> str:
    import os
    import platform
    from importlib.metadata import version

    from aotbuild.cli.bench import _cpu_model

    return (f"{os.cpu_count()} CPUs ({_cpu_model()}, {platform.machine()}), torch {version('torch')}, "
            f"diffusers {version('diffusers')}, Python {platform.python_version()}")


def choose(text: str | None, allowed: tuple[str, ...], option: str) -> list[str]:
    chosen = [x.strip() for x in text.split(",") if x.strip()] if text else list(allowed)
    unknown = [x for x in chosen if x not in allowed]
    if unknown or not chosen:
        sys.exit(f"{option}: {', '.join(unknown) or 'none given'}: allowed: {', '.join(allowed)}")
    return chosen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", help=f"comma list of {', '.join(harness.ARCHS)} (default: all)")
    ap.add_argument("--strategy", help=f"comma list of {', '.join(STRATEGIES)} (default: all)")
    ap.add_argument("--scope", help=f"comma list of {', '.join(SCOPES)} (default: both)")
    ap.add_argument("--json", metavar="FILE", help="also write every cell's figures (and failed logs' tails)")
    ap.add_argument("--keep", metavar="DIR", help="keep the recipes, caches and logs in DIR (default: a temp "
                                                  "folder, removed)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        try:
            result = serve(*args.child)
        except Exception as exc:  # the parent reports it as the cell's reason
            import traceback

            traceback.print_exc()
            result = {"error": " ".join(f"{type(exc).__name__}: {exc}".split())[:600]}
        print(RESULT + json.dumps(result), flush=True)
        return 0
    cells = [Cell(*c) for c in itertools.product(choose(args.arch, tuple(harness.ARCHS), "--arch"),
                                                 choose(args.strategy, STRATEGIES, "--strategy"),
                                                 choose(args.scope, SCOPES, "--scope"))]
    if args.keep:
        work = Path(args.keep).absolute()
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="arch-matrix."))
    started = time.perf_counter()
    try:
        for i, cell in enumerate(cells):
            run_cell(cell, work, lambda text, n=i: print(f"[{n + 1}/{len(cells)}] {text}", flush=True))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    failed = [c for c in cells if c.reason]
    print(f"\n{machine()}; {len(cells)} cell(s) in {(time.perf_counter() - started) / 60:.1f} min")
    print(harness.table(HEADER, [c.row() for c in cells], text_columns=5))
    for cell in (c for c in cells if c.auto):
        print(cell.why_text())
    for cell in failed:
        print(f"{cell.name}: {cell.reason}")
    print(f"{len(cells)} cells: {len(cells) - len(failed)} ok, {len(failed)} failed")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine(), "cells": [c.as_json() for c in cells]},
                                              indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
