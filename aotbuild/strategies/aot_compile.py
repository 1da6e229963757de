"""``strategy: aot-compile``: ``torch.compile(...).aot_compile()`` functions, loaded with no Dynamo tracing.

PyTorch 2.13 can compile a function ahead of time for given arguments
(``torch.compile(fn, fullgraph=True).aot_compile(((args), kwargs))``), save it
(``save_compiled_function(path)``) and load it in a fresh process
(``torch.compiler.load_compiled_function(file)``) as a callable that neither traces nor compiles.

Build (in the job's process, whose Inductor cache folder is the job's): the warmup runs eagerly
while the calls of the component (``scope: full``) or of each repeated block (``scope: regional``)
are recorded. Calls are grouped by what one artifact can serve: the module's class and structure
(calls.structure: tensor shapes, submodule classes, plain attributes), the call signature, the
values of float arguments and grad mode. Each group's first call is compiled through a module-level
trampoline ``call(module, *args, **kwargs)`` (its hooks set aside) with the module as an
argument (diffusers' decorated ``forward`` cannot be pickled by reference; as an argument, the
module's parameters are graph inputs), so one artifact serves every instance of a block with
that instance's own weights. The entry is the artifacts (``aot-compile/``) and the job's Inductor
folder (``inductor/``): an artifact carries its kernels' sources, not the compiled ``.so`` files,
and without them a load rebuilds every kernel (measured: 130 s for the tiny UNet).

Guards (a trust decision, docs/aot-compile.md): torch's default guard filter cannot serialize the
``ID_MATCH`` guards on the module, so artifacts are saved with ``keep_portable_guards_unsafe``
without its ``GLOBAL_STATE`` guard (:func:`portable_guards`; each record's ``dropped_guards`` lists the
kinds of guard the filter dropped, :class:`GuardFilter`): what torch re-checks at call time is
every tensor's shape, dtype, device, strides and requires_grad (the module's parameters included).
The global-state guard held torch's intra-op thread count, so an entry CI built on 2 cores missed on
a 16-core server (issue 36); the code does not depend on that count where the kernels ask OpenMP at
each call (CPU with ``cpp.dynamic_threads``, aotbuild's default) or run on CUDA. The rest of what it
held and that changes results is checked per call by aotbuild: grad mode (``AotRunner`` picks the
variant compiled for it), default dtype, autocast, deterministic algorithms, TF32 and matmul precision
(the dispatcher's ``dependencies.Watch``, against the state the warmup's calls ran under). Where kernels bake the count
in (``cpp.dynamic_threads: false``) the guard is kept and the target keys the count
(``compile.cpu_threads``). What is not re-checked by torch is checked by aotbuild:
the call's signature and float values (the dispatcher and ``AotRunner``), the module's class and
structure (``check`` at load), and the library versions that produced the code (key factors). Input
strides are made canonical before every call and at build (``canonical``), since the guards compare
strides exactly and upstream compiled code may lay out its outputs differently than eager.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import forwards
from aotbuild.dispatch import RouteDeclined, install_dispatcher, signature
from aotbuild.pipeline.blocks import select_blocks
from aotbuild.strategies.base import BuildJob, Built, Planned, Resolved, Strategy, lazy_compile
from aotbuild.strategies.calls import Watch, floats_of, snapshot, structure_digest, where_called

if TYPE_CHECKING:
    from aotbuild.cache.store import Entry
    from aotbuild.recipe.schema import Recipe
    from aotbuild.targets.base import InstallResult, Target

ARTIFACT_DIR = "aot-compile"
CACHE_DIR = "inductor"
#: The torch release this strategy was verified with (tests/test_strategies.py, benchmarks/).
VERIFIED_TORCH = (2, 13)


def portable_guards(guard_entries: list[Any]) -> list[bool]:
    """The guard filter of an artifact that serves any thread count: ``keep_portable_guards_unsafe``
    (tensor metadata, the shape environment, the global state) without ``GLOBAL_STATE``, which holds
    ``torch.get_num_threads()`` among grad mode, default dtype, autocast and the deterministic and TF32
    flags (torch 2.13: none of ``torch.compiler``'s filters drops only it)."""
    return GuardFilter(keep_global_state=False)(guard_entries)


class GuardFilter:
    """The guard filter an artifact is saved with (:func:`portable_guards`, or with ``keep_global_state``
    torch's ``keep_portable_guards_unsafe`` as it is), noting the kinds of guard it drops: the record's
    ``dropped_guards`` (issue 31: what torch no longer re-checks when the artifact is called is in the
    entry's manifest, beside what aotbuild checks instead; ``aotbuild show --json`` lists it)."""

    def __init__(self, keep_global_state: bool):
        self.keep_global_state = keep_global_state
        self.dropped: set[str] = set()

    def __call__(self, guard_entries: list[Any]) -> list[bool]:
        import torch

        kept = torch.compiler.keep_portable_guards_unsafe(guard_entries)
        out = []
        for entry, keep in zip(guard_entries, kept, strict=True):
            keep = bool(keep) and (self.keep_global_state or entry.guard_type != "GLOBAL_STATE")
            if not keep:
                self.dropped.add(str(entry.guard_type))
            out.append(keep)
        return out


#: How Dynamo names a global it installs for a Python module its code loads (torch/_dynamo/codegen.py
#: ``create_load_python_module``: ``___module_<last name part>_<id>``), e.g. ``collections`` to rebuild a
#: transformers ``ModelOutput`` (an OrderedDict) that a CLIP text encoder returns.
MODULE_GLOBAL = "___module_"


def module_globals() -> dict[str, str]:
    """The module globals Dynamo installed in this module (the trampoline's global scope) while it
    compiled: global name -> module name. A saved function's code loads them by name, but torch
    2.13 does not save them (its load said ``Missing required external references:
    ['___module_collections_...']``), so each record carries them and :func:`modules_for` gives
    them back at load."""
    import sys
    import types

    return {name: value.__name__ for name, value in sorted(vars(sys.modules[__name__]).items())
            if name.startswith(MODULE_GLOBAL) and isinstance(value, types.ModuleType)}


def modules_for(record: Mapping[str, Any]) -> dict[str, object] | None:
    """The globals a record's function needs (``modules``, :func:`module_globals`), each a module
    this process has already imported: a manifest never makes the load import anything (one it
    names that is not imported leaves torch's own error, and the entry misses)."""
    import sys

    found = {name: sys.modules[module] for name, module in (record.get("modules") or {}).items()
             if module in sys.modules}
    return found or None


def call(module: Any, *args: Any, **kwargs: Any) -> Any:
    """The compiled function: the module is an argument, so its parameters are graph inputs and the
    artifact names this function, not the module's decorated ``forward``. (``type(module).forward``
    would skip the module's hooks, but Dynamo cannot trace it on a class diffusers marks
    ``allow_in_graph``, e.g. BasicTransformerBlock: the hooks are set aside while compiling instead.)"""
    return module(*args, **kwargs)


@contextlib.contextmanager
def _without_hooks(module: Any) -> Iterator[None]:
    """The module's own forward hooks set aside while it is compiled: hooks present at build time (the
    worker's batch check) must not be compiled in; Dynamo reads them by position from the module's hook
    dicts, which a serving module does not have (its load failed with StopIteration). A serving
    module's hooks run outside the artifact, around the dispatcher."""
    names = [n for n in vars(module) if n.startswith(("_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
                                                        "_backward_pre_hooks"))
             and isinstance(vars(module)[n], dict)]
    saved = {n: vars(module)[n] for n in names}
    for n in names:
        setattr(module, n, type(saved[n])())
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(module, n, value)


def canonical(value: Any) -> Any:
    """Inputs with the strides the artifact's guards expect: a contiguous tensor keeps its memory and
    gets the canonical strides of its shape (size-1 dimensions included, which ``.contiguous()`` leaves
    as they are), a non-contiguous one is copied into them."""
    import torch
    from torch.utils._pytree import tree_map

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        if not t.is_contiguous():
            return t.contiguous()
        strides, step = [], 1
        for n in reversed(t.shape):
            strides.append(step)
            step *= max(n, 1)
        strides.reverse()
        if tuple(strides) == t.stride():
            return t
        return t.as_strided(t.shape, strides, t.storage_offset())

    return tree_map(one, value)


def _torch_version() -> tuple[int, int]:
    import torch

    major, minor = torch.__version__.split(".")[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


class AotCompile(Strategy):
    name = "aot-compile"
    summary = "torch.compile(...).aot_compile() functions (inductor, torch >= 2.13): no Dynamo tracing at load"
    targets = ("inductor",)

    def availability(self) -> str:
        import torch

        needs = f"needs torch >= {VERIFIED_TORCH[0]}.{VERIFIED_TORCH[1]} (verified)"
        if _torch_version() < VERIFIED_TORCH:
            return f"{needs}; this is torch {torch.__version__}"
        import torch._dynamo.config as dynamo_config

        missing = [name for name, ok in (
            ("torch.compiler.load_compiled_function", hasattr(torch.compiler, "load_compiled_function")),
            ("torch.compiler.keep_portable_guards_unsafe", hasattr(torch.compiler, "keep_portable_guards_unsafe")),
            ("torch._dynamo.config.enable_aot_compile", hasattr(dynamo_config, "enable_aot_compile"))) if not ok]
        return f"{needs}; torch {torch.__version__} lacks {', '.join(missing)}" if missing else ""

    def validate(self, recipe: Recipe, target: Target) -> None:
        super().validate(recipe, target)
        if not recipe.compile.fullgraph:
            raise recipe.error("compile.fullgraph", "strategy aot-compile compiles whole modules (the component, "
                                                    "or its blocks): fullgraph must be true")
        if recipe.compile.mode != "default":
            raise recipe.error("compile.mode", "strategy aot-compile is verified with mode: default only "
                                               f"(got {recipe.compile.mode!r})")
        self._refuse_freezing(recipe)
        if recipe.model.quantization is not None:
            # torch 2.13: saving the guards of a torchao tensor subclass fails (aten.empty_like is not
            # implemented for Int8Tensor), and torchao's per-module extra_repr cannot be pickled.
            raise recipe.error("model.quantization", "strategy aot-compile cannot save torchao's tensor subclasses "
                                                     "(torch 2.13): use strategy jit-cache")

    # -- build ---------------------------------------------------------------------------------

    def build(self, job: BuildJob) -> Built:
        from aotbuild.targets.inductor import bakes_thread_count

        ctx = job.ctx
        owners = self._owners(job.module, ctx.recipe)
        recorder = CallRecorder(owners)
        try:
            job.run_warmup(eager=True)  # eager: records the exact calls the pipeline makes
        finally:
            recorder.remove()
        job.phase("compiling ahead of time")
        kwargs = ctx.target.compile_kwargs(ctx.recipe, ctx.device)
        # Kernels that hold the thread count keep the guard on it (the target keys the count too).
        pinned = bakes_thread_count(kwargs.get("options") or {}, ctx.device)
        records = [self._compile(group, dict(owners)[group["instances"][0]], kwargs, job.workdir, pinned)
                   for group in recorder.groups.values()]
        return Built(sorted({r["signature"] for r in records}), records)

    @staticmethod
    def _owners(module: Any, recipe: Recipe) -> list[tuple[str, Any]]:
        """(name, module) of what gets an artifact: the component ("") or each repeated block."""
        if recipe.compile.scope == "regional":
            return select_blocks(module, recipe.compile.blocks, recipe)
        return [("", module)]

    @staticmethod
    def _compile(group: dict[str, Any], owner: Any, compile_kwargs: dict[str, Any], workdir: Path,
                 threads_pinned: bool) -> dict[str, Any]:
        import torch
        import torch._dynamo.config as dynamo_config

        args, kwargs = canonical(group["call"])
        guards = GuardFilter(keep_global_state=threads_pinned)
        options = {**(compile_kwargs.get("options") or {}), "guard_filter_fn": guards}
        compiled = torch.compile(call, backend=compile_kwargs["backend"], fullgraph=True,
                                 dynamic=compile_kwargs["dynamic"], options=options)
        name = hashlib.sha256(json.dumps([group["structure"], group["signature"], group["floats"], group["grad"]])
                              .encode()).hexdigest()[:20]
        path = workdir / ARTIFACT_DIR / f"{name}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        # The flag gates the API; its default is not assumed. Grad mode is guarded: compiled as recorded.
        # The module's own forward is compiled, not a wrapper put on it (forwards.class_forward).
        with dynamo_config.patch(enable_aot_compile=True), torch.set_grad_enabled(group["grad"]), \
                forwards.class_forward(owner), _without_hooks(owner), where_called(owner, (args, kwargs)):
            function = compiled.aot_compile(((owner, *args), kwargs))
        function.save_compiled_function(str(path))
        modules = module_globals()
        return {"signature": group["signature"], "path": f"{ARTIFACT_DIR}/{path.name}",
                "instances": group["instances"], "block_class": type(owner).__name__,
                "structure": group["structure"], "floats": group["floats"], "grad": group["grad"],
                "dropped_guards": sorted(guards.dropped), **({"modules": modules} if modules else {})}

    def collect(self, target: Target, workdir: Path) -> list[tuple[str, Path]]:
        from aotbuild.cache.trees import collect_tree

        return ([(f"{ARTIFACT_DIR}/{rel}", p) for rel, p in collect_tree(workdir / ARTIFACT_DIR)]
                + [(f"{CACHE_DIR}/{rel}", p) for rel, p in target.collect(workdir)])

    def check_records(self, records: tuple[Mapping[str, Any], ...]) -> str:
        for record in records:
            if not isinstance(record.get("structure", ""), str):
                return "packages[].structure: not a digest"
            floats = record.get("floats", [])
            if not isinstance(floats, list):
                return "packages[].floats: not a list"
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in floats):
                return "packages[].floats: not a list of numbers"
            if not isinstance(record.get("grad", False), bool):
                return "packages[].grad: not true or false"
            modules = record.get("modules", {})
            if not isinstance(modules, dict) or not all(
                    isinstance(k, str) and k.startswith(MODULE_GLOBAL) and k.isidentifier() and isinstance(v, str)
                    and all(part.isidentifier() for part in v.split(".")) for k, v in modules.items()):
                return "packages[].modules: not a map of Dynamo's module globals to module names"
            dropped = record.get("dropped_guards", [])  # absent: built before it was recorded
            if not isinstance(dropped, list) or not all(isinstance(k, str) and k.isidentifier() for k in dropped):
                return "packages[].dropped_guards: not a list of guard kinds"
        return ""

    def compile_counter(self, target: Target) -> tuple[str, Callable[[], int]]:
        from torch._dynamo.utils import counters

        # A loaded function neither traces nor compiles; one whose kernels are not in the Inductor
        # folder rebuilds them while it loads, which the target counts (kernels built here).
        # Dynamo graphs, not frames: with fullgraph=True torch 2.13 counts no frame (counters["frames"]).
        name, compiled = target.compile_counter()
        return f"Dynamo graphs traced + {name}", lambda: int(counters["stats"]["unique_graphs"]) + compiled()

    # -- load ------------------------------------------------------------------------------------

    def check(self, ctx: Resolved, module: Any, component: str, entry: Entry) -> str:
        """Torch's guards do not cover the module's structure: every instance an artifact serves must
        have the structure it was compiled for."""
        named = dict(module.named_modules())
        digests: dict[str, str] = {}
        for record in entry.manifest.packages:
            for instance in record.get("instances", [""]):
                owner = named.get(instance) if instance else module
                if owner is None:
                    return (f"{component} has no block {instance!r}, which the entry serves: it was built for "
                            f"another model")
                if instance not in digests:
                    digests[instance] = structure_digest(owner)
                if digests[instance] != record.get("structure"):
                    where = f"{component}.{instance}" if instance else component
                    return (f"{where} differs from the module the entry was compiled for (its submodules, tensor "
                            f"shapes or attributes): it was built for another model")
        return ""

    def install(self, ctx: Resolved, planned: list[Planned], policy: str) -> InstallResult | None:
        import torch

        prefix = CACHE_DIR + "/"
        files = [(rel[len(prefix):], p) for pl in planned for e in pl.entries for rel, p in e.files
                 if rel.startswith(prefix)]
        result = ctx.target.install(files, ctx.device) if files else None  # the kernels, before any load
        for p in planned:
            loaded: dict[str, Any] = {}
            routes: dict[str, dict[str, list[tuple[dict[str, Any], Any]]]] = {}
            for entry in p.entries:
                blobs = dict(entry.files)
                for record in entry.manifest.packages:
                    if record["path"] not in loaded:
                        with open(blobs[record["path"]], "rb") as f, ctx.target.loading():
                            loaded[record["path"]] = torch.compiler.load_compiled_function(
                                f, f_globals=modules_for(record))
                    for instance in record.get("instances", [""]):
                        routes.setdefault(instance, {}).setdefault(record["signature"], []).append(
                            (record, loaded[record["path"]]))
            for name, owner in self._owners(p.module, ctx.recipe):
                label = f"{p.component}.{name}" if name else p.component
                fallback = lazy_compile(ctx, owner, scope="full" if name else None) if policy == "compile" else None
                runners = {sig: AotRunner(owner, label, variants) for sig, variants in routes.get(name, {}).items()}
                install_dispatcher(owner, label, runners, fallback, policy)
        return result


class AotRunner:
    """Serves one signature of one module with its loaded functions: the call's float values and grad
    mode pick the variant, the variant's own guards must pass, and the function gets the module."""

    def __init__(self, module: Any, label: str, variants: list[tuple[dict[str, Any], Any]]):
        self.module = module
        self.label = label
        self.variants = variants

    def __deepcopy__(self, memo: dict[int, Any]) -> AotRunner:
        """A copy of the served module (``copy.deepcopy``) is served by the same loaded functions, which
        take the module as an argument: given the copy, they compute with the copy's weights."""
        import copy

        return AotRunner(copy.deepcopy(self.module, memo), self.label, self.variants)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import torch

        floats, grad = floats_of(args, kwargs), torch.is_grad_enabled()
        args, kwargs = canonical(args), canonical(kwargs)
        for record, function in self.variants:
            if record.get("floats", []) == floats and record.get("grad", False) == grad:
                if function.guard_check(self.module, *args, **kwargs):
                    return function(self.module, *args, **kwargs)
                raise RouteDeclined("its aot-compile guards refused the call (a tensor's dtype, device, strides "
                                    "or requires_grad differ from the build's, or, for kernels built with "
                                    "cpp.dynamic_threads: false, the global state: thread count, default dtype, "
                                    "autocast, deterministic or TF32 flags)")
        why = "float arguments" if all(r.get("grad", False) == grad for r, _ in self.variants) else "grad mode"
        raise RouteDeclined(f"its {why} differ from every call the entry was compiled for")


class CallRecorder(Watch):
    """Records, during an eager warmup, the first call of each group one artifact can serve: (class and
    structure of the module, signature, float values, grad mode) -> the call and every instance in it."""

    def __init__(self, owners: list[tuple[str, Any]]):
        self.groups: dict[tuple[str, ...], dict[str, Any]] = {}
        self.digests = {name: structure_digest(module) for name, module in owners}
        super().__init__(owners, forwards.RECORD, self._record)

    def _record(self, name: str, module: Any, forward: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        import torch

        from aotbuild.pipeline.dependencies import observe

        observe(module)  # the global state the artifacts are compiled under, what the module holds at its
        # first call (the manifest records both)
        digest = self.digests[name]
        sig, floats, grad = signature(args, kwargs), floats_of(args, kwargs), torch.is_grad_enabled()
        key = (type(module).__name__, digest, sig, json.dumps(floats), str(grad))
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = {"call": snapshot(args, kwargs), "instances": [], "signature": sig,
                                        "structure": digest, "floats": floats, "grad": grad}
        if name not in group["instances"]:
            group["instances"].append(name)
        return forward(*args, **kwargs)
