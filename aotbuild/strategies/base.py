"""The interface every strategy implements: how an entry is built, what it stores, how it is served.

A *target* says where compiled code runs and how its compiler is driven (``aotbuild/targets``); a
*strategy* says what an entry is: jit-cache stores ``torch.compile``'s own caches and re-traces at
load, aot-package stores AOTInductor packages, aot-compile stores ``torch.compile(...).aot_compile``
functions. A strategy owns five things, and nothing outside ``aotbuild/strategies`` branches on a
strategy's name:

1. ``validate``: which targets and recipe settings it supports, and whether this torch has what it
   needs (refused when the recipe is read, so at ``plan`` time);
2. ``build``: in the job's fresh process, compile the component at one shape and return the call
   signatures it built plus the strategy's own records for the manifest (``Built``);
3. ``collect``: after the job, the files that are the entry;
4. ``check`` and ``install``: at load, whether a verified entry fits the live module, then put the
   entries into the modules behind a dispatcher with the call policy (``InstallResult``);
5. ``compile_counter``: what its proof counts as "a compile" in a serving process.

What a strategy reads of a recipe resolved for this machine is the narrow :class:`Resolved`
(recipe, target, device, dtype): ``aotbuild.context.Context`` is one, defined above this layer.

Adding a strategy is one module with a ``Strategy`` subclass and one line in the registry
(``aotbuild/strategies/registry.py``); docs/architecture.md shows the steps.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from aotbuild import constants, forwards
from aotbuild.recipe.schema import CALIBRATED_QUANT_TYPES

if TYPE_CHECKING:
    from aotbuild.cache.store import Entry
    from aotbuild.recipe.schema import Recipe
    from aotbuild.targets.base import InstallResult, Target


class Resolved(Protocol):
    """What strategies and targets read of a recipe resolved for this machine."""

    recipe: Recipe
    target: Target
    device: str
    dtype: str


@dataclass
class BuildJob:
    """What a strategy's ``build`` gets in the job's process: the pipeline, loaded and placed, and
    the component to compile at the job's shape."""

    ctx: Resolved
    pipe: Any
    component: str
    module: Any
    #: the pipeline call that warms the job's shape up (the recipe's warmup at the shape)
    warmup: dict[str, Any]
    #: the job's staging folder: the target's compiler caches point into it (``capture_env``)
    workdir: Path
    #: tells the parent what the job is doing
    phase: Callable[[str], None] = lambda text: None
    #: with ``text_length``: the component's text pattern (aotbuild/pipeline/textlen.py ``Pattern``): calls that fit
    #: it are one signature, their text dimensions marked dynamic in the range
    text: Any = None
    #: the compile noise the recipe's features add to an output (features.registry.tolerance: a
    #: dynamically quantized activation's rounding), which a build's own checks against eager allow
    noise: float = 0.0

    def run_warmup(self, *, eager: bool = False) -> None:
        """Call the pipeline as a user does (its own no_grad, no inference_mode: grad mode is part of
        what a compiled graph is guarded and cached on): once with its own scheduler and once with each
        the recipe declares (``schedulers``, aotbuild/pipeline/schedulers.py).

        ``eager``: nothing compiled runs in it (the AOT strategies record the calls eagerly). If it
        fails with a ValueError or TypeError where no aotbuild code runs below the call, nor below any
        exception it was raised from (the pipeline's own code, diffusers', torch's: a missing input, a
        value it refuses; never out of memory or a device's error), the exception is marked
        (``constants.EAGER_CALL_FAILED``): every strategy runs that call, so auto tries no other
        (aotbuild/builder/build.py)."""
        from aotbuild.pipeline.schedulers import warm_up

        try:
            warm_up(self.pipe, self.ctx.recipe, self.warmup)
        except (ValueError, TypeError) as exc:  # an input refused; not a RuntimeError (out of memory, a device's)
            if eager and not _aotbuild_below(exc, warm_up.__code__):
                try:
                    setattr(exc, constants.EAGER_CALL_FAILED, True)
                except AttributeError:  # an exception class with slots: left unmarked, auto tries on
                    pass
            raise


def _aotbuild_below(exc: BaseException, caller: Any) -> bool:
    """Whether any frame of ``exc``'s traceback below ``caller``'s (the warmup) is aotbuild's own code (a
    recorder, a dispatcher: a failure a strategy may cause), rather than the pipeline's."""
    import traceback
    from pathlib import Path as _Path

    package = _Path(__file__).resolve().parent.parent
    frames = traceback.extract_tb(exc.__traceback__)
    start = next((i for i, f in enumerate(frames) if f.name == caller.co_name and f.filename == caller.co_filename),
                 None)
    if start is None:
        return True
    below = frames[start + 1:]
    seen = {id(exc)}
    cause = exc.__cause__ or exc.__context__
    while cause is not None and id(cause) not in seen:  # raised from another: that one's frames count too
        seen.add(id(cause))
        below += traceback.extract_tb(cause.__traceback__)
        cause = cause.__cause__ or cause.__context__
    return any(_Path(f.filename).resolve().is_relative_to(package) for f in below)


@dataclass
class Built:
    """What a job built: the call signatures served, and the strategy's records for the manifest
    (``Manifest.packages``: one per artifact, each naming its file and signature)."""

    signatures: list[str]
    records: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Planned:
    """At load: one component, its live module and its verified entries (one per shape that hit)."""

    component: str
    module: Any
    entries: list[Entry]


class Strategy:
    name: str = ""
    #: one line for the recipe reference (docs/recipes.md)
    summary: str = ""
    #: the targets it runs on (None: every target)
    targets: tuple[str, ...] | None = None
    #: whether it serves a component captured as several graphs (``compile.fullgraph: false``)
    graph_breaks: bool = False
    #: whether it serves ``text_length``: a range of text lengths from one build (aotbuild/pipeline/textlen.py)
    text_lengths: bool = False
    #: True when it serves a quant_type calibrated at build (schema.CALIBRATED_QUANT_TYPES: int8static)
    calibrates: bool = False

    # -- when the recipe is read --------------------------------------------------------------

    def availability(self) -> str:
        """Why this process's torch cannot run the strategy, or ""."""
        return ""

    def validate(self, recipe: Recipe, target: Target) -> None:
        """Raise ``recipe.error(...)`` for settings the strategy cannot honour."""
        if self.targets is not None and target.name not in self.targets:
            raise recipe.error("strategy", f"strategy {self.name} runs on target {', '.join(self.targets)} "
                                           f"(not {target.name})")
        why = self.availability()
        if why:
            raise recipe.error("strategy", f"strategy {self.name} {why}")
        if recipe.text_length is not None and not self.text_lengths and self.name != "auto":
            # auto validates as itself, then excludes each strategy by that strategy's validate: with a
            # text_length it tries only those that serve a range (issue 34, 36)
            raise recipe.error("text_length", f"strategy {self.name} cannot serve a range of text lengths yet: "
                                              "use strategy jit-cache (or auto, which then takes it), or remove "
                                              "text_length")
        quant = recipe.model.quantization
        if quant is not None and quant.quant_type in CALIBRATED_QUANT_TYPES and not self.calibrates \
                and self.name != "auto":
            raise recipe.error("model.quantization", f"quant_type {quant.quant_type} is calibrated at build and served "
                                                     f"by strategy aot-package with compile.options.freezing: true "
                                                     f"(or auto), not {self.name}")

    def _refuse_freezing(self, recipe: Recipe) -> None:
        """Inductor's ``freezing`` folds the build's weights into what it compiles. An ahead-of-time
        artifact would keep them, and weights are not a key factor (another checkpoint of the same
        model has the same key): refused. (jit-cache's FX graph cache re-binds frozen weights from
        the serving process's own module, torch 2.13 ``CompiledFxGraphConstantsWithGm``.)"""
        for key, value in recipe.compile.options.items():
            if key.replace("-", "_") == "freezing" and value:
                raise recipe.error(f"compile.options.{key}", f"strategy {self.name} would keep the build's weights "
                                                             "in its artifact (freezing folds them in) and weights "
                                                             "are not a key factor: use strategy aot-package (it "
                                                             "re-derives the prepacked weights at load: "
                                                             "docs/prepack.md) or jit-cache")

    def compile_factors(self, target: Target, device: str, recipe: Recipe | None = None) -> dict[str, Any]:
        """Key factors the strategy adds to the target's compile settings for ``recipe`` (what its
        artifacts depend on beyond them), or {}."""
        return {}

    # -- build, in the job's fresh process ----------------------------------------------------------

    def build(self, job: BuildJob) -> Built:
        raise NotImplementedError

    def collect(self, target: Target, workdir: Path) -> list[tuple[str, Path]]:
        """After the job: (relative path, file) for every file of the entry."""
        return target.collect(workdir)

    def embeds_weights(self, records: tuple[dict[str, Any], ...]) -> bool:
        """Whether the built artifacts (their manifest records) hold weight values (the manifest says so)."""
        return False

    def check_records(self, records: tuple[Mapping[str, Any], ...]) -> str:
        """Why the manifest's records (``packages``, already checked by the codec for what every record
        holds: ``path``, ``signature``, ``instances``) are malformed for this strategy, or "". A store
        applies it before handing an entry out, so a malformed record is a miss, never a crash."""
        return ""

    def compile_counter(self, target: Target) -> tuple[str, Callable[[], int]]:
        """What the proof counts as a compile in a serving process, and a function returning that count
        so far (aotbuild/builder/proof.py takes the difference over the proof's calls)."""
        return target.compile_counter()

    # -- load ---------------------------------------------------------------------------------------

    def check(self, ctx: Resolved, module: Any, component: str, entry: Entry) -> str:
        """Why a verified entry cannot serve the live ``module`` (then it is a miss with that reason), or "".
        The module's structure has been checked already (aotbuild/pipeline/structure.py)."""
        return ""

    def install(self, ctx: Resolved, planned: list[Planned], policy: str) -> InstallResult | None:
        """Make each planned module serve its entries: files where the compiler reads them, a
        dispatcher in each module's ``forward`` that routes a built signature to its artifact and any
        other call by ``policy`` ("compile", "eager" or "error", dispatch.py). The install's figures,
        or None when no file was installed."""
        raise NotImplementedError


def lazy_compile(ctx: Resolved, module: Any, scope: str | None = None) -> Callable[..., Any]:
    """A fallback that compiles the module's own forward on its first use, not at load (importing
    Dynamo alone costs ~0.7 s: an entry that serves every call never pays it).

    ``scope="full"`` compiles ``module`` whole whatever the recipe says (a regional recipe's block)."""
    compiled: list[Any] = []
    recipe = ctx.recipe
    if scope is not None:
        recipe = replace(recipe, compile=replace(recipe.compile, scope=scope))

    def run(*args: Any, **kwargs: Any) -> Any:
        if not compiled:
            with forwards.unwrapped(module):  # the module's own forward, not the dispatcher around it
                compiled.append(ctx.target.compile(module, recipe, ctx.device))
        return compiled[0](*args, **kwargs)

    return run
