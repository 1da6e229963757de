"""The mechanics of ``strategy: aot-package`` (aot_package.py): AOTInductor packages, no Dynamo at load.

Build (in the job's subprocess): the warmup runs eagerly while the dispatcher records the exact
args/kwargs of the component's first call per signature (ZeroGPU's ``aoti_capture`` does the same
with a forward pre-hook); each is exported with ``torch.export.export`` and compiled with
``aoti_compile_and_package`` **without weights** (``aot_inductor.package_constants_in_so=False``),
so a multi-GB model is neither stored once per shape nor held twice in memory. The build process
then opens each package with AOTInductor's C++ loader (:func:`open_package`, as a load does) to
list the constants it wants; the job's proof, a fresh process serving the stored entry, is what
proves it loads and serves. (Until this was changed, a fresh subprocess loaded each package with
``aoti_load_package`` and its CPU-ISA probe files were stored; a load has opened packages with the
C++ loader, which probes nothing, and answered a later compile's probes from the manifest's
``vec_isa_probes`` record since, so those files served nothing: the probe process only cost the
build a Python start-up and Inductor's ISA probes. A load still installs them from an older entry.)

Every weight is a constant supplied at load: ``always_keep_tensor_constants`` stops Inductor from
inlining small 1-D tensors as literals (it otherwise compiled the tiny UNet's 65 biases and norm
weights into the package). Should a torch still compile a tensor in, its sha256 is stored
(``baked``), a module whose tensors differ is a miss at load, and a rebind re-checks them.

``scope: regional`` packages each repeated block class (diffusers' ``_repeated_blocks``) once per
call signature; the package is shared by every instance called with that signature, each
instance's own weights swapped in before its call. The build records every instance's input
strides (``BlockRecorder.calls``), so it knows which instances' inputs the load will copy.

Load: packages are hard-linked into a per-process folder and opened by AOTInductor's C++ loader
(:func:`open_package`: no Inductor compile path imported, no ISA probe); each is handed the live
weights of the component with ``load_constants(..., user_managed=True)`` (shared, not copied)
after aotbuild itself checked every constant's shape, dtype and device, because AOTInductor
accepts a wrong one silently, and calling a package before its constants are loaded segfaults.
Before every call the runner checks that the component still holds the same tensors; after
``pipe.to(...)``, a dtype change or a LoRA fuse that replaced them, it re-supplies them when they
still fit and raises a clear error when they do not. Input checking is off in AOTInductor's runner
(a batch-4 input to a batch-2 package silently returns batch 2), so the dispatcher only ever routes
a call whose signature matches the package's, and an input whose strides differ from the ones the
package reads with (where they matter: not in dimensions of size 1) is first copied into exactly
those strides.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import forwards
from aotbuild.errors import PackageMismatch
from aotbuild.pipeline.blocks import select_blocks
from aotbuild.strategies import prepack
from aotbuild.strategies.calls import (
    call_strides,
    call_tensors,
    copyable,
    flatten_call,
    floats_of,
    relayout,
    snapshot,
    structure,
    where_called,
)

if TYPE_CHECKING:
    from aotbuild.recipe.schema import Recipe

PACKAGE_DIR = "aoti"
#: In an entry built before 2026-12-03: the CPU-ISA probe files a fresh load of its packages left in an
#: empty Inductor cache (installed at load as they were; an entry built since has none).
PROBE_DIR = "inductor"


def named_tensors(module: Any) -> dict[str, Any]:
    """Every parameter and buffer of ``module`` under every name it has: torch.export names a tied
    weight or a buffer registered twice by each of its names, and a package asks for the one its
    graph read (``named_parameters()`` keeps only the first: the build refused 'the package needs
    constant c.alias', issue 36 item 4)."""
    return {**dict(module.named_parameters(remove_duplicate=False)),
            **dict(module.named_buffers(remove_duplicate=False))}


def constant_meta(module: Any, fqns: list[str]) -> dict[str, list[Any]]:
    state = named_tensors(module)
    meta = {}
    for fqn in fqns:
        if fqn not in state:
            raise PackageMismatch(f"the package needs constant {fqn!r}, which the module does not have")
        t = state[fqn]
        meta[fqn] = [list(t.shape), str(t.dtype).replace("torch.", ""), t.device.type]
    return meta


def constant_strides(module: Any, fqns: list[str]) -> dict[str, list[int]]:
    """Each weight's strides at export: a package's kernels read its constants with them, and binding a
    tensor of another layout gave garbage with 0 compiles (channels_last: 0.57 off, issue 31)."""
    state = named_tensors(module)
    return {fqn: list(state[fqn].stride()) for fqn in fqns if fqn in state}


def _tensor_digest(t: Any) -> str:
    import torch

    data = t.detach().to("cpu").contiguous()
    if data.dtype == torch.bfloat16:  # numpy has no bfloat16: hash the raw 16-bit words
        data = data.view(torch.int16)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()


def baked_digests(module: Any, supplied: list[str] | dict[str, Any]) -> dict[str, str]:
    """sha256 of every tensor of ``module`` that the package does *not* take as a constant.

    Measured on the tiny UNet: ``get_constant_fqns()`` lists 143 of its 208 parameters and buffers;
    the other 65 (biases, norm weights) are compiled into the package itself. So a package embeds
    those values, and may only run with a module whose same tensors are equal. A tensor the package
    takes under another of its names (a tied weight) is supplied, not compiled in."""
    state = named_tensors(module)
    taken = {id(state[fqn]) for fqn in supplied if fqn in state}
    return {fqn: _tensor_digest(t) for fqn, t in sorted(state.items()) if fqn not in supplied and id(t) not in taken}


def check_baked(module: Any, component: str, packages: list[dict[str, Any]]) -> str:
    """Why the module's weights do not fit the values compiled into these packages, or ""."""
    import torch

    state = named_tensors(module)
    named = dict(module.named_modules())
    for package in packages:
        for instance in package.get("instances", [""]):
            owner = named.get(instance) if instance else module
            local = named_tensors(owner) if owner is not None else {}
            for fqn, digest in package.get("baked", {}).items():
                t = local.get(fqn, state.get(fqn) if not instance else None)
                if not isinstance(t, torch.Tensor) or _tensor_digest(t) != digest:
                    where = f"{instance}.{fqn}" if instance else fqn
                    return (f"{component}'s AOT package has {len(package['baked'])} tensors compiled in (biases, "
                            f"norms) and this model's differ (e.g. {where}): it was built for other weights")
    return ""


def _package(module: Any, sig: str, args: tuple[Any, ...], kwargs: dict[str, Any], workdir: Path,
             inductor_configs: dict[str, Any], group: str = "") -> dict[str, Any]:
    """Export one recorded call of ``module``, package it without weights, probe it; its manifest record."""
    import torch

    # Named by everything that tells packages apart: two block classes can share a signature, and
    # one class's instances can need two packages (another input layout, another float argument).
    strides = call_strides(args, kwargs)
    floats = floats_of(args, kwargs)
    name = hashlib.sha256(f"{group}\n{sig}\n{json.dumps(strides)}\n{floats!r}".encode()).hexdigest()[:20]
    path = workdir / PACKAGE_DIR / f"{name}.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), forwards.class_forward(module):  # the module itself, not a wrapper put on it
        exported = torch.export.export(module, args, kwargs)
    exported, lifted = _promote_lifted_constants(exported)
    # Weights out of the .so, and no tensor inlined as a literal (Inductor inlines 1-D tensors of <= 8
    # elements otherwise: the tiny UNet's biases and norms), so every weight can be supplied at load.
    # No -g1 line tables (a profiler's source lines; 11 % of the wrapper's compile at SD 1.5 size) and no
    # precompiled headers (on a fresh machine, the CI runner a build usually is, 8.4 s of g++ that saved
    # 1 s of the wrapper's compile at SD 1.5 size; docs/aot-package.md), unless the recipe asks for them.
    configs = {"aot_inductor.enable_line_tables": False, "aot_inductor.precompile_headers": False, **inductor_configs,
               "aot_inductor.package_constants_in_so": False, "always_keep_tensor_constants": True}
    # freezing (issue 39): each folded constant's computation from the weights is recorded, to be
    # re-derived at load from the served model's own (prepack.py); Inductor freezes only without grad.
    recorder = prepack.FoldRecorder({**named_tensors(module), **lifted}) if prepack.wanted(inductor_configs) else None
    # AOTI writes its device facts into the process's own aot_inductor.metadata dict (torch 2.13's
    # codecache mutates it in place): a fresh copy for the compile, so the process's settings -- a key
    # factor of every later jit-cache job or load in it -- are as they were.
    with (torch._inductor.config.patch({"aot_inductor.metadata": dict(torch._inductor.config.aot_inductor.metadata)}),
          recorder.active() if recorder else contextlib.nullcontext(),
          torch.no_grad() if recorder else contextlib.nullcontext(),
          wrapper_beside_kernels()):
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
    fqns = open_package(path).get_constant_fqns()  # what the package asks for, by the loader a load uses
    # Only the lifted constants the package asks for: Inductor folds one it can compute at compile
    # time (Chroma's guidance_proj(torch.tensor([0] * batch)) in time_text_embed), and supplying a
    # name the package lacks fails every load ("Constant not found", issue 36 item 4).
    derived = recorder.derived(fqns) if recorder else {}
    lifted = {name: value for name, value in lifted.items()
              if name in fqns or any(name in r["inputs"] for r in derived.values())}
    unsupplied = sorted(name for name in lifted if name not in fqns)  # only a recipe's input
    weights = [f for f in fqns if f not in lifted and f not in derived]
    sources = sorted({i for r in derived.values() for i in r["inputs"]} - set(lifted))
    record = {"signature": sig, "path": f"{PACKAGE_DIR}/{path.name}", "strides": strides,
              "constants": constant_meta(module, weights), "baked": baked_digests(module, [*weights, *sources]),
              "constant_strides": constant_strides(module, weights)}
    if derived:
        record["derived"] = derived
        record["derived_from"] = constant_meta(module, sources)
        if unsupplied:
            record["lifted_unsupplied"] = unsupplied
        prepack.check_other_weights(path, module, named_tensors(module), args, kwargs, record, lifted)
    if lifted:
        from safetensors.torch import save_file

        side = path.with_name(f"{name}.{LIFTED_SUFFIX}")
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in lifted.items()}, str(side))
        record["lifted"] = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in lifted.items()}
        record["lifted_path"] = f"{PACKAGE_DIR}/{side.name}"
    return record


#: The values of tensors a model makes in ``forward`` (torch.export's lifted constants), beside the package.
LIFTED_SUFFIX = "constants.safetensors"


@contextlib.contextmanager
def wrapper_beside_kernels() -> Iterator[None]:
    """While active, AOTInductor compiles its C++ wrapper and its kernels at the same time.

    torch 2.13's ``AotCodeCompiler.compile`` builds the wrapper's object (``<hash>.wrapper.o``), then the
    kernels' (``<hash>.kernel.o``), then links, one after the other, each one g++ on one core: at SD 1.5
    size 17 s and 4 s. Here the wrapper's build starts in a thread and returns; the kernels' build
    runs meanwhile and then waits for it, and any other build (the link) waits for it first. Its
    error is raised where it is waited for. A torch whose objects are named otherwise builds in turn."""
    from concurrent.futures import Future, ThreadPoolExecutor

    from torch._inductor import cpp_builder

    build = cpp_builder.CppBuilder.build
    pending: list[Future[None]] = []

    def wait() -> None:
        while pending:
            pending.pop().result()

    def beside(builder: Any) -> None:
        target = str(builder.get_target_file_path())
        if target.endswith(".wrapper.o") and not pending:
            pending.append(pool.submit(build, builder))
            return
        if not target.endswith(".kernel.o"):
            wait()
        try:
            build(builder)
        finally:
            wait()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="aoti-wrapper") as pool:
        cpp_builder.CppBuilder.build = beside
        try:
            yield
            wait()
        finally:
            cpp_builder.CppBuilder.build = build
            for future in pending:  # a failure before the wait: the thread's build ends, its result unread
                future.cancel()


def _promote_lifted_constants(exported: Any) -> tuple[Any, dict[str, Any]]:
    """A tensor made in ``forward`` (``torch.tensor([0] * batch)``, a tensor held as a plain attribute)
    is exported as a lifted constant, which the weightless package would then ask for under a name
    the module does not have (``_tensor_constant0``). As a non-persistent buffer it is asked for
    under its export name instead, and its value (known now, the same on every call: export traced
    it) is stored beside the package and supplied with the weights at load. Returns the program and
    {name: value}; a program without lifted constants is returned as it is."""
    import torch
    from torch.export.graph_signature import ExportGraphSignature, InputKind, InputSpec

    signature = exported.graph_signature
    lifted = {s.target: exported.constants[s.target] for s in signature.input_specs
              if s.kind == InputKind.CONSTANT_TENSOR}
    if not lifted:
        return exported, {}
    specs = [InputSpec(kind=InputKind.BUFFER, arg=s.arg, target=s.target, persistent=False)
             if s.kind == InputKind.CONSTANT_TENSOR else s for s in signature.input_specs]
    promoted = torch.export.ExportedProgram(
        root=exported.graph_module, graph=exported.graph,
        graph_signature=ExportGraphSignature(input_specs=specs, output_specs=list(signature.output_specs)),
        state_dict=exported.state_dict, range_constraints=exported.range_constraints,
        module_call_graph=exported.module_call_graph, example_inputs=exported.example_inputs,
        constants=exported.constants, verifiers=exported.verifiers)
    return promoted, lifted


def build_packages(module: Any, calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]], workdir: Path,
                   inductor_configs: dict[str, Any]) -> list[dict[str, Any]]:
    """Export and package each recorded call of the whole component; the package list for the manifest."""
    return [_package(module, sig, args, kwargs, workdir, inductor_configs)
            for sig, (args, kwargs) in sorted(calls.items())]


class BlockRecorder:
    """Build side of ``scope: regional``: records the calls of every repeated block during an eager warmup.

    Instances of one class that are called with one signature and hold tensors of the same shapes
    form a group: one package, exported from the group's first instance, serves them all with each
    instance's own weights. One call per group is kept (a snapshot of the first instance's inputs,
    not one per instance: a block's activations can be large); of every other instance only what
    its call looked like is kept (``calls``): its input strides and float arguments.

    That is enough to know at build time how each instance will be served. Input strides that
    differ from the package's are fixed at every call by a copy into the package's layout (the
    load's stride guard): so the package is exported for the layout most instances of the group
    receive (Flux's single-stream blocks after the first get slices of the previous block's output)
    and only the others copy. Float arguments are baked into a package by ``torch.export`` and no
    copy can change them: an instance called with other float values gets a package of its own,
    exported from a snapshot of its own call."""

    def __init__(self, module: Any, component: str, classes: tuple[str, ...] | None = None,
                 recipe: Recipe | None = None):
        from aotbuild.dispatch import install_dispatcher

        #: (class, signature, structure) -> its packages: each a dict with "instances", "call" (the
        #: snapshot to export) and "floats"; more than one only when instances' floats differ.
        self.groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
        #: instance -> signature -> {"strides": [...], "floats": [...], "group": key, "package": index
        #: in the group's list}; after :meth:`build`, also "copies": whether its input is copied
        #: into the package's layout on every call.
        self.calls: dict[str, dict[str, dict[str, Any]]] = {}
        self.blocks = select_blocks(module, classes, recipe)
        for name, block in self.blocks:
            group_of = (type(block).__name__, structure(block))
            install_dispatcher(block, f"{component}.{name}", {}, block.forward, "record",
                               on_record=self._recorder(name, group_of))

    def _recorder(self, name: str, group_of: tuple[str, str]) -> Callable[..., None]:
        def record(sig: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            key = (group_of[0], sig, group_of[1])
            floats = floats_of(args, kwargs)
            packages = self.groups.setdefault(key, [])
            index = next((i for i, p in enumerate(packages) if p["floats"] == floats), None)
            if index is None:
                index = len(packages)
                packages.append({"instances": [], "call": snapshot(args, kwargs), "floats": floats})
            packages[index]["instances"].append(name)
            self.calls.setdefault(name, {})[sig] = {"strides": call_strides(args, kwargs), "floats": floats,
                                                    "group": key, "package": index}

        return record

    @property
    def signatures(self) -> list[str]:
        return sorted({sig for _, sig, _ in self.groups})

    def _layout(self, sig: str, package: dict[str, Any]) -> list[list[int]]:
        """Per input tensor, the strides to export with: the layout most of the package's instances
        receive (the first instance's on a tie), among those a copy can produce."""
        shapes = [list(t.shape) for t in call_tensors(*package["call"])]
        chosen = []
        for i, shape in enumerate(shapes):
            seen: dict[tuple[Any, ...], tuple[int, list[int]]] = {}
            for instance in package["instances"]:
                strides = self.calls[instance][sig]["strides"][i]
                if not copyable(shape, strides):
                    continue
                # Equal where it matters (dims of size 1 and empty tensors aside): one layout.
                norm = ("empty",) if 0 in shape else tuple(s if n != 1 else None
                                                           for n, s in zip(shape, strides, strict=True))
                count, first = seen.get(norm, (0, strides))
                seen[norm] = (count + 1, first)
            best = max(seen.values(), key=lambda v: v[0], default=None)  # max keeps the first of a tie
            chosen.append(best[1] if best else list(call_tensors(*package["call"])[i].stride()))
        return chosen

    def plan_layouts(self) -> None:
        """Decide each package's input layout (``package["layout"]``) and so, per instance, whether
        the load will copy its inputs (``calls[instance][signature]["copies"]``). Nothing is exported."""
        for (_, sig, _), packages in self.groups.items():
            for package in packages:
                package["layout"] = layout = self._layout(sig, package)
                shapes = [t.shape for t in call_tensors(*package["call"])]
                for instance in package["instances"]:
                    call = self.calls[instance][sig]
                    # Exactly: the package checks every stride (AOTI_RUNTIME_CHECK_INPUTS), size-1 ones too.
                    call["copies"] = not all(list(have) == list(want)
                                             for _, have, want in zip(shapes, call["strides"], layout, strict=True))

    def build(self, workdir: Path, inductor_configs: dict[str, Any]) -> list[dict[str, Any]]:
        named = dict(self.blocks)
        for block in named.values():
            forwards.unwrap(block, forwards.DISPATCH)  # the recording dispatcher
        self.plan_layouts()
        built = []
        for (cls, sig, shape_of), packages in sorted(self.groups.items()):
            for package in packages:
                exporter = named[package["instances"][0]]
                args, kwargs = _relaid(package["call"], package["layout"])
                with where_called(exporter, (args, kwargs)):  # under offload: model, on the call's device
                    record = _package(exporter, sig, args, kwargs, workdir, inductor_configs,
                                      group=f"{cls}\n{shape_of}")
                if record["baked"]:  # a tensor compiled in would be the exporter's value for every instance
                    raise PackageMismatch(f"{cls}: AOTInductor compiled {len(record['baked'])} tensors into the "
                                          f"package (e.g. {next(iter(record['baked']))}), so it cannot be shared "
                                          f"by instances; use compile.scope: full")
                built.append({**record, "block_class": cls, "instances": package["instances"]})
        return built


def _relaid(call: tuple[tuple[Any, ...], dict[str, Any]],
            layout: list[list[int]]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A recorded call with each input tensor in ``layout`` (copied where its strides differ)."""
    import torch
    from torch.utils._pytree import tree_unflatten

    leaves, spec = flatten_call(*call)
    wanted = iter(layout)
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            want = next(wanted)
            if list(x.stride()) != list(want):  # exported in exactly the layout its record names
                leaves[i] = relayout(x, want)
    return tree_unflatten(leaves, spec)


def _lookup(module: Any, fqn: str) -> Any:
    """``module``'s parameter or buffer ``fqn``, or None; walked afresh on every call (a submodule
    replaced since load, e.g. a LoRA wrapper, must not leave us reading the old one), and ~5x faster
    than building ``named_parameters()`` for each call of a block."""
    *path, leaf = fqn.split(".")
    for part in path:
        module = module._modules.get(part) if hasattr(module, "_modules") else None
        if module is None:
            return None
    tensor = module._parameters.get(leaf)
    return tensor if tensor is not None else module._buffers.get(leaf)


#: Elements sampled per weight a prepacked package's recipes read (first, last, and evenly between).
SAMPLES_PER_WEIGHT = 4


def _samples(t: Any) -> list[Any]:
    """One-element views into ``t``'s storage at a few of its elements (whatever its layout), which
    read what is there now at every call; [] for a tensor whose elements do not fill its storage
    densely (an expanded view) or that has no data."""
    if t is None or t.numel() == 0 or t.is_mkldnn or t.device.type == "meta" or not _dense(t):
        return []
    span = t.numel()
    picks = sorted({(span - 1) * i // (SAMPLES_PER_WEIGHT - 1) for i in range(SAMPLES_PER_WEIGHT)})
    base = t.detach()
    return [base.as_strided((1,), (1,), base.storage_offset() + k) for k in picks]


def _dense(t: Any) -> bool:
    """Whether ``t``'s elements fill its storage span exactly, in some order of its dimensions."""
    expected = 1
    for stride, size in sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _version(t: Any) -> int:
    """A tensor's version counter (bumped by every in-place change); an inference tensor has none,
    and cannot be changed in place outside inference mode either."""
    return -1 if t.is_inference() else t._version


class PackageRunner:
    """One loaded package bound to one module's live weights.

    Regional packages are shared by every instance of a block: each instance has its runner, all
    runners of a package share ``shared`` (the loaded model and which runner's tensors it holds), and
    a call from another instance than the last one swaps its tensors in first (``load_constants`` with
    ``user_managed=True`` only rebinds pointers: nothing is copied)."""

    def __init__(self, model: Any, module: Any, component: str, package: dict[str, Any], device: str,
                 shared: dict[str, Any] | None = None, lifted: dict[str, Any] | None = None,
                 bind_at_first_call: bool = False):
        self.model = model
        #: the values of tensors the model makes in forward (stored beside the package), on the device
        self.lifted = lifted or {}
        self.module = module
        self.component = component
        self.package = package
        self.meta: dict[str, list[Any]] = package["constants"]
        self.constant_strides: dict[str, list[int]] = package.get("constant_strides", {})
        self.strides = package.get("strides")
        self.baked: dict[str, str] = package.get("baked", {})
        self.device_kind = device.partition(":")[0]
        self.shared = shared if shared is not None else {}
        self.bound: tuple[Any, ...] | None = None  # the identity of the tensors last supplied
        #: freezing (prepack.py): constants replayed from the module's weights at each bind, and the
        #: weights they come from (whose in-place changes count too: a prepacked copy would not follow)
        self.derived: dict[str, dict[str, Any]] = package.get("derived", {})
        self.derived_from: dict[str, list[Any]] = package.get("derived_from", {})
        self.derived_values: dict[str, Any] = {}
        #: a few elements of each weight the recipes read, as views into its storage, and their values at
        #: the last derive: an in-place change through ``.data`` (peft's unsafe merge, i.e. a fused LoRA)
        #: bumps no version counter, and a prepacked copy would not follow it (:func:`_samples`)
        self.samples: list[Any] = []
        self.sampled: Any = None
        self.unsupplied = set(package.get("lifted_unsupplied", []))
        self.rebinds = 0
        self.swaps = 0
        if not bind_at_first_call:
            self._bind()  # a module that does not fit is refused at load
        else:  # offload: model: the weights are on the CPU until the offload hook moves the component
            # to the execution device, just before its blocks run; bound then, and refused at load if
            # anything but their device differs.
            self._check(self._tensors(), device=False)

    def _tensors(self) -> dict[str, Any]:
        lifted = {k: v for k, v in self.lifted.items() if k not in self.unsupplied}
        return {**{fqn: _lookup(self.module, fqn) for fqn in self.meta}, **lifted, **self.derived_values}

    def _identity(self, tensors: dict[str, Any]) -> tuple[Any, ...]:
        versions = bool(self.derived)  # load_state_dict copies in place: only a prepacked copy misses it
        return tuple((id(t), t.data_ptr(), t.dtype, t.device, tuple(t.shape), _version(t) if versions else 0)
                     if t is not None else None for t in tensors.values())

    def _derive(self) -> None:
        """Replay every recipe on the module's weights as they are now (prepack.py)."""
        import torch

        sources = {fqn: _lookup(self.module, fqn) for fqn in self.derived_from}
        self._check(sources, meta=self.derived_from)
        self.samples = [v for fqn in self.derived_from for v in _samples(sources[fqn])]
        self.sampled = torch.cat(self.samples).clone() if self.samples else None
        sources.update(self.lifted)
        self.derived_values = {name: prepack.replay(recipe, sources) for name, recipe in self.derived.items()}

    def _resampled(self) -> bool:
        """Whether a sampled element of a weight the recipes read changed since the last derive."""
        import torch

        return self.sampled is not None and not torch.equal(torch.cat(self.samples), self.sampled)

    def _check(self, tensors: dict[str, Any], device: bool = True, meta: dict[str, list[Any]] | None = None) -> None:
        """Every constant the package asked for, with its shape, dtype and (``device``) device."""
        # AOTInductor takes a missing buffer or lifted constant with a warning, and the next call
        # segfaults: every name it asked for must be supplied (a missing parameter it does refuse).
        for fqn, (shape, dtype, device_kind) in (self.meta if meta is None else meta).items():
            t = tensors[fqn]
            if t is None:
                raise PackageMismatch(f"{self.component}: the module has no {fqn!r}, which its AOT package needs; "
                                      f"rebuild the recipe for this model")
            have = (list(t.shape), str(t.dtype).replace("torch.", ""), t.device.type)
            if have[:2] != (shape, dtype) or (device and have[2] != device_kind):
                raise PackageMismatch(
                    f"{self.component}: {fqn} is now {have[1]} {have[0]} on {have[2]}, but its AOT package was "
                    f"built for {dtype} {shape} on {device_kind}; rebuild the recipe for this dtype/device or "
                    f"load it again with load_compiled")
            strides = self.constant_strides.get(fqn)
            if strides is not None and list(t.stride()) != strides and t.numel() > 1:
                raise PackageMismatch(
                    f"{self.component}: {fqn} has strides {list(t.stride())}, but its AOT package reads it with "
                    f"{strides} (another memory format: channels_last?); convert it back "
                    f"(.to(memory_format=torch.contiguous_format)) or rebuild the recipe for this layout")

    def _bind(self) -> None:
        self._check(self._tensors())
        if self.derived:
            self._derive()
        self.model.load_constants(self._tensors(), check_full_update=True, user_managed=True)
        self.shared["owner"] = self
        self.bound = self._identity(self._watched())

    def _watched(self) -> dict[str, Any]:
        """The supplied constants, the weights derived ones come from, and any tensors compiled into the
        package: all must stay right."""
        return {fqn: _lookup(self.module, fqn) for fqn in (*self.meta, *self.derived_from, *self.baked)}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.bound is None:
            self._bind()  # the first call of a runner bound at its first call
        elif self._identity(self._watched()) != self.bound or self._resampled():  # pipe.to(...), dtype, LoRA fuse
            self.rebinds += 1
            self._bind()  # checks the supplied constants' shape, dtype and device first
            if self.baked and baked_digests(self.module, self.meta) != self.baked:
                raise PackageMismatch(f"{self.component}: tensors compiled into its AOT package "
                                      f"changed since load; rebuild the recipe for these weights")
        elif self.shared.get("owner") is not self:  # another instance of the block ran last
            self.swaps += 1
            self.model.load_constants(self._tensors(), check_full_update=True, user_managed=True)
            self.shared["owner"] = self
        try:
            return self.model(*args, **kwargs)
        except RuntimeError as exc:  # the package's own input check (AOTI_RUNTIME_CHECK_INPUTS, load_packages)
            if "input_handles[" not in str(exc):
                raise
            first = next((x.strip() for x in str(exc).splitlines() if "input_handles[" in x), "")
            raise PackageMismatch(f"{self.component}: its AOT package {self.package['path']} refused the call "
                                  f"({first}): it was not built for the call signature its manifest records (a "
                                  f"damaged or altered store: run aotbuild verify, rebuild the recipe)") from None

    def adapt(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's inputs laid out as the package reads them. A package reads each input with the
        strides it was built for, so an input whose strides differ where it matters is copied into
        exactly those strides (``.contiguous()`` would not do: it keeps a size-1 dimension's stride
        and cannot make a strided layout). The inputs themselves when nothing differs (the usual case)."""
        if self.strides is None:
            return args, kwargs
        import torch
        from torch.utils._pytree import tree_unflatten

        leaves, spec = flatten_call(args, kwargs)
        positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        if len(positions) != len(self.strides):
            raise PackageMismatch(f"{self.component}: called with {len(positions)} tensors, its AOT package was "
                                  f"built for {len(self.strides)}; rebuild the recipe")
        changed = False
        for i, want in zip(positions, self.strides, strict=True):
            t = leaves[i]
            if list(t.stride()) == list(want):  # exactly: the package checks every stride, size-1 ones too
                continue
            if t.dim() != len(want) or not copyable(t.shape, want):
                raise PackageMismatch(f"{self.component}: an input of shape {list(t.shape)} has strides "
                                      f"{list(t.stride())}; its AOT package was built for {want}, which no copy "
                                      f"can make; rebuild the recipe")
            leaves[i] = relayout(t, want)
            changed = True
        return tree_unflatten(leaves, spec) if changed else (args, kwargs)


def open_package(path: Path) -> Any:
    """One package, loaded by AOTInductor's C++ loader alone (``torch._C._aoti.AOTIModelPackageLoader``,
    what ``torch._inductor.aoti_load_package`` ends with): no compiler imported, no CPU-ISA probe.

    ``aoti_load_package`` first imports ``torch._inductor.package`` (the export serializer) and
    ``torch._inductor.codecache`` (Inductor's compile cache, with redis and opentelemetry behind it)
    and picks Inductor's vector ISA, only to compare the package's recorded device information with
    this host's and log a warning if they differ; measured on tiny-sd's package in a fresh process
    with only torch imported: 1061 modules and 42-54 s (the ISA probes compiled with g++, 2 busy
    cores) against 0 modules and 0.01-0.03 s. That comparison is the key's ``device`` factor here
    (``cpu_isa``, ``machine``: a package built for another ISA is a miss, never loaded). The call
    spec is read once, not at every call as torch's wrapper does. A torch without that loader, or
    older than the one this was verified with (2.13: ``load_constants``' arguments), gets
    ``aoti_load_package``."""
    import torch

    loader = getattr(getattr(torch._C, "_aoti", None), "AOTIModelPackageLoader", None)
    if loader is None or tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 13):
        return torch._inductor.aoti_load_package(str(path))
    return LoadedPackage(loader(str(path), "model", False, 1, -1))  # torch's defaults: one runner, the current device


class LoadedPackage:
    """What ``aoti_load_package`` returns (torch's ``AOTICompiledModel``) as far as aotbuild uses it,
    over the C++ loader, without importing the module that defines it (see :func:`open_package`)."""

    def __init__(self, loader: Any) -> None:
        import torch
        from torch.export._tree_utils import reorder_kwargs
        from torch.utils import _pytree

        self.loader = loader
        in_spec, out_spec = loader.get_call_spec()
        self.in_spec, self.out_spec = _pytree.treespec_loads(in_spec), _pytree.treespec_loads(out_spec)
        self._tensor, self._reorder = torch.Tensor, reorder_kwargs
        self._flatten, self._unflatten = _pytree.tree_flatten, _pytree.tree_unflatten

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat = self._flatten((args, self._reorder(kwargs, self.in_spec)))[0]
        return self._unflatten(self.loader.boxed_run([x for x in flat if isinstance(x, self._tensor)]), self.out_spec)

    def load_constants(self, constants: dict[str, Any], *, check_full_update: bool, user_managed: bool = False) -> None:
        self.loader.load_constants(constants, False, check_full_update, user_managed, False)  # not the inactive
        # buffer; no host-to-device copy (torch 2.13's AOTICompiledModel.load_constants)

    def get_constant_fqns(self) -> list[str]:
        return list(self.loader.get_constant_fqns())

    def __deepcopy__(self, memo: dict[int, Any]) -> LoadedPackage:
        """``copy.deepcopy(pipe)`` after a load: the copy shares the C++ loader, as torch's own
        ``AOTICompiledModel.__deepcopy__`` does (a pybind loader cannot be copied). Each copy's runner
        binds its own module's weights before its calls (:class:`PackageRunner`)."""
        return LoadedPackage(self.loader)


def load_packages(module: Any, component: str, packages: list[tuple[dict[str, Any], dict[str, Path]]],
                  device: str, bind_at_first_call: bool = False) -> dict[str, dict[str, Callable[..., Any]]]:
    """instance -> signature -> runner, for every package ("" is the component itself; regional
    packages name their block instances). ``packages``: each record with its entry's files (relative
    path -> blob). Each package is loaded once, from a hard link (or copy) named *.pt2.
    ``bind_at_first_call``: under ``offload: model``, each runner takes its weights at its first call."""
    from aotbuild.cache.trees import lay_tree

    # Every package checks each call's inputs (sizes, strides, dtype, device) against what it was built
    # for, before reading any: a manifest whose recorded signature is not its package's is refused at
    # the first call, never served at a wrong shape (the check is a few comparisons per input).
    # Read by each package's library at its first call; a caller's explicit "0" is respected.
    os.environ.setdefault("AOTI_RUNTIME_CHECK_INPUTS", "1")
    named = dict(module.named_modules())
    routes: dict[str, dict[str, Callable[..., Any]]] = {}
    models = {}
    folder = Path(tempfile.mkdtemp(prefix="aotbuild-aoti-"))
    try:  # the loader extracts what it needs: the links are only its way in
        lay_tree([(Path(p["path"]).name, files[p["path"]]) for p, files in packages], folder)
        for package, _ in packages:
            models[package["path"]] = open_package(folder / Path(package["path"]).name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    for package, files in packages:
        model = models[package["path"]]
        lifted = _lifted(package, files, device)
        shared: dict[str, Any] = {}
        for instance in package.get("instances", [""]):
            owner = named.get(instance)
            if owner is None:
                raise PackageMismatch(f"{component} has no block {instance!r}, which its AOT package serves; "
                                      f"rebuild the recipe for this model")
            label = f"{component}.{instance}" if instance else component
            runner = PackageRunner(model, owner, label, package, device, shared, lifted, bind_at_first_call)
            routes.setdefault(instance, {})[package["signature"]] = _stride_guard(runner)
    return routes


def _lifted(package: dict[str, Any], files: dict[str, Path], device: str) -> dict[str, Any]:
    """The package's lifted constants (safetensors: no pickle), checked against its record, on ``device``."""
    if not package.get("lifted"):
        return {}
    from safetensors.torch import load_file

    values = load_file(str(files[package["lifted_path"]]), device=device)
    for name, (shape, dtype) in package["lifted"].items():
        t = values.get(name)
        if t is None or list(t.shape) != shape or str(t.dtype).replace("torch.", "") != dtype:
            raise PackageMismatch(f"the constants file of {package['path']} does not hold {name} as {dtype} {shape}")
    return {name: values[name] for name in package["lifted"]}


def _stride_guard(runner: PackageRunner) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = runner.adapt(args, kwargs)
        return runner(*args, **kwargs)

    run.runner = runner  # type: ignore[attr-defined]
    return run
