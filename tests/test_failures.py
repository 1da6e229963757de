"""Builds that fail say why, are remembered, and misses compare like with like (the build-failure issue)."""

from __future__ import annotations

import json

import pytest

from aotbuild import builder
from aotbuild.builder import FAILED, JobResult
from tests.conftest import TINY_RECIPE, invoke_cli


def test_a_failed_job_is_remembered_shown_by_plan_and_cleared_by_a_build_that_retries_it(cache, fake_compiles,
                                                                                          monkeypatch):
    from aotbuild import plan

    stand_in = builder._build_one  # fake_compiles' stand-in compile

    def failing(store, job, tick=None, limit=None, sign_key=None, *, loads=None):
        return JobResult(job, FAILED, 1.0, reason="the component cannot be captured whole: Unsupported: x")

    monkeypatch.setattr(builder, "_build_one", failing)
    report = builder.build(str(TINY_RECIPE), cache)
    assert [r.status for r in report.results] == ["failed", "failed"]
    jobs = plan(str(TINY_RECIPE), cache)
    assert [j.status for j in jobs] == ["failed", "failed"]
    assert all(j.reason.startswith("failed before (") and "captured whole" in j.reason for j in jobs)
    assert all(j.estimated_build_s is None for j in jobs)  # out of the estimates
    proc = invoke_cli("plan", "--json", "--cache", str(cache), str(TINY_RECIPE))
    assert {j["status"] for j in json.loads(proc.stdout)["jobs"]} == {"failed"}
    text = invoke_cli("plan", "--cache", str(cache), str(TINY_RECIPE)).stdout
    assert "to build" not in text  # no estimate counts a job that fails again
    assert invoke_cli("verify", "--cache", str(cache)).returncode == 0  # records are aotbuild's: no problem

    monkeypatch.setattr(builder, "_build_one", stand_in)  # now it would build
    report = builder.build(str(TINY_RECIPE), cache)  # a recorded failure is not retried (issue 30)
    assert [r.status for r in report.results] == ["failed", "failed"] and all(r.not_retried for r in report.results)
    report = builder.build(str(TINY_RECIPE), cache, retry_failed=True)
    assert [r.status for r in report.results] == ["built", "built"]
    assert [j.status for j in plan(str(TINY_RECIPE), cache)] == ["hit", "hit"]
    assert not list((cache / "failures").glob("*.json"))  # a successful build clears the record


def test_capture_failures_say_the_cause_where_and_the_fix():
    """Data-dependent Python in forward: a 60-line Dynamo error was cut before its useful part."""
    import torch

    from aotbuild.recipes import parse_recipe
    from aotbuild.strategies import get_strategy
    from aotbuild.worker import capture_failure

    def forward(x):
        if x.sum() > 0:  # data-dependent: Dynamo cannot capture it whole
            return x + 1
        return x - 1

    try:
        torch.compile(forward, fullgraph=True, backend="eager")(torch.ones(2))
    except Exception as exc:
        error = exc
    else:
        pytest.fail("Dynamo captured data-dependent control flow")
    recipe = parse_recipe({"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}]})
    why = capture_failure(error, get_strategy("jit-cache"), recipe)
    assert why.startswith("the component cannot be captured whole: ") and "\n" not in why
    assert "test_failures.py:" in why  # the model's file:line, not torch's
    assert why.endswith("set compile.fullgraph: false (several graphs, each proven) or compile.scope: regional")
    aot = capture_failure(error, get_strategy("aot-compile"), recipe)
    assert aot.endswith("use compile.scope: regional, or strategy jit-cache with compile.fullgraph: false")
    assert capture_failure(ValueError("something else"), get_strategy("jit-cache"), recipe) == ""


def test_plan_reports_every_bad_recipe_of_a_folder_and_plans_the_good_ones(models_dir, tmp_path):
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "a.yaml").write_text("model: builtin:tiny-sd\nshape: []\n")
    (folder / "b.yaml").write_text("model: builtin:tiny-sd\nshapes: [{height: 7, width: 64}]\n")
    (folder / "c.yaml").write_text(TINY_RECIPE.read_text())
    proc = invoke_cli("plan", "--cache", str(models_dir), str(folder))
    assert proc.returncode == 2
    assert "a.yaml: shape: unknown key; did you mean 'shapes'?" in proc.stderr
    assert "b.yaml: shapes[0].height: 7 is not allowed" in proc.stderr
    assert proc.stdout.count("\nc ") == 2  # the good recipe's two jobs are planned


def test_ls_shows_each_entry_s_model_strategy_and_scope(tmp_path):
    from aotbuild.store import Store
    from tests import manifests

    store = Store(tmp_path / "c")
    key = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"k"})
    data = json.loads(store.layout.manifest(key).read_text())
    data["recipe_data"] = {"model": {"id": "builtin:tiny-sd"}}
    manifests.write_raw(store, key, data)
    out = invoke_cli("ls", "--cache", str(store.root)).stdout
    header = out.splitlines()[0].split()
    assert header == ["key", "recipe", "model", "component", "shape", "target", "strategy", "scope", "size",
                      "created"]
    assert "builtin:tiny-sd" in out and "jit-cache" in out and "full" in out
    entry = json.loads(invoke_cli("ls", "--json", "--cache", str(store.root)).stdout)["entries"][0]
    assert (entry["model"], entry["strategy"], entry["scope"]) == ("builtin:tiny-sd", "jit-cache", "full")
