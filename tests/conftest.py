"""Shared fixtures. Every test gets its own cache root and Inductor cache (huggingface_hub's
``tests/conftest.py`` does the same), so nothing leaks between tests or into ~/.cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest_plugins = ["tests.guards"]  # a fast test that reaches Inductor's code generation fails

REPO = Path(__file__).resolve().parents[1]
TINY_RECIPE = REPO / "recipes" / "tiny_sd_cpu.yaml"
#: recipes/tiny_sd_cpu.yaml's settings at one shape, as the dict a Python caller passes.
TINY_DICT = {
    "model": {"id": "builtin:tiny-sd", "dtype": "float32"},
    "target": "inductor",
    "device": "cpu",
    "shapes": [{"height": 64, "width": 64}],
    "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0},
}
#: The environment that puts the stand-in backends (tests/fakes) under the real backends' names, for a
#: subprocess only: the fakes never leak into the tests' own process.
FAKES = {"PYTHONPATH": f"{REPO}:{REPO / 'tests' / 'fakes'}"}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch):
    root = tmp_path / "aotcache"
    monkeypatch.setenv("AOTBUILD_CACHE", str(root))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return root


@pytest.fixture(autouse=True)
def restore_process_state():
    """A CLI command run in-process (click's CliRunner) sets library variables and the aotbuild
    logger's handler: undone after each test, so later tests (and their subprocesses) see neither."""
    import logging

    env = dict(os.environ)
    log = logging.getLogger("aotbuild")
    handlers, level, propagate = list(log.handlers), log.level, log.propagate
    yield
    os.environ.clear()
    os.environ.update(env)
    log.handlers[:] = handlers
    log.setLevel(level)
    log.propagate = propagate


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aotbuild.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd or REPO)


def run_python(code: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, cwd=cwd or REPO)


#: Session fixtures that build for real (minutes): the tests using one run on one xdist worker, so
#: each build happens once per run. A test uses at most one of them (two groups balance the workers).
SHARED_BUILDS = ("built_cache", "strategy_build")


def pytest_collection_modifyitems(config, items):
    """Group the tests for ``--dist=loadgroup``: those sharing a session build by that build, the rest
    by module (module fixtures, e.g. tests/test_parallel.py's builds, are built once per worker)."""
    for item in items:
        shared = [name for name in SHARED_BUILDS if name in item.fixturenames]
        assert len(shared) <= 1, f"{item.nodeid} uses {shared}: one shared build per test keeps one build per run"
        item.add_marker(pytest.mark.xdist_group(shared[0] if shared else item.module.__name__))


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory) -> Path:
    """A cache root holding only the built-in tiny model (created once per session)."""
    from aotbuild import builtin

    root = tmp_path_factory.mktemp("models-cache")
    builtin.ensure("builtin:tiny-sd", root / "models")
    return root


@pytest.fixture(scope="session")
def built_cache(tmp_path_factory) -> tuple[Path, dict]:
    """The tiny recipe built once per session, for real, with the CLI: (cache root, build --json)."""
    root = tmp_path_factory.mktemp("built-cache")
    inductor = tmp_path_factory.mktemp("build-inductor")
    proc = run_cli("build", "--json", "--cache", str(root), str(TINY_RECIPE),
                   env={"TORCHINDUCTOR_CACHE_DIR": str(inductor), "AOTBUILD_CACHE": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, json.loads(proc.stdout)


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
    proc = run_cli("build", "--json", "--cache", str(root / "cache"), str(recipe),
                   env={"TORCHINDUCTOR_CACHE_DIR": str(root / "build-inductor"), "AOTBUILD_CACHE": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return recipe, root / "cache", json.loads(proc.stdout)


_STRATEGY_BUILDS: dict[str, tuple[Path, Path, dict]] = {}


@pytest.fixture(scope="session")
def strategy_build(tmp_path_factory, models_dir):
    """``strategy_build("aot-package")``: STRATEGY_RECIPE built for that strategy, once per session."""

    def get(strategy: str) -> tuple[Path, Path, dict]:
        if strategy not in _STRATEGY_BUILDS:
            _STRATEGY_BUILDS[strategy] = build_strategy(strategy, tmp_path_factory.mktemp(strategy), models_dir)
        return _STRATEGY_BUILDS[strategy]

    return get


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
    from aotbuild import builder
    from aotbuild.builder import store_job
    from tests.standins import artifacts

    compiled: list[str] = []

    def fake_build_one(store, job, tick=None, limit=None, sign_key=None, *, loads=None):
        compiled.append(job.key)
        return store_job(store, job, artifacts(tmp_path / "out", job.key), {"signatures": []}, 0.1, limit,
                         sign_key=sign_key)

    monkeypatch.setattr(builder, "_build_one", fake_build_one)
    return compiled
