"""``strategy: aot-package``: AOTInductor packages, loaded with no Dynamo at all (mechanics: aoti.py).

Build: the warmup runs eagerly while every call of the component (or, for ``scope: regional``, of
each repeated block) is recorded; each distinct call is exported and packaged without weights, and
opened once by AOTInductor's C++ loader for its constants' names. The entry is the packages
(``aoti/``). Load: each package is opened by AOTInductor's C++ loader alone (no Inductor compile path
imported: aoti.open_package) and bound to the live module's weights, and a dispatcher routes each
built signature to its package. A serving process that traced any Dynamo graph compiled something:
that is the proof's counter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import forwards
from aotbuild.dispatch import install_dispatcher, signature
from aotbuild.pipeline.blocks import select_blocks
from aotbuild.strategies import aoti, calibrate, calls, prepack
from aotbuild.strategies.base import BuildJob, Built, Planned, Resolved, Strategy, lazy_compile

if TYPE_CHECKING:
    from aotbuild.cache.store import Entry
    from aotbuild.recipe.schema import Recipe
    from aotbuild.targets.base import InstallResult, Target


#: torchao types whose quantized weights a package is built and served with (tests/test_quantization.py):
#: torch.export lifts each quantized weight's inner tensors (runner.named_tensors), handed over live.
PACKAGED_QUANT_TYPES = ("int8wo", "int8dq", *calibrate.CALIBRATED)
#: Types whose weights Inductor's freezing dequantizes at compile time (int8wo's ``mm(x, w.to(float32))``
#: folds to a float32 weight, prepacked as float32): no prepacked package is built for them.
DEQUANTIZED_BY_FREEZING = ("int8wo",)
#: The key factor (compile settings) naming the dtype a package computes in where it is not the weights'.
COMPUTE_DTYPE = "compute_dtype"


class AotPackage(Strategy):
    name = "aot-package"
    summary = "AOTInductor packages without weights (inductor): no Dynamo at load"
    targets = ("inductor",)
    calibrates = True

    def validate(self, recipe: Recipe, target: Target) -> None:
        super().validate(recipe, target)
        if not recipe.compile.fullgraph:
            raise recipe.error("compile.fullgraph", "strategy aot-package exports whole modules (the "
                                                    "component, or its blocks): fullgraph must be true")
        if prepack.wanted(recipe.compile.options) and recipe.compile.scope == "regional":
            raise recipe.error("compile.options.freezing", "strategy aot-package serves freezing's prepacked "
                                                           "weights with compile.scope: full only (regional is not "
                                                           "verified yet)")
        if recipe.lora is not None:
            raise recipe.error("lora", "strategy aot-package cannot hot-swap adapters (torch.export makes the LoRA "
                                       "scaling a constant of the package): use strategy jit-cache or aot-compile")
        quant = recipe.model.quantization
        if quant is not None and quant.quant_type not in PACKAGED_QUANT_TYPES:
            raise recipe.error("model.quantization", f"strategy aot-package serves quant_type "
                                                     f"{', '.join(PACKAGED_QUANT_TYPES)} (verified); "
                                                     f"{quant.quant_type}: use strategy jit-cache")
        if quant is not None and quant.quant_type in DEQUANTIZED_BY_FREEZING and prepack.wanted(recipe.compile.options):
            raise recipe.error("compile.options.freezing", f"freezing folds {quant.quant_type}'s int8 weights back "
                                                           f"into float32 constants (4x their bytes, float32 "
                                                           f"kernels): set freezing false")
        if quant is not None and quant.quant_type in calibrate.CALIBRATED:
            if not prepack.wanted(recipe.compile.options):
                # Named where the recipe says it: its freezing option set false, else the quantization that
                # needs the option it leaves out (an error names a key the recipe holds).
                said = next((f"compile.options.{k}" for k in recipe.compile.options
                             if k.replace("-", "_") == "freezing"), "model.quantization")
                raise recipe.error(said, f"{quant.quant_type} reaches oneDNN's int8 kernels only through "
                                         f"Inductor's freezing: set compile.options.freezing true (strategy "
                                         f"aot-package)")
            if quant.quant_kwargs:
                raise recipe.error("model.quantization.quant_kwargs",
                                   f"{quant.quant_type} takes no arguments (torchao's default static "
                                   f"X86InductorQuantizer config)")
            if recipe.device is not None and not recipe.device.startswith("cpu"):
                raise recipe.error("device", f"{quant.quant_type} is torchao's X86InductorQuantizer: x86 CPUs only")
        if recipe.tensor_parallel > 1:
            raise recipe.error("parallel.tensor", "strategy aot-package cannot shard: torch.export fails on a "
                                                  "tensor-parallel module's DTensor spec (torch 2.13): use strategy "
                                                  "jit-cache or aot-compile")

    def build(self, job: BuildJob) -> Built:
        ctx = job.ctx
        options = ctx.target.compile_settings(ctx.recipe, ctx.device)["options"]
        if ctx.recipe.compile.scope == "regional":  # one package per repeated block class x signature
            recorder = aoti.BlockRecorder(job.module, job.component, ctx.recipe.compile.blocks, ctx.recipe)
            job.run_warmup(eager=True)  # eager: records the exact calls the pipeline makes to each block
            job.phase("exporting and packaging")
            return Built(recorder.signatures, recorder.build(job.workdir, options))
        recorded: dict[str, Any] = {}
        dispatcher = install_dispatcher(job.module, job.component, {}, job.module.forward, "record",
                                        on_record=lambda sig, a, k: recorded.setdefault(sig, calls.snapshot(a, k)))
        quant = ctx.recipe.model.quantization
        calibrating: dict[str, list[Any]] | None = \
            {} if quant is not None and quant.quant_type in calibrate.CALIBRATED else None
        hook = job.module.register_forward_pre_hook(
            lambda _, a, k: calibrating.setdefault(signature(a, k), []).append(calls.snapshot(a, k)),
            with_kwargs=True) if calibrating is not None else None
        try:
            job.run_warmup(eager=True)  # eager: records the exact calls the pipeline makes
        finally:
            forwards.unwrap(job.module, forwards.DISPATCH)
            if hook is not None:
                hook.remove()
        if calibrating is not None:  # int8static: calibrated on every call of the warmup, per signature
            if not ctx.device.startswith("cpu"):
                raise RuntimeError(f"{quant.quant_type} serves x86 CPUs only (torchao's X86InductorQuantizer); "
                                   f"this job's device is {ctx.device}")
            job.phase(f"calibrating int8 on {sum(map(len, calibrating.values()))} warmup calls, exporting and "
                      f"packaging")
            reduce_range = self.compile_factors(ctx.target, ctx.device, ctx.recipe)[calibrate.REDUCE_RANGE]
            return Built(sorted(dispatcher.built), aoti.build_calibrated(job.module, calibrating, job.workdir, options,
                                                                         reduce_range))
        job.phase("exporting and packaging")
        compute = self.compile_factors(ctx.target, ctx.device, ctx.recipe).get(COMPUTE_DTYPE)
        if compute is not None:
            import torch

            compute = getattr(torch, compute)
        return Built(sorted(dispatcher.built), aoti.build_packages(job.module, recorded, job.workdir, options,
                                                                   noise=job.noise, compute=compute))

    def compile_factors(self, target: Target, device: str, recipe: Recipe | None = None) -> dict[str, Any]:
        """``compute_dtype: float32`` where a prepacked package's weights are in a format this CPU computes
        slowly (``Target.slow_format``: bfloat16 without native bfloat16): it computes in float32, its
        prepacked constants float32 derived from the served weights (aoti.computing_in), never slower than
        a float32 recipe's package; keyed, so a CPU with native bfloat16 builds and serves its own. Not for
        a quantized recipe (``model.quantization``: its weights' format is the quantization's)."""
        quant = recipe.model.quantization if recipe is not None else None
        if quant is not None and quant.quant_type in calibrate.CALIBRATED:  # 7-bit activations without VNNI
            return {calibrate.REDUCE_RANGE: target.int8_reduce_range(device)}
        if recipe is None or not prepack.wanted(recipe.compile.options) or recipe.model.quantization is not None:
            return {}
        return {COMPUTE_DTYPE: "float32"} if target.slow_format(recipe, device) else {}

    def collect(self, target: Target, workdir: Path) -> list[tuple[str, Path]]:
        # The packages (not the compile's cache: its build folder repeats each package's contents).
        from aotbuild.cache.trees import collect_tree

        return [(f"{aoti.PACKAGE_DIR}/{rel}", p) for rel, p in collect_tree(workdir / aoti.PACKAGE_DIR)]

    def check_records(self, records: tuple[Mapping[str, Any], ...]) -> str:
        for record in records:
            for fqn, meta in _mapping(record.get("constants", {})).items():
                if (not isinstance(meta, list) or len(meta) != 3 or not isinstance(meta[0], list)
                        or not all(isinstance(d, int) and not isinstance(d, bool) for d in meta[0])
                        or not isinstance(meta[1], str) or not isinstance(meta[2], str)):
                    return f"packages[].constants[{fqn[:40]!r}]: not [shape, dtype, device]"
            if not isinstance(record.get("constants", {}), dict):
                return "packages[].constants: not an object"
            baked = record.get("baked", {})
            if not isinstance(baked, dict):
                return "packages[].baked: not an object"
            for fqn, digest in baked.items():
                if not isinstance(digest, str):
                    return f"packages[].baked[{fqn[:40]!r}]: not a digest"
            calibrated = record.get("calibrated", {})
            if not isinstance(calibrated, dict) or not all(isinstance(d, str) for d in calibrated.values()):
                return "packages[].calibrated: not {name: digest}"
            strides = record.get("constant_strides", {})
            if not isinstance(strides, dict) or not all(
                    isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in v)
                    for v in strides.values()):
                return "packages[].constant_strides: not {name: [strides]}"
            if record.get("strides") is not None and not isinstance(record["strides"], list):
                return "packages[].strides: not a list"
            lifted = record.get("lifted", {})
            if not isinstance(lifted, dict) or not all(
                    isinstance(m, list) and len(m) == 2 and isinstance(m[0], list) and isinstance(m[1], str)
                    and prepack.dims_ok(m[0]) for m in lifted.values()):
                return "packages[].lifted: not {name: [shape, dtype]}"
            if lifted and not isinstance(record.get("lifted_path"), str):
                return "packages[].lifted_path: not a file name"
            why = prepack.check_record(record)
            if why:
                return why
        return ""

    def embeds_weights(self, records: tuple[dict[str, Any], ...]) -> bool:
        # Only if AOTInductor compiled a tensor's value into a package (packages[].baked), or the package
        # holds scales calibrated on the weights (packages[].calibrated: int8static)
        return any(r.get("baked") or r.get("calibrated") for r in records)

    def compile_counter(self, target: Target) -> tuple[str, Callable[[], int]]:
        from torch._dynamo.utils import counters

        # Every call must reach a package: any Dynamo graph is a fallback compile.
        return "Dynamo graphs traced", lambda: int(counters["stats"]["unique_graphs"])

    def check(self, ctx: Resolved, module: Any, component: str, entry: Entry) -> str:
        named = dict(module.named_modules())
        files = dict(entry.files)
        for package in entry.manifest.packages:
            if package.get("lifted") and package.get("lifted_path") not in files:
                return f"{component}'s AOT package names a constants file the entry does not have"
            for instance in package.get("instances", [""]):
                if instance and instance not in named:
                    return (f"{component} has no block {instance!r}, which the entry's AOT package serves: it was "
                            f"built for another model")
        return aoti.check_baked(module, component, entry.manifest.packages)

    def install(self, ctx: Resolved, planned: list[Planned], policy: str) -> InstallResult | None:
        # An older entry's probe files go to Inductor's cache (aoti.PROBE_DIR); packages load from the store.
        probe = aoti.PROBE_DIR + "/"
        files = [(rel[len(probe):], p) for pl in planned for e in pl.entries for rel, p in e.files
                 if rel.startswith(probe)]
        result = ctx.target.install(files, ctx.device) if files else None
        for p in planned:
            packages = [(package, dict(e.files)) for e in p.entries for package in e.manifest.packages]
            built_by = next((e.manifest.factors.get("env", {}).get("torch") for e in p.entries), None)
            try:
                routes = aoti.load_packages(p.module, p.component, packages, ctx.device,
                                            bind_at_first_call=ctx.recipe.offload == "model", built_by=built_by)
            except prepack.RecipeError as exc:  # a store's recipe that does not make what the build recorded
                routes = _unservable(p, exc, policy)
            if ctx.recipe.compile.scope == "regional":  # the component runs eagerly, its blocks dispatch
                for name, block in select_blocks(p.module, ctx.recipe.compile.blocks, ctx.recipe):
                    fallback = lazy_compile(ctx, block, scope="full") if policy == "compile" else None
                    install_dispatcher(block, f"{p.component}.{name}", routes.get(name, {}), fallback, policy)
            else:
                fallback = lazy_compile(ctx, p.module) if policy == "compile" else None
                install_dispatcher(p.module, p.component, routes.get("", {}), fallback, policy)
        return result


def _unservable(p: Planned, exc: Exception, policy: str) -> dict[str, Any]:
    """A component whose entry passed every check but cannot be served (its prepacked constants cannot be
    derived as recorded): a CacheMiss under ``on_miss="error"`` (or strict shapes), else a warning and
    no routes (every call falls back as at a miss)."""
    import warnings

    from aotbuild.errors import CacheMiss
    from aotbuild.utils.text import printable

    reason = (f"{p.component} ({', '.join(e.key[:12] for e in p.entries)}): its entry cannot be served: "
              f"{printable(str(exc))}")
    if policy == "error":
        raise CacheMiss(reason) from None
    then = "compiles on first call" if policy == "compile" else "runs eagerly"
    warnings.warn(f"aotbuild: {reason}; it {then}", stacklevel=2)
    return {}


def _mapping(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}
