"""``model.quantization``: a denoiser quantized with torchao after loading, keyed, built, served.

diffusers 0.42.1 takes torchao only through ``PipelineQuantizationConfig(quant_mapping=...)`` with a
config instance (and then makes the quantized component bfloat16 unless told otherwise), so
aotbuild maps ``quant_type`` to torchao's config class itself and calls ``quantize_`` on each
component after ``from_pretrained``, in the build job, the proof and ``load_compiled`` alike.

``quantize_`` also changes Inductor's config for the whole process (torchao's
``recommended_inductor_config_setter``: ``force_fuse_int_mm_with_mul``,
``coordinate_descent_tuning``, ``coordinate_descent_check_all_directions``), which the FX graph
cache key holds: those settings are key factors, known from the recipe alone, so plan, job and load
compute one key; the job fails if torchao changed anything else (the key would not say so).
"""

from __future__ import annotations

from typing import Any

from aotbuild.constants import dist_version
from aotbuild.errors import UsageError
from aotbuild.features.base import Feature, Where
from aotbuild.recipe.frozen import thaw
from aotbuild.recipe.schema import CALIBRATED_QUANT_TYPES, QuantSpec, Recipe
from aotbuild.strategies.calibrate import EAGER_BOUND

#: quant_type -> torchao.quantization config class
QUANT_TYPES = {
    "int8wo": "Int8WeightOnlyConfig",
    "int8dq": "Int8DynamicActivationInt8WeightConfig",
    "int4wo": "Int4WeightOnlyConfig",
    "float8wo": "Float8WeightOnlyConfig",
    "float8dq": "Float8DynamicActivationFloat8WeightConfig",
    # calibrated at build, not by quantize_: strategies/calibrate.py (PT2E)
    "int8static": "X86InductorQuantizer",
}
#: What quantize_ sets in Inductor's config unless the config's set_inductor_config is False (torchao
#: 0.18, quantization/utils.py recommended_inductor_config_setter; checked by every build job).
INDUCTOR_SETTINGS = {"coordinate_descent_check_all_directions": True, "coordinate_descent_tuning": True,
                     "force_fuse_int_mm_with_mul": True}

#: The proof's bound for a type that quantizes activations as it runs (int8dq: each row's scale from its
#: max): a compiled reduction that reorders the max moves a scale by an ulp, which flips int8 roundings
#: (one step is 1/127 of a row's range), so compiled and eager differ by more than float32's 1e-4 (the
#: one-level tiny UNet: 1.2e-3 to 2.0e-3 with jit-cache, aot-package and aot-package+freezing alike);
#: 10x that, as a deeper model adds more flips. float8dq quantizes its activations the same way and gets
#: the same bound (not measured here: no float8 kernel on this CPU was checked). Weight-only types compute
#: in the activations' dtype and keep its bound.
TOLERANCE = {"int8dq": 2e-2, "float8dq": 2e-2}
#: int8static's proof compares the served package with the quantized model run eagerly, calibrated in the
#: proof's process as the build calibrated it (proof._quantized_reference), held to a relative bound
#: (``|served - eager| / |eager|`` per output): eager quantizes around float kernels, the package runs int8
#: kernels that requantize each output, so roundings flip and spread (strategies/calibrate.EAGER_BOUND, the
#: job's own check; an output over it passes where the package is as far from the float model as the quantized
#: model is: calibrate.accepted, proof._calibrated_gaps). How far the format is from the
#: float model is recorded beside it, not bounded (a random-weight tiny UNet's int8 was 0.39 from its float
#: self on the pipeline's own calls).
RELATIVE = {"int8static": EAGER_BOUND}

__all__ = ["QUANT_TYPES", "INDUCTOR_SETTINGS", "TOLERANCE", "RELATIVE", "components", "factors", "apply", "require"]


def require() -> Any:
    """torchao, or a UsageError that says how to install it."""
    try:
        import torchao
    except ImportError:
        raise UsageError("model.quantization (backend torchao) needs torchao: pip install 'aotbuild[torchao]'") \
            from None
    return torchao


def components(recipe: Recipe) -> tuple[str, ...]:
    q = recipe.model.quantization
    if q is None:
        return ()
    return q.components if q.components is not None else recipe.compile.components


def _compiles_quantized(recipe: Recipe) -> bool:
    """Whether a component ``recipe`` compiles is quantized. A proof's recipe compiles its job's component
    alone, so an unquantized one (``model.quantization.components: [unet]``, the VAE compiled too) keeps
    its dtype's absolute bound, not the quantized type's looser one."""
    return recipe.model.quantization is not None and bool(set(components(recipe)) & set(recipe.compile.components))


def _sets_inductor(q: QuantSpec) -> bool:
    if q.quant_type in CALIBRATED_QUANT_TYPES:
        return False  # quantize_ is not called: nothing changes Inductor's settings
    return bool(thaw(q.quant_kwargs).get("set_inductor_config", True))


def factors(recipe: Recipe, component: str) -> dict[str, Any] | None:
    """The key factor of a quantized component (None when it is not quantized): the backend and its
    version, the type and its arguments, and the Inductor settings quantize_ makes."""
    q = recipe.model.quantization
    if q is None or component not in components(recipe):
        return None
    return {"backend": q.backend, "version": dist_version("torchao"), "quant_type": q.quant_type,
            "quant_kwargs": thaw(q.quant_kwargs), "inductor": INDUCTOR_SETTINGS if _sets_inductor(q) else {}}


def config(q: QuantSpec) -> Any:
    require()
    import torchao.quantization as quantization

    cls = getattr(quantization, QUANT_TYPES[q.quant_type], None)
    if cls is None:
        raise UsageError(f"this torchao has no {QUANT_TYPES[q.quant_type]} (model.quantization.quant_type "
                         f"{q.quant_type})")
    try:
        return cls(**thaw(q.quant_kwargs))
    except TypeError as exc:
        raise UsageError(f"model.quantization.quant_kwargs: {exc}") from None


def apply(pipe: Any, recipe: Recipe) -> None:
    """Quantize each component the recipe names, in place; the Inductor settings it changed must be
    what the key says."""
    q = recipe.model.quantization
    if q is None or q.quant_type in CALIBRATED_QUANT_TYPES:
        return  # int8static: the served module stays float, its package is int8 (strategies/calibrate.py)
    import torch._inductor.config as inductor_config
    from torchao.quantization import quantize_

    before = inductor_config.get_config_copy()
    for name in components(recipe):
        quantize_(getattr(pipe, name), config(q))
    after = inductor_config.get_config_copy()
    changed = {k: after[k] for k in after if not _same_setting(before.get(k), after[k])}
    declared = INDUCTOR_SETTINGS if _sets_inductor(q) else {}
    if any(declared.get(k, before.get(k)) != v for k, v in changed.items()):
        raise RuntimeError(f"torchao's quantize_ changed Inductor settings the key does not hold: {sorted(changed)} "
                           f"(aotbuild knows {sorted(declared)}); this torchao is not supported yet")


def _same_setting(a: Any, b: Any) -> bool:
    """Two copies of one Inductor setting are equal. ``get_config_copy`` deep-copies each value, and a custom
    pass object has no ``==`` (torchao's X86InductorQuantizer, once imported, sets ``pre_grad_custom_pass``
    to a ``QuantLiftUp``: every copy differed from every other, and ``quantize_`` read as changing it): such
    a pass is the same by its ``uuid()`` (what Inductor's own cache key reads), or by its class."""
    if a == b:
        return True
    if type(a) is not type(b) or a is None:
        return False
    uuid = getattr(a, "uuid", None)
    if callable(uuid):
        try:
            return uuid() == b.uuid()
        except Exception:  # a pass whose uuid needs what it was not given: compared by its class alone
            return True
    return type(a).__eq__ is object.__eq__  # an object without equality of its own: one class, one setting


class Quantization(Feature):
    """``model.quantization``: the compiled components quantized (torchao) before compiling and
    serving, keyed by backend, version, type and what ``quantize_`` sets in Inductor."""

    section = "quantization"

    def factors(self, recipe: Recipe, where: Where) -> dict[str, Any] | None:
        return factors(recipe, where.component)

    def prepare(self, pipe: Any, recipe: Recipe) -> None:
        apply(pipe, recipe)

    def changes_modules(self, recipe: Recipe, component: str) -> bool:
        q = recipe.model.quantization
        if q is not None and q.quant_type in CALIBRATED_QUANT_TYPES:
            return False  # the module is served as it is: its package holds the quantization
        return component in components(recipe)  # torchao's tensor subclasses in its linears

    def tolerance(self, recipe: Recipe) -> float:
        q = recipe.model.quantization
        return TOLERANCE.get(q.quant_type, 0.0) if _compiles_quantized(recipe) else 0.0

    def relative_tolerance(self, recipe: Recipe) -> float:
        q = recipe.model.quantization
        return RELATIVE.get(q.quant_type, 0.0) if _compiles_quantized(recipe) else 0.0
