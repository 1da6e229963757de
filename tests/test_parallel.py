"""Tensor parallelism: a job is one entry per rank, built, proven and served by that many processes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from aotbuild.errors import RecipeError, UsageError
from aotbuild.features import parallel
from aotbuild.planner import plan, shard_jobs
from aotbuild.recipe.rules import parse_recipe
from tests.conftest import REPO, invoke_cli

FLUX = {"model": {"id": "builtin:tiny-flux", "dtype": "float32"}, "target": "inductor", "device": "cpu",
        "strategy": "jit-cache", "compile": {"components": ["transformer"]}, "shapes": [{"height": 64, "width": 64}],
        "warmup": {"num_inference_steps": 2, "guidance_scale": 3.5}}


def flux(tensor: int | None = 2, **changes) -> dict:
    data = json.loads(json.dumps(FLUX))
    if tensor is not None:
        data["parallel"] = {"tensor": tensor}
    for key, value in changes.items():
        head, _, tail = key.partition(".")
        if tail:
            data.setdefault(head, {})[tail] = value
        else:
            data[key] = value
    return data


@pytest.fixture(scope="module")
def flux_cache(tmp_path_factory) -> Path:
    """A cache root holding only the built-in tiny Flux (created once for this module)."""
    from aotbuild import builtin

    root = tmp_path_factory.mktemp("flux-cache")
    builtin.ensure("builtin:tiny-flux", root / "models")
    return root


@pytest.fixture(scope="module")
def flux_1_1(flux_cache, tmp_path_factory) -> Path:
    """builtin:tiny-flux with one double-stream and one single-stream block (tests/loras.py): a model
    folder for the real builds. Every style of Flux's _tp_plan still shards a block (colwise, rowwise,
    the single block's packed rowwise proj_out); the second block of each kind only added Dynamo and
    Inductor work to each rank."""
    from tests.loras import flux_1_1 as make

    return make(flux_cache / "models", tmp_path_factory.mktemp("flux-1-1") / "tiny-flux-1-1")


@pytest.mark.parametrize(("changes", "key", "says"), [
    ({"parallel": {"tensor": 0}}, "parallel.tensor", "1 to 64"),
    ({"parallel": {"tensor": 65}}, "parallel.tensor", "1 to 64"),
    ({"parallel": {"tensor": "2"}}, "parallel.tensor", "expected an integer"),
    ({"parallel": {"tensors": 2}}, "parallel.tensors", "did you mean 'tensor'"),
    ({"offload": "model", "compile.scope": "regional"}, "offload", "diffusers refuses it too"),
    ({"compile.scope": "regional"}, "compile.scope", "regional scope with tensor parallelism"),
    ({"model.quantization": {"backend": "torchao", "quant_type": "int8wo"}}, "model.quantization", "not shown"),
    ({"strategy": "aot-package"}, "parallel.tensor", "torch.export fails on a tensor-parallel module's DTensor"),
])
def test_what_tensor_parallelism_cannot_do_is_refused_when_the_recipe_is_read(changes, key, says):
    data = flux(2)
    for k, v in changes.items():
        head, _, tail = k.partition(".")
        if tail:
            data.setdefault(head, {})[tail] = v
        else:
            data[k] = v
    with pytest.raises(RecipeError) as info:
        parse_recipe(data)
    assert info.value.key == key and says in str(info.value), str(info.value)


def test_lora_with_tensor_parallelism_is_refused(tmp_path):
    data = flux(2, lora={"rank": 4, "adapters": [{"path": "x.safetensors", "adapter_name": "a"}]})
    with pytest.raises(RecipeError, match="_tp_plan shards the base layers only"):
        parse_recipe(data)


def test_keys_per_rank_differ_from_the_unsharded_and_tensor_1_is_unsharded(flux_cache):
    plain, = plan([flux(None)], flux_cache)
    one, = plan([flux(1)], flux_cache)
    two = plan([flux(2)], flux_cache)
    assert one.key == plain.key and one.rank is None and "parallel" not in plain.factors
    assert len(two) == 2 and len({j.key for j in two} | {plain.key}) == 3
    by_rank = {j.rank: j for j in two}
    assert by_rank[0].siblings == by_rank[1].siblings == (by_rank[0].key, by_rank[1].key)
    factors = by_rank[1].factors["parallel"]
    assert factors["tensor"] == 2 and factors["rank"] == 1 and factors["mesh"] == [2]
    assert factors["backend"] == "gloo" and len(factors["plan"]) == 64
    text = json.dumps(by_rank[0].factors)
    assert "MASTER" not in text and "localhost" not in text and "29500" not in text  # no host, no port


def test_a_rank_s_thread_count_is_keyed_where_kernels_bake_it_not_this_process_s(flux_cache, monkeypatch):
    import torch

    pinned = {"compile.options": {"cpp.dynamic_threads": False}}  # the one setting that keys the count
    job = plan([flux(2, strategy="aot-compile", **pinned)], flux_cache)[0]
    assert job.factors["compile"]["cpu_threads"] == parallel.rank_threads(2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)  # the parent's count is not a rank's
    assert plan([flux(2, strategy="aot-compile", **pinned)], flux_cache)[0].key == job.key
    assert "cpu_threads" not in plan([flux(2, strategy="aot-compile")], flux_cache)[0].factors["compile"]


def test_a_component_without_a_tp_plan_or_with_heads_the_degree_does_not_divide_is_a_recipe_error(
        flux_cache, models_dir):
    sd = {"model": {"id": "builtin:tiny-sd", "dtype": "float32"}, "target": "inductor", "device": "cpu",
          "compile": {"components": ["unet"]}, "shapes": [{"height": 64, "width": 64}], "parallel": {"tensor": 2}}
    with pytest.raises(RecipeError, match=r"unet \(UNet2DConditionModel\) has no _tp_plan.*no component of this "
                                          r"model has one"):
        plan([sd], models_dir)
    with pytest.raises(RecipeError, match="4 does not divide transformer's 2 attention heads"):
        plan([flux(4)], flux_cache)


def test_a_shard_keeps_every_rank_of_a_job_together(flux_cache):
    shapes = [{"height": 64, "width": 64}, {"height": 64, "width": 96}, {"height": 96, "width": 64}]
    jobs = plan([{**flux(2), "shapes": shapes}], flux_cache)
    assert len(jobs) == 6
    for count in (2, 3):
        shards = [shard_jobs(jobs, i, count) for i in range(1, count + 1)]
        assert sorted(j.key for s in shards for j in s) == sorted(j.key for j in jobs)
        for shard in shards:
            assert all(set(j.siblings) <= {k.key for k in shard} for j in shard)


def test_outside_torchrun_or_at_another_world_size_a_load_says_what_to_start(flux_cache, monkeypatch):
    from aotbuild import load_compiled
    from aotbuild.recipe.rules import as_recipe

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(UsageError, match=r"start 2 processes, one per rank, e.g. `torchrun --nproc-per-node 2"):
        load_compiled(flux(2), cache=flux_cache)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError, match=r"the world size is 3 \(WORLD_SIZE\) but parallel.tensor is 2"):
        parallel.setup(as_recipe(flux(2)), "cpu")


def test_on_an_accelerator_the_shard_goes_through_diffusers_public_enable_parallelism():
    class Mesh:
        device_type = "cuda"

        def size(self) -> int:
            return 2

    class Model:
        _tp_plan = {"x": "colwise"}
        _parallel_config = None

        def __init__(self):
            self.configs = []

        def enable_parallelism(self, *, config):
            self.configs.append(config)

    mesh, model = Mesh(), Model()
    parallel.shard(model, mesh, "transformer")
    parallel.shard(model, mesh, "transformer")  # sharded once
    assert len(model.configs) == 1 and model.configs[0].mesh is mesh


def test_a_child_runs_as_ranks_through_torch_s_launcher_and_never_inherits_a_rank(tmp_path, monkeypatch):
    from aotbuild.builder import child

    cmd = child.command("aotbuild.builder.worker", "spec.json", ranks=2)
    launcher = cmd[1:] if sys.version_info >= (3, 11) else cmd[3:]
    # the launcher runs through aotbuild.builder.child, which makes it die with its parent (issue 32, item 4)
    assert launcher[:4] == ["-P", "-m", "aotbuild.builder.child", "torch.distributed.run"] \
        or launcher[:2] == ["aotbuild.builder.child", "torch.distributed.run"]
    assert cmd[-3:] == ["-m", "aotbuild.builder.worker", "spec.json"] and "--standalone" in cmd
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2"
    assert child.command("aotbuild.builder.worker", "spec.json")[-2:] == ["aotbuild.builder.worker", "spec.json"]
    monkeypatch.setenv("RANK", "1")  # aotbuild itself run as a rank of someone's torchrun
    monkeypatch.setenv("WORLD_SIZE", "4")
    code, result = child.spawn("tests.fakes.echo_env", {"names": ["RANK", "WORLD_SIZE"]}, tmp_path / "spec.json",
                               tmp_path / "log", env={"PYTHONPATH": str(REPO)})
    assert code == 0 and result == {"RANK": None, "WORLD_SIZE": None}, result


@pytest.mark.slow  # two ranks compile a tiny Flux transformer, a fresh pair of ranks proves it
@pytest.mark.parametrize("strategy", ["jit-cache", "aot-compile"])
def test_a_tensor_parallel_flux_builds_then_two_fresh_ranks_serve_it_with_0_compiles(strategy, flux_1_1, tmp_path,
                                                                                    monkeypatch):
    """The build's proof is the replica (aotbuild/builder/build.py ``_prove_ranks``): a fresh launch of two
    ranks by torch's launcher, in another working directory with every compiler folder empty, each
    loading its own rank's entry from another store than the build's, after running the unsharded
    pipeline eagerly as the reference. Each rank's entry keeps what its rank saw (``proof.served``),
    read here instead of a second pair serving the same entries (issue 30, item 4). Here the proof
    runs with the build's folders gone (``proof_without_the_build_s_folders``): what a pair serving
    a moved cache checked (an aot-compile rank's artifacts are compiled functions that name their
    kernel files, and an entry that only worked beside the build's folder would show), for both
    strategies, without a third launch. The model is tiny-flux at one block of each kind
    (``flux_1_1``)."""
    import yaml

    build = tmp_path / "build"
    recipe = tmp_path / "tp_flux.yaml"
    recipe.write_text(yaml.safe_dump(flux(2, strategy=strategy, **{"model.id": str(flux_1_1)})))
    hidden = proof_without_the_build_s_folders(monkeypatch, tmp_path / "aside")
    # in this process: the ranks that build and the pair that proves are launched by torch's launcher
    proc = invoke_cli("build", "--json", "--cache", str(build), str(recipe),
                      env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"), "AOTBUILD_CACHE": ""})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    jobs = json.loads(proc.stdout)["jobs"]
    assert [j["status"] for j in jobs] == ["built", "built"], jobs
    # one proof, launched without the ranks' shared compiler folder, their laid-out entries, their cwd
    assert len(hidden) == 1 and {"shared", "rank0", "rank1", "cwd"} <= set(hidden[0]), hidden
    check_each_rank_served([json.loads(invoke_cli("show", job["key"][:12], "--json", "--cache", str(build)).stdout)
                            for job in jobs], strategy)


def proof_without_the_build_s_folders(monkeypatch, aside: Path) -> list[list[str]]:
    """Launch the build's proof (this process runs the build: ``invoke_cli``) with everything of the
    job's folder but the proof's own moved to ``aside``, and put back when it ends (the entries are
    stored from it): a rank's artifact naming a file of the build (its compiler folder, its laid-out
    entry, its cwd) fails the proof, as it would fail a replica serving a moved cache. Returns the
    names moved, one list per proof."""
    from aotbuild.builder import child

    spawn, hidden = child.spawn, []

    def spawn_proof(module: str, spec: dict, spec_path: Path, log: Path, **options):
        if module != "aotbuild.builder.proof":
            return spawn(module, spec, spec_path, log, **options)
        staging = spec_path.parent.parent  # <job folder>/proof/proof.json
        moved = [p for p in staging.iterdir() if p.name not in ("proof", "phase", ".lock")]
        hidden.append(sorted(p.name for p in moved))
        aside.mkdir(parents=True)
        for path in moved:
            shutil.move(str(path), str(aside / path.name))
        try:
            return spawn(module, spec, spec_path, log, **options)
        finally:
            for path in moved:
                shutil.move(str(aside / path.name), str(path))
            aside.rmdir()

    monkeypatch.setattr(child, "spawn", spawn_proof)
    return hidden


def check_each_rank_served(manifests: list[dict], strategy: str) -> None:
    """What each rank of the proof's fresh pair saw serving its own entry (``proof.served``)."""
    assert sorted(m["factors"]["parallel"]["rank"] for m in manifests) == [0, 1]
    for manifest in manifests:
        rank, proof = manifest["factors"]["parallel"]["rank"], manifest["proof"]
        served = proof["served"]
        assert manifest["factors"]["parallel"]["tensor"] == 2
        # this rank's own entry, loaded by the rank it was built for: a hit, nothing compiled
        assert served["rank"] == rank and served["tensor"] == 2, served
        assert served["hits"] == 1 and served["misses"] == 0, served
        assert proof["compiles"] == 0 and served["fxgraph_cache_miss"] == 0, proof
        if strategy == "jit-cache":
            assert served["fxgraph_cache_hit"] >= 1, served  # the rank's graphs, from its entry
        else:
            assert served["dynamo_graphs"] == 0, served  # every call reached the rank's compiled function
        assert proof["calls"] >= 1 and served["dispatch"] == {"": {"built": proof["calls"], "unbuilt": 0}}, served
        # the sharded transformer's outputs against the unsharded eager pipeline's, on each rank
        assert proof["max_abs_diff"] <= 1e-4, proof
        assert served["strict"] == "not tried: tensor parallel", served  # one rank refusing alone would hang


def test_a_rank_s_load_report_names_its_rank_and_the_degree():
    from aotbuild.runtime import LoadReport

    assert "tp_flux (rank 1 of 2): 0 hit, 0 miss" in str(LoadReport("tp_flux", "/c", rank=1, tensor=2))
    assert LoadReport("tp_flux", "/c", rank=1, tensor=2).as_dict()["rank"] == 1
    assert "rank" not in str(LoadReport("tp_flux", "/c")) and "rank" not in LoadReport("tp_flux", "/c").as_dict()


def _ranked_entries(store, tmp_path, name: str, ranks=(0, 1)) -> list[str]:
    from tests import manifests

    parallel_factor = {"tensor": 2, "mesh": [2], "backend": "gloo", "plan": "0" * 64}
    return [manifests.add_entry(store, tmp_path / "src", name,
                                {f"x{r}.so": f"rank {r} of {name}".encode()},
                                parallel={**parallel_factor, "rank": r}) for r in ranks]


def test_pushing_one_rank_s_key_pushes_every_rank_and_a_job_missing_a_rank_is_not_pushed(tmp_path):
    from aotbuild.cache.store import Store
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote

    local = Store(tmp_path / "local")
    both = _ranked_entries(local, tmp_path, "a")
    assert sync.rank_keys(local.read_manifest(both[1]).factors) == both
    lonely = _ranked_entries(local, tmp_path, "b", ranks=(1,))
    folder = tmp_path / "remote"
    folder.mkdir()
    report = sync.push([both[0][:12], lonely[0][:12]], parse_remote(f"file://{folder}"), local.root)
    assert sorted(report.result.sent) == sorted(both)
    assert report.skipped and "rank 0 of its 2 ranks is not in the local cache" in report.skipped[0][1]
    assert not Store(folder).layout.manifest(lonely[0]).is_file()


def test_a_tensor_parallel_job_is_pulled_whole_or_not_at_all(flux_cache, tmp_path):
    from aotbuild.cache.store import Store
    from aotbuild.remote import sync
    from aotbuild.remote.schemes import parse_remote
    from tests import manifests

    jobs = plan([flux(2)], flux_cache)
    remote = Store(tmp_path / "remote")
    for job in jobs:  # the planned entries, stand-in artifacts
        f = json.loads(json.dumps(job.factors))
        src = tmp_path / "src" / str(job.rank)
        src.mkdir(parents=True)
        (src / "x.so").write_bytes(f"rank {job.rank}".encode())
        digest, size = remote.put_blob(src / "x.so")
        remote.put_manifest(manifests.manifest(f, [("x.so", digest, size)], recipe="flux"))
    local = tmp_path / "local"
    shutil.copytree(flux_cache / "models", local / "models")
    one_rank = tmp_path / "one-rank"
    shutil.copytree(remote.root, one_rank)
    (Store(one_rank).layout.manifest(jobs[1].key)).unlink()
    items = sync.pull([flux(2)], parse_remote(f"file://{one_rank}"), local)
    assert {i.status for i in items} == {"missing"} and all("pulled together" in i.reason for i in items), items
    items = sync.pull([flux(2)], parse_remote(f"file://{remote.root}"), local)
    assert sorted(i.status for i in items) == ["pulled", "pulled"]


def test_a_job_missing_one_rank_s_entry_rebuilds_every_rank_in_one_launch(flux_cache, monkeypatch, tmp_path):
    from aotbuild.builder import build as builder
    from aotbuild.builder.build import ResultStatus, store_job
    from aotbuild.cache.store import Store
    from tests.standins import artifacts

    launches: list[list[int]] = []

    def fake_ranks(store, jobs, tick, limit, sign_key, loads, chosen=None):
        launches.append([j.rank for j in jobs])
        return [store_job(store, j, artifacts(tmp_path / "out", j.key), {"signatures": []}, 0.1, limit) for j in jobs]

    monkeypatch.setattr(builder, "_build_group", fake_ranks)
    cache = tmp_path / "cache"
    shutil.copytree(flux_cache / "models", cache / "models")
    first = builder.build([flux(2)], cache)
    assert launches == [[0, 1]] and [r.status for r in first.results] == [ResultStatus.BUILT, ResultStatus.BUILT]
    assert sorted(r.job.rank for r in first.results) == [0, 1]
    cached = builder.build([flux(2)], cache).results
    assert [r.status for r in cached] == [ResultStatus.CACHED, ResultStatus.CACHED] and len(launches) == 1
    rank1 = next(r.job.key for r in first.results if r.job.rank == 1)
    Store(cache).layout.manifest(rank1).unlink()
    again = builder.build([flux(2)], cache)
    assert launches == [[0, 1], [0, 1]] and {r.status for r in again.results} == {ResultStatus.BUILT}
