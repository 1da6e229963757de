"""Prepacked CPU kernels that still run on the user's weights (issue 39): Inductor's ``freezing`` for
``strategy: aot-package``, with every folded constant re-derived at load from the live weights.

Freezing folds a module's weights into the graph as constants and prepacks convolution and linear
weights into oneDNN's blocked layouts (``mkldnn._reorder_convolution_weight``,
``_reorder_linear_weight``) once, at compile time. An AOTInductor package built that way and
packaged without weights asks at load for those *folded* constants (``_frozen_paramN``: a reordered
weight, a reshaped GroupNorm scale, a weight with a following multiplication folded in), which no
model has: supplied with raw weights it returned NaN (issue 39's first try).

So the build records, while Inductor folds, how each folded constant is computed from the
module's own tensors (:class:`FoldRecorder`): a small program of torch operators (a *recipe*, JSON in
the manifest, no pickle), checked on the spot by replaying it on the build's weights. The load
replays every recipe on the weights of the pipeline it is given and hands the results to the
package (:func:`derive`). The package holds no weight values, and another checkpoint of the same
structure is served with its own weights, prepacked.

A recipe from a store is untrusted data (issue 53), not a program: it may name only the operators of
:data:`OPERATORS` for the format (dtype) of the constant it makes, which is what the build's recorder
emits (a build that records another refuses to prepack), none of which writes to its inputs, reads or
writes files, or makes a tensor from nothing. The build records each constant's shape, dtype, layout,
strides and bytes (:func:`describe`); :func:`check_record` (every manifest read, and ``verify``) checks
the operators, the references, the recipe set and the declared sizes without loading anything; a replay
(:func:`replay`) refuses a step that would make a tensor larger than its recipe's bound before it runs,
and a value that is not the one recorded. What no check can see is a well-formed recipe that computes
another value (``aten.mul(w, 2)``): only a signature vouches for values (docs/security.md).
"""

from __future__ import annotations

import contextlib
import math
import operator
import re
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from aotbuild.cache.store import STALE_RECORDS

if TYPE_CHECKING:
    from concurrent.futures import Future

#: The operator namespaces a recipe may call (what Inductor's freezing passes fold: layout changes,
#: arithmetic of binary folding, oneDNN/MKL weight reorders).
NAMESPACES = ("aten", "prims", "mkldnn", "mkl", "quantized_decomposed", "onednn")

#: What freezing records for a float32 constant (torch 2.13; tests/test_prepack.py records each): layout
#: changes, the arithmetic of folding a batch norm or a following multiplication into a convolution, and
#: oneDNN's and MKL's weight reorders (MKL's where torch has MKL, oneDNN's otherwise).
_FLOAT32 = frozenset({
    "aten.clone.default", "aten.reshape.default", "aten.permute.default", "aten.unsqueeze.default",
    "aten.mul.Tensor", "aten.add.Tensor", "aten.sub.Tensor", "aten.sqrt.default", "aten.reciprocal.default",
    "mkldnn._reorder_convolution_weight", "mkl._mkl_reorder_linear_weight", "mkldnn._reorder_linear_weight"})
#: A cast: bf16 and fp16 fold in float32 and cast back; a package computing in float32 over bfloat16
#: weights (aoti.computing_in: bfloat16 on a CPU without native bfloat16) folds each weight's cast up.
#: A cast's dtype is only ever float32 or the constant's own (:func:`_cast_problem`).
CAST = "prims.convert_element_type.default"
#: The operators a recipe may replay, by the dtype of the constant it makes (its *format*): a closed list
#: of what the build's recorder emits, checked at record time (a build that records another does not
#: prepack) and whenever a manifest is read. No operator here writes to its inputs, touches a file or
#: makes a tensor but from its inputs.
OPERATORS: dict[str, frozenset[str]] = {
    "float32": _FLOAT32 | {CAST},
    "bfloat16": _FLOAT32 | {CAST},
    "float16": _FLOAT32 | {CAST},
    # torchao's int8 with dynamically quantized activations (quant_type int8dq): on a CPU with VNNI the
    # transposed int8 weight, and its columns' int32 sums times the activation's zero point; without VNNI
    # (AVX2) the weight made contiguous, transposed and reordered for oneDNN's int8 linear (torch 2.13,
    # torchao 0.18). int8static (PT2E, calibrate.py): the float weight quantized per output channel with
    # its stored scales, then reordered for oneDNN's int8 convolution or linear.
    "int8": frozenset({"aten.permute.default", "aten.contiguous.default",
                       "quantized_decomposed.quantize_per_channel.default", "onednn.qconv_prepack",
                       "onednn.qlinear_prepack"}),
    "int32": frozenset({"aten.permute.default", "aten.sum.dim_IntList", "aten.mul.Tensor"}),
}
#: Operators that can make a tensor larger than each of their inputs (broadcasting): the output's size
#: is checked against the recipe's bound before they run.
_BROADCASTING = frozenset({"aten.mul.Tensor", "aten.add.Tensor", "aten.sub.Tensor"})
#: Steps in one recipe (freezing's longest, a batch norm folded into a convolution in bf16: 19).
MAX_STEPS = 256
#: A derived constant may declare at most this many times the bytes of the tensors it is made from, plus
#: :data:`PACK_SLACK`: MKL's packed linear weights are up to 22x a 256x257 weight's bytes, and at least
#: about 5.8 MB whatever the weight (torch 2.13, measured); oneDNN pads blocked channels to 16.
PACK_FACTOR = 32
PACK_SLACK = 8 << 20

#: Linear weights of at most this many elements (in x out) are left unpacked under freezing: oneDNN's
#: packed linear costs a fixed few microseconds more per call than ``addmm`` and gains only on larger
#: weights. Measured on a 2-core AVX-512 CPU (fp32, medians; docs/prepack.md): packed against ``addmm``,
#: 16x64 by 64x64 2.9x slower, 16x256 by 256x256 1.24x, 64x256 by 256x256 1.03x; 16x256 by 256x1024 0.72x,
#: 1x320 by 320x1280 0.80x, 1024x320 by 320x320 0.99x, 4096x3072 by 3072x3072 0.87x. Packing every
#: linear made the tiny-width Flux sweep's prepacked entry 17-20 % slower than unfrozen kernels.
SMALL_LINEAR = 256 * 256


class RecipeError(RuntimeError):
    """A folded constant whose computation cannot be recorded or replayed (the build refuses it)."""


def _op_name(target: Any) -> str:
    if target is operator.getitem:
        return "operator.getitem"
    import torch

    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        if ns in NAMESPACES:
            return f"{ns}.{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
    if isinstance(target, torch._ops.OpOverloadPacket):  # the freezing passes call some ops unresolved
        ns, _, op = target._qualified_op_name.partition("::")
        if ns in NAMESPACES:
            return f"{ns}.{op}"
    name = getattr(target, "__name__", "")  # torch._C._nn.mkldnn_reorder_conv2d_weight: the aten op's binding
    if getattr(target, "__module__", None) == "torch._C._nn" and hasattr(torch.ops.aten, name):
        return f"aten.{name}"
    raise RecipeError(f"a folded constant is computed by {target!r}, which a recipe cannot replay")


_ALLOWED = frozenset().union(*OPERATORS.values())
_RESOLVED: dict[str, Any] = {}


def allowed_op(name: str, fmt: str | None = None) -> None:
    """RecipeError unless ``name`` is one of :data:`OPERATORS` (of format ``fmt`` when given): the check
    of a stored recipe that needs no torch (``show``, ``ls`` and ``verify`` read manifests without it);
    :func:`resolve_op` adds what only torch can say."""
    allowed = _ALLOWED if fmt is None else OPERATORS.get(fmt, frozenset())
    if name not in allowed:
        if fmt is not None and fmt not in OPERATORS:
            raise RecipeError(f"a recipe makes a {fmt} constant: no recipe is replayed for {fmt} constants "
                              f"(prepacked formats: {', '.join(OPERATORS)})")
        where = f"for {fmt} constants" if fmt is not None else "for any format"
        raise RecipeError(f"a recipe names the operator {name[:80]!r}, which is not one aotbuild replays {where} "
                          f"(prepack.OPERATORS: what freezing records)")


def resolve_op(name: str, fmt: str | None = None) -> Any:
    """The operator a recipe names: one of :data:`OPERATORS` (of format ``fmt`` when given), whose
    schema writes to none of its arguments (a manifest is untrusted input)."""
    allowed_op(name, fmt)
    op = _RESOLVED.get(name)
    if op is not None:
        return op
    import torch

    ns, _, rest = name.partition(".")
    if ns == "quantized_decomposed":  # torch registers these operators when this module is imported
        import torch.ao.quantization.fx._decomposed  # noqa: F401
    try:
        op = getattr(getattr(torch.ops, ns), rest.split(".")[0])
        op = getattr(op, rest.split(".")[1]) if "." in rest else op
    except (AttributeError, RuntimeError) as exc:
        raise RecipeError(f"a recipe names the operator {name!r}, which this torch does not have") from exc
    overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, o) for o in op.overloads()]
    if any(o._schema.is_mutable for o in overloads):  # never the case for the list: held anyway
        raise RecipeError(f"a recipe names the operator {name!r}, which writes to its arguments")
    _RESOLVED[name] = op
    return op


def describe(t: Any) -> dict[str, Any]:
    """What a derived constant is, as the build recorded it and a load checks it: shape, dtype, layout
    (``strided`` or oneDNN's opaque ``mkldnn``), strides (strided) and bytes."""
    import torch

    dtype = str(t.dtype).replace("torch.", "")
    if t.is_mkldnn:
        return {"shape": list(t.shape), "dtype": dtype, "layout": "mkldnn", "nbytes": int(torch.ops.mkldnn._nbytes(t))}
    return {"shape": list(t.shape), "dtype": dtype, "layout": "strided", "stride": list(t.stride()),
            "nbytes": _span(list(t.shape), list(t.stride()), t.element_size())}


def _span(shape: list[int], stride: list[int], itemsize: int) -> int:
    """Bytes a strided tensor's elements reach (0 when it has none)."""
    if any(d == 0 for d in shape):
        return 0
    return (1 + sum((d - 1) * s for d, s in zip(shape, stride, strict=True))) * itemsize


#: Bytes per element of torch's dtypes, by the name a record gives it (``describe``): what the static checks
#: of a record need, without importing torch (tests/test_stored_recipes.py holds it to torch's own). A name
#: not here (a dtype a newer torch adds) is looked up in torch.
ITEMSIZE: dict[str, int] = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2,
    "complex128": 16, "cdouble": 16, "complex64": 8, "cfloat": 8, "complex32": 4, "chalf": 4, "bcomplex32": 4,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "short": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1, "qint8": 1, "quint8": 1, "qint32": 4,
    "quint4x2": 1, "quint2x4": 1, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1, "float4_e2m1fn_x2": 1, "bits8": 1, "bits16": 2,
    "bits1x8": 1, "bits2x4": 1, "bits4x2": 1, "bit": 1,
    **{f"int{n}": 1 for n in range(1, 8)}, **{f"uint{n}": 1 for n in range(1, 8)},
}


def _itemsize(dtype: str) -> int | None:
    size = ITEMSIZE.get(dtype)
    if size is None and dtype.isidentifier():  # a dtype the table does not know (a newer torch's): torch says
        import torch

        value = getattr(torch, dtype, None)
        return value.itemsize if isinstance(value, torch.dtype) else None
    return size


def _bytes(t: Any) -> int:
    import torch

    return int(torch.ops.mkldnn._nbytes(t)) if t.is_mkldnn else t.numel() * t.element_size()


def _encode(value: Any, refs: dict[Any, int]) -> Any:
    """An FX argument as JSON: ``{"ref": i}`` for the i-th value of the program, tagged dtypes and
    devices, lists; anything else is refused."""
    import torch

    if isinstance(value, torch.fx.Node):
        return {"ref": refs[value]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_encode(v, refs) for v in value]
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).replace("torch.", "")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if isinstance(value, torch.memory_format):
        return {"memory_format": str(value).replace("torch.", "")}
    if isinstance(value, torch.layout):
        return {"layout": str(value).replace("torch.", "")}
    raise RecipeError(f"a folded constant's computation has an argument of type {type(value).__name__}")


def _decode(value: Any, values: list[Any]) -> Any:
    import torch

    if isinstance(value, list):
        return [_decode(v, values) for v in value]
    if isinstance(value, dict):
        (kind, v), = value.items()
        if kind == "ref":
            return values[v]
        if kind in ("dtype", "memory_format", "layout"):
            out = getattr(torch, v, None)
            if not isinstance(out, (torch.dtype, torch.memory_format, torch.layout)):
                raise RecipeError(f"a recipe names {kind} {v!r}")
            return out
        if kind == "device":
            if not _DEVICE.match(v):
                raise RecipeError(f"a recipe names device {v[:40]!r}")
            return torch.device(v)
        raise RecipeError(f"a recipe holds an argument tagged {kind!r}")
    return value


class FoldRecorder:
    """Records, during one Inductor compile with ``freezing``, how every folded constant is computed.

    Patches (process-wide, only while active) ``constant_folding.replace_node_with_constant``,
    through which Inductor's constant folding turns each foldable node into a new constant: before
    the node goes, its computation from the graph's earlier constants is kept (the nodes between the
    ``get_attr`` leaves and it). And ``freezing.freeze``, to read the frozen graph's constants at the
    end. While active it also leaves small linear weights unpacked (:func:`small_linears_unpacked`).
    :meth:`recipes` then writes each final constant as a program over the module's tensors."""

    def __init__(self, tensors: dict[str, Any]):
        #: the module's tensors under each of their names, and what the exported program holds besides
        #: them (aoti._promote_lifted_constants): the only inputs a recipe may have
        self.tensors = tensors
        #: id(folded tensor) -> (the tensor, kept alive so its id stays its own; leaves; program)
        self._folded: dict[int, tuple[Any, list[Any], list[tuple[Any, list[Any], dict[str, Any]]]]] = {}
        #: the frozen graph's constants: get_attr target -> tensor
        self.final: dict[str, Any] = {}
        #: :meth:`_checked_recipes` of the last freeze, running beside the rest of the compile
        self._checked: Future[dict[str, dict[str, Any]]] | None = None

    @contextlib.contextmanager
    def active(self) -> Iterator[FoldRecorder]:
        from concurrent.futures import ThreadPoolExecutor  # build only: the runtime imports this module too

        import torch._inductor.constant_folding as folding
        import torch._inductor.freezing as freezing

        replace, freeze = folding.replace_node_with_constant, freezing.freeze

        def recording_replace(gm: Any, node: Any, constant: Any = None, name: str | None = None) -> None:
            if constant is not None:
                self._record(gm, node, constant)
            return replace(gm, node, constant, name)

        def recording_freeze(*args: Any, **kwargs: Any) -> Any:
            gm, preserved = freeze(*args, **kwargs)
            for n in gm.graph.find_nodes(op="get_attr"):
                self.final[n.target] = _attr(gm, n.target)
            self._checked = pool.submit(self._checked_recipes, dict(self._folded), dict(self.final))
            return gm, preserved

        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="aotbuild-recipes") as pool:
            folding.replace_node_with_constant, freezing.freeze = recording_replace, recording_freeze
            try:
                with small_linears_unpacked():
                    yield self
            finally:
                folding.replace_node_with_constant, freezing.freeze = replace, freeze

    def _record(self, gm: Any, node: Any, constant: Any) -> None:
        # The node's ancestors: get_attr leaves (earlier constants) and the operators between.
        seen, stack = set(), [node]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            seen.add(n)
            if n.op == "placeholder":
                raise RecipeError(f"the folded constant {node.name} depends on a graph input")
            if n.op != "get_attr":
                stack.extend(n.all_input_nodes)
        ordered = [n for n in gm.graph.nodes if n in seen]
        leaves = [n for n in ordered if n.op == "get_attr"]
        refs = {n: i for i, n in enumerate(leaves)}
        program = []
        for n in ordered:
            if n.op == "get_attr":
                continue
            if n.op != "call_function":
                raise RecipeError(f"the folded constant {node.name} is computed by a {n.op} node")
            refs[n] = len(refs)
            program.append((n.target, list(n.args), dict(n.kwargs), refs))
        self._folded[id(constant)] = (constant, [_attr(gm, n.target) for n in leaves],
                                      [(_op_name(t), _encode(a, r), {key: _encode(v, r) for key, v in k.items()})
                                       for t, a, k, r in program])

    def recipes(self, folded: dict[int, Any], final: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """get_attr target -> ``{"inputs": [module tensor names], "program": [[op, args, kwargs], ...]}``
        for each constant of ``final`` (the frozen graph's), from ``folded`` (what folding recorded).
        Each step's value is numbered by its position (``{"ref": i}`` reads step i's); ``["input", [j],
        {}]`` is ``inputs[j]``; the last step's value is the constant. A module tensor as it is: one step."""
        names = _tensor_names(self.tensors)
        out = {}
        for target, tensor in final.items():
            inputs: list[str] = []
            program: list[list[Any]] = []
            _inline(tensor, folded, names, inputs, program, {})
            out[target] = {"inputs": inputs, "program": program}
        return out

    def _checked_recipes(self, folded: dict[int, Any], final: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The recipe of every constant of the frozen graph (``final``) that is not a module tensor under
        its own name, each replayed on the build's weights and compared with Inductor's value bit for bit.

        Started when freezing ends, in a thread, while Inductor generates and compiles its code (Python
        and g++ on one core each, mostly one at a time): at SD 1.5 size 4 s of oneDNN reorders that
        ran after the compile before. It reads only the module's tensors and the snapshots it is given."""
        checked = {}
        for target, recipe in self.recipes(folded, final).items():
            if recipe["inputs"] == [target] and len(recipe["program"]) == 1:
                continue  # a weight as it is: supplied live, as without freezing
            recipe["value"] = describe(final[target])
            _refuse_dequantized(target, recipe, self.tensors)
            for op, _, _ in recipe["program"]:
                if op != "input":
                    resolve_op(op, recipe["value"]["dtype"])  # what a load would refuse is not stored
            if len(recipe["program"]) > MAX_STEPS:
                raise RecipeError(f"{target!r} is folded in {len(recipe['program'])} steps, more than the "
                                  f"{MAX_STEPS} a recipe may have")
            try:
                same = same_value(replay(recipe, self.tensors), final[target])
            except RecipeError as exc:
                raise RecipeError(f"replaying how Inductor folded {target!r} does not give its value: {exc}") from None
            if not same:
                raise RecipeError(f"replaying how Inductor folded {target!r} does not give its value")
            checked[target] = recipe
        return checked

    def derived(self, fqns: list[str], made: dict[str, Any] | None = None) -> dict[str, dict[str, Any]]:
        """The recipe of every constant in ``fqns`` (what the package asks for) that is not a module
        tensor under its own name, each checked by replaying it on the build's weights. ``made``: constants
        Inductor's lowering made after freezing (calibrate.made_constants), which the caller stores
        instead; a frozen constant is never one of them."""
        checked = self._checked.result() if self._checked is not None else {}  # raises what the check found
        out = {}
        for fqn in fqns:
            if fqn in checked:
                out[fqn] = checked[fqn]
            elif fqn not in self.tensors and (fqn not in (made or {}) or fqn in self.final):
                raise RecipeError(f"the package asks for {fqn!r}, which freezing made and whose computation "
                                  f"from the weights was not recorded")
        self._folded.clear()  # the build's folded tensors (a second copy of the weights) are not needed now
        self.final.clear()
        return out


def _quantized_dtype(t: Any) -> bool:
    """An integer tensor narrower than 32 bits (int8, uint8, int16; not bool): a quantized weight's."""
    import torch

    return not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool and t.dtype.itemsize < 4


def _refuse_dequantized(target: str, recipe: dict[str, Any], tensors: dict[str, Any]) -> None:
    """A folded float constant made from an integer weight is a quantized weight dequantized at compile
    time: a package would hold and compute with float weights (4x an int8 weight's bytes), not the
    format the recipe asked for. The build refuses to prepack it."""
    if not recipe["value"]["dtype"].startswith(("float", "bfloat")):
        return
    integer = [name for name in recipe["inputs"] if name in tensors and _quantized_dtype(tensors[name])]
    if integer:
        raise RecipeError(f"freezing folds the {tensors[integer[0]].dtype} weight {integer[0]!r} into a "
                          f"{recipe['value']['dtype']} constant ({target}): it would serve the quantized weights "
                          f"dequantized; build without compile.options.freezing")


@contextlib.contextmanager
def small_linears_unpacked() -> Iterator[None]:
    """While active, Inductor's freezing packs only linear weights of more than :data:`SMALL_LINEAR`
    elements: its weight-pack pattern's check (``_is_packable_linear``, torch 2.13's
    ``fx_passes/mkldnn_fusion.py``, registered once per process by ``freezing_patterns.lazy_init``) has
    no size setting, so each pattern entry's check is wrapped, and put back on exit. A torch whose
    entries go by another name packs every linear, as before."""
    import torch
    from torch._inductor.fx_passes import freezing_patterns

    freezing_patterns.lazy_init()  # registers the patterns (cached: freezing's own call then finds them)
    entries = [entry for patterns in freezing_patterns.pass_patterns for listed in patterns.patterns.values()
               for entry in listed if getattr(entry.extra_check, "__name__", "") == "_is_packable_linear"]
    checks = [entry.extra_check for entry in entries]

    def gated(check: Any) -> Any:
        def large_enough(match: Any) -> bool:
            node = match.output_node()
            weight = node.args[2 if node.target is torch.ops.aten.addmm.default else 1]
            value = weight.meta.get("val") if hasattr(weight, "meta") else None
            return value is not None and value.numel() > SMALL_LINEAR and check(match)

        large_enough.__name__ = check.__name__
        return large_enough

    for entry, check in zip(entries, checks, strict=True):
        entry.extra_check = gated(check)
    try:
        yield
    finally:
        for entry, check in zip(entries, checks, strict=True):
            entry.extra_check = check


def wanted(inductor_configs: dict[str, Any]) -> bool:
    """Whether a package is built with Inductor's freezing (its constants then need recipes)."""
    return any(key.replace("-", "_") == "freezing" and bool(value) for key, value in inductor_configs.items())


def check_other_weights(path: Any, module: Any, state: dict[str, Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any], record: dict[str, Any], lifted: dict[str, Any],
                        noise: float = 0.0) -> None:
    """Serve the package with *other* weights of the same shapes and compare with eager on those
    weights: a value Inductor baked in from the build's weights, which no replay on the build's weights
    can show, fails the build here instead of serving another checkpoint wrongly.

    The other weights are new tensors made from the build's own (:func:`other_weights`), freed on
    return. Changing the build's weights in place instead holds no less memory: ``from_pretrained``
    maps the checkpoint's file and a forked job shares the loader's pages, so the first write to each
    page copies it (copy on write), and that copy is what a new tensor costs too -- only slower, page
    by page, with a second pass to put every bit back (SD 1.5-size UNet, forked job: 13 s and 2 s
    against 4 s; docs/prepack.md)."""
    import torch
    from torch.utils._pytree import tree_leaves

    from aotbuild.strategies.subclasses import wrapped

    other = other_weights(state, [*record["constants"], *record.get("derived_from", {})])
    sources = {**state, **other, **lifted}
    supplied = {**{fqn: other[fqn] for fqn in record["constants"]},
                **{k: v for k, v in lifted.items() if k not in record.get("lifted_unsupplied", [])},
                **{name: replay(recipe, sources) for name, recipe in record["derived"].items()}}
    loaded = torch._inductor.aoti_load_package(str(path))
    loaded.load_constants(supplied, check_full_update=True, user_managed=True)
    with torch.no_grad():
        served = tree_leaves(loaded(*args, **kwargs))
        del loaded, supplied  # the prepacked copies: not needed for eager's call
        eager = tree_leaves(torch.func.functional_call(module, wrapped(module, other), args, kwargs))
    low = any(t.dtype in (torch.float16, torch.bfloat16) for t in other.values())
    if not low:
        for a, b in zip(served, eager, strict=True):
            if isinstance(b, torch.Tensor):
                worst = _relative(a, b)
                if not worst <= max(1e-4, OTHER_NOISE * noise):
                    raise RecipeError(f"served with other weights, the frozen package differs from eager by "
                                      f"{worst:.3g} (relative): Inductor compiled a value of the build's weights in")
        return
    # bf16/fp16: eager rounds after every op, the compiled graph keeps fused intermediates in fp32, so the
    # two differ by rounding alone (a tiny UNet in bf16: 5.2 % apart, the package 1.9 % from fp32 eager,
    # bf16 eager 3.5 %). Both are judged against eager in fp32 on the same other weights: a value baked
    # in from the build's weights puts the package far from it, rounding does not (issue 57).
    reference = _in_float32(module, {**state, **other}, args, kwargs)
    for a, b, r in zip(served, eager, reference, strict=True):
        if isinstance(r, torch.Tensor):
            worst, rounding = _relative(a, r), _relative(b, r)
            if not worst <= max(1e-2, 2 * rounding, OTHER_NOISE * noise):
                raise RecipeError(f"served with other weights, the frozen package differs from eager in float32 by "
                                  f"{worst:.3g} (relative; eager in {b.dtype} by {rounding:.3g}): Inductor compiled a "
                                  f"value of the build's weights in")


def _relative(a: Any, b: Any) -> float:
    """The largest difference of two outputs, relative to ``b``'s largest magnitude (at least 1)."""
    scale = max(1.0, b.detach().float().abs().max().item())
    return (a.float() - b.float()).abs().max().item() / scale


def _in_float32(module: Any, weights: dict[str, Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The outputs of ``module`` with ``weights`` and the inputs upcast to float32 (copies, freed on return):
    the reference a low-precision package and eager are both held to."""
    import torch
    from torch.utils._pytree import tree_leaves, tree_map

    from aotbuild.strategies.subclasses import wrapped

    def up(value: Any) -> Any:
        return value.float() if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    with torch.no_grad():
        return tree_leaves(torch.func.functional_call(module, wrapped(module, {k: up(v) for k, v in weights.items()}),
                                                      tree_map(up, args), tree_map(up, kwargs)))


#: With other weights (:func:`other_weights`: scaled by 2 by turns) the activations are larger and a
#: dynamically quantized activation's rounding moves an output further than with the build's own: the
#: one-level tiny UNet in int8dq, served by a package *without* freezing (nothing to bake), is 4.2e-2 from
#: eager with other weights, 1.7e-3 with its own. :func:`check_other_weights` allows this many times the
#: proof's noise (a value baked in from the build's weights moves an output by its whole size).
OTHER_NOISE = 10

#: the scales of :func:`other_weights`, by turns
OTHER_SCALES = (-1.0, 2.0, -2.0)


def other_weights(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """``names``' tensors as other weights, each a new tensor: a floating tensor reversed along every
    dimension and scaled by -1, 2 or -2 (by turns, so that no two neighbours, a query's and a key's
    projection, keep their product); an all-zero one, which that leaves as it is, replaced by noise; a
    quantized weight's integers (int8) reversed; any other tensor that is not floating as it is. A tensor
    under two names gets one other value."""
    import torch

    generator = torch.Generator().manual_seed(39)
    other: dict[str, Any] = {}
    done: dict[int, Any] = {}  # id -> its other value: a tensor under two names changes once
    with torch.no_grad():
        for i, fqn in enumerate(names):
            t = state[fqn]
            if id(t) not in done and _quantized_dtype(t) and t.dim():
                other[fqn] = done[id(t)] = t.flip(list(range(t.dim())))  # a quantized weight's integers
                continue
            if id(t) in done or not t.is_floating_point():
                other[fqn] = done.get(id(t), t)
                continue
            if not t.any():
                value = torch.randn(t.shape, generator=generator).to(t.device, t.dtype)
            else:
                value = t.flip(list(range(t.dim()))).mul_(OTHER_SCALES[i % len(OTHER_SCALES)])
            other[fqn] = done[id(t)] = value
    return other


def _attr(gm: Any, target: str) -> Any:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _storage_key(t: Any) -> tuple[Any, ...] | None:
    if getattr(t, "is_mkldnn", False):
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _tensor_names(tensors: dict[str, Any]) -> dict[tuple[Any, ...], str]:
    """Each tensor by its memory (the compile sees the module's weights detached, not as the objects)."""
    names: dict[tuple[Any, ...], str] = {}
    for fqn, t in tensors.items():
        key = _storage_key(t)
        if key is not None:
            names.setdefault(key, fqn)
    return names


def _inline(tensor: Any, folded: dict[int, Any], names: dict[tuple[Any, ...], str], inputs: list[str],
            program: list[list[Any]], done: dict[int, int]) -> int:
    """Append what computes ``tensor`` to ``program``; the index of its value. A module tensor is the
    step ``["input", [i], {}]`` (its name is ``inputs[i]``), a folded one the steps that computed it from
    its leaves, each leaf inlined first (folding runs in rounds: a leaf can itself be folded)."""
    if id(tensor) in done:
        return done[id(tensor)]
    key = _storage_key(tensor)
    if key is not None and key in names:
        if names[key] not in inputs:
            inputs.append(names[key])
        program.append(["input", [inputs.index(names[key])], {}])
        done[id(tensor)] = len(program) - 1
        return done[id(tensor)]
    if id(tensor) not in folded:
        raise RecipeError(f"a frozen constant of shape {list(tensor.shape)} is neither a module tensor nor "
                          f"computed from them (a value Inductor made: it would be the build's)")
    _, leaves, steps = folded[id(tensor)]
    local = [_inline(leaf, folded, names, inputs, program, done) for leaf in leaves]

    def remap(v: Any) -> Any:
        if isinstance(v, list):
            return [remap(x) for x in v]
        if isinstance(v, dict) and set(v) == {"ref"}:
            return {"ref": local[v["ref"]]}
        if isinstance(v, dict):
            return {k: remap(x) for k, x in v.items()}
        return v

    for op, args, kwargs in steps:
        program.append([op, remap(args), remap(kwargs)])
        local.append(len(program) - 1)
    done[id(tensor)] = local[-1]
    return local[-1]


#: Operators that read their input into a new tensor of their own (oneDNN's weight reorders): a clone
#: read by one of them alone is an intermediate, copied into :class:`Scratch` memory instead of fresh.
_FRESH_READERS = frozenset({"mkldnn._reorder_convolution_weight", "mkldnn._reorder_linear_weight"})
CLONE = "aten.clone.default"


class Scratch:
    """Memory reused by a run of replays for their intermediates (freezing's clone of each 3x3
    convolution weight to channels_last before its reorder). A copy into pages already touched costs
    about half of one into fresh pages, which every new allocation of this size is (measured at SD 1.5
    size: benchmarks/README.md, "The first image: where the derivation goes"). One per run of replays
    (the runner's derive); its memory goes with it."""

    def __init__(self) -> None:
        self._buffers: dict[Any, Any] = {}
        self.used = 0  # clones written here

    def clone(self, src: Any, memory_format: Any) -> Any:
        """``src.clone(memory_format=...)``, in this scratch's memory: valid until the next call."""
        import torch

        layout = torch.empty_like(src, memory_format=memory_format)  # its strides; its pages are never touched
        span = _span(list(layout.shape), list(layout.stride()), 1)
        buffer = self._buffers.get(src.dtype)
        if buffer is None or buffer.numel() < span:
            buffer = self._buffers[src.dtype] = torch.empty(span, dtype=src.dtype)
        out = buffer.as_strided(layout.shape, layout.stride())
        out.copy_(src)
        self.used += 1
        return out

    def holds(self, t: Any) -> bool:
        """Whether ``t`` reads this scratch's memory (an operator that returned a view of its input); True
        where that cannot be told (a torch without ``mkldnn.data_ptr``): then it is made again, never shared."""
        import torch

        try:
            start = int(torch.ops.mkldnn.data_ptr(t)) if t.is_mkldnn else t.untyped_storage().data_ptr()
        except (AttributeError, RuntimeError, NotImplementedError):
            return True
        return any(b.data_ptr() <= start < b.data_ptr() + b.numel() * b.element_size()
                   for b in self._buffers.values())


def _scratch_clones(program: list[Any]) -> set[int]:
    """The steps of ``program`` that are a clone read by exactly one later step, one of
    :data:`_FRESH_READERS`, and are not the result."""
    readers: dict[int, list[int]] = {}
    for j, (_, args, kwargs) in enumerate(program):
        for ref in _refs(args) + _refs(kwargs):
            readers.setdefault(ref, []).append(j)
    return {i for i, (op, _, kwargs) in enumerate(program[:-1])
            if op == CLONE and len(readers.get(i, [])) == 1 and program[readers[i][0]][0] in _FRESH_READERS
            and set(kwargs) <= {"memory_format"}}


def _refs(value: Any) -> list[int]:
    if isinstance(value, list):
        return [r for v in value for r in _refs(v)]
    if isinstance(value, dict):
        if set(value) == {"ref"} and isinstance(value["ref"], int):
            return [value["ref"]]
        return [r for v in value.values() for r in _refs(v)]
    return []


def replay(recipe: dict[str, Any], tensors: dict[str, Any], scratch: Scratch | None = None) -> Any:
    """Run a recipe (as :func:`check_record` passed it) on ``tensors`` (module tensor name -> tensor); the
    constant it computes, checked against the one the build recorded (``recipe["value"]``). ``scratch``:
    memory for intermediates that no result keeps (:class:`Scratch`).

    No step may make a tensor of more than twice the larger of the recorded constant's bytes and its
    largest input's (plus 64 KiB): a broadcasting step is refused before it runs, any other after (each
    of the others makes at most a fixed multiple of what it reads). Every failure is a RecipeError
    naming the step."""
    import torch

    declared = recipe["value"]
    fmt = declared["dtype"]
    inputs = [tensors[name] for name in recipe["inputs"]]
    bound = 2 * max([declared["nbytes"], *(_bytes(t) for t in inputs)]) + (64 << 10)
    values: list[Any] = []
    scratched = _scratch_clones(recipe["program"]) if scratch is not None else set()
    with torch.no_grad():
        for i, (op, args, kwargs) in enumerate(recipe["program"]):
            if op == "input":
                values.append(inputs[args[0]].detach())
                continue
            fn = resolve_op(op, fmt)
            why = _cast_problem(op, args, kwargs, fmt)
            if why:
                raise RecipeError(f"step {i} ({op}) {why}")
            a, k = _decode(args, values), {name: _decode(v, values) for name, v in kwargs.items()}
            try:
                if op in _BROADCASTING:
                    operands = [x for x in a if isinstance(x, torch.Tensor)]
                    size = math.prod(torch.broadcast_shapes(*(x.shape for x in operands))) * max(
                        x.element_size() for x in operands) if operands else 0
                    if size > bound:
                        raise RecipeError(f"step {i} ({op}) would make {size} bytes, more than the {bound} its "
                                          f"recipe may use")
                if i in scratched and len(a) == 1 and isinstance(a[0], torch.Tensor) and not a[0].is_mkldnn:
                    out = scratch.clone(a[0], k.get("memory_format", torch.preserve_format))
                else:
                    out = fn(*a, **k)
                    if scratch is not None and isinstance(out, torch.Tensor) and any(
                            isinstance(x, torch.Tensor) and not x.is_mkldnn and scratch.holds(x) for x in a) \
                            and scratch.holds(out):
                        out = fn(*[x.clone() if isinstance(x, torch.Tensor) and scratch.holds(x) else x for x in a],
                                 **k)  # a view of the scratch: made again from memory of its own
            except RecipeError:
                raise
            except (RuntimeError, TypeError, ValueError, IndexError, OverflowError) as exc:
                why = (str(exc).strip().splitlines() or [""])[0][:200]
                raise RecipeError(f"step {i} ({op}) fails: {type(exc).__name__}: {why}") from None
            if isinstance(out, torch.Tensor) and _bytes(out) > bound:
                raise RecipeError(f"step {i} ({op}) made {_bytes(out)} bytes, more than the {bound} its recipe "
                                  f"may use")
            values.append(out)
    value = values[-1]
    why = _unlike(value, declared)
    if why:
        raise RecipeError(f"it made {why}")
    return value


def _cast_problem(op: str, args: Any, kwargs: Any, fmt: str) -> str:
    """Why a cast step is not one freezing records for a ``fmt`` constant (a cast to float32, or to
    ``fmt`` itself), or "" (and "" for any other step)."""
    if op != CAST:
        return ""
    if isinstance(args, list) and len(args) > 1:
        dtype = args[1]
    else:
        dtype = kwargs.get("dtype") if isinstance(kwargs, dict) else None
    allowed = " or ".join(dict.fromkeys(("float32", fmt)))
    if not (isinstance(dtype, dict) and dtype.get("dtype") in ("float32", fmt)):
        return f"casts to {str(dtype)[:40]}: a {fmt} constant's recipe casts only to {allowed}"
    return ""


def _unlike(value: Any, declared: dict[str, Any]) -> str:
    """How ``value`` differs from the constant the build recorded, or ""."""
    import torch

    if not isinstance(value, torch.Tensor):
        return f"a {type(value).__name__}, not a tensor"
    got = describe(value)
    if got["layout"] == "mkldnn" == declared["layout"]:
        # oneDNN's padding follows the CPU's ISA (a key factor): equal on the build's ISA, bounded here
        same = got["shape"] == declared["shape"] and got["dtype"] == declared["dtype"] \
            and got["nbytes"] <= 2 * declared["nbytes"] + (64 << 10)
    else:
        same = got == declared
    if same:
        return ""
    shown = {k: v for k, v in got.items() if declared.get(k) != v}
    return f"{shown}, where the build recorded {({k: declared.get(k) for k in shown})}"


def same_value(a: Any, b: Any) -> bool:
    """Two constants hold the same values (oneDNN's blocked tensors compared as dense ones)."""
    import torch

    a = a.to_dense() if a.is_mkldnn else a
    b = b.to_dense() if b.is_mkldnn else b
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


#: :func:`check_record`'s word for a record of prepacked constants made before each constant's value and
#: the package's constant names were recorded (issue 53): a stale entry (a miss ``build`` rebuilds and
#: ``gc --stale`` removes), not a malformed one (aotbuild/cache/store.py, ``RecordsCheck``).
STALE = (f"{STALE_RECORDS}its prepacked constants were recorded by an older aotbuild, without their shapes and the "
         "package's constant names (issue 53): rebuild it")

#: The tags an argument may carry, and the devices a ``{"device": ...}`` may name.
_TAGS = frozenset({"ref", "dtype", "device", "memory_format", "layout"})
_DEVICE = re.compile(r"^(cpu|cuda|xpu)(:[0-9]{1,2})?$")


def _refs_ok(value: Any, below: int) -> bool:
    if isinstance(value, list):
        return all(_refs_ok(v, below) for v in value)
    if isinstance(value, dict):
        if set(value) == {"ref"}:
            return isinstance(value["ref"], int) and not isinstance(value["ref"], bool) and 0 <= value["ref"] < below
        if len(value) != 1 or not all(isinstance(v, str) for v in value.values()):
            return False
        (kind, v), = value.items()
        return kind in _TAGS and (kind != "device" or bool(_DEVICE.match(v))) and (
            kind not in ("dtype", "memory_format", "layout") or v.isidentifier())
    return value is None or isinstance(value, (bool, int, float, str))


def _ints(value: Any, low: int = 0) -> bool:
    return isinstance(value, list) and len(value) <= 8 and all(
        isinstance(d, int) and not isinstance(d, bool) and low <= d < 1 << 40 for d in value)


def dims_ok(value: Any) -> bool:
    """Whether a record's shape is a list of at most 8 sizes, each from 0 to below 2**40: a declared
    shape bounds what a recipe may make (:data:`PACK_FACTOR` times what it reads)."""
    return _ints(value)


def _value_problem(value: Any) -> str:
    """What is wrong with a recipe's recorded constant (:func:`describe`), or ""."""
    if not isinstance(value, dict) or not isinstance(value.get("dtype"), str) or not _ints(value.get("shape")) \
            or value.get("layout") not in ("strided", "mkldnn") or not _ints([value.get("nbytes")]):
        return "not {shape, dtype, layout, nbytes}"
    itemsize = _itemsize(value["dtype"])
    if itemsize is None:
        return f"dtype {value['dtype'][:40]!r} is no torch dtype"
    if value["layout"] == "strided":
        if not _ints(value.get("stride")) or len(value["stride"]) != len(value["shape"]) or set(value) != {
                "shape", "dtype", "layout", "stride", "nbytes"}:
            return "a strided constant without its strides"
        if value["nbytes"] != _span(value["shape"], value["stride"], itemsize):
            return "nbytes is not what its shape and strides reach"
    elif set(value) != {"shape", "dtype", "layout", "nbytes"} or value["nbytes"] < math.prod(value["shape"]) * itemsize:
        return "an opaque constant smaller than its elements"
    return ""


def check_record(record: dict[str, Any]) -> str:
    """What is wrong with a package record's recipes (``derived``, ``derived_from``), or "": the static
    checks of every manifest read and of ``verify``, which load nothing (a package's ``.so`` runs when it
    is loaded). Each recipe: steps of :data:`OPERATORS` for its constant's format, each reading values
    computed before it, its inputs among the weights (``derived_from``) and lifted constants the record
    names, its recorded constant well-formed and at most :data:`PACK_FACTOR` times the bytes of its inputs
    (plus :data:`PACK_SLACK`); no name both a derived constant and a weight."""
    derived = record.get("derived", {})
    if not isinstance(derived, dict):
        return "packages[].derived: not an object"
    if derived and ("asks" not in record or any(isinstance(r, dict) and "value" not in r for r in derived.values())):
        return STALE  # recorded before each constant was (issue 53): every other entry still serves
    sources = record.get("derived_from", {})
    if not isinstance(sources, dict) or not all(isinstance(m, list) and len(m) == 3 and _ints(m[0])
                                                and isinstance(m[1], str) for m in sources.values()):
        return "packages[].derived_from: not {name: [shape, dtype, device]}"
    lifted = record.get("lifted", {}) if isinstance(record.get("lifted", {}), dict) else {}
    readable = {name: meta[:2] for name, meta in {**lifted, **sources}.items() if isinstance(meta, list)}
    constants = record.get("constants", {})
    for name, recipe in derived.items():
        where = f"packages[].derived[{name[:40]!r}]"
        if (not isinstance(recipe, dict) or not isinstance(recipe.get("inputs"), list)
                or not all(isinstance(i, str) for i in recipe["inputs"])
                or not isinstance(recipe.get("program"), list) or not recipe["program"]):
            return f"{where}: not {{inputs, program, value}}"
        if isinstance(constants, dict) and name in constants:
            return f"{where}: also a weight the package is handed as it is"
        if len(recipe["program"]) > MAX_STEPS:
            return f"{where}: {len(recipe['program'])} steps, more than {MAX_STEPS}"
        why = _value_problem(recipe.get("value"))
        if why:
            return f"{where}.value: {why}"
        unknown = [i for i in recipe["inputs"] if i not in readable]
        if unknown:
            return f"{where}: reads {unknown[0][:60]!r}, which is not among the weights it is derived from"
        read = 0
        for i in recipe["inputs"]:
            shape, dtype = readable[i]
            read += math.prod(shape) * (_itemsize(dtype) or 8)
        if recipe["value"]["nbytes"] > PACK_FACTOR * read + PACK_SLACK:
            return (f"{where}: declares {recipe['value']['nbytes']} bytes, more than {PACK_FACTOR}x the "
                    f"{read} it reads")
        for i, step in enumerate(recipe["program"]):
            if (not isinstance(step, list) or len(step) != 3 or not isinstance(step[0], str)
                    or not isinstance(step[1], list) or not isinstance(step[2], dict)):
                return f"{where}: step {i} is not [op, args, kwargs]"
            if step[0] == "input":
                if step[1] not in ([n] for n in range(len(recipe["inputs"]))) or step[2]:
                    return f"{where}: step {i} names no input"
                continue
            try:
                allowed_op(step[0], recipe["value"]["dtype"])  # resolved (and its schema checked) when replayed
            except RecipeError as exc:
                return f"{where}: {exc}"
            why = _cast_problem(step[0], step[1], step[2], recipe["value"]["dtype"])
            if why:
                return f"{where}: step {i} {why}"
            if not _refs_ok(step[1], i) or not _refs_ok(list(step[2].values()), i) \
                    or not all(isinstance(k, str) and k.isidentifier() for k in step[2]):
                return f"{where}: step {i} reads a value not computed before it, or an argument of no known kind"
    unsupplied = record.get("lifted_unsupplied", [])
    if not isinstance(unsupplied, list) or not all(isinstance(n, str) for n in unsupplied):
        return "packages[].lifted_unsupplied: not a list of names"
    if "asks" not in record:  # a package without recipes, built before the list was recorded: the load
        return ""               # compares the package's own list with what the record supplies
    asks = record.get("asks")
    if not isinstance(asks, list) or not all(isinstance(n, str) for n in asks):
        return "packages[].asks: not the list of the package's constants"
    supplied = {*(constants if isinstance(constants, dict) else {}), *derived,
                *(n for n in lifted if n not in unsupplied)}
    if set(asks) != supplied:
        missing, extra = sorted(set(asks) - supplied), sorted(supplied - set(asks))
        return (f"packages[].asks: the package asks for {missing[0][:60]!r}, which no weight, recipe or lifted "
                f"constant supplies" if missing else
                f"packages[]: {extra[0][:60]!r} is supplied but the package does not ask for it")
    return ""
