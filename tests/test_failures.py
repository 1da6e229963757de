"""Builds that fail say why, are remembered, and misses compare like with like (the build-failure issue)."""

from __future__ import annotations

import json

import pytest

from aotbuild.builder import build as builder
from aotbuild.builder.build import JobResult, ResultStatus
from tests.conftest import TINY_RECIPE, invoke_cli, one_job, per_job


def test_a_failed_job_is_remembered_shown_by_plan_and_cleared_by_a_build_that_retries_it(cache, fake_compiles,
                                                                                          monkeypatch):
    from aotbuild import plan

    stand_in = per_job(builder._build_group)  # fake_compiles' stand-in compile

    def failing(store, job, *args, **kwargs):
        return JobResult(job, ResultStatus.FAILED, 1.0, reason="the component cannot be captured whole: Unsupported: x")

    monkeypatch.setattr(builder, "_build_group", one_job(failing))
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

    monkeypatch.setattr(builder, "_build_group", one_job(stand_in))  # now it would build
    report = builder.build(str(TINY_RECIPE), cache)  # a recorded failure is not retried (issue 30)
    assert [r.status for r in report.results] == ["failed", "failed"] and all(r.not_retried for r in report.results)
    report = builder.build(str(TINY_RECIPE), cache, retry_failed=True)
    assert [r.status for r in report.results] == ["built", "built"]
    assert [j.status for j in plan(str(TINY_RECIPE), cache)] == ["hit", "hit"]
    assert not list((cache / "failures").glob("*.json"))  # a successful build clears the record


def test_capture_failures_say_the_cause_where_and_the_fix():
    """Data-dependent Python in forward: a 60-line Dynamo error was cut before its useful part."""
    import torch

    from aotbuild.builder.worker import capture_failure
    from aotbuild.recipe.rules import parse_recipe
    from aotbuild.strategies.registry import get_strategy

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
    from aotbuild.cache.store import Store
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


def _runner(models_dir, path):
    import shutil

    shutil.copytree(models_dir / "models", path / "models")
    return path


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_a_failure_recorded_on_the_remote_is_skipped_by_every_fresh_runner_until_retried(
        scheme, models_dir, fake_compiles, monkeypatch, tmp_path):
    """The store's one rule for failures across runners (issue 35): a build's push records its failed
    job on the remote (key, toolchain, first line of why); a runner with a fresh cache pulls the
    record before it plans, does not build the job, and stays red; --retry-failed builds it again,
    and the pushed entry clears the record. What `aotbuild build --push` does, step by step."""
    import uuid

    from aotbuild.planner import plan
    from aotbuild.remote.schemes import parse_remote
    from aotbuild.remote.sync import pull_failures, push
    from tests.conftest import TINY_DICT

    recipe = {**TINY_DICT, "strategy": "jit-cache", "shapes": [{"height": 64, "width": 64},
                                                               {"height": 64, "width": 96}]}
    stand_in = per_job(builder._build_group)
    tried: list[str] = []
    fails = [True]

    def failing_one(store, job, *args, **kwargs):
        if job.shape.width == 96 and fails[0]:
            tried.append(job.key)
            return JobResult(job, ResultStatus.FAILED, 1.0,
                             reason="the component cannot be captured whole: Unsupported: x\n"
                                                      "  File model.py, line 3\nmore of the log")
        return stand_in(store, job, *args, **kwargs)

    monkeypatch.setattr(builder, "_build_group", one_job(failing_one))
    if scheme == "file":
        (tmp_path / "remote").mkdir()
        url = (tmp_path / "remote").as_uri()
    else:
        url = f"memory://f-{uuid.uuid4().hex[:8]}/ci"
    remote = parse_remote(url)

    def run(name: str, retry: bool = False):  # a runner's cache: fresh, or the one it kept (self-hosted)
        cache = tmp_path / name if (tmp_path / name).is_dir() else _runner(models_dir, tmp_path / name)
        pull_failures(remote, cache)
        report = builder.build(recipe, cache, remote=remote, retry_failed=retry)
        # the 64x64 job's result first, whatever order the keys give the jobs (a key factor changes it)
        report.results.sort(key=lambda r: r.job.shape.width)
        keys = [r.job.key for r in report.results if r.status in ("built", "cached")]
        failed = [r.job for r in report.results if r.status == ResultStatus.FAILED]
        return report, push(keys, remote, cache, failed=failed)

    report, pushed = run("first")
    assert [r.status for r in report.results] == ["built", "failed"] and len(tried) == 1
    [key] = tried
    assert pushed.failures == [key] and remote.failure_keys() == {key}
    record = remote.read_failure(key)
    assert record["reason"] == "the component cannot be captured whole: Unsupported: x"  # the first line
    assert record["key"] == key and record["toolchain"]["env"]["torch"] and record["toolchain"]["target"]
    assert "recorded 1 failed job(s) on" in pushed.text()

    for name in ("second", "third"):  # fresh runners (another shard's, a rerun after preemption)
        report, pushed = run(name)
        assert [r.status for r in report.results] == ["remote", "failed"] and report.failed
        assert report.results[1].not_retried and f"(recorded on {url})" in report.results[1].reason
        assert pushed.failures == []  # the same failure is not written back
    assert len(tried) == 1  # built once across all runners

    from aotbuild.cache.store import Store

    assert Store(tmp_path / "second").failure(key)["remote"] == url  # pulled into a cache that is kept
    fails[0] = False  # fixed (a new toolchain would be a new key; here, the same key built again)
    report, pushed = run("retry", retry=True)
    assert [r.status for r in report.results] == ["remote", "built"] and pushed.result.sent == [key]
    assert remote.failure_keys() == set()  # the entry there clears the record
    assert Store(tmp_path / "retry").failure(key) is None  # and the retrying runner's own
    report, _ = run("after")
    assert [r.status for r in report.results] == ["remote", "remote"] and not report.failed
    # A runner that kept its cache forgets the record it pulled once the remote no longer has it: its
    # plan, with or without the remote, no longer says the job failed.
    report, _ = run("second")
    assert [r.status for r in report.results] == ["remote", "remote"] and not report.failed
    assert Store(tmp_path / "second").failure(key) is None
    assert "failed" not in [j.status for j in plan(recipe, tmp_path / "second")]


def test_a_hostile_failure_record_on_a_remote_is_ignored(models_dir, tmp_path):
    """A record is read bounded and checked before use: too big, not JSON, too deep, without a reason,
    or naming another key, it is not pulled (a bucket's writer can only ever make a job look failed)."""
    from aotbuild.cache.store import MAX_FAILURE_BYTES, Store
    from aotbuild.remote.schemes import parse_remote
    from aotbuild.remote.sync import pull_failures
    from tests.standins import key_of

    (tmp_path / "remote").mkdir()
    remote = parse_remote((tmp_path / "remote").as_uri())
    bad = {"big": json.dumps({"reason": "x" * MAX_FAILURE_BYTES}), "text": "not json", "deep": '{"reason": "x", '
           '"a": ' + "[" * 50 + "]" * 50 + "}", "noreason": '{"time": "now"}',
           "other": json.dumps({"key": key_of("someone else"), "reason": "x"}),
           "nokey": json.dumps({"reason": "x", "aotbuild": "1"})}
    folder = tmp_path / "remote" / "failures"
    folder.mkdir()
    for name, text in bad.items():
        (folder / f"{key_of(name)}.json").write_text(text)
    good = key_of("good")
    (folder / f"{good}.json").write_text(json.dumps({"key": good, "reason": "boom\nsecond line", "aotbuild": "1"}))
    cache = Store(tmp_path / "cache")
    assert pull_failures(remote, cache) == [good]
    assert sorted(p.stem for p in (cache.root / "failures").iterdir()) == [good]
    assert cache.failure(good)["reason"] == f"boom (recorded on {remote.url})"


def test_a_failure_record_pushed_by_key_names_the_building_toolchain(tmp_path):
    """A record named by its key (a build whose failed attempts are recorded under keys of their own)
    goes with this process's toolchain, and is not written again once the remote has it."""
    import torch

    from aotbuild.cache.store import Store
    from aotbuild.remote.schemes import parse_remote
    from aotbuild.remote.sync import push_failures
    from tests.standins import key_of

    (tmp_path / "remote").mkdir()
    remote = parse_remote((tmp_path / "remote").as_uri())
    store = Store(tmp_path / "cache")
    key = key_of("a")
    store.put_failure(key, {"key": key, "reason": "boom\nthe rest", "time": "t1", "aotbuild": "x"})
    assert push_failures(remote, store, [key, key_of("no record")]) == [key]
    record = remote.read_failure(key)
    assert record["reason"] == "boom" and record["toolchain"]["env"]["torch"] == torch.__version__
    assert push_failures(remote, store, [key]) == []  # the same failure: not written again
    store.put_failure(key, {"key": key, "reason": "boom again", "time": "t2", "aotbuild": "x"})
    assert push_failures(remote, store, [key]) == [key] and remote.read_failure(key)["reason"] == "boom again"


def test_an_auto_attempt_that_failed_is_not_tried_again_by_a_fresh_runner(models_dir, fake_compiles, monkeypatch,
                                                                            tmp_path):
    """`build --push` records auto's failed attempt (under its strategy's key) on the remote; a fresh
    runner that must build the job again (its entry is not on the remote) goes straight to the
    strategy that worked, as a rerun on the same cache does (tests/test_auto.py)."""
    from aotbuild.planner import plan
    from aotbuild.remote.schemes import parse_remote
    from tests.conftest import TINY_DICT, invoke_cli

    stand_in = per_job(builder._build_group)
    tried: list[str] = []

    def build_one(store, job, *args, **kwargs):
        tried.append(job.recipe.strategy)
        if job.recipe.strategy == "aot-package":
            return JobResult(job, ResultStatus.FAILED, 1.0,
                             reason="the component cannot be captured whole: x\nsecond line")
        return stand_in(store, job, *args, **kwargs)

    monkeypatch.setattr(builder, "_build_group", one_job(build_one))
    recipe = tmp_path / "auto.yaml"
    # auto without its prepacked first try on a CPU (freezing: false): its three strategies, as tests/test_auto.py
    recipe.write_text(json.dumps({**{k: v for k, v in TINY_DICT.items() if k != "strategy"},
                                  "compile": {"options": {"freezing": False}}}))
    (tmp_path / "remote").mkdir()
    url = (tmp_path / "remote").as_uri()

    def build(name: str):
        cache = _runner(models_dir, tmp_path / name)
        return invoke_cli("build", "--json", "--cache", str(cache), str(recipe), "--push", url), cache

    first, cache = build("first")
    assert first.returncode == 0 and tried == ["aot-package", "aot-compile"], first.stderr
    job, = plan(str(recipe), cache)
    package = job.attempt_keys["aot-package"]
    assert json.loads(first.stdout)["push"]["failures"] == [package]
    assert parse_remote(url).failure_keys() == {package}
    parse_remote(url).store.remove_manifest(job.key)  # the entry gone from the remote: built again
    again, _ = build("second")
    assert again.returncode == 0 and tried[2:] == ["aot-compile"], again.stderr  # not aot-package again

    # aot-package works now: a --retry-failed build's entry holds that attempt, and its push clears the
    # attempt's record there, so no runner skips aot-package for this job again.
    def works(store, job, *args, **kwargs):
        tried.append(job.recipe.strategy)
        return stand_in(store, job, *args, **kwargs)

    monkeypatch.setattr(builder, "_build_group", one_job(works))
    parse_remote(url).store.remove_manifest(job.key)
    cache = _runner(models_dir, tmp_path / "retry")
    retried = invoke_cli("build", "--json", "--cache", str(cache), str(recipe), "--push", url, "--retry-failed")
    assert retried.returncode == 0 and tried[3:] == ["aot-package"], retried.stderr
    assert parse_remote(url).failure_keys() == set()


def test_plan_with_a_remote_shows_the_remote_s_failure_records(cache, tmp_path):
    """`plan --remote` says of a job whose key has a failure record on the remote what a build with
    --push would say after pulling it: "failed", the record's first line and where it was recorded
    (text and --json; the --fail-on-miss gate counts it as missing), writing nothing locally. A record
    of another aotbuild version is a miss (as a local one is), and a job whose entry is on the
    remote is "remote" whatever record is there."""
    from aotbuild import constants, plan
    from aotbuild.cache.store import Store
    from aotbuild.remote.schemes import parse_remote

    keys = [j.key for j in plan(str(TINY_RECIPE), cache)]
    (tmp_path / "remote").mkdir()
    url = (tmp_path / "remote").as_uri()
    remote = parse_remote(url)
    first, second = keys
    for key, version in ((first, constants.VERSION), (second, "0.0.1-older")):
        remote.put_failure(key, {"key": key, "reason": "the component cannot be captured whole: x\nmore",
                                 "time": "2026-12-01T00:00:00+00:00", "aotbuild": version})
    proc = invoke_cli("plan", "--json", "--cache", str(cache), str(TINY_RECIPE), "--remote", url)
    jobs = {j["key"]: j for j in json.loads(proc.stdout)["jobs"]}
    assert jobs[first]["status"] == "failed" and jobs[second]["status"] == "miss"
    assert jobs[first]["reason"] == (f"failed before (2026-12-01T00:00:00+00:00, aotbuild {constants.VERSION}): "
                                     f"the component cannot be captured whole: x (recorded on {url})")
    text = invoke_cli("plan", "--cache", str(cache), str(TINY_RECIPE), "--remote", url)
    assert text.returncode == 0 and "failed before (2026" in text.stdout and f"(recorded on {url})" in text.stdout
    row = next(line for line in text.stdout.splitlines() if first[:12] in line)
    assert " failed " in row, text.stdout
    gate = invoke_cli("plan", "--cache", str(cache), str(TINY_RECIPE), "--remote", url, "--fail-on-miss")
    assert gate.returncode == 3
    assert Store(cache).failure_keys() == set()  # plan wrote nothing
    assert [j.status for j in plan(str(TINY_RECIPE), cache)] == ["miss", "miss"]  # without the remote: misses

    listed = tmp_path / "remote" / "manifests" / first[:2] / f"{first}.json"  # its entry, as a listing sees it
    listed.parent.mkdir(parents=True)
    listed.write_text("{}")
    proc = invoke_cli("plan", "--json", "--cache", str(cache), str(TINY_RECIPE), "--remote", url)
    assert {j["key"]: j["status"] for j in json.loads(proc.stdout)["jobs"]}[first] == "remote"


def _record(key: str, reason: str = "boom") -> dict:
    from aotbuild import constants

    return {"key": key, "reason": reason, "time": "2026-12-01T00:00:00+00:00", "aotbuild": constants.VERSION}


def test_an_entry_pushed_again_clears_its_failure_record_there_and_here(tmp_path):
    """A key with a failure record on the remote (a runner whose retry failed again after another's
    worked) and an entry there: pushing the entry, though the remote has it, removes the record
    there and in the pushing cache, so no shard skips a job that builds."""
    from aotbuild.cache.store import Store
    from aotbuild.remote.schemes import parse_remote
    from aotbuild.remote.sync import push
    from tests.standins import add_entry

    (tmp_path / "remote").mkdir()
    remote = parse_remote((tmp_path / "remote").as_uri())
    local = Store(tmp_path / "cache")
    a = add_entry(local, tmp_path, "a", {"x.so": b"kernel-a"})
    assert push([a], remote, local.root).result.sent == [a]
    remote.put_failure(a, _record(a))
    local.put_failure(a, {**_record(a), "remote": remote.url})
    assert push([a], remote, local.root).result.present == [a]
    assert remote.failure_keys() == set() and local.failure(a) is None


def test_a_remote_past_the_pull_limit_gives_its_newest_failure_records(tmp_path, monkeypatch, caplog):
    """Past MAX_PULLED_FAILURES, the newest records are pulled (by the store's modification time of
    each, from the listing: no record is read to sort them), not the first by name, and a warning
    names the remote and how many it holds."""
    import logging
    import os
    import time

    from aotbuild.cache.store import Store
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote
    from tests.standins import key_of

    monkeypatch.setattr(sync, "MAX_PULLED_FAILURES", 2)
    (tmp_path / "remote").mkdir()
    remote = parse_remote((tmp_path / "remote").as_uri())
    keys = sorted(key_of(f"k{i}") for i in range(5))  # by name; the last is the newest
    now = time.time()
    for i, key in enumerate(keys):
        remote.put_failure(key, _record(key))
        os.utime(remote.store.layout.failure(key), (now - 3600 * (5 - i),) * 2)
    read: list[str] = []
    real = remote.read_failure
    monkeypatch.setattr(remote, "read_failure", lambda key: read.append(key) or real(key))
    with caplog.at_level(logging.WARNING, logger="aotbuild"):
        pulled = sync.pull_failures(remote, Store(tmp_path / "cache"))
    assert pulled == [keys[4], keys[3]] and read == pulled
    assert f"{remote.url} holds 5 failure records of jobs it has no entry of: only the newest 2 were read" \
        in caplog.text
