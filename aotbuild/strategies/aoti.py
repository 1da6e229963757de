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
call signature; the package is shared by every instance called with that signature, each instance
opening it for itself at load and serving its own weights. The build records every instance's input
strides (``BlockRecorder.calls``), so it knows which instances' inputs the load will copy.

Load: packages are hard-linked into a per-process folder and opened by AOTInductor's C++ loader
(:func:`open_package`: no Inductor compile path imported, no ISA probe), one per served module; each is
bound to the live weights of its module by a :class:`~aotbuild.strategies.runner.PackageRunner`, which
checks every constant's shape, dtype and device first (AOTInductor accepts a wrong one silently, and
calling a package before its constants are loaded segfaults) and, before every call, that the module
still holds what it handed over (runner.py: replaced weights handed over again, prepacked constants
replayed, memory flat on torch 2.13's runtime through handover.py). Input checking is off in
AOTInductor's runner (a batch-4 input to a batch-2 package silently returns batch 2), so the dispatcher
only ever routes a call whose signature matches the package's, and an input whose strides differ from
the ones the package reads with (where they matter: not in dimensions of size 1) is first copied into
exactly those strides.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import forwards
from aotbuild.errors import PackageMismatch
from aotbuild.pipeline.blocks import select_blocks
from aotbuild.strategies import handover, prepack
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
from aotbuild.strategies.runner import (
    PackageRoute,
    PackageRunner,
    baked_digests,
    calibrated_problem,
    named_tensors,
    tensor_digest,
    tensor_digests,
)

if TYPE_CHECKING:
    from aotbuild.recipe.schema import Recipe

PACKAGE_DIR = "aoti"
#: In an entry built before 2026-12-03: the CPU-ISA probe files a fresh load of its packages left in an
#: empty Inductor cache (installed at load as they were; an entry built since has none).
PROBE_DIR = "inductor"


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
                if not isinstance(t, torch.Tensor) or tensor_digest(t) != digest:
                    where = f"{instance}.{fqn}" if instance else fqn
                    return (f"{component}'s AOT package has {len(package['baked'])} tensors compiled in (biases, "
                            f"norms) and this model's differ (e.g. {where}): it was built for other weights")
        why = calibrated_problem(state, package.get("calibrated", {}))
        if why:
            return f"{component}'s AOT package {why}"
    return ""


@contextlib.contextmanager
def computing_in(module: Any, dtype: Any) -> Iterator[None]:
    """While active, ``module``'s forward computes in ``dtype``: its floating weights and inputs cast to it,
    its floating outputs cast back to its weights' dtype. What ``compute_dtype: float32`` exports
    (``AotPackage.compile_factors``: bfloat16 weights on a CPU without native bfloat16): the casts are
    graph nodes, so freezing folds each weight's cast into its prepacked float32 constant, re-derived at
    load from the served bfloat16 weights (the recipe's first step a cast), and the package reads and
    returns bfloat16 as the pipeline around it expects. Put on under :func:`forwards.class_forward`."""
    import torch
    from torch.nn.utils.stateless import _reparametrize_module
    from torch.utils._pytree import tree_map

    floating = [t for t in named_tensors(module).values() if t.is_floating_point()]
    home = floating[0].dtype if floating else dtype

    def cast(to: Any) -> Callable[[Any], Any]:
        return lambda v: v.to(to) if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != to else v

    def make(below: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            state = {**dict(module.named_parameters(remove_duplicate=False)),
                     **dict(module.named_buffers(remove_duplicate=False))}
            up = {name: t.to(dtype) for name, t in state.items() if t.is_floating_point() and t.dtype != dtype}
            with _reparametrize_module(module, up):
                out = below(*tree_map(cast(dtype), args), **tree_map(cast(dtype), kwargs))
            return tree_map(cast(home), out)

        return forward

    forwards.wrap(module, forwards.COMPUTE, make)
    try:
        yield
    finally:
        forwards.unwrap(module, forwards.COMPUTE)


def _package(module: Any, sig: str, args: tuple[Any, ...], kwargs: dict[str, Any], workdir: Path,
             inductor_configs: dict[str, Any], group: str = "", noise: float = 0.0,
             compute: Any = None, calibrated: Any = None, reduce_range: bool = False) -> dict[str, Any]:
    """Export one recorded call of ``module``, package it without weights, probe it; its manifest record.
    ``compute``: the dtype it computes in where not its weights' (:func:`computing_in`). ``calibrated``: the
    served module, where ``module`` is its int8static conversion (calibrate.py): the package serves its
    weights only, and what the conversion and the int8 lowering add is stored beside it."""
    import torch

    from aotbuild.strategies import calibrate

    # Named by everything that tells packages apart: two block classes can share a signature, and
    # one class's instances can need two packages (another input layout, another float argument).
    strides = call_strides(args, kwargs)
    floats = floats_of(args, kwargs)
    name = hashlib.sha256(f"{group}\n{sig}\n{json.dumps(strides)}\n{floats!r}".encode()).hexdigest()[:20]
    path = workdir / PACKAGE_DIR / f"{name}.pt2"
    path.parent.mkdir(parents=True, exist_ok=True)
    with (torch.no_grad(), forwards.class_forward(module),  # the module itself, not a wrapper put on it
          computing_in(module, compute) if compute is not None else contextlib.nullcontext()):
        exported = torch.export.export(module, args, kwargs)
    exported, lifted = _promote_lifted_constants(exported)
    owner = module if calibrated is None else calibrated  # whose weights the load supplies
    if calibrated is not None:  # the conversion's per-channel scales and zero points: stored, not supplied
        served = named_tensors(calibrated)
        lifted.update({name: t for name, t in named_tensors(module).items() if name not in served})
    unread = unread_parts(exported, module)  # a quantized weight's parts no kernel reads: not compiled in
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
          calibrate.made_constants() if calibrated is not None else contextlib.nullcontext({}) as made,
          wrapper_beside_kernels()):
        torch._inductor.aoti_compile_and_package(exported, package_path=str(path), inductor_configs=configs)
    fqns = open_package(path).get_constant_fqns()  # what the package asks for, by the loader a load uses
    # Only the lifted constants the package asks for: Inductor folds one it can compute at compile
    # time (Chroma's guidance_proj(torch.tensor([0] * batch)) in time_text_embed), and supplying a
    # name the package lacks fails every load ("Constant not found", issue 36 item 4).
    derived = recorder.derived(fqns, made=made) if recorder else {}
    # int8static: the scalars the int8 lowering made from the calibrated activation scales, stored too
    if made:
        served = named_tensors(owner)
        lifted.update({f: made[f] for f in fqns if f in made and f not in derived and f not in lifted
                       and f not in served})
    lifted = {name: value for name, value in lifted.items()
              if name in fqns or any(name in r["inputs"] for r in derived.values())}
    unsupplied = sorted(name for name in lifted if name not in fqns)  # only a recipe's input
    weights = [f for f in fqns if f not in lifted and f not in derived]
    sources = sorted({i for r in derived.values() for i in r["inputs"]} - set(lifted))
    record = {"signature": sig, "path": f"{PACKAGE_DIR}/{path.name}", "strides": strides, "asks": sorted(fqns),
              "constants": constant_meta(owner, weights),
              "baked": baked_digests(owner, [*weights, *sources, *unread]),
              "constant_strides": constant_strides(owner, weights)}
    if calibrated is not None:  # bound to the weights it was calibrated on: every one of them
        every = dict(sorted(named_tensors(owner).items()))
        record["calibrated"] = dict(zip(every, tensor_digests(list(every.values())), strict=True))
    if derived:
        record["derived"] = derived
        record["derived_from"] = constant_meta(owner, sources)
        if unsupplied:
            record["lifted_unsupplied"] = unsupplied
        if calibrated is None:  # (a calibrated package serves no other weights: nothing to try)
            prepack.check_other_weights(path, module, named_tensors(module), args, kwargs, record, lifted, noise)
    if calibrated is not None:
        calibrate.check_against_eager(path, module, named_tensors(owner), args, kwargs, record, lifted, reduce_range,
                                      floating=calibrated)
    if lifted:
        from safetensors.torch import save_file

        side = path.with_name(f"{name}.{LIFTED_SUFFIX}")
        save_file({k: v.detach().to("cpu").contiguous().clone() for k, v in lifted.items()}, str(side))
        record["lifted"] = {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in lifted.items()}
        record["lifted_path"] = f"{PACKAGE_DIR}/{side.name}"
    return record


def unread_parts(exported: Any, module: Any) -> list[str]:
    """The inner tensors of ``module``'s tensor-subclass weights that ``exported`` never reads (torchao's
    symmetric int8 weight: its zero point), by the names a package would ask for them: a package cannot
    have compiled them in, so they are not digested as if it had (``baked``)."""
    import torch

    from aotbuild.strategies.subclasses import is_subclass

    params = {**exported.graph_signature.inputs_to_parameters, **exported.graph_signature.inputs_to_buffers}
    state = dict(module.named_parameters(remove_duplicate=False)) | dict(module.named_buffers(remove_duplicate=False))
    read: dict[str, set[str]] = {}
    for node in exported.graph.nodes:
        if node.op == "placeholder" and params.get(node.name) in state and is_subclass(state[params[node.name]]):
            users = list(node.users)
            if not all(u.target is torch.ops.export.access_subclass_inner_tensor.default for u in users):
                read[params[node.name]] = {"*"}  # read as a whole somewhere: every part counts
            else:
                read.setdefault(params[node.name], set()).update(u.args[1] for u in users)
    out = []
    for fqn, attrs in read.items():
        names = state[fqn].__tensor_flatten__()[0]
        if "*" in attrs or any(is_subclass(getattr(state[fqn], a)) for a in names):
            continue  # nested subclasses: every part is digested, as before
        prefix, _, leaf = fqn.rpartition(".")
        out += [f"{prefix}{'.' if prefix else ''}parametrizations.{leaf}.original{i}"
                for i, attr in enumerate(names) if attr not in attrs]
    return out


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
                   inductor_configs: dict[str, Any], noise: float = 0.0, compute: Any = None) -> list[dict[str, Any]]:
    """Export and package each recorded call of the whole component; the package list for the manifest.
    ``noise``: what the recipe's features allow a compiled output to differ by (BuildJob.noise);
    ``compute``: the dtype the packages compute in where not the weights' (:func:`computing_in`)."""
    return [_package(module, sig, args, kwargs, workdir, inductor_configs, noise=noise, compute=compute)
            for sig, (args, kwargs) in sorted(calls.items())]


def build_calibrated(module: Any, calls: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]], workdir: Path,
                     inductor_configs: dict[str, Any], reduce_range: bool = False) -> list[dict[str, Any]]:
    """int8static (calibrate.py): per signature, ``module`` converted with observers calibrated on every
    recorded call of it, exported and packaged from its first; the package list for the manifest."""
    from aotbuild.strategies import calibrate

    built = []
    with calibrate.quantizer_passes():  # the int8 lowering's passes for these compiles alone
        for sig, recorded in sorted(calls.items()):
            converted = calibrate.convert(module, recorded, reduce_range)
            args, kwargs = recorded[0]
            built.append(_package(converted, sig, args, kwargs, workdir, inductor_configs, calibrated=module,
                                  reduce_range=reduce_range))
            del converted
    return built


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


def load_packages(module: Any, component: str, packages: list[tuple[dict[str, Any], dict[str, Path]]],
                  device: str, bind_at_first_call: bool = False,
                  built_by: str | None = None) -> dict[str, dict[str, Callable[..., Any]]]:
    """instance -> signature -> route, for every package ("" is the component itself; regional
    packages name their block instances). ``packages``: each record with its entry's files (relative
    path -> blob). Each instance gets the package opened for itself (from a hard link or copy named
    *.pt2): a regional package's instances no longer share one and swap their weights in before each
    call, which handed the package new tensors at every call (memory grew without end on torch 2.13,
    handover.py) and let two threads interleave a swap and a call (issue 52).
    ``bind_at_first_call``: under ``offload: model``, each runner takes its weights at its first call.
    ``built_by``: the torch version that built the entry (whether its packages pin what they are handed
    is found out once per version: handover.leaks)."""
    named = dict(module.named_modules())
    routes: dict[str, dict[str, Callable[..., Any]]] = {}
    for package, files in packages:
        lifted = _lifted(package, files, device)
        blob = files[package["path"]]

        def opener(blob: Path = blob, name: str = Path(package["path"]).name) -> Any:
            return open_blob(blob, name)

        for instance in package.get("instances", [""]):
            owner = named.get(instance)
            if owner is None:
                raise PackageMismatch(f"{component} has no block {instance!r}, which its AOT package serves; "
                                      f"rebuild the recipe for this model")
            model = opener()
            if instance == package.get("instances", [""])[0]:
                _check_asked(model, package, lifted)
            pinning = handover.leaks(model, list(package["constants"]) + list(package.get("derived", {})), built_by)
            label = f"{component}.{instance}" if instance else component
            runner = PackageRunner(model, owner, label, package, device, lifted, bind_at_first_call,
                                   pinning=pinning, opener=opener)
            routes.setdefault(instance, {})[package["signature"]] = PackageRoute(runner)
    return routes


def _check_asked(model: Any, package: dict[str, Any], lifted: dict[str, Any]) -> None:
    """RecipeError unless the names the package asks for are exactly what its record supplies: weights,
    derived constants and the lifted constants it reads. A recipe missing from a store's manifest left
    a constant unsupplied, and the package's first call read freed memory (SIGSEGV); an extra one is a
    record that is not this package's."""
    unsupplied = set(package.get("lifted_unsupplied", []))
    supplied = {*package["constants"], *package.get("derived", {}), *(n for n in lifted if n not in unsupplied)}
    asked = set(model.get_constant_fqns())  # (the static check made the record's "asks", if any, this set)
    if asked != supplied:
        missing, extra = sorted(asked - supplied), sorted(supplied - asked)
        what = f"asks for {missing[0]!r}, which its record does not supply" if missing else \
            f"does not ask for {extra[0]!r}, which its record supplies"
        raise prepack.RecipeError(f"the package {Path(package['path']).name} {what} ({len(missing)} missing, "
                                  f"{len(extra)} extra)")


def open_blob(blob: Path, name: str) -> Any:
    """The package stored at ``blob``, opened from a hard link (or copy) named ``name`` (*.pt2) in a
    folder of its own, removed once the loader has extracted what it needs."""
    from aotbuild.cache.trees import lay_tree

    folder = Path(tempfile.mkdtemp(prefix="aotbuild-aoti-"))
    try:
        lay_tree([(name, blob)], folder)
        return open_package(folder / name)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


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
