"""Shared fixtures. Every test gets its own cache root and Inductor cache (huggingface_hub's
``tests/conftest.py`` does the same), so nothing leaks between tests or into ~/.cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest_plugins = ["tests.guards"]  # a fast test that reaches Inductor's code generation fails

REPO = Path(__file__).resolve().parents[1]
#: The README's main job, as users run it: no strategy, so auto (issue 54). For the tests about that file.
MAIN_RECIPE = REPO / "recipes" / "tiny_sd_cpu.yaml"
#: MAIN_RECIPE naming jit-cache: the suite's shared jit-cache build (``built_cache``) and every test that
#: plans, builds or serves against it. Its own file (tests/test_recipe.py holds it to MAIN_RECIPE), so the
#: main job can show the default while the shared build's keys stay what the tests expect.
TINY_RECIPE = REPO / "tests" / "recipes" / "tiny_sd_cpu.yaml"
#: TINY_RECIPE's settings at one shape, as the dict a Python caller passes.
TINY_DICT = {
    "model": {"id": "builtin:tiny-sd", "dtype": "float32"},
    "target": "inductor",
    "device": "cpu",
    "strategy": "jit-cache",
    "shapes": [{"height": 64, "width": 64}],
    "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0},
}
# Inductor compiles kernels in a pool of compile processes (one per core), each importing torch: on the
# tiny models of these tests that start-up is most of the pool's work. One compile thread (no pool)
# built the tiny-sd UNet in 75 s of CPU instead of 98 s (wall 89 s instead of 110 s, quiet 2-core host,
# `/usr/bin/time aotbuild build`). Set before any session build; every subprocess inherits it. A test
# about compile processes sets its own value.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Scalar C++ kernels: Inductor includes no vector headers and runs no ISA probes. A kernel's g++ run
# loads a precompiled header of those headers (0.78 s a kernel against 1.23 s here), so a real build of
# the tiny-sd UNet spends about 25 s less CPU in g++ (28.5 s against 53 s, /tmp experiment on 2 cores,
# AVX-512), and every real build in the suite gains that. It also makes the suite's kernels the same on
# an AVX2 and an AVX-512 runner. What the vector ISA changes is tested with it on: tests/test_isa_probes.py
# and tests/test_headers.py unset it (``VECTOR_ISA``), as do the doctor's roundtrip test and the shared
# aot-package build (``build_strategy``: the entry auto stores on a CPU).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
#: The environment of a test about Inductor's vector ISA: Inductor's own choice (an empty value is unset).
VECTOR_ISA = {"TORCHINDUCTOR_VEC_ISA_OK": ""}
# Bytecode. Where PYTHONDONTWRITEBYTECODE is set (this workplace's shell sets it, and CI's), every process
# the suite starts (builds, workers, proofs, CLIs: hundreds) compiled aotbuild's sources again, and every
# xdist worker rewrote every test module's asserts again (collection 14.7 s a worker against 6.9 s). So
# the suite writes bytecode as Python does by default (``__pycache__/`` beside the sources, .gitignored),
# for this process and every subprocess it starts. Fast tier, one after another on 2 cores, each from no
# __pycache__: 151 s (user CPU 248 s) before, 144 s (233 s) after, 134 s (224 s) on a second run; the
# full suite's time moved less than this host's noise. A PYTHONPYCACHEPREFIX is left as it is.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False
# OpenMP threads that sleep at a barrier instead of spinning. The suite keeps the 2 cores busy (99.4% over
# the whole slow tier, /proc/stat), with three xdist workers and their builds, proofs and fresh processes,
# each running torch with one OpenMP thread per core: a thread that spins while it waits for its partner
# burns the core another process needs. Six slow build tests (bf16 auto, lora, int8static, build_from_pipe,
# declared freeu, sdxl aot-package) on 3 workers: 207 s and 191 s (CPU 396 s, 365 s) spinning against
# 169 s (CPU 327 s) passive, 167 s and 169 s (CPU 321 s) with one thread each, run in turn on this host.
# Passive keeps the thread count (tests/test_threads.py serves fewer and more threads than the build's)
# and changes no key factor (none reads OMP_*). libgomp reads it when torch loads: set before any import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

#: The environment that puts the stand-in backends (tests/fakes) under the real backends' names, for a
#: subprocess only: the fakes never leak into the tests' own process.
FAKES = {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'fakes'}"}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    root = tmp_path / "aotcache"
    monkeypatch.setenv("AOTBUILD_CACHE", str(root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return root


@pytest.fixture
def vector_isa(monkeypatch):
    """Inductor's own vector ISA choice, in this process and its children (``VECTOR_ISA``)."""
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "")
    with inductor_config.patch({"cpp.vec_isa_ok": None}):
        yield


_CUSTOM_PASSES = ("pre_grad_custom_pass", "post_grad_custom_pre_pass", "post_grad_custom_post_pass",
                  "joint_custom_pre_pass", "joint_custom_post_pass")


@pytest.fixture(autouse=True)
def restore_process_state():
    """A CLI command run in-process (click's CliRunner) sets library variables and the aotbuild
    logger's handler: undone after each test, so later tests (and their subprocesses) see neither."""
    import logging

    env = dict(os.environ)
    log = logging.getLogger("aotbuild")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    # Inductor's settings too: torchao's quantize_ sets some for the whole process, so a test that
    # quantized made a later one on the same worker see them as the defaults.
    inductor = sys.modules.get("torch._inductor.config")
    settings = inductor.save_config() if inductor is not None else None
    # and the custom passes save_config leaves out (torchao's X86InductorQuantizer sets pre_grad_custom_pass
    # when imported: int8static's conversion)
    passes = {k: getattr(inductor, k) for k in _CUSTOM_PASSES if hasattr(inductor, k)} if inductor is not None else {}
    # diffusers' process-wide attention backend: a recipe's changes.attention_backend sets it at load
    dispatch = sys.modules.get("diffusers.models.attention_dispatch")
    registry = getattr(dispatch, "_AttentionBackendRegistry", None)
    backend = getattr(registry, "_active_backend", None)
    yield
    if inductor is not None:
        inductor.load_config(settings)
        for k, v in passes.items():
            setattr(inductor, k, v)
    if registry is not None and backend is not None:
        registry._active_backend = backend
    os.environ.clear()
    os.environ.update(env)
    log.handlers[:] = handlers
    log.setLevel(level)
    log.propagate = propagate


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aotbuild.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd or REPO)


def invoke_cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``run_cli`` in this process (click's CliRunner), for commands whose promise is not process
    isolation (a read-only ``show``, ``ls``, ``plan``): no fresh interpreter importing torch again.
    The same result fields; an exception the command did not turn into an exit code is raised (a
    subprocess would have printed its traceback). No ``cwd``: pass ``--cache``. The variables and
    logging the command sets are undone by ``restore_process_state``; its signal handlers here."""
    import signal

    from click.testing import CliRunner

    from aotbuild.cli.commands import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM))}
    try:
        result = CliRunner().invoke(main, list(args), env=env, catch_exceptions=True)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return subprocess.CompletedProcess(["aotbuild", *args], result.exit_code, result.stdout, result.stderr)


def run_python(code: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=cwd or REPO)


#: Session fixtures that build for real (minutes). Each entry is built once per run, whichever xdist
#: worker asks first (``once_per_run``); the tests sharing an entry are grouped on one worker so that
#: no worker waits for another's build. A test uses at most one shared entry.
SHARED_BUILDS = ("built_cache", "strategy_build", "aot_cache")


def build_group(item: pytest.Item) -> str | None:
    """The shared entry a test reads: ``tiny-sd:<strategy>`` (``built_cache`` is the jit-cache one:
    strategy_build("jit-cache") reuses it), or None."""
    shared = [name for name in SHARED_BUILDS if name in item.fixturenames]
    if "aot_cache" in shared:
        shared.remove("strategy_build")  # aot_cache is strategy_build("aot-package")
    assert len(shared) <= 1, f"{item.nodeid} uses {shared}: one shared build per test keeps the groups apart"
    if not shared:
        return None
    if shared[0] == "built_cache":
        return "tiny-sd:jit-cache"
    if shared[0] == "aot_cache":
        return "tiny-sd:aot-package"
    strategy = getattr(item, "callspec", None) and item.callspec.params.get("strategy")
    return f"tiny-sd:{strategy}" if strategy else "tiny-sd:strategy_build"


def group_node_id(item: pytest.Item, group: str) -> None:
    """What ``--dist=loadgroup`` needs: the group as a suffix of the node id (``...::test@group``), the
    one thing xdist's scheduler reads. xdist 3.8 writes ``item._nodeid`` for an ``xdist_group`` mark, and
    from pytest 9.2 on nothing reads that attribute (the id is ``item._id``, a ``NodeId``): every group
    silently became ungrouped, and two workers waited on one shared build's lock at once. So the
    suffix is written here, for either form; ``tests/test_suite_groups.py`` checks it takes."""
    if item.nodeid.endswith(f"@{group}"):
        return
    if hasattr(item, "_id"):  # pytest >= 9.2
        from _pytest.nodeid import coerce_node_id

        item._id = coerce_node_id(f"{item.nodeid}@{group}")
    else:
        item._nodeid = f"{item.nodeid}@{group}"


def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: one worker more than the CPUs (``--maxprocesses`` caps it): many tests wait on
    subprocesses, servers and polls rather than compute, and a build's own processes spend seconds
    starting up, so a third worker on 2 cores fills the waits (fast tier: 120 s with 3 workers against
    133 s with 2, side by side). The whole suite too since the compile pool is off
    (``TORCHINDUCTOR_COMPILE_THREADS=1`` above): a build is one busy core again."""
    return (os.cpu_count() or 1) + 1


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks added here
def pytest_collection_modifyitems(config, items):
    """For ``--dist=loadgroup``: the tests reading one shared entry form one group (one worker builds
    it, the others never wait for it); every other test is its own unit, so no module is pinned to one
    worker. Slow tests are queued first: the longest work starts first, and the two workers end
    together instead of one finishing a module of builds alone."""
    grouping = os.environ.get("PYTEST_XDIST_WORKER") and config.getvalue("loadgroup")
    for item in items:
        group = build_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        # A module's own mark too (``pytestmark = pytest.mark.xdist_group(...)``): its tests share an
        # expensive module fixture (a subprocess, a server) that each worker would otherwise start.
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        if grouping and names:
            group_node_id(item, "_".join(names))
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: slow first, then the rest


def once_per_run(tmp_path_factory: pytest.TempPathFactory, name: str, build) -> Any:
    """``build(folder)`` once per test run, across xdist workers (xdist's recipe for a session fixture:
    a file lock in the folder the workers' temp folders share, the result kept there as JSON).
    A failed build is kept too: the other workers fail with its message instead of building again."""
    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # gw0, gw1: their base temps share a parent, fresh per run
        shared = shared.parent
    result = shared / f"{name}.json"
    with FileLock(str(shared / f"{name}.lock")):
        if not result.is_file():
            try:
                value = {"ok": build(shared / name)}
            except BaseException as exc:  # an assertion of the build's: recorded, then raised here
                result.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
                raise
            result.write_text(json.dumps(value))
        value = json.loads(result.read_text())
    if "error" in value:
        pytest.fail(f"the shared build {name} failed on another worker: {value['error'][-3000:]}")
    return value["ok"]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """A cache root holding only the built-in tiny model (created once per session)."""
    from aotbuild import builtin

    root = tmp_path_factory.mktemp("models-cache")
    builtin.ensure("builtin:tiny-sd", root / "models")
    return root


@pytest.fixture(scope="session")
def built_cache(tmp_path_factory) -> tuple[Path, dict]:
    """TINY_RECIPE (jit-cache) built once per run, for real, with the CLI: (cache root, build --json)."""

    def build(folder: Path) -> list:
        root = folder / "cache"
        proc = invoke_cli("build", "--json", "--cache", str(root), str(TINY_RECIPE),
                       env={"TORCHINDUCTOR_CACHE_DIR": str(folder / "build-inductor"), "AOTBUILD_CACHE": ""})
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [str(root), json.loads(proc.stdout)]

    root, report = once_per_run(tmp_path_factory, "built-cache", build)
    return Path(root), report


#: The tiny model at one shape, for any strategy: what tests/test_strategies.py holds every strategy to.
STRATEGY_RECIPE = """\
model: {{id: builtin:tiny-sd, dtype: float32}}
target: inductor
device: cpu
strategy: {strategy}
compile: {{components: [unet]}}
shapes: [{{height: 64, width: 64}}]
warmup: {{num_inference_steps: 2, guidance_scale: 0.0}}
"""


def build_strategy(strategy: str, root: Path, models_dir: Path) -> tuple[Path, Path, dict]:
    """Build STRATEGY_RECIPE for ``strategy`` into ``root/cache``: (recipe file, cache, build --json)."""
    import shutil

    shutil.copytree(models_dir / "models", root / "cache" / "models")
    recipe = root / f"tiny_sd_{strategy}.yaml"
    recipe.write_text(STRATEGY_RECIPE.format(strategy=strategy))
    # aot-package with Inductor's own vector ISA: the entry as a user's build makes it, its ISA probe
    # record included (tests/test_aot.py); its package serves any process. The others (auto's prepacked
    # aot-package too) emit scalar kernels (above): a jit-cache entry's FX graph key reads the setting.
    vector = VECTOR_ISA if strategy == "aot-package" else {}
    proc = invoke_cli("build", "--json", "--cache", str(root / "cache"), str(recipe),
                   env={"TORCHINDUCTOR_CACHE_DIR": str(root / "build-inductor"), "AOTBUILD_CACHE": "", **vector})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return recipe, root / "cache", json.loads(proc.stdout)


@pytest.fixture(scope="session")
def strategy_build(tmp_path_factory, models_dir, built_cache_lazy):
    """``strategy_build("aot-package")``: STRATEGY_RECIPE built for that strategy, once per run.
    jit-cache's entry is ``built_cache``'s 64x64 one (the same key: checked by a plan, else built)."""

    def get(strategy: str) -> tuple[Path, Path, dict]:
        if strategy == "jit-cache":
            reused = _jit_cache_from_built_cache(tmp_path_factory, built_cache_lazy())
            if reused:
                return reused
        # (auto's first try on the CPU is prepacked aot-package: a build of its own, in its own test group.)
        def build(folder: Path) -> list:
            recipe, cache, report = build_strategy(strategy, folder, models_dir)
            return [str(recipe), str(cache), report]

        recipe, cache, report = once_per_run(tmp_path_factory, f"strategy-{strategy}", build)
        return Path(recipe), Path(cache), report

    return get


@pytest.fixture(scope="session")
def built_cache_lazy(request):
    """``built_cache`` on demand: a strategy_build("aot-package") test does not build the tiny recipe."""
    return lambda: request.getfixturevalue("built_cache")


def _jit_cache_from_built_cache(tmp_path_factory, built: tuple[Path, dict]) -> tuple[Path, Path, dict] | None:
    """STRATEGY_RECIPE for jit-cache served from ``built_cache``'s root when its one job is a hit there:
    (recipe file, that root, the build --json narrowed to that job); None if the keys ever differ."""
    from aotbuild.planner import plan

    root, report = built
    recipe = tmp_path_factory.mktemp("jit-cache") / "tiny_sd_jit-cache.yaml"
    recipe.write_text(STRATEGY_RECIPE.format(strategy="jit-cache"))
    job, = plan([str(recipe)], root)
    if job.status != "hit":
        return None
    return recipe, root, {**report, "jobs": [j for j in report["jobs"] if j["key"] == job.key]}


@pytest.fixture(scope="session")
def aot_cache(strategy_build):
    return strategy_build("aot-package")


@pytest.fixture
def no_ambient_hf_auth(tmp_path, monkeypatch):
    """No token from the environment or ~/.cache/huggingface, no offline mode, caches under tmp_path.
    huggingface_hub reads HF_HOME once at import, so the derived constants are patched too."""
    from huggingface_hub import constants

    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE", "HF_OIDC_ID_TOKEN", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "hf_home"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(home / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def cache(models_dir, tmp_path) -> Path:
    """An empty cache root of this test's own, holding only the built-in tiny model."""
    import shutil

    root = tmp_path / "cache"
    shutil.copytree(models_dir / "models", root / "models")
    return root


@pytest.fixture
def fake_compiles(monkeypatch, tmp_path):
    """builder.build with the compile replaced by stand-in artifacts; returns the list of keys compiled."""
    from aotbuild.builder import build as builder
    from aotbuild.builder.build import store_job
    from tests.standins import artifacts

    compiled: list[str] = []

    def fake_build_group(store, jobs, tick=None, limit=None, sign_key=None, loads=None, chosen=None):
        compiled.extend(job.key for job in jobs)
        return [store_job(store, job, artifacts(tmp_path / "out", job.key), {"signatures": []}, 0.1, limit,
                          sign_key=sign_key, chosen=chosen[k] if chosen else None) for k, job in enumerate(jobs)]

    monkeypatch.setattr(builder, "_build_group", fake_build_group)
    return compiled


def one_job(build_one):
    """A stand-in for ``builder._build_group`` (one job's ranks) made of ``build_one(store, job, *args,
    **kwargs) -> JobResult`` for jobs of one rank (the tests' recipes that are not tensor-parallel)."""
    def build_group(store, jobs, *args, **kwargs):
        job, = jobs
        return [build_one(store, job, *args, **kwargs)]

    return build_group


def per_job(build_group):
    """``builder._build_group`` (or its stand-in) called for one job of one rank: returns its JobResult."""
    def build_one(store, job, *args, **kwargs):
        return build_group(store, [job], *args, **kwargs)[0]

    return build_one
