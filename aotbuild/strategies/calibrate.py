"""``model.quantization.quant_type: int8static``: int8 that reaches the convolutions (issue 57, item 2).

torchao's ``quantize_`` configs replace ``nn.Linear`` weights only, and most of a UNet's work is its
convolutions. PyTorch 2 export quantization does both: the component is exported (``torch.export``),
torchao's ``X86InductorQuantizer`` annotates every convolution and linear (activations uint8 per tensor,
weights int8 per output channel, static), ``prepare_pt2e`` puts observers in, the build calibrates them
on **every call the warmup made** with that call signature, and ``convert_pt2e(fold_quantize=False)``
writes quantize/dequantize pairs around each: Inductor's freezing (aot-package with
``compile.options.freezing``) then lowers each pattern to oneDNN's int8 ``qconv_pointwise`` /
``qlinear_pointwise``.

What that means for serving:

- ``fold_quantize=False`` keeps the float weights as the graph's inputs, so freezing folds each int8
  weight as ``quantize_per_channel(weight, scale, zero_point)`` then ``onednn.qconv_prepack`` /
  ``qlinear_prepack``: recorded like any prepacked constant (prepack.py) and re-derived at load from the
  served float weights. The entry holds no weight.
- The calibrated activation scales are literals of the compiled code and the weights' per-channel
  scales are computed from the weights: a package serves **only the weights it was calibrated on**. Its
  record holds every weight's sha256 (``calibrated``): a load with other weights is a miss ("calibrated
  on other weights": build the recipe with them), and weights changed after load are refused at the next
  call (PackageMismatch), never served with the old scales.
- The per-channel scales and zero points (``convert_pt2e``'s ``_scale_<i>`` / ``_zero_point_<i>``
  buffers) and the scalars Inductor's int8 lowering makes from the activation scales are stored beside
  the package with its other lifted constants.

The served module stays the user's float model: nothing is quantized at load (``model.quantization``'s
``quantize_`` is not called for this type), its package computes in int8.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from aotbuild import forwards
from aotbuild.recipe.schema import CALIBRATED_QUANT_TYPES

#: The quant_types served this way (by strategy aot-package with freezing, on an x86 CPU).
CALIBRATED = CALIBRATED_QUANT_TYPES
#: The key factor (compile settings) saying whether activations keep to 7 bits (a CPU without VNNI).
REDUCE_RANGE = "int8_reduce_range"


def convert(module: Any, calls: list[tuple[tuple[Any, ...], dict[str, Any]]], reduce_range: bool = False) -> Any:
    """``module`` exported for the first of ``calls`` (all of one signature), quantized by torchao's
    ``X86InductorQuantizer`` with observers calibrated on every call in ``calls``: the converted
    ``GraphModule``, its float weights under their own names, each quantized in the graph.
    ``reduce_range``: activations of 7 bits (a CPU without VNNI: Target.int8_reduce_range)."""
    import torch

    with quantizer_passes():
        import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        args, kwargs = calls[0]
        with torch.no_grad(), forwards.class_forward(module):
            exported = torch.export.export(module, args, kwargs)
        config = xiq.get_default_x86_inductor_quantization_config(reduce_range=reduce_range)
        quantizer = xiq.X86InductorQuantizer().set_global(config)
        prepared = prepare_pt2e(exported.module(), quantizer)
        with torch.no_grad():
            for a, k in calls:
                prepared(*a, **k)
        return convert_pt2e(prepared, fold_quantize=False)


#: Inductor's process-wide custom passes (settings ``save_config`` leaves out).
CUSTOM_PASSES = ("pre_grad_custom_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                 "joint_custom_pre_pass", "joint_custom_post_pass")


@contextlib.contextmanager
def quantizer_passes() -> Iterator[None]:
    """While active, Inductor's custom passes are the ones the int8 lowering wants; after, they are what
    they were before, whatever they were.

    Importing torchao's ``X86InductorQuantizer`` sets ``pre_grad_custom_pass`` for the whole process (its
    ``quant_lift_up``, which moves quantize nodes above view ops so the int8 patterns fuse). Left set, every
    later compile in the process (another recipe's jit-cache build, the user's own ``torch.compile``) would
    run it and carry it in Inductor's cache keys, which a serving process without it does not: its
    entries would miss there. The first import sets it by itself; a later one is a no-op, so the pass is
    set here by name where torchao has it."""
    import torch._inductor.config as inductor_config

    before = {k: getattr(inductor_config, k) for k in CUSTOM_PASSES if hasattr(inductor_config, k)}
    try:
        try:
            import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer  # noqa: F401  (sets the pass)
            from torchao.quantization.pt2e.inductor_passes import x86 as x86_passes
        except ImportError as exc:  # the recipe was checked with torchao present; an older one lacks PT2E
            raise RuntimeError(f"quant_type int8static needs torchao's PT2E quantization "
                               f"(torchao.quantization.pt2e): {exc}") from None
        lift_up = getattr(x86_passes, "quant_lift_up", None)
        if lift_up is not None:
            inductor_config.pre_grad_custom_pass = lift_up
        yield
    finally:
        for k, v in before.items():
            setattr(inductor_config, k, v)


@contextlib.contextmanager
def made_constants() -> Iterator[dict[str, Any]]:
    """While active, every constant Inductor's lowering adds to a graph gets a name of its own, and
    the yielded dict gets {name the package asks for it by: value}.

    The int8 lowerings (torch 2.13's mkldnn_lowerings.py) add each activation's scale and zero point
    as a scalar constant named ``x_scale`` / ``x_zp``, and an int32 copy of an int64 weight zero point
    under the buffer's own name: a package built without its constants would ask for several
    different values by one name, and a load can supply only one of them (AOTInductor maps constants
    by that name). A name already another constant's is replaced by the constant's unique name in the
    graph (``x_scale_0``), so each can be supplied."""
    from torch._inductor.graph import GraphLowering

    allocate = GraphLowering.allocate_non_dup_const_name
    made: dict[str, Any] = {}

    def unique(self: Any, name: str | None, data: Any) -> str:
        before = len(self.constants)
        new = allocate(self, name, data)
        if len(self.constants) == before:
            return new  # an existing constant of the same value: nothing added
        fqn = self.allocated_constant_name.get(new, new)
        taken = {v for k, v in self.allocated_constant_name.items() if k != new}
        taken |= set(self.dynamo_flat_name_to_original_fqn.values())
        if fqn in taken:
            fqn = new
            while fqn in taken:
                fqn += "_"
            self.allocated_constant_name[new] = fqn
        made[fqn] = data
        return new

    GraphLowering.allocate_non_dup_const_name = unique
    try:
        yield made
    finally:
        GraphLowering.allocate_non_dup_const_name = allocate


#: How far (relative, ``|served - eager| / |eager|`` over each output) a calibrated package's output may be
#: from the converted model run eagerly on the build's call. Eager quantizes and dequantizes in float32
#: around float kernels; the package runs oneDNN's int8 kernels, which requantize each output with its
#: calibrated scale, so roundings flip and spread through the network. Measured: the one-level tiny UNet
#: 1.6e-7 and a UNet of 32/64 channels 9.6e-2 (2-core AVX2 EPYC, 7-bit activations), SD 1.5 size 4.4e-2
#: (an AVX-512 VNNI CPU, benchmarks/int8_convs.py; 4.4e-2 from float32 eager too) and 8.9e-2 on random
#: inputs on the AVX2 EPYC (torch.compile's own: 9.1e-2). Full-range activations on a CPU without VNNI
#: saturate its int16 sums: 0.22 and 0.34 on the tiny UNets (Target.int8_reduce_range). An output over it
#: can still be served: see :data:`FLOAT_MARGIN`.
EAGER_BOUND = 0.2
#: Where the quantized model is itself far from the float one, its own roundings decide its output, and a
#: package that rounds in other places (each int8 kernel requantizes its output) lands as far from it as
#: from the float model: on the SD 1.5-size pipeline's own random-weight activations (an AVX-512 VNNI Xeon,
#: 2026-12-07) the package was 0.28 from the quantized model run eagerly, while each was 0.315 and 0.316 from
#: the float model (``torch.compile`` with freezing: the same). So an output over :data:`EAGER_BOUND` is
#: accepted where, with q the quantized model's distance from the float model, the package is as far from
#: the float model as the format itself (between q / this and q x this) and at most q x this from the
#: quantized model: then it computes what the format does, and serving it costs no more than the format.
#: Measured ratios (package's distance from float / quantized model's): 0.996 to 1.07 where the kernels
#: compute what the calibration made (SD 1.5 size with VNNI; the same kept from VNNI by
#: ``ONEDNN_MAX_CPU_ISA=AVX2`` at 7 bits, compiled by ``torch.compile``: 0.49 from the quantized model, 0.5805
#: and 0.5808 from float, like the 0.51 an AVX2 EPYC's build was refused at; the 32/64-channel tiny UNet with
#: VNNI, and without it at 7 bits); 1.32 and 3.7 where a CPU without VNNI saturates full-range activations
#: (``ONEDNN_MAX_CPU_ISA=AVX2``, the tiny UNet; its first call 0.41 from the quantized model: refused). The
#: band's lower end refuses a package that lost its int8 kernels (as close to float as float itself), the
#: bound on the gap one whose error points elsewhere than the format's (a wrong output scale).
FLOAT_MARGIN = 1.2
#: The second rule holds only while the quantized model is less than this far from the float one (the
#: largest measured where the kernels were right: 0.58): past it the format's output is mostly its own
#: noise, and an all-zero output (1.0 from float) would fit the band.
FORMAT_NOISE_CAP = 0.75


def relative(a: Any, b: Any) -> float:
    """``|a - b| / |b|`` over the whole tensor (norms), in float32: 0.0 where they are equal, inf where
    they are not and ``b`` is all zeros (no relative figure: never within a bound)."""
    import math

    difference, reference = float((a.float() - b.float()).norm()), float(b.float().norm())
    if difference == 0.0:
        return 0.0
    if not (math.isfinite(reference) and reference > 0.0):
        return math.inf
    return difference / reference


def accepted(gap: float, served_from_float: float, quantized_from_float: float) -> bool:
    """Whether a calibrated package's output, ``gap`` from the quantized model run eagerly and
    ``served_from_float`` from the float model, computes what the calibration made: within
    :data:`EAGER_BOUND` of the quantized model, or (the quantized model ``quantized_from_float`` from the
    float one, less than :data:`FORMAT_NOISE_CAP`) as far from the float model as the quantized model,
    within :data:`FLOAT_MARGIN` either way, and at most :data:`FLOAT_MARGIN` times that from it."""
    if gap <= EAGER_BOUND:
        return True
    q = quantized_from_float
    return (0.0 < q < FORMAT_NOISE_CAP and q / FLOAT_MARGIN <= served_from_float <= q * FLOAT_MARGIN
            and gap <= q * FLOAT_MARGIN)


def check_against_eager(path: Any, converted: Any, weights: dict[str, Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any], record: dict[str, Any], lifted: dict[str, Any],
                        reduce_range: bool = False, floating: Any = None) -> None:
    """The package at ``path``, handed the build's weights as a load hands them (each weight, each derived
    constant replayed, each stored constant), called with the build's call, against ``converted`` (the
    quantized model) run eagerly and ``floating`` (the float model it was calibrated from; None: the bound
    alone): RuntimeError if an output is not :func:`accepted`."""
    import torch
    from torch.utils._pytree import tree_leaves

    from aotbuild.strategies import prepack

    sources = {**weights, **lifted}
    supplied = {**{fqn: weights[fqn] for fqn in record["constants"]},
                **{k: v for k, v in lifted.items() if k not in record.get("lifted_unsupplied", [])},
                **{name: prepack.replay(recipe, sources) for name, recipe in record.get("derived", {}).items()}}
    loaded = torch._inductor.aoti_load_package(str(path))
    loaded.load_constants(supplied, check_full_update=True, user_managed=True)
    with torch.no_grad():
        served = tree_leaves(loaded(*args, **kwargs))
        del loaded, supplied
        eager = tree_leaves(converted(*args, **kwargs))
        floats: list[Any] = [None] * len(eager)
        if floating is not None:
            with forwards.class_forward(floating):
                floats = tree_leaves(floating(*args, **kwargs))
    for a, b, f in zip(served, eager, floats, strict=True):
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            gap = relative(a, b)
            served_f, quantized_f = (relative(a, f), relative(b, f)) if isinstance(f, torch.Tensor) \
                else (float("inf"), 0.0)
            if not accepted(gap, served_f, quantized_f):
                cpu = (" on this CPU without VNNI (7-bit activations): serve dtype float32 here, or build on a CPU "
                       "with avx512_vnni, avx_vnni or amx_int8") \
                    if reduce_range else ""
                beside = (f", and {served_f:.3g} from the float model where the quantized model is {quantized_f:.3g} "
                          f"(accepted: as far from it within {FLOAT_MARGIN}x either way, the quantized model less "
                          f"than {FORMAT_NOISE_CAP} from it)") if isinstance(f, torch.Tensor) else ""
                raise RuntimeError(f"the int8static package differs from the quantized model run eagerly by {gap:.3g} "
                                   f"(relative; at most {EAGER_BOUND} accepted){beside}: its int8 kernels do not "
                                   f"compute what the calibration made{cpu}")
