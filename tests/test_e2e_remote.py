"""The CI flow for real on the tiny pipeline: build --push, plan --remote as a gate, then a serving
process that pulls lazily what it needs from the remote and loads warm (Inductor's counters)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from aotbuild import load_compiled
from aotbuild.cache.store import Store
from tests.conftest import TINY_RECIPE, invoke_cli, run_cli
from tests.fakes.hub_server import HubStandIn
from tests.serving import assert_warm, serve_fresh

pytestmark = pytest.mark.slow


def fresh_root(built: Path, where: Path) -> Path:
    """A serving machine's empty cache root (only the built-in model, which any machine can create)."""
    shutil.copytree(built / "models", where / "models")
    return where


def test_folder_remote_ci_flow_and_lazy_runtime_pull(built_cache, tmp_path):
    cache, _ = built_cache
    remote = f"file://{tmp_path / 'remote'}"
    proc = run_cli("build", "--json", "--cache", str(cache), str(TINY_RECIPE), "--push", remote)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert {j["status"] for j in report["jobs"]} == {"cached"} and len(report["push"]["sent"]) == 2

    serving = fresh_root(cache, tmp_path / "serving")
    gate = invoke_cli("plan", "--cache", str(serving), str(TINY_RECIPE), "--fail-on-miss")
    assert gate.returncode == 3  # nothing local
    gate = invoke_cli("plan", "--json", "--cache", str(serving), str(TINY_RECIPE), "--remote", remote, "--fail-on-miss")
    assert gate.returncode == 0, gate.stderr
    assert {j["status"] for j in json.loads(gate.stdout)["jobs"]} == {"remote"}

    # Lazy: a recipe with one of the two shapes pulls that entry only (no compile happens at load).
    one = tmp_path / "one_shape.yaml"
    one.write_text(TINY_RECIPE.read_text().replace("  - {height: 64, width: 96}\n", ""))
    lazy = fresh_root(cache, tmp_path / "lazy")
    pipe = load_compiled(one, cache=lazy, remote=remote, on_miss="error")
    assert [e.pulled for e in pipe.aotbuild_report.entries] == [True]
    assert len(list(Store(lazy).iter_manifests())) == 1

    # A fresh serving process: pulls both, then every FX graph hits and no kernel is rebuilt.
    result = serve_fresh(TINY_RECIPE, serving, tmp_path, remote=remote)
    assert_warm(result)
    assert result["pulled"] == 2


def test_hub_remote_push_then_read_only_pull_with_the_cli(built_cache, tmp_path, no_ambient_hf_auth):
    cache, _ = built_cache
    with HubStandIn(write_token="hf_w") as hub:
        hub.create_repo("org/aot", repo_type="dataset")
        env = {"HF_ENDPOINT": hub.endpoint}
        url = "hf://datasets/org/aot"
        denied = run_cli("push", "--cache", str(cache), str(TINY_RECIPE), "--remote", url, env=env)
        assert denied.returncode == 1 and "HF_TOKEN" in denied.stderr and "Traceback" not in denied.stderr
        pushed = run_cli("push", "--json", "--cache", str(cache), str(TINY_RECIPE), "--remote", url,
                         env={**env, "HF_TOKEN": "hf_w"})
        assert pushed.returncode == 0, pushed.stderr[-3000:]
        assert len(json.loads(pushed.stdout)["sent"]) == 2

        serving = fresh_root(cache, tmp_path / "serving")
        pulled = run_cli("pull", "--json", "--cache", str(serving), str(TINY_RECIPE), "--remote", url, env=env)
        assert pulled.returncode == 0, pulled.stderr[-3000:]
        assert [j["status"] for j in json.loads(pulled.stdout)["jobs"]] == ["pulled", "pulled"]
        gate = invoke_cli("plan", "--cache", str(serving), str(TINY_RECIPE), "--fail-on-miss")
        assert gate.returncode == 0, gate.stdout
        for key in (j["key"] for j in json.loads(pulled.stdout)["jobs"]):  # byte-identical to the source
            local, source = Store(serving).open_entry(key)[0], Store(cache).open_entry(key)[0]
            assert local is not None and source is not None
            assert sorted((r, p.name) for r, p in local.files) == sorted((r, p.name) for r, p in source.files)
