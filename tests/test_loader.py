"""A build's loader process (aotbuild/builder/loader.py): the recipe's pipeline loaded once, each job's worker
forked from it; a job that fails, dies or runs too long fails alone.

These jobs stop before compiling (the plan's key they carry is wrong, which the worker checks right
after placing the pipeline), so the protocol is tested in seconds; tests/test_e2e.py's build proves
that forked jobs compile, store complete entries and pass their proofs.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from aotbuild.builder import loader
from aotbuild.builder.loader import Loader
from aotbuild.recipe.rules import parse_recipe
from aotbuild.recipe.schema import recipe_spec
from tests.conftest import TINY_DICT


def _run(ld: Loader, folder: Path, cache_root: Path, *, timeout: float = 600, log: Path | None = None):
    folder.mkdir(parents=True)
    spec = {"recipe": recipe_spec(parse_recipe(TINY_DICT)), "component": "unet", "shape": {"height": 64, "width": 64},
            "cache_root": str(cache_root), "key": "0" * 64, "ranks": [{"key": "0" * 64, "factors": {}}],
            "workdir": str(folder / "work")}
    return ld.run(spec, folder / "job.json", log or folder / "worker.log", env={"AOTBUILD_TEST_JOB": folder.name},
                  cwd=None, phase_file=folder / "phase", tick=None, started=time.perf_counter(), name="worker",
                  timeout=timeout)


@pytest.mark.slow  # seconds of subprocesses or server traffic: the full suite runs it
def test_one_load_serves_every_job_and_a_job_that_dies_fails_alone(tmp_path, models_dir):
    ld = Loader(recipe_spec(parse_recipe(TINY_DICT)), models_dir, tmp_path / "loader", {})
    try:
        code, result = _run(ld, tmp_path / "a", models_dir)
        assert code == 1 and "another key than the plan" in result["error"]  # the job's own failure, reported
        assert "another key than the plan" in (tmp_path / "a" / "worker.log").read_text()  # its traceback: its log
        pid = ld.proc.pid
        # A job whose process ends without writing a result (here: its log cannot be opened).
        code, result = _run(ld, tmp_path / "b", models_dir, log=tmp_path / "no-such-folder" / "log")
        assert code == 1 and result["error"].startswith("worker exited with 1")
        code, result = _run(ld, tmp_path / "c", models_dir)  # the loader serves on
        assert code == 1 and "another key than the plan" in result["error"]
        assert ld.loads == 1 and ld.proc.pid == pid and ld.proc.poll() is None
    finally:
        ld.close()
    assert ld.proc is None


@pytest.mark.slow  # seconds of subprocesses or server traffic: the full suite runs it
def test_a_job_past_its_time_limit_stops_the_loader_and_the_next_job_starts_another(tmp_path, models_dir):
    ld = Loader(recipe_spec(parse_recipe(TINY_DICT)), models_dir, tmp_path / "loader", {})
    try:
        code, result = _run(ld, tmp_path / "a", models_dir, timeout=0.2)  # importing torch alone takes longer
        assert code == -9 and "ran past its time limit of 0 s" in result["error"] and ld.proc is None
        code, result = _run(ld, tmp_path / "b", models_dir)
        assert code == 1 and "another key than the plan" in result["error"] and ld.loads == 2
    finally:
        ld.close()


def test_a_pipeline_that_cannot_load_fails_each_job_with_the_reason(tmp_path):
    broken = {**TINY_DICT, "model": {"id": str(tmp_path / "no-model-here"), "dtype": "float32"}}
    ld = Loader(recipe_spec(parse_recipe(broken)), tmp_path / "cache", tmp_path / "loader", {})
    try:
        for name in ("a", "b"):
            code, result = _run(ld, tmp_path / name, tmp_path / "cache")
            assert code == 1 and "model.id: no such folder" in result["error"]
            assert result.get("load_failed") is True  # no strategy's code ran: auto tries no other
            assert "Traceback" in (tmp_path / name / "worker.log").read_text()  # the loader's log, as the job's
        assert ld.loads == 1 and ld.proc is None  # tried once, not once per job
    finally:
        ld.close()


def test_which_jobs_share_a_load(models_dir, monkeypatch):
    """Inductor jobs share their recipe's load on Linux; AOTBUILD_SHARED_LOADS=0 gives each a worker."""
    import aotbuild
    from aotbuild.builder.loader import SharedLoads

    jobs = aotbuild.plan(TINY_DICT, cache=models_dir)
    assert len(jobs) == 1 and SharedLoads._shares(jobs[0]) == sys.platform.startswith("linux")
    monkeypatch.setenv(loader.ENV_SHARED_LOADS, "0")
    assert not loader.available() and not SharedLoads._shares(jobs[0])


def test_an_auto_recipe_s_jobs_and_every_try_share_one_load(models_dir):
    """The default recipe (no strategy) loads its pipeline once for all its shapes: each try of an auto job
    (the prepacked one adds compile options, which no load reads) is the same pipeline as the plan's job.
    Before, each try read as another pipeline, so every shape started a loader of its own."""
    import aotbuild
    from aotbuild import planner
    from aotbuild.builder.loader import SharedLoads
    from aotbuild.strategies import order as auto

    two_shapes = {**TINY_DICT, "shapes": [{"height": 64, "width": 64}, {"height": 64, "width": 96}]}
    two_shapes.pop("strategy", None)
    jobs = aotbuild.plan(two_shapes, cache=models_dir)
    assert len(jobs) == 2 and all(j.recipe.strategy == "auto" for j in jobs)
    tries = auto.tries_on("cpu")
    assert auto.PREPACKED in tries and len(tries) >= 3
    identities = {SharedLoads._identity(j) for j in jobs}
    identities |= {SharedLoads._identity(planner.concrete_job(j, name)) for j in jobs for name in tries}
    assert len(identities) == 1
    other = {**two_shapes, "model": {**two_shapes["model"], "dtype": "bfloat16"}}
    assert SharedLoads._identity(aotbuild.plan(other, cache=models_dir)[0]) not in identities  # another load
    # the load applies a recipe's changes to its compiled components: other components, another pipeline
    changed = {**two_shapes, "changes": {"memory_format": "channels_last"}}
    unet, vae = (planner.concrete_job(aotbuild.plan(parse_recipe({**changed, "compile": {"components": [c]}},
                                                                 name="sd"), cache=models_dir)[0], auto.PREPACKED)
                 for c in ("unet", "vae"))
    assert SharedLoads._identity(unet) != SharedLoads._identity(vae)


@pytest.mark.slow  # a build's loader or worker process, twice (about 15 s each on 2 cores)
@pytest.mark.parametrize("shared", ["1", "0"], ids=["loader", "worker"])
def test_auto_stops_at_a_pipeline_that_does_not_load_and_keeps_no_failure_record(shared, tmp_path, models_dir,
                                                                                 monkeypatch):
    """A pipeline that does not load (a damaged weights file here; a missing library, a download, memory)
    fails before any strategy's code runs, so every strategy auto would try next loads it the same way:
    none is tried (one load, not one per strategy), and no failure record is kept, since what failed is no
    key factor: the next build, once the cause is mended, loads again instead of reporting "failed before"
    for every strategy until --retry-failed. Both ways a job loads: the build's loader process, a worker."""
    import shutil

    import aotbuild
    from aotbuild.builtin import folder_of

    monkeypatch.setenv(loader.ENV_SHARED_LOADS, shared)
    model = tmp_path / "model"
    shutil.copytree(folder_of("builtin:tiny-sd", models_dir / "models"), model)
    weights = next((model / "unet").glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:200])
    # two shapes of one component: the second is never tried, and says no "--retry-failed" either
    recipe = {**TINY_DICT, "model": {"id": str(model), "dtype": "float32"},
              "shapes": [{"height": 64, "width": 64}, {"height": 64, "width": 96}]}
    recipe.pop("strategy")
    cache = tmp_path / "cache"
    report = aotbuild.build(recipe, cache=cache)
    assert [r.status for r in report.results] == ["failed", "failed"] and report.loads["build"] == 1, report.as_json()
    tried = next(r for r in report.results if r.attempts[0].outcome == "failed")
    first, *rest = tried.attempts
    assert "Unable to load weights" in first.reason, first
    assert rest and all(a.outcome == "dropped" and "the pipeline did not load" in a.reason for a in rest), rest
    for result in report.results:
        assert not result.not_retried and "--retry-failed" not in result.reason, result.reason
    assert not (cache / "failures").exists() or not any((cache / "failures").iterdir())
    assert [j.status for j in aotbuild.plan(recipe, cache=cache)] == ["miss", "miss"]  # not "failed": built next time
