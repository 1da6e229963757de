"""The small interface every target implements (vLLM's ``compiler_interface.py`` is the model).

A target knows whether it can run here and why not, its default device and dtype, the compile
call, the environment fingerprint that goes into keys, how to capture what a warmup compiled and
how to install it again so a fresh process compiles nothing. Nothing outside ``aotbuild/targets``
branches on a target's name. What an entry *is* (compiler caches, AOTInductor packages, aot_compile
functions) is the strategy's concern (``aotbuild/strategies``), not the target's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from aotbuild.recipe.schema import Recipe


@dataclass(frozen=True)
class Availability:
    ok: bool
    reason: str = ""
    versions: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class ToolchainCheck:
    """``aotbuild doctor``'s toolchain check: whether this target can compile here, what it found, the fix."""

    ok: bool
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class InstallResult:
    installed: int  # files written
    present: int  # files already there with the same content
    folder: str  # where they went (for the report; never part of a key)


class Target:
    name: str = ""
    default_dtype: str = "float32"
    #: aotbuild builds one graph per declared shape; a target that needs static shapes rejects dynamic.
    static_shapes: bool = True
    #: True when the compiler embeds weight values in its artifacts. The weights' identity is not a key
    #: factor yet, so such a target is refused when a recipe is read (validate), never served wrong.
    embeds_weights: bool = False
    #: True when a build may load the pipeline once per recipe and fork each job's worker from that
    #: process (aotbuild/builder/loader.py): the compiler reads the cache folders of ``capture_env`` when it
    #: compiles, not when it is imported, and keeps nothing in memory between processes.
    shares_loads: bool = False
    #: True when the compiler serves a dimension dynamic within a range (``text_length``: Dynamo's
    #: mark_dynamic); a target that compiles static shapes only (Neuron, TPU) refuses the setting.
    text_ranges: bool = False

    #: warmup arguments a recipe gets unless it sets them (part of the key, like the recipe's own)
    warmup_defaults: dict[str, Any] = {}

    def availability(self, device: str | None = None) -> Availability:
        """Whether this target can run here (for ``device``, when given), and why not."""
        raise NotImplementedError

    def default_device(self) -> str:
        raise NotImplementedError

    def check_toolchain(self, device: str) -> ToolchainCheck:
        """For ``aotbuild doctor``: can this target compile for ``device`` here (versions found, or the fix)."""
        available = self.availability(device)
        versions = dict(available.versions)
        if not available.ok:
            return ToolchainCheck(False, available.reason, f"install the {self.name} toolchain, or pick another "
                                                           f"--target (aotbuild targets lists them)",
                                  {"versions": versions})
        return ToolchainCheck(True, ", ".join(f"{k} {v}" for k, v in versions.items()) or "available",
                              data={"versions": versions})

    def check_caches(self) -> ToolchainCheck:
        """For ``aotbuild doctor``: whether this process's compiler caches would use installed entries;
        ``data["folder"]`` is the folder they live in (doctor checks it is writable), ``data["label"]``
        names it."""
        raise NotImplementedError

    def validate(self, recipe: Recipe) -> None:
        """Raise ``recipe.error(...)`` for settings this target cannot honour (the strategy checks its own)."""
        if self.embeds_weights:
            raise recipe.error("target", f"target {self.name}'s artifacts embed weight values, and aotbuild does "
                                         "not key weights yet: it cannot serve this target safely")
        if self.static_shapes and recipe.compile.dynamic:
            raise recipe.error("compile.dynamic", f"target {self.name} needs static shapes: set dynamic: false")
        if recipe.text_length is not None and not self.text_ranges:
            raise recipe.error("text_length", f"target {self.name} compiles static shapes only: a text range cannot "
                                              f"be served (target inductor can); remove text_length")
        if recipe.device is not None:
            self.check_device(recipe.device, recipe)

    def check_device(self, device: str, recipe: Recipe) -> None:
        raise NotImplementedError

    def compile_settings(self, recipe: Recipe, device: str) -> dict[str, Any]:
        """The exact compile arguments, as JSON data: a key factor, and what ``compile`` uses."""
        raise NotImplementedError

    def slow_format(self, recipe: Recipe, device: str) -> str:
        """Why ``recipe``'s number format computes slower than float32 on ``device`` here, or "" (a build
        warns with it)."""
        return ""

    def int8_reduce_range(self, device: str) -> bool:
        """Whether int8 activations must keep to 7 bits on ``device`` here (an x86 CPU without VNNI: its int8
        kernels' int16 sums saturate); a key factor of a calibrated int8 package (strategies/calibrate.py)."""
        return False

    def fingerprint(self, device: str) -> dict[str, Any]:
        """Toolchain versions and device kind (never a device index, path or hostname)."""
        raise NotImplementedError

    def compile_kwargs(self, recipe: Recipe, device: str) -> dict[str, Any]:
        """The keyword arguments of ``torch.compile`` that ``compile`` uses (backend, fullgraph, dynamic,
        options), for a strategy that calls ``torch.compile`` itself."""
        raise NotImplementedError

    def compile(self, module: torch.nn.Module, recipe: Recipe, device: str) -> Callable[..., Any]:
        """Compile ``module`` as the recipe says (``torch.compile`` with :meth:`compile_kwargs`; regional
        scope: each block in place); return the callable that runs its compiled forward."""
        import torch

        from aotbuild.pipeline.blocks import compile_regional

        self.before_compile()
        kwargs = self.compile_kwargs(recipe, device)
        raise_recompile_limit(len(recipe.shapes))
        if recipe.compile.scope == "regional":
            compile_regional(module, recipe, kwargs)
            return module.forward
        return torch.compile(module.forward, **kwargs)

    def before_compile(self) -> None:
        """What ``compile`` needs in this process first (a vendor's import registers its backend)."""

    def capture_env(self, workdir: Path) -> dict[str, str | None]:
        """Environment for a build job's subprocess so that everything it compiles lands in ``workdir``
        (a None value removes the variable from the job's environment)."""
        raise NotImplementedError

    def collect(self, workdir: Path) -> list[tuple[str, Path]]:
        """After the job: (relative path, file) for every file the job's compile left in the caches
        ``capture_env`` pointed into ``workdir``."""
        raise NotImplementedError

    def compile_counter(self) -> tuple[str, Callable[[], int]]:
        """What counts as a compile in a process that installed this target's cached files and compiled
        again (strategy jit-cache), and a function that returns that count so far."""
        raise NotImplementedError

    def global_settings(self) -> dict[str, Any]:
        """This process's compiler settings that its compiled artifacts' cache keys hold and a library
        can change for the whole process (recorded at build, compared by jit-cache loads), or {}."""
        return {}

    def install_blocker(self) -> str:
        """Why this process could not use installed artifacts (then every entry is a miss), or ""."""
        return ""

    def build_facts(self, device: str) -> dict[str, Any]:
        """What this process's compiler chose for the machine during a build, which a load may use to
        skip work (recorded in the manifest's ``build``), or {}."""
        return {}

    def prepare_build(self, device: str) -> None:
        """In a build job's process, before its first compile: skip what this host's earlier builds make
        redundant (Inductor: its CPU probes), never anything that changes what is compiled."""

    def before_install(self, builds: list[Mapping[str, Any]], device: str) -> None:
        """Prepare this process for the hit entries, given each one's ``build`` record (its
        ``build_facts``): skip what they make redundant here, never what they cannot vouch for."""

    def install(self, files: Iterable[tuple[str, Path]], device: str) -> InstallResult:
        """Put artifacts back where this process's compiler will find them, before compiling."""
        raise NotImplementedError

    def loading(self) -> contextlib.AbstractContextManager[None]:
        """Entered while installed artifacts are loaded: around aot-compile's deserializing, and
        around the first call of each signature jit-cache serves (where Dynamo loads its kernels).
        Never changes what is loaded or how it runs; may skip work that only a compile would use."""
        return contextlib.nullcontext()


def raise_recompile_limit(n_shapes: int) -> None:
    """One graph per static shape: Dynamo's default recompile limit (8) would make a 9th shape a hard
    error, so a target's ``compile`` raises it to the recipe's shapes plus that margin."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    wanted = n_shapes + 8
    if getattr(dynamo_config, name) < wanted:
        setattr(dynamo_config, name, wanted)
