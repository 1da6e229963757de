"""The promises, proven for real on the built-in tiny pipeline (CPU Inductor).

The cache is built once per session by the CLI (``built_cache``). Warm loads run in fresh
subprocesses with an empty ``TORCHINDUCTOR_CACHE_DIR`` and count what Inductor did: FX graph cache
hits, zero misses, and no C++ kernel written after the install.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from aotbuild import CacheMiss, load_compiled
from tests.conftest import REPO, TINY_RECIPE, invoke_cli, one_job, per_job, run_cli
from tests.serving import assert_warm, serve_fresh


@pytest.mark.slow
def test_build_stored_two_jobs(built_cache):
    root, report = built_cache
    assert report["counts"] == {"built": 2}
    assert all(j["size"] > 0 for j in report["jobs"])
    manifests = [json.loads(p.read_text()) for p in (root / "manifests").glob("*/*.json")]
    assert len(manifests) == 2
    # One pipeline load for both jobs (a loader process forks each job's worker), one per proof.
    assert report["loads"] == {"jobs": 2, "build": 1, "proof": 2}
    assert [m["build"]["loaded_by"] for m in manifests] == ["loader", "loader"]
    assert all(m["build"]["phases"]["shared_load"] > 0 for m in manifests)  # the loader's one load
    # Each job compiled from empty in-process caches: a kernel both shapes use is in both entries.
    shared = {f["sha256"] for f in manifests[0]["files"]} & {f["sha256"] for f in manifests[1]["files"]}
    assert shared and all(len(m["files"]) > len(shared) for m in manifests)


@pytest.mark.slow
def test_copied_cache_from_another_cwd_compiles_nothing(built_cache, tmp_path):
    root, _ = built_cache
    copy = tmp_path / "elsewhere" / "cache"
    shutil.copytree(root, copy)
    recipe = tmp_path / "recipes" / "tiny_sd_cpu.yaml"
    recipe.parent.mkdir()
    shutil.copy(TINY_RECIPE, recipe)
    cwd = tmp_path / "somewhere-else"
    cwd.mkdir()
    before = snapshot(copy)
    manifests = sorted((copy / "manifests").rglob("*.json"))
    for m in manifests:  # make "used long ago" visible
        os.utime(m, (1_000_000, 1_000_000))
    assert_warm(serve_fresh(recipe, copy, tmp_path, cwd=cwd))
    # Loading writes no file and changes no byte: only the manifests' mtime, their recency for gc
    # (a touch that is skipped where the store is read-only).
    assert snapshot(copy) == before
    assert all(m.stat().st_mtime > 1_000_000 for m in manifests)


def snapshot(root: Path) -> dict[str, tuple[int, str]]:
    return {p.relative_to(root).as_posix(): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in root.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_plan_ls_show_on_built_cache(built_cache):
    root, report = built_cache
    proc = invoke_cli("plan", "--cache", str(root), "--fail-on-miss", str(TINY_RECIPE))
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[5] for line in proc.stdout.splitlines()[2:4]] == ["hit", "hit"]
    data = json.loads(invoke_cli("plan", "--json", "--cache", str(root), str(TINY_RECIPE)).stdout)
    assert {j["status"] for j in data["jobs"]} == {"hit"}
    assert {j["strategy"] for j in data["jobs"]} == {"jit-cache"}  # what TINY_RECIPE names
    listing = json.loads(invoke_cli("ls", "--json", "--cache", str(root)).stdout)
    assert sorted(e["key"] for e in listing["entries"]) == sorted(j["key"] for j in report["jobs"])
    assert listing["models"] == ["tiny-sd-v1"]
    key = report["jobs"][0]["key"]
    shown = invoke_cli("show", "--cache", str(root), key[:10])
    assert shown.returncode == 0 and key in shown.stdout and "env.torch" in shown.stdout
    assert json.loads(invoke_cli("show", "--json", "--cache", str(root), key[:8]).stdout)["key"] == key


@pytest.mark.slow  # the broken recipe's jobs fail in a real worker (no compile: the stand-ins build the rest)
def test_adding_a_shape_builds_one_job_and_failures_are_not_stored(cache, request, monkeypatch, tmp_path):
    """Which jobs a build runs, caches and fails is the promise here, not the compile (a real build of
    the added shape proved nothing the built_cache tests do not): the tiny recipe's jobs compile as
    stand-ins (``fake_compiles``); the broken recipe's run for real, in the worker a build starts."""
    from aotbuild.builder import build as builder

    real = per_job(builder._build_group)
    compiled = request.getfixturevalue("fake_compiles")
    stand_in = per_job(builder._build_group)
    monkeypatch.setattr(builder, "_build_group", one_job(lambda store, job, *args, **kwargs: (
        real if job.recipe.name == "broken" else stand_in)(store, job, *args, **kwargs)))
    assert invoke_cli("build", "--json", "--cache", str(cache), str(TINY_RECIPE)).returncode == 0
    assert len(compiled) == 2
    grown = tmp_path / "tiny_sd_cpu.yaml"
    grown.write_text(TINY_RECIPE.read_text().replace("  - {height: 64, width: 96}",
                                                     "  - {height: 64, width: 96}\n  - {height: 32, width: 32}"))
    broken = tmp_path / "broken.yaml"
    broken.write_text(TINY_RECIPE.read_text().replace("guidance_scale: 0.0", "guidance_scale: high"))
    typo = tmp_path / "typo.yaml"  # the pipeline takes **kwargs: without a check this ran 50 steps
    typo.write_text(TINY_RECIPE.read_text().replace("num_inference_steps: 2", "num_inference_step: 2"))
    # A recipe mistake is found before any job runs (docs/troubleshooting.md): one line, exit 2, nothing built
    refused = invoke_cli("build", "--json", "--cache", str(cache), str(grown), str(typo))
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert ("typo.yaml: warmup.num_inference_step: not an argument of StableDiffusionPipeline.__call__; did you "
            "mean 'num_inference_steps'?") in refused.stderr
    assert len(list((cache / "manifests").glob("*/*.json"))) == 2 and len(compiled) == 2
    proc = invoke_cli("build", "--json", "--cache", str(cache), str(grown), str(broken))
    assert proc.returncode == 1, proc.stderr[-3000:]
    jobs = json.loads(proc.stdout)["jobs"]
    by = {(j["recipe"], j["shape"]["height"], j["shape"]["width"]): j["status"] for j in jobs}
    assert by[("tiny_sd_cpu", 32, 32)] == "built"
    assert by[("tiny_sd_cpu", 64, 64)] == by[("tiny_sd_cpu", 64, 96)] == "cached"
    assert compiled[2:] == [next(j["key"] for j in jobs if j["shape"]["height"] == 32)]  # the added shape alone
    assert by[("broken", 64, 64)] == by[("broken", 64, 96)] == "failed"
    assert "TypeError" in next(j["reason"] for j in jobs if j["recipe"] == "broken")
    assert len(list((cache / "manifests").glob("*/*.json"))) == 3  # nothing stored for the failures
    again = invoke_cli("build", "--json", "--cache", str(cache), str(grown))
    assert again.returncode == 0
    assert {j["status"] for j in json.loads(again.stdout)["jobs"]} == {"cached"}  # unchanged: builds nothing
    assert len(compiled) == 3


@pytest.mark.slow
def test_corrupted_blob_is_a_miss(built_cache, tmp_path):
    root, _ = built_cache
    cache = tmp_path / "cache"
    shutil.copytree(root, cache)
    blob = max((p for p in (cache / "blobs").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    blob.chmod(0o644)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))
    with pytest.raises(CacheMiss, match="corrupt"):
        load_compiled(TINY_RECIPE, cache=cache, on_miss="error")


@pytest.mark.slow
def test_on_miss_error_names_the_differing_factor(built_cache, tmp_path):
    root, _ = built_cache
    recipe = tmp_path / "tiny_sd_cpu.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("guidance_scale: 0.0", "guidance_scale: 5.0"))
    with pytest.raises(CacheMiss) as info:
        load_compiled(recipe, cache=root, on_miss="error")
    assert "warmup.guidance_scale: 0.0 in the cache, 5.0 here" in str(info.value)


#: Put first on a proof child's PYTHONPATH: after the real load, one more Inductor compile, and every
#: output of the component moved by 0.01. The child is aotbuild's own proof, unchanged otherwise.
PLANT = """
import aotbuild.runtime as runtime

real = runtime.load_compiled


def load_compiled(recipe, pipe=None, *args, **kwargs):
    import torch
    from torch.utils._pytree import tree_map

    pipe = real(recipe, pipe, *args, **kwargs)
    torch.compile(lambda x: x.sin() + 1)(torch.randn(8))  # a compile the entry did not cover
    served = pipe.unet.forward

    def wrong(*a, **k):
        return tree_map(lambda t: t + 0.01 if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
                        served(*a, **k))

    pipe.unet.forward = wrong
    return pipe


runtime.load_compiled = load_compiled
"""


@pytest.mark.slow  # the session's tiny-sd entry, proven once more by a proof child with both planted
def test_the_proof_counts_a_planted_compile_and_a_planted_wrong_output(built_cache, tmp_path):
    """The tests read what the proof measured (``proof.served``, tests/test_architectures.py), so the
    proof must not be its own oracle: its fresh process, given a compile and a wrong output it did not
    cause, counts the compile (the strategy's counter, Dynamo's graphs, an FX graph cache miss) and
    measures the difference, and the builder's verdict refuses the entry for each."""
    from aotbuild.builder import child
    from aotbuild.builder.proof import verdict
    from aotbuild.errors import ProofFailed
    from aotbuild.planner import plan
    from aotbuild.recipe.schema import recipe_spec

    root, _ = built_cache
    store = tmp_path / "store"
    shutil.copytree(root, store)
    job = next(j for j in plan([str(TINY_RECIPE)], store) if (j.shape.height, j.shape.width) == (64, 64))
    assert job.status == "hit"
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(PLANT)
    (tmp_path / "cwd").mkdir()
    spec = {"recipe": recipe_spec(job.recipe), "component": "unet", "shape": job.shape.as_dict(),
            "cache_root": str(store), "store": str(store)}
    _, result = child.spawn("aotbuild.builder.proof", spec, tmp_path / "proof" / "spec.json", tmp_path / "proof.log",
                            env={"PYTHONPATH": f"{hooks}{os.pathsep}{REPO}", "AOTBUILD_CACHE": None,
                                 "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "empty-inductor")}, cwd=tmp_path / "cwd")
    assert "error" not in result, result["error"][-3000:]
    served = result["served"]
    assert result["compiles"] >= 1 and served["fxgraph_cache_miss"] >= 1 and served["dynamo_graphs"] >= 1, result
    assert 0.005 < result["max_abs_diff"] < 0.02, result  # the planted 0.01, measured against eager
    assert served["hits"] == 1 and served["misses"] == 0  # the entry itself was loaded, as in any proof
    with pytest.raises(ProofFailed, match=r"compiled [1-9]\d* time\(s\)"):
        verdict(result, job.label)
    with pytest.raises(ProofFailed, match="differs from eager by 0.01"):
        verdict({**result, "compiles": 0}, job.label)  # the wrong output alone is refused too


def test_on_miss_error_on_empty_cache(models_dir, tmp_path):
    """The first-hour trap: loading from another cache root than the build's. The miss says the
    cache is empty, where it is, and how the root is chosen; the error says what to run next."""
    with pytest.raises(CacheMiss, match=f"the cache at {models_dir} is empty .*AOTBUILD_CACHE") as info:
        load_compiled(TINY_RECIPE, cache=models_dir, on_miss="error")
    # into that cache (issue 55: it advised the default cache, and the next load missed again), in Python words
    assert f"next: `aotbuild build {TINY_RECIPE} --cache {models_dir}` builds them here" in str(info.value)
    assert "pass cache= or set AOTBUILD_CACHE" in str(info.value)


@pytest.mark.slow
def test_fx_graph_cache_off_makes_every_entry_a_miss(built_cache):
    import torch._inductor.config as inductor_config

    root, _ = built_cache
    with inductor_config.patch(fx_graph_cache=False), pytest.raises(CacheMiss, match="FX graph cache is off") as info:
        load_compiled(TINY_RECIPE, cache=root, on_miss="error")
    assert "aotbuild build" not in str(info.value)  # building would not help: the message says what would


@pytest.mark.slow  # seconds of subprocesses or server traffic: the full suite runs it
def test_cli_output_is_aotbuild_s_own(tmp_path):
    """First use of the built-in model: one line says it is being created; transformers' torchvision
    notice and the libraries' progress bars stay out of the command's output."""
    proc = run_cli("plan", "--cache", str(tmp_path / "fresh"), str(TINY_RECIPE))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.startswith("creating builtin:tiny-sd in ") and "first use" in proc.stderr
    for noise in ("torchvision", "Writing model shards", "it/s", "Loading"):
        assert noise not in proc.stderr, proc.stderr
    assert "not built: the cache at" in proc.stdout and "is empty" in proc.stdout


def test_build_progress_without_a_terminal_shows_life_once_a_minute(capsys):
    from types import SimpleNamespace

    from aotbuild.cli.commands import _progress

    show = _progress()
    job = SimpleNamespace(label="r:unet@64x64", key="ab" * 32)
    show("start", 1, 2, job, None)
    for seconds in (0.5, 30.0, 61.0, 90.0, 121.5):
        show("tick", 1, 2, job, SimpleNamespace(status="compiling and warming up", seconds=seconds))
    show("end", 1, 2, job, SimpleNamespace(status="built", seconds=130.2, reason=""))
    lines = capsys.readouterr().err.splitlines()
    assert lines == ["[1/2] r:unet@64x64 (abababababab) building ...",
                     "[1/2] r:unet@64x64 (abababababab) compiling and warming up (61 s so far)",
                     "[1/2] r:unet@64x64 (abababababab) compiling and warming up (122 s so far)",
                     "[1/2] r:unet@64x64 (abababababab) built in 130.2 s"]


def test_read_only_commands_on_a_missing_cache_say_so_and_create_nothing(tmp_path):
    missing = tmp_path / "typo"
    for command in (["ls"], ["verify"], ["gc", "--max-size", "1GB"]):
        proc = invoke_cli(*command, "--cache", str(missing))
        assert proc.returncode == 0 and f"no cache at {missing}" in proc.stdout, (command, proc.stderr)
    assert json.loads(invoke_cli("verify", "--json", "--cache", str(missing)).stdout)["problems"] == []
    assert not missing.exists()


def test_a_cache_that_cannot_be_created_is_one_line(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    # a build: a plan writes nothing under the cache (tests/test_reading_writes_nothing.py)
    proc = invoke_cli("build", "--cache", str(blocker / "cache"), str(TINY_RECIPE))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: cannot create builtin:tiny-sd in ") and "--cache DIR" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
