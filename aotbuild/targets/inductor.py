"""PyTorch Inductor on CPU or CUDA, with ``torch.compile``'s own caches captured and replayed.

What a fresh process needs to compile nothing: Dynamo still traces (that is cheap), and then
Inductor looks up the FX graph cache and the AOTAutograd cache, whose hits name generated Python
wrappers and C++/Triton kernels by content hash in the same cache folder. Mega-Cache
(``torch.compiler.save_cache_artifacts``) carries the graph entries but not the compiled CPU
kernels, and a fresh machine then spends ~60% of a cold compile rebuilding them. So a build job
runs in a subprocess whose ``TORCHINDUCTOR_CACHE_DIR`` is an empty folder, and every file the job
leaves there (graph entries, wrappers, kernel sources and ``.so`` files; never lock files) is the
job's artifact. Install copies those files into the process's *active* Inductor cache folder, file
by file with atomic renames, so several processes may install at once and the folder stays theirs.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import constants
from aotbuild.cache.layout import safe_relpath
from aotbuild.pipeline.blocks import blocks_setting
from aotbuild.targets.base import Availability, InstallResult, Target, ToolchainCheck

if TYPE_CHECKING:

    from aotbuild.recipe.schema import Recipe

_SKIP_DIRS = {"locks", "__pycache__"}
# Triton keeps its kernels under triton/<device index>/: stored as triton/{device}/ so an entry built
# on cuda:0 installs for cuda:3 (a device index must never split a cache).
_TRITON = re.compile(r"^triton/(\d+)/")
_DEVICE_SLOT = "triton/{device}/"


def _parse_device(device: str) -> tuple[str, int | None]:
    kind, _, index = device.partition(":")
    return kind, (int(index) if index.isdigit() else None)


def bakes_thread_count(options: Mapping[str, Any], device: str) -> bool:
    """Whether code compiled with these Inductor ``options`` for ``device`` holds the build's
    ``torch.get_num_threads()``: CPU kernels without ``cpp.dynamic_threads`` (``#pragma omp parallel
    num_threads(N)``). With it they ask OpenMP at each call, and CUDA kernels never depend on it, so an
    artifact serves any thread count (aot-compile then drops the guard that held it)."""
    return _parse_device(device)[0] == "cpu" and not options.get("cpp.dynamic_threads")


#: oneDNN ISA caps (``ONEDNN_MAX_CPU_ISA``) that keep a native bfloat16 instruction (AVX512-BF16, AMX,
#: AVX-NE-CONVERT) available to it.
_BF16_CAPS = ("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16", "AVX10_1_512",
              "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2", "AVX2_VNNI_2", "ALL",
              "DEFAULT")


def onednn_cap() -> str:
    """oneDNN's ISA cap (``ONEDNN_MAX_CPU_ISA``, or its older name ``DNNL_MAX_CPU_ISA``), upper case; "" unset."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").strip().upper()


def slow_bfloat16() -> str:
    """Why a bfloat16 pipeline computes slower than float32 on this CPU (no native bfloat16 instruction
    for oneDNN), or "". Measured at SD 1.5 size on an AVX512-BF16 CPU (docs/targets.md): one UNet call in
    bfloat16 0.6x float32's; with oneDNN capped to AVX512_CORE 1.6x; capped to AVX2 66x (oneDNN refuses
    to reorder a bfloat16 convolution weight there, so every convolution takes a slow path)."""
    import torch

    cap = onednn_cap()
    if not (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()):
        why = "this CPU has no native bfloat16 instruction (avx512_bf16, amx_bf16)"
    elif cap and cap not in _BF16_CAPS:
        why = f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN from its bfloat16 instructions"
    else:
        return ""
    slow = "66x" if not torch.ops.mkldnn._is_mkldnn_bf16_supported() else "1.6x"
    return (f"{why}: bfloat16 runs slower than float32 here (a UNet call measured {slow} float32's on such a CPU, "
            f"docs/targets.md); a prepacked package (aot-package with freezing, auto's first try on a CPU) computes "
            f"in float32 from the bfloat16 weights (compute_dtype: float32), every other strategy in bfloat16, and "
            f"the build's eager warmup too (dtype: float32 serves faster there)")


#: oneDNN ISA caps that keep an int8 dot-product instruction (AVX512-VNNI, AVX-VNNI, AMX) available to it.
_VNNI_CAPS = ("AVX512_CORE_VNNI", "AVX2_VNNI", *_BF16_CAPS)


def int8_without_vnni() -> str:
    """Why this CPU's int8 kernels need activations of 7 bits, or "": without VNNI (or AMX), oneDNN multiplies
    uint8 by int8 with ``vpmaddubsw``, whose pairwise int16 sums saturate on full-range activations.
    Measured on a 2-core AVX2 EPYC (no VNNI; a UNet of 32/64 channels, int8static): the compiled int8 model 0.34
    from the same model run eagerly with 8-bit activations, 0.1 with 7 (torchao's ``reduce_range``, its advice
    for CPUs without VNNI); the one-level tiny UNet 0.22 and 1.6e-7."""
    import torch

    cap = onednn_cap()
    if not (torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()):
        return "this CPU has no int8 dot-product instruction (avx512_vnni, avx_vnni, amx_int8)"
    if cap and cap not in _VNNI_CAPS:
        return f"ONEDNN_MAX_CPU_ISA={cap} keeps oneDNN from its int8 dot-product instructions"
    return ""


class InductorTarget(Target):
    name = "inductor"
    default_dtype = "float32"
    static_shapes = True
    embeds_weights = False  # weights are graph inputs, never frozen into kernels (freezing stays off)
    shares_loads = True  # TORCHINDUCTOR_CACHE_DIR is read at each compile (torch._inductor cache_dir())
    text_ranges = True  # Dynamo's mark_dynamic(min, max): one graph for a range of text lengths

    def availability(self, device: str | None = None) -> Availability:
        import torch

        versions = (("torch", torch.__version__),)
        if device and device.startswith("cuda") and not torch.cuda.is_available():
            return Availability(False, f"CUDA is not available here (torch {torch.__version__})", versions)
        return Availability(True, "", versions)

    def default_device(self) -> str:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def slow_format(self, recipe: Recipe, device: str) -> str:
        return slow_bfloat16() if recipe.model.dtype == "bfloat16" and device.split(":")[0] == "cpu" else ""

    def int8_reduce_range(self, device: str) -> bool:
        return device.split(":")[0] == "cpu" and bool(int8_without_vnni())

    def check_device(self, device: str, recipe: Recipe) -> None:
        kind, index = _parse_device(device)
        if kind not in ("cpu", "cuda") or (":" in device and index is None) or (kind == "cpu" and index is not None):
            raise recipe.error("device", f"{device!r} is not a device of target inductor (allowed: cpu, cuda, cuda:N)")

    def validate(self, recipe: Recipe) -> None:
        super().validate(recipe)
        if recipe.compile.options:
            _check_options(recipe)

    def check_toolchain(self, device: str) -> ToolchainCheck:
        """torch's availability, then what Inductor needs to generate code: CUDA and Triton, or a C++
        compiler (the one Inductor itself would run)."""
        found = super().check_toolchain(device)
        if not found.ok:
            return found
        import torch

        if device.startswith("cuda"):
            if not torch.cuda.is_available():
                return ToolchainCheck(False, f"CUDA is not available (torch {torch.__version__})",
                                      "install a CUDA build of torch and the NVIDIA driver")
            major, minor = torch.cuda.get_device_capability()
            try:
                import triton

                triton_version = triton.__version__
            except ImportError:
                return ToolchainCheck(False, "Triton is not installed: Inductor cannot generate CUDA kernels",
                                      "pip install triton (it comes with torch's CUDA wheels)")
            detail = (f"{torch.cuda.get_device_name()} (capability {major}.{minor}), CUDA {torch.version.cuda}, "
                      f"driver ok, Triton {triton_version}")
            return ToolchainCheck(True, detail, data={"versions": {"cuda": torch.version.cuda,
                                                                   "triton": triton_version}})
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            compiler = get_cpp_compiler()  # honours CXX, as Inductor does when it compiles
            proc = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30)
            if proc.returncode != 0:
                raise OSError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode)
        except Exception as exc:  # InvalidCxxCompiler, OSError, a timeout: the same fix
            cxx = os.environ.get("CXX")
            where = f" (CXX={cxx})" if cxx else ""
            return ToolchainCheck(False, f"no working C++ compiler{where}: {str(exc).splitlines()[0][:160]}",
                                  "install g++ (apt-get install g++) or point CXX at a working compiler")
        version = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else compiler
        return ToolchainCheck(True, f"C++ compiler {compiler}: {version}", data={"compiler": compiler})

    def compile_settings(self, recipe: Recipe, device: str) -> dict[str, Any]:
        from aotbuild.recipe.frozen import thaw

        spec = recipe.compile
        options = thaw(spec.options)  # plain lists and dicts: what torch.compile and JSON expect
        if _parse_device(device)[0] == "cpu":
            # CPU kernels otherwise bake in torch.get_num_threads(): a 2-core CI build would miss on a
            # 16-core server. Measured cost: see docs/cache.md (Threads) and benchmarks/cold_vs_warm.py.
            options.setdefault("cpp.dynamic_threads", True)
        settings = {
            "backend": "inductor", "scope": spec.scope, **blocks_setting(recipe), "mode": spec.mode,
            "fullgraph": spec.fullgraph, "dynamic": spec.dynamic, "options": dict(sorted(options.items())),
        }
        if bakes_thread_count(options, device):
            # Kernels then bake in the thread count: it must be a key factor.
            import torch

            settings["cpu_threads"] = torch.get_num_threads()
        return settings

    def fingerprint(self, device: str) -> dict[str, Any]:
        import torch

        kind, _ = _parse_device(device)
        fp: dict[str, Any] = {"device_kind": kind, "machine": platform.machine()}
        if kind == "cpu":
            # The vector ISA Inductor generates code for: an AVX-512 kernel can crash on an AVX2 host.
            fp["cpu_isa"] = torch.backends.cpu.get_cpu_capability()
            # oneDNN's own cap (its prepacked layouts and bf16 paths follow it: a bf16 convolution weight
            # cannot be reordered under AVX2, issue 57); keyed only where set, so other keys are unchanged
            if onednn_cap():
                fp["onednn_max_cpu_isa"] = onednn_cap()
        else:
            major, minor = torch.cuda.get_device_capability()
            fp["cuda_capability"] = f"{major}.{minor}"
            fp["cuda"] = torch.version.cuda
            try:
                import triton

                fp["triton"] = triton.__version__
            except ImportError:
                fp["triton"] = None
        return fp

    def compile_kwargs(self, recipe: Recipe, device: str) -> dict[str, Any]:
        settings = self.compile_settings(recipe, device)
        options = dict(settings["options"])
        if settings["mode"] != "default":
            # torch.compile takes mode or options, not both: expand the mode into its options.
            from torch._inductor import list_mode_options

            options = {**list_mode_options(settings["mode"], settings["dynamic"]), **options}
        return {"backend": "inductor", "fullgraph": settings["fullgraph"], "dynamic": settings["dynamic"],
                "options": options or None}

    def capture_env(self, workdir: Path) -> dict[str, str | None]:
        # The caches must be on in the job even if the user's environment turned them off: what they
        # write is the artifact.
        # TRITON_CACHE_DIR would send Triton's kernels elsewhere (uncaptured): they belong under the
        # Inductor cache folder, where torch puts them by default.
        return {constants.ENV_INDUCTOR_CACHE: str(workdir / "inductor"), "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
                "TORCHINDUCTOR_AUTOGRAD_CACHE": "1", "TRITON_CACHE_DIR": None}

    def collect(self, workdir: Path) -> list[tuple[str, Path]]:
        base = workdir / "inductor"
        found = []
        for folder, dirs, files in os.walk(base):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
            for name in sorted(files):
                path = Path(folder) / name
                if name.endswith(".lock") or path.is_symlink() or not path.is_file():
                    continue
                rel = path.relative_to(base).as_posix()
                found.append((_TRITON.sub(_DEVICE_SLOT, rel), path))
        return found

    def compile_counter(self) -> tuple[str, Callable[[], int]]:
        from torch._dynamo.utils import counters

        # A jit-cache load traces with Dynamo (that is not compiling) and must hit the FX graph cache;
        # a hit whose kernels are not in the folder would rebuild them (C++ or Triton) without a miss.
        return ("FX graph cache misses + kernels built here",
                lambda: int(counters["inductor"]["fxgraph_cache_miss"]) + kernels_built_here())

    def check_caches(self) -> ToolchainCheck:
        import torch._functorch.config as functorch_config
        import torch._inductor.config as inductor_config

        off = [name for name, on in (("FX graph cache (TORCHINDUCTOR_FX_GRAPH_CACHE)", inductor_config.fx_graph_cache),
                                     ("AOTAutograd cache (TORCHINDUCTOR_AUTOGRAD_CACHE)",
                                      functorch_config.enable_autograd_cache)) if not on]
        if off:
            return ToolchainCheck(False, f"{' and '.join(off)} off in this process: installed entries would not be "
                                         "used", "unset the variable or set it to 1")
        return ToolchainCheck(True, "FX graph and AOTAutograd caches on",
                              data={"folder": active_cache_dir(), "label": "Inductor cache folder",
                                    "variable": constants.ENV_INDUCTOR_CACHE})

    def global_settings(self) -> dict[str, Any]:
        import math

        import torch._inductor.config as inductor_config

        def plain(value: Any) -> Any:  # JSON that round-trips: a manifest holds no NaN, sets or functions
            if isinstance(value, float) and not math.isfinite(value):
                return repr(value)
            if value is None or isinstance(value, (bool, int, float, str)):
                return value
            return json.dumps(value, sort_keys=True, default=repr)

        # What the FX graph cache key holds of Inductor's config (codecache.FxGraphHashDetails).
        return {k: plain(v) for k, v in sorted(inductor_config.save_config_portable().items())}

    def install_blocker(self) -> str:
        import torch._inductor.config as inductor_config

        if not inductor_config.fx_graph_cache:
            return ("Inductor's FX graph cache is off in this process (TORCHINDUCTOR_FX_GRAPH_CACHE=0 or "
                    "torch._inductor.config.fx_graph_cache = False), so installed artifacts would not be used")
        return ""

    def build_facts(self, device: str) -> dict[str, Any]:
        if _parse_device(device)[0] != "cpu":
            return {}
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        from aotbuild.targets.inductor_isa import keep_host_record, probe_record

        # After the compile: picked already, nothing probed again. The probes' results let a load
        # on a CPU that vouches for them skip the probes (aotbuild/targets/inductor_isa.py), and the
        # next job built on this host too (prepare_build).
        picked, record = str(pick_vec_isa()), probe_record()
        keep_host_record(picked, record)
        return {"vec_isa": picked, **({"vec_isa_probes": record} if record is not None else {})}

    def prepare_build(self, device: str) -> None:
        if _parse_device(device)[0] == "cpu":
            from aotbuild.targets.inductor_isa import reuse_host_record

            reuse_host_record()

    def before_install(self, builds: list[Mapping[str, Any]], device: str) -> None:
        from aotbuild.targets.inductor_isa import replay_probes

        found = {json.dumps([b.get("vec_isa"), b.get("vec_isa_probes")], sort_keys=True, default=repr) for b in builds}
        if _parse_device(device)[0] == "cpu" and len(found) == 1:  # every hit entry found the same
            replay_probes(builds[0].get("vec_isa"), builds[0].get("vec_isa_probes"))

    def loading(self) -> contextlib.AbstractContextManager[None]:
        return headers_not_precompiled()

    def install(self, files: Iterable[tuple[str, Path]], device: str) -> InstallResult:
        folder = Path(active_cache_dir())
        index = _parse_device(device)[1] or 0
        installed = present = 0
        for rel, blob in files:
            rel = rel.replace(_DEVICE_SLOT, f"triton/{index}/", 1) if rel.startswith(_DEVICE_SLOT) else rel
            dest = folder.joinpath(*safe_relpath(rel).parts)
            _INSTALLED.add(os.path.normpath(dest))
            size = blob.stat().st_size
            if dest.is_file() and dest.stat().st_size == size:
                present += 1
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
            try:
                with os.fdopen(fd, "wb") as out, open(blob, "rb") as src:
                    while chunk := src.read(1 << 20):
                        out.write(chunk)
                if dest.suffix == ".so":
                    os.chmod(tmp, 0o755)
                else:
                    os.chmod(tmp, 0o644)
                os.replace(tmp, dest)  # atomic: a concurrent installer writes the same bytes
            except BaseException:
                if os.path.exists(tmp):
                    os.unlink(tmp)
                raise
            installed += 1
        return InstallResult(installed, present, str(folder))


_HEADERS_LOCK = threading.Lock()
_HEADERS = {"depth": 0, "saved": None}


@contextlib.contextmanager
def headers_not_precompiled() -> Iterator[None]:
    """While installed CPU kernels are loaded, Inductor does not precompile its C++ prefix header.

    Each process's first C++ kernel load (``CppCodeCache.load_async``, once per process) prepares a
    precompiled header before it looks for the kernel's ``.so``: a g++ preprocessing run and an
    ``openssl`` hash (0.25 s here), and, where the header's ``.gch`` is not in the temp folder
    (``$TMPDIR/torchinductor_<user>/precompiled_headers``: every fresh container), a full header
    compile of ~150 MB (8 s here). A ``.gch`` only speeds up compiling; a loaded ``.so`` never uses
    it. Inside this context the header is written as a plain ``#include`` file and passed instead:
    the kernel's key and command line are the same (they are hashed before the header is chosen, and
    the ``TORCH_INDUCTOR_PRECOMPILE_HEADERS`` define stays), and a kernel that must be compiled after
    all is compiled from the plain header (correct, slower). Outside it, Inductor is as it was.
    Nests, and is safe across threads (the last one out restores)."""
    try:
        from torch._inductor import codecache
    except ImportError:
        yield
        return
    if not all(hasattr(codecache, name) for name in ("_precompile_header", "write", "_HEADER_DIR")):
        yield  # another torch: leave it alone
        return

    def plain(header: str, hashable_cmd_line: str, **_compile_command: Any) -> str:
        return codecache.write(f"#include <{header}>\n", "h", extra=hashable_cmd_line,
                               specified_dir=os.path.join(codecache._HEADER_DIR, "plain"))[1]

    with _HEADERS_LOCK:  # the function to restore is read under the lock: never another thread's stand-in
        if _HEADERS["depth"] == 0:
            _HEADERS["saved"] = codecache._precompile_header
            codecache._precompile_header = plain
        _HEADERS["depth"] += 1
    try:
        yield
    finally:
        with _HEADERS_LOCK:
            _HEADERS["depth"] -= 1
            if _HEADERS["depth"] == 0:
                codecache._precompile_header = _HEADERS["saved"]
                _HEADERS["saved"] = None


#: Compiled kernel files: what a process that had to compile a kernel leaves in the Inductor folder.
KERNEL_SUFFIXES = (".so", ".cubin", ".hsaco", ".spv")
_STARTED = time.time()
_INSTALLED: set[str] = set()  # files install() put in the active folder, in this process


def kernels_built_here() -> int:
    """Kernel binaries in the active Inductor folder that this process wrote and aotbuild did not
    install: kernels compiled here (Inductor counts no FX miss when a cache hit rebuilds them)."""
    built = 0
    for folder, dirs, names in os.walk(active_cache_dir()):
        dirs[:] = [d for d in dirs if d not in _SKIP_DIRS]
        for name in names:
            path = os.path.normpath(os.path.join(folder, name))
            if name.endswith(KERNEL_SUFFIXES) and path not in _INSTALLED:
                with contextlib.suppress(OSError):
                    built += os.stat(path).st_mtime >= _STARTED
    return built


def active_cache_dir() -> str:
    """The Inductor cache folder this process uses (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:  # torch < 2.7
        from torch._inductor.runtime.runtime_utils import cache_dir  # type: ignore[no-redef]
    return cache_dir()


__all__ = ["InductorTarget", "active_cache_dir"]


def _check_options(recipe: Recipe) -> None:
    """The checks torch.compile makes on ``options`` (torch/__init__.py ``apply_options``), made when
    the recipe is read: a typo is one line at ``plan`` time, not a failed job with a 20 kB message."""
    from torch._inductor import config

    from aotbuild.recipe.frozen import thaw
    from aotbuild.targets import options
    from aotbuild.utils.suggest import suggest

    current = config.get_config_copy()
    for key, value in thaw(recipe.compile.options).items():
        name = key.replace("-", "_")
        if name not in current:
            raise recipe.error(f"compile.options.{key}", f"not an Inductor option{suggest(name, list(current))} "
                                                         "(torch._inductor.list_options() lists them)")
        options.check(recipe, key, value, config.get_type(name))  # type: ignore[attr-defined]
