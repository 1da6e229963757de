"""Targets whose compiler keeps a persistent cache in one folder named by an environment variable.

AWS Neuron writes NEFF files under ``TORCH_NEURONX_NEFF_CACHE_DIR``; TorchTPU keeps compiled
executables under ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT``. For both, a build job points the
variable at an empty folder and every regular file the compile leaves there is the artifact; install
lays the tree back (hard links from the store, else copies) into the folder the variable names
(a fresh per-process folder when it is unset) before the compile, so the runtime compiles nothing.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild.cache.layout import safe_relpath
from aotbuild.cache.trees import collect_tree, lay_tree
from aotbuild.constants import dist_version
from aotbuild.pipeline.blocks import blocks_setting
from aotbuild.targets.base import Availability, InstallResult, Target, ToolchainCheck

if TYPE_CHECKING:

    from aotbuild.recipe.schema import Recipe


class FolderCacheTarget(Target):
    default_dtype = "bfloat16"
    static_shapes = True
    embeds_weights = False
    #: environment variable naming the compiler's persistent cache folder
    cache_env = ""
    #: module whose import registers the device and the torch.compile backend
    vendor = ""
    #: pip distributions whose versions are key factors
    toolchain: tuple[str, ...] = ()
    warmup_defaults = {"num_inference_steps": 1}
    #: environment variables a build job must not inherit (so they keep their documented default)
    unset_in_jobs: tuple[str, ...] = ()

    def import_vendor(self) -> Any:
        return importlib.import_module(self.vendor)

    def availability(self, device: str | None = None) -> Availability:
        try:
            module = self.import_vendor()
        except ImportError as exc:
            return Availability(False, f"`import {self.vendor}` failed ({exc}); it runs on "
                                       f"{self.hardware}", ())
        versions = tuple((n, v) for n, v in self.versions(module).items() if v)
        return Availability(True, "", versions)

    hardware = ""

    def versions(self, module: Any) -> dict[str, str | None]:
        found = {self.vendor: getattr(module, "__version__", None) or dist_version(self.vendor.replace("_", "-"))}
        for dist in self.toolchain:
            found[dist] = dist_version(dist)
        return found

    def default_device(self) -> str:
        return self.name

    #: name of the fingerprint entry for the accelerator's generation (NeuronCore kind, TPU generation)
    hardware_factor = ""

    def hardware_kind(self) -> str:
        raise NotImplementedError

    def fingerprint(self, device: str) -> dict[str, Any]:
        fp: dict[str, Any] = {"device_kind": device.partition(":")[0], **self.versions(self.import_vendor())}
        fp[self.hardware_factor] = "cpu-standin" if device.startswith("cpu") else self.hardware_kind()
        return fp

    def check_device(self, device: str, recipe: Recipe) -> None:
        kind, _, index = device.partition(":")
        if kind == "cpu" and not index:
            return  # exercises the compile path with a stand-in backend
        if kind != self.name or (":" in device and not index.isdigit()):
            raise recipe.error("device", f"{device!r} is not a device of target {self.name} "
                                         f"(allowed: {self.name}, {self.name}:N, cpu)")

    def validate(self, recipe: Recipe) -> None:
        from aotbuild.recipe.frozen import thaw
        from aotbuild.targets import options

        super().validate(recipe)
        for key, value in thaw(recipe.compile.options).items():  # no declared types: plain numbers and flags
            options.check(recipe, key, value)
        if recipe.compile.mode != "default":
            raise recipe.error("compile.mode", f"target {self.name} supports only mode: default "
                                               f"(got {recipe.compile.mode!r})")

    def compile_settings(self, recipe: Recipe, device: str) -> dict[str, Any]:
        from aotbuild.recipe.frozen import thaw

        spec = recipe.compile
        return {"backend": self.name, "scope": spec.scope, **blocks_setting(recipe), "mode": spec.mode,
                "fullgraph": spec.fullgraph, "dynamic": spec.dynamic,
                "options": dict(sorted(thaw(spec.options).items()))}

    def compile_kwargs(self, recipe: Recipe, device: str) -> dict[str, Any]:
        settings = self.compile_settings(recipe, device)
        return {"backend": self.name, "fullgraph": settings["fullgraph"], "dynamic": False,
                "options": settings["options"] or None}

    def before_compile(self) -> None:
        self.import_vendor()  # registers the backend

    def check_caches(self) -> ToolchainCheck:
        folder = os.environ.get(self.cache_env)
        detail = f"{self.cache_env}={folder}" if folder else f"{self.cache_env} unset: a fresh folder per process"
        return ToolchainCheck(True, detail, data={"folder": folder or tempfile.gettempdir(),
                                                  "label": f"{self.name} compiler cache folder",
                                                  "variable": self.cache_env})

    def capture_env(self, workdir: Path) -> dict[str, str | None]:
        env: dict[str, str | None] = {self.cache_env: str(workdir / "compiler-cache")}
        env.update({name: None for name in self.unset_in_jobs})
        return env

    def collect(self, workdir: Path) -> list[tuple[str, Path]]:
        return collect_tree(workdir / "compiler-cache")

    def compile_counter(self) -> tuple[str, Callable[[], int]]:
        """A persistent-cache compiler writes what it compiles into its cache folder, and only reads
        what it finds there: every file in it that aotbuild did not lay there is a compile."""

        def files() -> int:
            folder = os.environ.get(self.cache_env)
            if not folder:
                return 0
            return sum(os.path.normpath(os.path.join(d, n)) not in self._laid
                       for d, _, names in os.walk(folder) for n in names)

        return f"files the compiler wrote to {self.cache_env}", files

    #: files install() laid in the compiler's folder in this process (not compiles: compile_counter)
    _laid: set[str] = set()

    def install(self, files: Iterable[tuple[str, Path]], device: str) -> InstallResult:
        folder = os.environ.get(self.cache_env)
        if not folder:
            folder = tempfile.mkdtemp(prefix=f"aotbuild-{self.name}-cache-")
            os.environ[self.cache_env] = folder  # read by the compiler at compile time
            atexit.register(_remove_if_mine, folder, os.getpid())  # this process's own: not left behind
        files = list(files)
        self._laid = self._laid | {os.path.normpath(Path(folder).joinpath(*safe_relpath(rel).parts))
                                   for rel, _ in files}
        return InstallResult(*lay_tree(files, Path(folder)), folder)


def _remove_if_mine(folder: str, pid: int) -> None:
    """At exit, the compiler folder this process made, but not in a child forked after it was made
    (a preloaded server's worker exits while its parent still compiles into the folder)."""
    if os.getpid() == pid:
        shutil.rmtree(folder, ignore_errors=True)
