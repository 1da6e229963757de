"""A recipe resolved for this machine, and the one place a job's key factors are assembled.

:class:`Context` is what every job of one recipe shares here: its ``Target`` and ``Strategy``
objects, the device and dtype they resolve to, the model (a built-in, a folder or a Hub id, found
but not loaded), the environment and the device fingerprint. :func:`job_factors` turns a context
and one job (component, its class and architecture config, shape, pipeline class) into the factors
its key hashes (vLLM's ``compute_env_and_config_hashes`` does the same for its cache); plan, build
job, proof and ``load_compiled`` all call it, so they agree by construction:

==================  ===================================================================================
``format``          aotbuild's key/manifest format version
``model``           pipeline class, weights variant, built-in model version (for ``builtin:`` ids)
``component``       component name, class, architecture config (``config.json`` without paths or
                    versions), dtype
``target``          target name and ``strategy``
``compile``         the target's exact compile settings (scope, mode, fullgraph, dynamic, options,
                    backend) and what the strategy adds (``Strategy.compile_factors``)
``shape``           height, width, batch_size (images per prompt)
``warmup``          every warmup argument but the prompt text; prompts only as ``{"texts": N}`` (guidance
                    and a list of prompts change the denoiser's batch)
``env``             torch version and git build, diffusers, transformers, python major.minor
``device``          the target's fingerprint: device kind and, for CPU Inductor, machine and vector
                    ISA; for CUDA the compute capability, CUDA and Triton versions
``lora``            only with ``lora:``: the rank and target modules compiled for, the adapters' names
``quantization``    only for a quantized component: backend and version, type and arguments, and the
                    Inductor settings the backend sets for the whole process
``changes``         only with ``changes:``: the declared changes of this component (FreeU's factors for
                    the unet, attention processor, cache hook, memory format; aotbuild/pipeline/changes.py)
``parallel``        only with ``parallel.tensor`` > 1: degree, mesh shape, collective backend, the
                    ``_tp_plan``'s sha256, and the rank (aotbuild/features/parallel.py); the thread count
                    keyed (``compile.cpu_threads``) is then a rank's, :func:`parallel.rank_threads`
``text_length``     only with ``text_length:``: the range of text lengths served (aotbuild/pipeline/textlen.py)
``schedulers``      only with ``schedulers:``: the sorted scheduler classes the warmup also ran with
                    (aotbuild/pipeline/schedulers.py)
==================  ===================================================================================

Never an absolute path, hostname, user, cwd, device index or process group name, and a rank only
where the entry is one rank's shard: peers lose caches to exactly that. The factors are written
into each manifest so a miss can be explained later (keys.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from aotbuild import constants
from aotbuild.errors import AotbuildError, ModelUnavailable, ModelUnreachable, TargetUnavailable
from aotbuild.pipeline import models
from aotbuild.recipe.schema import Recipe, Shape
from aotbuild.strategies.base import Strategy
from aotbuild.strategies.registry import get_strategy
from aotbuild.targets.base import Target
from aotbuild.targets.registry import get_target

__all__ = ["Context", "Unavailable", "environment_factors", "job_factors", "job_pipeline", "shard_pipeline"]


def environment_factors() -> dict[str, Any]:
    import torch

    from aotbuild.targets import side_channels

    # A remote compiler cache kept on purpose (AOTBUILD_ALLOW_REMOTE_COMPILER_CACHE=1) is a factor;
    # otherwise build jobs never see one, and keys are unchanged (aotbuild/targets/side_channels.py).
    remote_cache = side_channels.factors()
    return {
        "torch": torch.__version__,
        "torch_build": getattr(torch.version, "git_version", None),
        "diffusers": constants.dist_version("diffusers"),
        "transformers": constants.dist_version("transformers"),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        **({"remote_compiler_cache": remote_cache} if remote_cache else {}),
    }


class Unavailable(Enum):
    """Why none of a recipe's jobs can be keyed here: what callers branch on (``build`` skips a job
    only for ``TARGET``); ``Context.problem`` is the same reason in words, for people."""

    #: the target or its device is not on this host (a Neuron recipe on a CPU runner): another host builds it
    TARGET = "target"
    #: the model's files cannot be read or are refused (NaN in a config.json, nested too deep, a link
    #: out of the folder): the input is at fault, as with a bad recipe
    MODEL = "model"
    #: a Hub model's files cannot be fetched (offline, no network, no such repo, gated): a failure of the model
    HUB = "hub"

    @classmethod
    def of(cls, exc: ModelUnavailable) -> Unavailable:
        return cls.HUB if isinstance(exc, ModelUnreachable) else cls.MODEL

    def error(self, message: str) -> AotbuildError:
        """The exception of this kind (each carries its CLI exit code)."""
        kind = {Unavailable.TARGET: TargetUnavailable, Unavailable.MODEL: ModelUnavailable,
                Unavailable.HUB: ModelUnreachable}[self]
        return kind(message)


@dataclass
class Context:
    """What the jobs of one recipe share (its target and strategy objects among them). ``problem`` says
    why none of them can be keyed here, ``cause`` what kind of reason it is (None when they can)."""

    recipe: Recipe
    target: Target
    strategy: Strategy
    device: str = ""
    dtype: str = ""
    model: models.ResolvedModel | None = None
    environment: dict[str, Any] = field(default_factory=dict)
    fingerprint: dict[str, Any] = field(default_factory=dict)
    problem: str = ""
    cause: Unavailable | None = None

    @classmethod
    def create(cls, recipe: Recipe, cache_root: Path, *, resolve_model: bool = True,
               reading: bool = False) -> Context:
        """``reading``: for a command that only reads the cache (plan, a load): nothing is written under
        it (models.resolve_model)."""
        target = get_target(recipe.target)
        ctx = cls(recipe, target, get_strategy(recipe.strategy))
        available = target.availability(recipe.device)
        if not available.ok:
            ctx.problem, ctx.cause = f"target unavailable: {available.reason}", Unavailable.TARGET
            return ctx
        ctx.device = recipe.device or target.default_device()
        ctx.dtype = recipe.model.dtype or target.default_dtype
        ctx.environment = environment_factors()
        ctx.fingerprint = target.fingerprint(ctx.device)
        if resolve_model:
            try:
                ctx.model = models.resolve_model(recipe, cache_root, reading=reading)
            except models.ModelUnavailable as exc:
                ctx.problem, ctx.cause = f"model unavailable: {exc}", Unavailable.of(exc)
                return ctx
            models.check_components(recipe, ctx.model)
        return ctx

    def factors(self, component: str, component_class: str, config: dict[str, Any], shape: Shape,
                pipeline_class: str, rank: int | None = None) -> dict[str, Any]:
        return job_factors(self, component, component_class, config, shape, pipeline_class, rank)

    @property
    def ranks(self) -> tuple[int | None, ...]:
        """The ranks of each job: (None,) unsharded, else 0 .. N - 1 (one entry each), N the ranks a
        feature asks for (``Feature.ranks``: tensor parallelism's ``parallel.tensor``)."""
        from aotbuild.features.registry import used

        ranks = max((f.ranks(self.recipe) for f in used(self.recipe)), default=1)
        return (None,) if ranks == 1 else tuple(range(ranks))

    @property
    def pipeline_class(self) -> str:
        """The class ``from_pretrained`` will return (a key factor), known before loading."""
        assert self.model is not None
        named = self.recipe.model.pipeline
        # AutoPipeline* classes return the model's own pipeline class (model_index.json's _class_name).
        return named if named and not named.startswith("AutoPipeline") else self.model.pipeline_class


def job_factors(ctx: Context, component: str, component_class: str, config: dict[str, Any], shape: Shape,
                pipeline_class: str, rank: int | None = None) -> dict[str, Any]:
    """Every key factor of one job (of one rank's entry, for a tensor-parallel recipe): from the recipe,
    its target and strategy, this machine, and the component as loaded (class and architecture
    config) or as planned (from its ``config.json``)."""
    from aotbuild.features.base import Where
    from aotbuild.features.registry import used

    recipe = ctx.recipe
    features = used(recipe)
    where = Where(component, component_class, ctx.device, rank)
    # The pipeline as users change it: present only where the recipe sets it (other keys unchanged).
    changed = {f.section: value for f in features if (value := f.factors(recipe, where)) is not None}
    if recipe.text_length is not None:
        changed["text_length"] = _text_length(recipe)
    if recipe.schedulers:  # the warmup ran with each (aotbuild/pipeline/schedulers.py)
        # each name once: a Recipe made in Python is not checked as a file is (empty, or a name twice), and
        # neither changes what the warmup runs
        changed["schedulers"] = sorted(set(recipe.schedulers))
    compile_settings = {**ctx.target.compile_settings(recipe, ctx.device),
                        **ctx.strategy.compile_factors(ctx.target, ctx.device, recipe)}
    for feature in features:  # a tensor-parallel rank's thread count
        compile_settings = feature.compile_settings(recipe, compile_settings)
    return {
        **changed,
        "format": constants.FORMAT_VERSION,
        "model": {"pipeline": pipeline_class, "variant": recipe.model.variant,
                  "builtin_version": builtin_version(recipe)},
        "component": {"name": component, "class": component_class, "config": config, "dtype": ctx.dtype},
        "target": {"name": recipe.target, "strategy": recipe.strategy},
        "compile": compile_settings,
        "shape": shape.as_dict(),
        "warmup": recipe.warmup_factors(ctx.target.warmup_defaults),
        "env": ctx.environment,
        "device": ctx.fingerprint,
    }


def _text_length(recipe: Recipe) -> dict[str, int] | None:
    text = recipe.text_length
    return None if text is None else {"min": text.min, "max": text.max}


def builtin_version(recipe: Recipe) -> int | None:
    """Known from the id alone, so a caller that passes its own pipeline gets the same key."""
    from aotbuild import builtin

    return builtin.lookup(recipe.model.id).version if builtin.is_builtin(recipe.model.id) else None


def prepare_pipeline(pipe: Any, recipe: Recipe) -> None:
    """The pipeline as the recipe serves it, after loading and placing: each feature's change
    (aotbuild/features: quantized, then its LoRA adapters loaded for hot-swap)."""
    from aotbuild.features.registry import used

    for feature in used(recipe):
        feature.prepare(pipe, recipe)


def shard_pipeline(pipe: Any, ctx: Context) -> int | None:
    """In a process that is one rank of a job split over ranks: the feature that splits it
    (``Feature.split``: tensor parallelism) shards the pipeline. Returns this process's rank (None:
    unsharded)."""
    from aotbuild.features.registry import used

    ranks = [rank for feature in used(ctx.recipe) if (rank := feature.split(pipe, ctx.recipe, ctx.device)) is not None]
    return ranks[0] if ranks else None


def job_pipeline(recipe: Recipe, cache_root: Path, loaded: Any = None) -> tuple[Context, Any]:
    """For a build job, a proof or a benchmark child: the recipe's context and its pipeline, loaded
    (progress bar off) and placed on the recipe's device; RuntimeError when it cannot be. Not
    sharded: a tensor-parallel build job shards it (:func:`shard_pipeline`), its proof first runs
    the unsharded pipeline eagerly. ``loaded``: the pipeline :func:`cpu_pipeline` gave a build's
    loader process (aotbuild/builder/loader.py), which this forked job then places and prepares."""
    ctx = Context.create(recipe, cache_root)
    if ctx.problem:
        raise RuntimeError(ctx.problem)
    assert ctx.model is not None
    from aotbuild.features.registry import used

    for feature in used(recipe):  # before the weights load (a rank: its device and its share of the CPUs)
        feature.before_load(recipe, ctx.device)
    pipe = loaded if loaded is not None else models.load_pipeline(recipe, ctx.model, ctx.dtype, quiet=True)
    models.place_pipeline(pipe, recipe, ctx.device)
    prepare_pipeline(pipe, recipe)
    return ctx, pipe


def cpu_pipeline(recipe: Recipe, cache_root: Path) -> Any:
    """The recipe's pipeline as ``from_pretrained`` gives it, on the CPU, with no device touched (a
    process that initialised CUDA cannot fork a child that uses it): what a build's loader process
    loads once for all of a recipe's jobs. RuntimeError when it cannot be loaded."""
    target = get_target(recipe.target)
    try:
        model = models.resolve_model(recipe, cache_root)
    except models.ModelUnavailable as exc:
        raise RuntimeError(f"model unavailable: {exc}") from exc
    models.check_components(recipe, model)
    return models.load_pipeline(recipe, model, recipe.model.dtype or target.default_dtype, quiet=True)
