"""``--shard auto`` (aotbuild/shards.py): each scheduler's variables give every worker its own shard,
the shards partition the plan by job identity (never by key: keys hold the host's ISA), and a
worker that finds no scheduler, half of one, a non-contiguous Slurm array or two schedulers that
disagree is refused (exit 2) instead of building everything. Builds use stand-in compiles."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from aotbuild.builder import build as builder
from aotbuild.builder.build import JobResult, ResultStatus
from aotbuild.errors import UsageError
from aotbuild.shards import Shard, from_environment
from tests.conftest import REPO, TINY_DICT, invoke_cli, one_job, per_job, run_cli

#: Every variable --shard auto reads: each worker's environment starts with none of them.
ALL_VARIABLES = ("CI_NODE_INDEX", "CI_NODE_TOTAL", "BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT",
                 "JOB_COMPLETION_INDEX", "AOTBUILD_SHARD_COUNT", "SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT",
                 "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_STEP", "AWS_BATCH_JOB_ARRAY_INDEX",
                 "AWS_BATCH_JOB_ARRAY_SIZE", "BATCH_TASK_INDEX", "BATCH_TASK_COUNT")


def workers(scheduler: str, n: int) -> list[dict[str, str]]:
    """The environments a scheduler gives its n workers (as its documentation says it does)."""
    if scheduler == "gitlab":
        return [{"CI_NODE_INDEX": str(i + 1), "CI_NODE_TOTAL": str(n)} for i in range(n)]
    if scheduler == "buildkite":
        return [{"BUILDKITE_PARALLEL_JOB": str(i), "BUILDKITE_PARALLEL_JOB_COUNT": str(n)} for i in range(n)]
    if scheduler == "kubernetes":
        return [{"JOB_COMPLETION_INDEX": str(i), "AOTBUILD_SHARD_COUNT": str(n)} for i in range(n)]
    if scheduler == "slurm":  # sbatch --array=10-(10+3(n-1)):3
        return [{"SLURM_ARRAY_TASK_ID": str(10 + 3 * i), "SLURM_ARRAY_TASK_COUNT": str(n),
                 "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_MAX": str(10 + 3 * (n - 1)),
                 "SLURM_ARRAY_TASK_STEP": "3"} for i in range(n)]
    if scheduler == "aws-batch":
        return [{"AWS_BATCH_JOB_ARRAY_INDEX": str(i), "AWS_BATCH_JOB_ARRAY_SIZE": str(n)} for i in range(n)]
    assert scheduler == "gcp-batch"
    return [{"BATCH_TASK_INDEX": str(i), "BATCH_TASK_COUNT": str(n)} for i in range(n)]


SCHEDULERS = ["gitlab", "buildkite", "kubernetes", "slurm", "aws-batch", "gcp-batch"]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_each_scheduler_gives_each_worker_its_own_shard(scheduler):
    found = [from_environment(env) for env in workers(scheduler, 5)]
    assert [(s.index, s.count) for s in found] == [(i, 5) for i in range(1, 6)]


@pytest.fixture
def recipes(tmp_path) -> Path:
    """Three recipes, seven jobs, no two with the same key (each shape is used once)."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    shapes = [[(64, 64), (64, 96)], [(96, 64), (96, 96)], [(32, 32), (32, 64), (64, 32)]]
    for name, sizes in zip("abc", shapes, strict=True):
        data = {**TINY_DICT, "strategy": "jit-cache",
                "shapes": [{"height": h, "width": w} for h, w in sizes]}
        (folder / f"{name}.yaml").write_text(json.dumps(data))  # JSON is YAML
    return folder


def _plan(cache: Path, recipes: Path, *args: str, env: dict[str, str] | None = None):
    clean = {name: None for name in ALL_VARIABLES}  # CliRunner: None unsets
    return invoke_cli("plan", "--json", "--cache", str(cache), str(recipes), *args, env={**clean, **(env or {})})


def _jobs(proc) -> list[tuple[str, str, str]]:
    assert proc.returncode == 0, proc.stderr
    return [(j["recipe"], j["component"], json.dumps(j["shape"], sort_keys=True))
            for j in json.loads(proc.stdout)["jobs"]]


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_n_auto_workers_partition_the_plan_exactly(scheduler, cache, recipes):
    everything = _jobs(_plan(cache, recipes))
    assert len(everything) == 7
    # The partition does not depend on the scheduler, only its variables do: every count of workers
    # (one, some, as many as jobs, more) under one scheduler, three workers under each of the others.
    for n in ((1, 3, 7, 9) if scheduler == SCHEDULERS[0] else (3,)):
        outs = [_plan(cache, recipes, "--shard", "auto", env=env) for env in workers(scheduler, n)]
        shards = [_jobs(p) for p in outs]
        assert sorted(sum(shards, [])) == sorted(everything)  # every job once: none twice, none missing
        assert max(map(len, shards)) - min(map(len, shards)) <= 1  # balanced
        info = [json.loads(p.stdout)["shard"] for p in outs]
        assert len({i["digest"] for i in info}) == 1 and [i["index"] for i in info] == list(range(1, n + 1))
        assert all(i["of"] == 7 and i["jobs"] == len(s) for i, s in zip(info, shards, strict=True))
        assert all(f"of 7 jobs (job list digest {info[0]['digest']})" in p.stderr for p in outs)  # in the log


@pytest.mark.slow  # seconds of subprocesses or server traffic: the full suite runs it
def test_auto_workers_as_subprocesses_split_the_plan(cache, recipes, monkeypatch):
    """Two workers of a Kubernetes Indexed Job as processes of their own (the variables in their
    real environment): the same partition."""
    for name in ALL_VARIABLES:  # this suite may itself run as a shard of a CI scheduler
        monkeypatch.delenv(name, raising=False)
    everything = _jobs(_plan(cache, recipes))
    shards = [_jobs(run_cli("plan", "--json", "--cache", str(cache), str(recipes), "--shard", "auto", env=env))
              for env in workers("kubernetes", 2)]
    assert sorted(sum(shards, [])) == sorted(everything) and all(shards)


@pytest.mark.parametrize("env,says", [
    ({}, "no scheduler's shard variables are set (looked for CI_NODE_INDEX"),
    ({"CI_NODE_INDEX": "2"}, "CI_NODE_INDEX is set but CI_NODE_TOTAL is not"),
    ({"BUILDKITE_PARALLEL_JOB_COUNT": "4"}, "BUILDKITE_PARALLEL_JOB_COUNT is set but BUILDKITE_PARALLEL_JOB is not"),
    ({"JOB_COMPLETION_INDEX": "0"}, "JOB_COMPLETION_INDEX is set but AOTBUILD_SHARD_COUNT is not (Kubernetes"),
    ({"AOTBUILD_SHARD_COUNT": "4"}, "AOTBUILD_SHARD_COUNT is set but JOB_COMPLETION_INDEX is not"),
    ({"AWS_BATCH_JOB_ARRAY_INDEX": "3"}, "AWS_BATCH_JOB_ARRAY_INDEX is set but AWS_BATCH_JOB_ARRAY_SIZE is not"),
    ({"BATCH_TASK_COUNT": "3"}, "BATCH_TASK_COUNT is set but BATCH_TASK_INDEX is not"),
    ({"SLURM_ARRAY_TASK_ID": "3"}, "SLURM_ARRAY_TASK_COUNT, SLURM_ARRAY_TASK_MIN not set"),
    # sbatch --array=1,3,7: three tasks between 1 and 7, step 1
    ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1",
      "SLURM_ARRAY_TASK_MAX": "7"}, "the Slurm array is not contiguous (--array=A-B or A-B:S): SLURM_ARRAY_TASK_ID=3, "
                                    "SLURM_ARRAY_TASK_COUNT=3, SLURM_ARRAY_TASK_MIN=1, SLURM_ARRAY_TASK_MAX=7"),
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "1",
      "SLURM_ARRAY_TASK_STEP": "3"}, "not contiguous"),  # --array=1-7:3 has tasks 1, 4, 7
    ({"CI_NODE_INDEX": "5", "CI_NODE_TOTAL": "4"}, "CI_NODE_INDEX=5 is outside 1..4"),
    ({"BUILDKITE_PARALLEL_JOB": "4", "BUILDKITE_PARALLEL_JOB_COUNT": "4"}, "outside 0..3"),
    ({"BATCH_TASK_INDEX": "x1", "BATCH_TASK_COUNT": "4"}, "BATCH_TASK_INDEX='x1' is not a whole number"),
    ({"CI_NODE_INDEX": "1", "CI_NODE_TOTAL": "2", "JOB_COMPLETION_INDEX": "1", "AOTBUILD_SHARD_COUNT": "2"},
     "schedulers disagree: GitLab (CI_NODE_INDEX=1, CI_NODE_TOTAL=2) says 1/2; Kubernetes (JOB_COMPLETION_INDEX=1, "
     "AOTBUILD_SHARD_COUNT=2) says 2/2"),
])
def test_auto_refuses_what_would_build_the_wrong_share(env, says, cache, recipes):
    proc = _plan(cache, recipes, "--shard", "auto", env=env)
    assert proc.returncode == 2
    assert says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not proc.stdout.strip()  # nothing planned, nothing printed as if it were the shard's list


def test_agreeing_schedulers_and_gitlab_without_parallel_are_accepted():
    both = {"CI_NODE_INDEX": "2", "CI_NODE_TOTAL": "2", "JOB_COMPLETION_INDEX": "1", "AOTBUILD_SHARD_COUNT": "2"}
    assert from_environment(both)[:2] == (2, 2)
    assert from_environment({"CI_NODE_TOTAL": "1"})[:2] == (1, 1)  # GitLab sets it to 1 for a job without parallel:
    with pytest.raises(UsageError, match="CI_NODE_TOTAL is set but CI_NODE_INDEX is not"):
        from_environment({"CI_NODE_TOTAL": "3"})


def test_the_partition_is_the_same_on_an_avx2_and_an_avx512_runner(cache, recipes, monkeypatch):
    """A matrix whose runners differ in ISA: keys differ, each job is still in exactly one shard."""
    import torch

    from aotbuild.planner import plan, shard_jobs

    def jobs_on(isa: str):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: isa)
        return plan(str(recipes), cache)

    avx2, avx512 = jobs_on("AVX2"), jobs_on("AVX512")
    assert {j.key for j in avx2}.isdisjoint({j.key for j in avx512})  # the host factor is in every key
    for n in (2, 3, 4):
        # runners 1..n-1 land on AVX2 machines, the last on AVX-512: the union is still the plan, once each
        split = [shard_jobs(avx2 if i < n else avx512, i, n) for i in range(1, n + 1)]
        names = sorted((j.recipe.name, str(j.shape)) for s in split for j in s)
        assert names == sorted((j.recipe.name, str(j.shape)) for j in avx2)


def _build(cache: Path, recipes: Path, remote: Path, env: dict[str, str]):
    clean = {name: None for name in ALL_VARIABLES}
    return invoke_cli("build", "--json", "--cache", str(cache), str(recipes), "--shard", "auto",
                      "--push", remote.as_uri(), env={**clean, **env})


def _fresh_cache(models_dir: Path, path: Path) -> Path:
    shutil.copytree(models_dir / "models", path / "models")
    return path


def test_auto_shards_build_the_plan_once_and_a_rerun_builds_only_what_the_remote_lacks(
        models_dir, recipes, fake_compiles, tmp_path):
    remote = tmp_path / "remote"
    remote.mkdir()
    envs = workers("gitlab", 3)
    outs = [_build(_fresh_cache(models_dir, tmp_path / f"runner{i}"), recipes, remote, env)
            for i, env in enumerate(envs)]
    assert [p.returncode for p in outs] == [0, 0, 0]
    info = [json.loads(p.stdout)["shard"] for p in outs]  # what each shard's --json says of its shard
    assert [(i["index"], i["count"], i["jobs"], i["of"]) for i in info] == [(1, 3, 3, 7), (2, 3, 2, 7), (3, 3, 2, 7)]
    assert len({i["digest"] for i in info}) == 1 and info[0]["source"].startswith("GitLab (CI_NODE_INDEX=1")
    from aotbuild.cache.store import Store
    from aotbuild.remote.schemes import parse_remote

    assert len(fake_compiles) == 7 and len(set(fake_compiles)) == 7  # every job, each once
    assert parse_remote(remote.as_uri()).keys() == set(fake_compiles)  # and all pushed
    # Shard 2's runner was preempted after building one job and before its push: that entry is lost
    # from the remote. Its rerun, on a fresh runner, compiles only that one.
    lost = fake_compiles[3]  # shard 2's first (the jobs build in shard order)
    Store(remote).remove_manifest(lost)
    fake_compiles.clear()
    proc = _build(_fresh_cache(models_dir, tmp_path / "rerun2"), recipes, remote, envs[1])
    assert proc.returncode == 0 and fake_compiles == [lost]
    fake_compiles.clear()
    assert _build(_fresh_cache(models_dir, tmp_path / "rerun1"), recipes, remote, envs[0]).returncode == 0
    assert fake_compiles == []  # nothing missing: nothing built


def test_a_failing_job_is_built_once_across_shards_and_reruns(models_dir, recipes, fake_compiles, monkeypatch,
                                                               tmp_path):
    stand_in = per_job(builder._build_group)
    tried: list[str] = []

    def failing_one(store, job, *args, **kwargs):
        if job.recipe.name == "b" and job.shape.height == 96 and job.shape.width == 96:
            tried.append(job.key)
            return JobResult(job, ResultStatus.FAILED, 1.0,
                             reason="the component cannot be captured whole: Unsupported: x")
        return stand_in(store, job, *args, **kwargs)

    monkeypatch.setattr(builder, "_build_group", one_job(failing_one))
    remote = tmp_path / "remote"
    remote.mkdir()
    envs = workers("slurm", 3)
    caches = [_fresh_cache(models_dir, tmp_path / f"runner{i}") for i in range(3)]
    outs = [_build(c, recipes, remote, env) for c, env in zip(caches, envs, strict=True)]
    assert sorted(p.returncode for p in outs) == [0, 0, 1]  # the shard holding the failure is red, the others green
    [red] = [i for i, p in enumerate(outs) if p.returncode == 1]
    assert json.loads(outs[red].stdout)["push"]["failures"] == tried  # recorded on the remote with the push
    # Every shard rerun, each on a fresh runner (the failure record is the remote's, not a cache's):
    codes = [_build(_fresh_cache(models_dir, tmp_path / f"rerun{i}"), recipes, remote, env).returncode
             for i, env in enumerate(envs)]
    assert sorted(codes) == [0, 0, 1]  # a known failure keeps its shard red on a rerun...
    assert len(tried) == 1  # ...and is tried once, by one shard, until --retry-failed
    assert len(fake_compiles) == 6
    clean = {name: None for name in ALL_VARIABLES}
    retried = invoke_cli("build", "--json", "--cache", str(_fresh_cache(models_dir, tmp_path / "retry")),
                         str(recipes), "--shard", "auto", "--push", remote.as_uri(), "--retry-failed",
                         env={**clean, **envs[red]})
    assert retried.returncode == 1 and len(tried) == 2  # tried again, only when asked


def test_shard_spec_api_accepts_a_shard_with_its_source():
    from aotbuild.shards import resolve

    assert resolve("2/4") == Shard(2, 4, "--shard")
    assert resolve("auto", {"BATCH_TASK_INDEX": "0", "BATCH_TASK_COUNT": "2"})[:2] == (1, 2)
    with pytest.raises(UsageError, match="expected I/N"):
        resolve("auto-ish", {})


def test_docs_show_the_scheduler_examples():
    text = (REPO / "docs" / "ci.md").read_text()
    for needle in ("--shard auto", "completionMode: Indexed", "backoffLimitPerIndex", "AOTBUILD_SHARD_COUNT",
                   "#SBATCH --array", "CI_NODE_INDEX", "BUILDKITE_PARALLEL_JOB", "AWS_BATCH_JOB_ARRAY_INDEX",
                   "BATCH_TASK_INDEX"):
        assert needle in text, needle


def test_an_auto_component_s_shapes_are_built_by_one_shard(cache, tmp_path):
    """Under strategy auto one strategy serves every shape of a component (builder._build_component):
    a shard that held one shape of it could choose another strategy than the shard holding the rest,
    and the load would miss one of them. Its shapes share one identity; a named strategy's do not."""
    from aotbuild.planner import plan, shard_jobs

    folder = tmp_path / "auto"
    folder.mkdir()
    shapes = [{"height": h, "width": w} for h, w in ((64, 64), (64, 96), (96, 64), (32, 32))]
    (folder / "a.yaml").write_text(json.dumps({**{k: v for k, v in TINY_DICT.items() if k != "strategy"},
                                                "shapes": shapes}))
    (folder / "j.yaml").write_text(json.dumps({**TINY_DICT, "shapes": shapes}))
    jobs = plan(str(folder), cache)
    for n in (2, 3, 4):
        split = [shard_jobs(jobs, i, n) for i in range(1, n + 1)]
        auto_holders = [i for i, s in enumerate(split) if any(j.recipe.name == "a" for j in s)]
        assert len(auto_holders) == 1, [[(j.recipe.name, str(j.shape)) for j in s] for s in split]
        assert sum(j.recipe.name == "a" for j in split[auto_holders[0]]) == 4
        assert len([i for i, s in enumerate(split) if any(j.recipe.name == "j" for j in s)]) > 1  # jit-cache spreads


def test_an_auto_job_this_host_cannot_build_has_the_same_identity_as_on_a_host_that_can(cache, tmp_path):
    """The split must not depend on what the runner can build: an auto recipe for a device this host
    lacks (CUDA here) is dealt as one component, as a host with the device deals it."""
    from aotbuild.planner import identity, plan

    folder = tmp_path / "auto"
    folder.mkdir()
    data = {**{k: v for k, v in TINY_DICT.items() if k != "strategy"}, "device": "cuda",
            "shapes": [{"height": 64, "width": 64}, {"height": 64, "width": 96}]}
    (folder / "gpu.yaml").write_text(json.dumps(data))
    assert {identity(j) for j in plan(str(folder), cache)} == {json.dumps(["gpu", "unet", "*"])}


# -- every number of a shard is ASCII digits (issue 53) ------------------------------------------------
#: Values that are not 1 to 9 ASCII digits: each passed str.isdigit() (then int() raised: a traceback,
#: exit 1) or int() (a shard nobody asked for).
NOT_NUMBERS = ["²", "③", "٣", "１", "+3", "3_0", "-1", "0x3", "1e3", "3.0", "\u00a02", "2\u3000", "1234567890", "2 2"]


def _one_line_refusal(proc, *names: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert all(name in proc.stderr for name in names), (names, proc.stderr)
    assert not proc.stdout.strip()  # nothing planned or built, nothing printed as if it were the shard's list


def test_every_scheduler_variable_is_ascii_digits_or_exit_2_naming_it(cache, recipes):
    """Each variable of each scheduler (AOTBUILD_SHARD_COUNT included) through the one parser: a
    superscript, a circled or Arabic-Indic digit, a sign, an underscore, a space inside, ten digits."""
    refused = 0
    for scheduler in SCHEDULERS:
        env = workers(scheduler, 3)[1]  # a valid worker, then one variable made bad
        for name in env:
            for value in NOT_NUMBERS:
                proc = _plan(cache, recipes, "--shard", "auto", env={**env, name: value})
                _one_line_refusal(proc, f"{name}={ascii(value)} is not a whole number")
                refused += 1
    assert refused == len(NOT_NUMBERS) * sum(len(workers(s, 1)[0]) for s in SCHEDULERS)


def test_gitlab_without_parallel_reads_its_count_with_the_same_parser(cache, recipes):
    _one_line_refusal(_plan(cache, recipes, "--shard", "auto", env={"CI_NODE_TOTAL": "¹"}), "CI_NODE_TOTAL='\\xb9'")


def test_ascii_whitespace_around_a_variable_is_ignored_and_nothing_else():
    """A YAML block scalar leaves a newline: still the number. A no-break space is not ASCII whitespace."""
    assert from_environment({"CI_NODE_INDEX": "2\n", "CI_NODE_TOTAL": " 3\t"})[:2] == (2, 3)
    with pytest.raises(UsageError, match=r"CI_NODE_INDEX='\\xa0' is not a whole number"):
        from_environment({"CI_NODE_INDEX": "\u00a0", "CI_NODE_TOTAL": "1"})  # before: read as unset, 1 of 1


@pytest.mark.parametrize("value", ["", "  ", "\t", "²/4", "2/③", "٣/4", "１/２", " 3/4", "3/ 4", "+3/4", "3_0/40",
                                   "1/2/3", "2/4\n", "0x1/4", "1234567890/1234567891", "0/4", "5/4", "auto-ish"])
def test_a_bad_or_empty_shard_option_is_exit_2_naming_it(cache, recipes, value):
    """``--shard ""`` is an unset ``$SHARD`` in a CI template: it meant "no shard", so every worker built
    every job and went green."""
    _one_line_refusal(_plan(cache, recipes, "--shard", value), f"--shard {ascii(value[:20])}")


@pytest.mark.parametrize("value", ["", " ", "²/4"])
def test_build_refuses_a_bad_or_empty_shard_before_building_anything(models_dir, recipes, fake_compiles, tmp_path,
                                                                     value):
    cache = _fresh_cache(models_dir, tmp_path / "runner")
    proc = invoke_cli("build", "--json", "--cache", str(cache), str(recipes), "--shard", value,
                      env={name: None for name in ALL_VARIABLES})
    _one_line_refusal(proc, f"--shard {ascii(value)}")
    assert fake_compiles == []


def test_the_python_api_refuses_a_shard_that_does_not_exist(cache, recipes):
    from aotbuild import build

    for shard in ((0, 4), (5, 4), (1, 0), ("1", "2"), (True, 1)):
        with pytest.raises(UsageError, match="shard"):
            build(str(recipes), cache=cache, shard=shard)
