"""Exit codes a CI job can trust (issue 30, item 3): ``build`` exits 2 for a model folder it cannot
read, 1 for a job that failed (now, or before and not retried), 0 when the only jobs not built are
skipped because their target is not on this host; ``plan --fail-on-miss`` exits 3 for all of those.

In-process (click's CliRunner): what is tested is the exit code and the output, not process isolation;
no compile (``fake_compiles``, or a stand-in failure).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from aotbuild.builder import build as builder
from aotbuild.builder.build import JobResult, ResultStatus
from aotbuild.cache.store import Store
from aotbuild.cli.commands import main
from tests.conftest import REPO, TINY_RECIPE, one_job, per_job

RECIPE = ("model: {{id: {model}, dtype: float32}}\nshapes: [{{height: 64, width: 64}}]\n"
          "warmup: {{guidance_scale: 0.0}}\n")
REASON = "the component cannot be captured whole: Unsupported: x\nsecond line of the recorded reason"


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def jobs_of(result) -> list[dict]:
    return json.loads(result.stdout)["jobs"]


@pytest.fixture
def model_folder(models_dir, tmp_path) -> Path:
    """A copy of the built-in tiny SD pipeline as a local model folder, with a recipe beside it."""
    folder = tmp_path / "pr" / "model"
    shutil.copytree(next((models_dir / "models").glob("tiny-sd-v*")), folder)
    (tmp_path / "pr" / "r.yaml").write_text(RECIPE.format(model="./model"))
    return folder


# -- a build that built nothing does not exit 0 ---------------------------------------------------

@pytest.mark.parametrize("damage,says", [
    ("nan", "NaN is not JSON"),
    ("nested", "nested more than 64 levels"),
])
def test_a_build_whose_model_folder_cannot_be_read_exits_2(model_folder, tmp_path, fake_compiles, damage, says):
    """It was planned "unavailable", reported "skipped" and exited 0: a CI pre-warm went green, the cache empty."""
    if damage == "nan":
        (model_folder / "unet" / "config.json").write_text('{"in_channels": NaN}')
    else:
        (model_folder / "model_index.json").write_text("[" * 100 + "]" * 100)
    recipe = str(model_folder.parent / "r.yaml")
    result = cli("build", "--json", "--cache", str(tmp_path / "cache"), recipe)
    assert result.exit_code == 2, result.output
    [job] = jobs_of(result)
    assert (job["status"], job["unavailable"]) == ("failed", "model") and says in job["reason"]
    assert fake_compiles == []
    text = cli("build", "--cache", str(tmp_path / "cache"), recipe)
    assert text.exit_code == 2 and "skipped" not in text.stdout and says in text.stdout
    plan = cli("plan", "--json", "--cache", str(tmp_path / "cache"), recipe)
    assert plan.exit_code == 0 and jobs_of(plan)[0]["unavailable"] == "model"  # plan reports; build refuses


def test_a_model_folder_that_cannot_be_read_is_a_model_error_for_bench_and_load_compiled_too(model_folder, tmp_path):
    """Both said TargetUnavailable (exit 1) for any job that could not be keyed: the kind is the model's."""
    from aotbuild import ModelUnavailable, TargetUnavailable, load_compiled

    (model_folder / "unet" / "config.json").write_text('{"in_channels": NaN}')
    recipe = model_folder.parent / "r.yaml"
    result = cli("bench", "--modes", "eager", "--cache", str(tmp_path / "cache"), str(recipe))
    assert result.exit_code == 2 and "cannot bench" in result.stderr and "NaN is not JSON" in result.stderr
    (model_folder / "model_index.json").write_text("[" * 100 + "]" * 100)
    with pytest.raises(ModelUnavailable, match="nested more than 64 levels") as info:
        load_compiled(recipe, cache=tmp_path / "cache")
    assert not isinstance(info.value, TargetUnavailable)


def test_a_target_not_on_this_host_is_skipped_with_exit_0_and_names_what_is_missing(tmp_path, monkeypatch):
    """A Neuron recipe on a CPU runner (no stand-in backends in this process): another host builds it."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    recipe = str(REPO / "recipes" / "sdxl_neuron.yaml")
    result = cli("build", "--json", "--cache", str(tmp_path / "cache"), recipe)
    assert result.exit_code == 0, result.output
    [job] = jobs_of(result)
    assert (job["status"], job["unavailable"]) == ("skipped", "target")
    assert "torch_neuronx" in job["reason"]
    text = cli("build", "--cache", str(tmp_path / "cache"), recipe)
    assert text.exit_code == 0
    assert "skipped: 1 job(s) this host cannot build (another host builds them): target unavailable: " \
           "`import torch_neuronx` failed" in text.stdout
    # A gate must not pass what it did not check.
    assert cli("plan", "--fail-on-miss", "--cache", str(tmp_path / "cache"), recipe).exit_code == 3


def test_an_unreachable_hub_model_fails_the_build_not_the_host(tmp_path, monkeypatch, no_ambient_hf_auth):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # refused at once: no network here
    hub = tmp_path / "hub.yaml"
    hub.write_text("model: {id: someorg/not-here}\nshapes: [{height: 512, width: 512}]\n")
    neuron = str(REPO / "recipes" / "sdxl_neuron.yaml")
    result = cli("build", "--json", "--cache", str(tmp_path / "cache"), str(hub), neuron)
    assert result.exit_code == 1, result.output
    status = {j["recipe"]: (j["status"], j["unavailable"]) for j in jobs_of(result)}
    assert status == {"hub": ("failed", "hub"), "sdxl_neuron": ("skipped", "target")}


# -- one rule for failures: a recorded failure is not retried until --retry-failed -------------------

@pytest.fixture
def failing(monkeypatch) -> list[str]:
    """Every job fails, as a compile that cannot capture the component would; returns the keys tried."""
    tried: list[str] = []

    def fail(store, job, *args, **kwargs):
        tried.append(job.key)
        return JobResult(job, ResultStatus.FAILED, 1.0, reason=REASON)

    monkeypatch.setattr(builder, "_build_group", one_job(fail))
    return tried


def test_a_recorded_failure_is_not_retried_keeps_exit_1_and_says_retry_failed(cache, fake_compiles, failing):
    recipe = str(TINY_RECIPE)
    first = cli("build", "--json", "--cache", str(cache), recipe)
    assert first.exit_code == 1 and len(failing) == 2  # both jobs tried, both failed, both recorded

    again = cli("build", "--json", "--cache", str(cache), recipe)
    assert again.exit_code == 1, again.output  # never "skipped, exit 0"
    assert len(failing) == 2  # not tried again
    for job in jobs_of(again):
        assert job["status"] == "failed" and job["reason"].startswith("failed before (")
        assert "captured whole: Unsupported: x; not retried: the same command with --retry-failed" in job["reason"]
        assert "second line" not in job["reason"]  # the recorded reason's first line
    assert cli("plan", "--fail-on-miss", "--cache", str(cache), recipe).exit_code == 3
    text = cli("build", "--cache", str(cache), recipe).stdout
    assert "--retry-failed" in text and len(failing) == 2

    retried = cli("build", "--json", "--retry-failed", "--cache", str(cache), recipe)
    assert retried.exit_code == 1 and len(failing) == 4  # tried again, failed again


def test_retry_failed_builds_it_and_a_build_clears_the_record(cache, fake_compiles, monkeypatch):
    from aotbuild import build

    stand_in = per_job(builder._build_group)  # fake_compiles' stand-in compile
    monkeypatch.setattr(builder, "_build_group",
                        one_job(lambda store, job, *a, **k: JobResult(job, ResultStatus.FAILED, 1.0, reason=REASON)))
    assert cli("build", "--cache", str(cache), str(TINY_RECIPE)).exit_code == 1
    monkeypatch.setattr(builder, "_build_group", one_job(stand_in))  # now it would build
    report = build(str(TINY_RECIPE), cache)  # the Python API keeps the rule
    assert [r.status for r in report.results] == ["failed", "failed"] and fake_compiles == []
    assert report.failed and all(r.not_retried for r in report.results)
    report = build(str(TINY_RECIPE), cache, retry_failed=True)
    assert [r.status for r in report.results] == ["built", "built"] and len(fake_compiles) == 2
    assert not list(Store(cache).failure_files())  # a build that succeeds clears the record
    assert cli("plan", "--fail-on-miss", "--cache", str(cache), str(TINY_RECIPE)).exit_code == 0


def test_a_failure_recorded_by_another_aotbuild_is_retried(cache, fake_compiles):
    """The record says nothing about this version (a fix may have landed): retried without the flag."""
    from aotbuild import build, plan

    store = Store(cache)
    keys = [j.key for j in plan(str(TINY_RECIPE), cache)]
    for key in keys:
        store.put_failure(key, {"key": key, "reason": REASON, "aotbuild": "0.0.1", "time": "2026-01-01"})
    jobs = plan(str(TINY_RECIPE), cache)
    assert [j.status for j in jobs] == ["miss", "miss"]
    assert all("it failed with aotbuild 0.0.1: this version tries again" in j.reason for j in jobs)
    report = build(str(TINY_RECIPE), cache)
    assert [r.status for r in report.results] == ["built", "built"] and sorted(fake_compiles) == sorted(keys)


def test_a_build_that_waited_for_another_builder_does_not_retry_its_failure(cache, fake_compiles):
    """Two builders of one job (a terminal and a CI job on a shared cache): the second waited, then
    built the job again after the first failed it."""
    import contextlib

    from aotbuild import build, plan
    from aotbuild.cache.locks import flocked
    from aotbuild.constants import VERSION
    from tests.conftest import TINY_DICT

    store = Store(cache)
    [job] = plan(TINY_DICT, cache)
    first = contextlib.ExitStack()  # the other builder, holding the job's build lock
    first.enter_context(flocked(store.layout.build_lock(job.key), exclusive=True, timeout=0))

    def progress(event, n, total, _job, result):
        if event == "tick" and result.status.startswith("waiting"):  # the other builder fails, then lets go
            store.put_failure(job.key, {"key": job.key, "reason": REASON, "aotbuild": VERSION, "time": "now"})
            first.close()

    [result] = build(TINY_DICT, cache, progress=progress).results
    assert result.status == "failed" and fake_compiles == []
    assert result.reason.startswith("failed meanwhile in another aotbuild process: the component cannot be")
    assert result.reason.endswith("not retried: build(..., retry_failed=True) builds it again")  # Python's words
    assert store.failure(job.key)["reason"] == REASON  # the other builder's record, not overwritten


def test_a_tensor_parallel_job_one_of_whose_ranks_failed_is_not_built_until_retry_failed(tmp_path, monkeypatch):
    """Its ranks are built in one launch: a failure recorded for any rank holds back the whole job."""
    from aotbuild import build, builtin, plan
    from aotbuild.constants import VERSION

    recipe = {"model": {"id": "builtin:tiny-flux", "dtype": "float32"}, "target": "inductor", "device": "cpu",
              "strategy": "jit-cache", "compile": {"components": ["transformer"]},
              "shapes": [{"height": 64, "width": 64}],
              "warmup": {"num_inference_steps": 2, "guidance_scale": 3.5}, "parallel": {"tensor": 2}}
    root = tmp_path / "c"
    builtin.ensure("builtin:tiny-flux", root / "models")
    ranks = plan([recipe], root)
    assert sorted(j.rank for j in ranks) == [0, 1]
    rank1 = next(j for j in ranks if j.rank == 1)
    Store(root).put_failure(rank1.key, {"key": rank1.key, "reason": REASON, "aotbuild": VERSION, "time": "now"})
    launches: list[int] = []

    def launch(store, jobs, *args):  # what builds every rank of one job in one launch
        launches.append(len(jobs))
        return [JobResult(j, ResultStatus.FAILED, 1.0, reason="stand-in") for j in jobs]

    monkeypatch.setattr(builder, "_build_group", launch)
    report = build([recipe], root)
    assert [r.status for r in report.results] == ["failed", "failed"] and launches == []
    assert all(r.not_retried and "captured whole" in r.reason for r in report.results)
    build([recipe], root, retry_failed=True)
    assert launches == [2]  # both ranks, in one launch
