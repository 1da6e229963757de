"""Neuron and TPU targets, proven here through stand-in backends (tests/fakes) registered under the
real backends' names; the device-helper table; ``aotbuild targets``.

Anything that imports a stand-in runs in a subprocess with ``tests/fakes`` on PYTHONPATH, so the
fakes never leak into the other tests' process.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest
import torch

from aotbuild.errors import RecipeError
from aotbuild.recipe.rules import parse_recipe
from tests.conftest import FAKES, REPO, invoke_cli, run_cli, run_python
from tests.standins import NEURON_BENCH_GROUP, neuron_bench

CUDA = torch.cuda.is_available()
#: Facts of a host without CUDA: where CUDA is, a cuda recipe is available and inductor defaults to cuda.
cpu_only = pytest.mark.skipif(CUDA, reason="asserts what a host without CUDA answers; CUDA is available here")


def recipe(**over) -> dict:
    base = {"model": {"id": "builtin:tiny-sd"}, "shapes": [{"height": 64, "width": 64}]}
    base.update(over)
    return base


@pytest.mark.parametrize("data,expected", [
    (recipe(target="neuron", compile={"dynamic": True}), "compile.dynamic: target neuron needs static shapes"),
    (recipe(target="tpu", compile={"dynamic": True}), "compile.dynamic: target tpu needs static shapes"),
    (recipe(target="neuron", compile={"mode": "max-autotune"}),
     "compile.mode: target neuron supports only mode: default"),
    (recipe(target="tpu", offload="model"), "offload: model offload needs compile.scope: regional"),
    (recipe(target="neuron", device="cuda"),
     "device: 'cuda' is not a device of target neuron (allowed: neuron, neuron:N, cpu)"),
    (recipe(target="tpu", device="tpu:x"), "device: 'tpu:x' is not a device of target tpu"),
    (recipe(target="inductor", device="neuron"), "device: 'neuron' is not a device of target inductor"),
])
def test_forbidden_combinations(data, expected):
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "r.yaml")
    assert expected in str(info.value)


@pytest.mark.parametrize("data", [
    recipe(target="neuron", device="neuron:1"), recipe(target="tpu", device="cpu"),
    recipe(target="tpu", offload="model", compile={"scope": "regional"}),
])
def test_allowed_combinations(data):
    parse_recipe(data, "r.yaml")


def test_real_recipes_validate_and_plan_as_unavailable():
    """Neuron and TPU recipes plan as unavailable on any host these tests run on (no torch_neuronx, no
    torch_tpu); the CUDA recipe is checked apart, since it is available where CUDA is."""
    recipes = [REPO / "recipes" / n for n in ("sdxl_neuron.yaml", "sd35_tpu.yaml", "flux_schnell_tpu_offload.yaml")]
    proc = run_cli("plan", "--json", *map(str, recipes), env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr
    jobs = {j["recipe"]: j for j in json.loads(proc.stdout)["jobs"]}
    assert set(jobs) == {"sdxl_neuron", "sd35_tpu", "flux_schnell_tpu_offload"}
    assert all(j["status"] == "unavailable" and j["reason"].startswith("target unavailable: ") for j in jobs.values())
    assert "torch_neuronx" in jobs["sdxl_neuron"]["reason"] and "torch_tpu" in jobs["sd35_tpu"]["reason"]
    assert invoke_cli("plan", "--fail-on-miss", *map(str, recipes)).returncode == 3


@cpu_only
def test_the_cuda_recipe_plans_as_unavailable_without_cuda(tmp_path):
    from aotbuild import plan
    from aotbuild.recipe.rules import load_recipe

    jobs = plan([load_recipe(REPO / "recipes" / "flux_cuda.yaml")], tmp_path)
    assert [(j.status, j.reason.split(" (")[0]) for j in jobs] == \
        [("unavailable", "target unavailable: CUDA is not available here")]


def test_targets_command():
    data = json.loads(invoke_cli("targets", "--json").stdout)["targets"]
    by = {t["name"]: t for t in data}
    # inductor's default device is cuda where CUDA is (aotbuild/targets/inductor.py)
    assert by["inductor"]["available"] and by["inductor"]["default_device"] == ("cuda" if CUDA else "cpu")
    assert not by["neuron"]["available"] and "torch_neuronx" in by["neuron"]["reason"]
    assert not by["tpu"]["available"] and by["tpu"]["default_dtype"] == "bfloat16"
    faked = {t["name"]: t for t in json.loads(run_cli("targets", "--json", env=FAKES).stdout)["targets"]}
    assert faked["neuron"]["available"] and faked["neuron"]["versions"]["torch_neuronx"] == "0.0.0+standin"
    assert faked["tpu"]["default_device"] == "tpu"
    table = invoke_cli("targets").stdout
    assert "neuron" in table and "why not" in table
    strategies = {s["name"]: s for s in json.loads(invoke_cli("targets", "--json").stdout)["strategies"]}
    assert strategies["jit-cache"]["targets"] == ["inductor", "neuron", "tpu"]
    assert strategies["aot-compile"]["targets"] == ["inductor"] and strategies["aot-compile"]["available"]
    assert "aot-compile" in table and "torch >= 2.13" in table


LOAD = textwrap.dedent("""
    import json, sys, os, importlib
    import torch
    from aotbuild import load_compiled, load_recipe
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from pathlib import Path
    recipe_path, cache, vendor = sys.argv[1:4]
    r = load_recipe(recipe_path)
    eager = load_pipeline(r, resolve_model(r, Path(cache)), "float32")
    defaults = {"num_inference_steps": 1}
    ref = eager(**warmup_kwargs(r, r.shapes[0], eager, defaults=defaults), output_type="pt").images
    # on_miss="compile": the unbuilt shape below must compile (under "error" it would raise ShapeNotBuilt)
    pipe = load_compiled(recipe_path, cache=cache, on_miss="compile")
    stats = importlib.import_module(vendor).stats
    out = pipe(**warmup_kwargs(r, r.shapes[0], pipe, defaults=defaults), output_type="pt").images
    warm = dict(stats)
    pipe(**warmup_kwargs(r, r.shapes[0], pipe, defaults=defaults) | {"height": 32, "width": 32})
    print("RESULT " + json.dumps({"warm": warm, "after_new_shape": dict(stats),
                                  "max_diff": (out - ref).abs().max().item(),
                                  "hits": len(pipe.aotbuild_report.hits)}))
""")


def standin_recipe(tmp_path: Path, target: str, scope: str) -> Path:
    path = tmp_path / f"tiny_{target}.yaml"
    path.write_text(textwrap.dedent(f"""
        model: {{id: builtin:tiny-sd, dtype: float32}}
        target: {target}
        device: cpu
        compile: {{components: [unet], scope: {scope}}}
        shapes: [{{height: 64, width: 64}}]
        warmup: {{guidance_scale: 0.0}}
    """))
    return path


def check_standin_entry(manifest: dict, vendor: str, suffix: str) -> None:
    """A stand-in target's entry: the compiler's own files, keyed by its version, the target's warmup
    default, no weights; and what the build's proof saw serving it in a fresh process (another store and
    working directory, an empty compiler folder): a hit, 0 files written by the compiler, every call of
    the UNet (each block's, regional) through the entry, equal to eager, an unbuilt shape refused."""
    files = [f["path"] for f in manifest["files"]]
    assert files and all(f.startswith("MODULE_") for f in files) and any(f.endswith(suffix) for f in files)
    assert manifest["factors"]["device"][vendor] == "0.0.0+standin"
    assert manifest["factors"]["warmup"]["num_inference_steps"] == 1  # the target's warmup default
    assert manifest["embeds_weights"] is False
    proof = manifest["proof"]
    folder = {"torch_neuronx": "TORCH_NEURONX_NEFF_CACHE_DIR", "torch_tpu": "TORCH_TPU_TIER3"}[vendor]
    assert proof["compiles"] == 0 and folder in proof["counter"], proof  # a fresh load compiles nothing
    assert proof["max_abs_diff"] <= 1e-4 and proof["calls"] >= 1, proof
    served = proof["served"]
    assert served["hits"] == 1 and served["misses"] == 0, served
    assert served["fxgraph_cache_hit"] == served["fxgraph_cache_miss"] == 0, served  # Inductor never ran
    assert served["dispatch"] and all(c == {"built": proof["calls"], "unbuilt": 0}
                                      for c in served["dispatch"].values()), served
    h, w = manifest["shape"]["height"], manifest["shape"]["width"]  # refused at half the height, in pixels
    assert (f'the pipeline was called at {h // 2}x{w} (1 image, guidance off), which this cache did not build '
            f'(on_miss="error"); built: {h}x{w} (1 image, guidance off, as called)') in served["strict"], served


@pytest.fixture
def bench_run(tmp_path_factory, models_dir) -> dict:
    return neuron_bench(tmp_path_factory, models_dir)


@pytest.mark.slow  # builds and proves through the stand-in (shared with tests/test_bench.py)
@pytest.mark.xdist_group(NEURON_BENCH_GROUP)
def test_standin_build_then_fresh_load_compiles_nothing_neuron(bench_run):
    """The Neuron stand-in's entry, built by tests/test_bench.py's bench run (its build is ``aotbuild build``'s:
    builder.build): what its proof's fresh process saw. A fresh load of it was served there, and again by
    bench's warm process (load_compiled, on_miss="error"); the rest of what a serving process of a folder
    target does (the stand-in's own load counter, an unbuilt shape compiled under on_miss="compile", the
    whole pipeline's output) is the TPU case below, in a process of its own: the same FolderCacheTarget."""
    assert bench_run["returncode"] == 0, bench_run["stderr"][-3000:]
    cache = bench_run["cache"]
    entry, = json.loads(invoke_cli("ls", "--json", "--cache", cache).stdout)["entries"]
    assert (entry["target"], entry["shape"]["height"], entry["shape"]["width"]) == ("neuron", 32, 32)
    manifest = json.loads(invoke_cli("show", "--json", "--cache", cache, entry["key"][:12]).stdout)
    check_standin_entry(manifest, "torch_neuronx", "neff")


@pytest.mark.slow  # builds and proves through the stand-in (a minute on 2 cores)
def test_standin_build_then_fresh_load_compiles_nothing_tpu(tmp_path, cache):
    path = standin_recipe(tmp_path, "tpu", "regional")
    build = run_cli("build", "--json", "--cache", str(cache), str(path), env=FAKES)
    assert build.returncode == 0, build.stderr[-3000:]
    job = json.loads(build.stdout)["jobs"][0]
    assert job["status"] == "built"
    # show reads the manifest only: in this process (no stand-in imported here)
    manifest = json.loads(invoke_cli("show", "--json", "--cache", str(cache), job["key"][:12]).stdout)
    check_standin_entry(manifest, "torch_tpu", "bin")
    script = tmp_path / "load.py"
    script.write_text(LOAD)
    proc = run_python(f"import runpy, sys; sys.argv = ['l', {str(path)!r}, {str(cache)!r}, 'torch_tpu']; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')",
                      env={**FAKES, "TORCH_NEURONX_NEFF_CACHE_DIR": "", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert result["hits"] == 1
    assert result["warm"]["compiles"] == 0 and result["warm"]["loads"] >= 1  # a fresh load compiles nothing
    assert result["after_new_shape"]["compiles"] >= 1  # a shape that was not built compiles
    assert result["max_diff"] <= 1e-4


def test_hardware_kind_from_the_environment(monkeypatch):
    from aotbuild.targets.registry import get_target

    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v6e-8")
    assert get_target("tpu").hardware_kind() == "v6e"
    monkeypatch.setenv("NEURON_PLATFORM_TARGET_OVERRIDE", "trn2")
    assert get_target("neuron").hardware_kind() == "trn2"


def test_captured_tree_refuses_symlinks_and_special_files(tmp_path):
    import os

    from aotbuild.cache.trees import collect_tree, lay_tree
    from aotbuild.errors import StoreError

    base = tmp_path / "cache"
    (base / "MODULE_a").mkdir(parents=True)
    (base / "MODULE_a" / "model.neff").write_bytes(b"neff")
    (base / "MODULE_a" / "x.lock").write_bytes(b"")
    assert [rel for rel, _ in collect_tree(base)] == ["MODULE_a/model.neff"]
    installed, _ = lay_tree(collect_tree(base), tmp_path / "out")
    assert installed == 1 and (tmp_path / "out" / "MODULE_a" / "model.neff").read_bytes() == b"neff"
    os.symlink("/etc/passwd", base / "MODULE_a" / "evil")
    with pytest.raises(StoreError, match="not a regular file"):
        collect_tree(base)
    (base / "MODULE_a" / "evil").unlink()
    os.mkfifo(base / "fifo")
    with pytest.raises(StoreError, match="not a regular file"):
        collect_tree(base)


@pytest.mark.slow
@pytest.mark.parametrize("target,scope,fault,named", [
    ("tpu", "regional", "first-instance", "time(s) (files the compiler wrote to TORCH_TPU_TIER3"),
    ("neuron", "full", "drift", "differs from eager by 0.01"),
])
def test_an_entry_that_fails_its_proof_is_never_stored(tmp_path, cache, target, scope, fault, named):
    """A compiler whose artifacts serve only the first block instance in a fresh process, and one
    whose compiled graph drifts from eager: the build fails with the reason, and stores nothing."""
    path = standin_recipe(tmp_path, target, scope)
    build = run_cli("build", "--json", "--cache", str(cache), str(path), env={**FAKES, "AOTBUILD_STANDIN_FAULT": fault})
    assert build.returncode == 1, build.stderr[-3000:]
    job = json.loads(build.stdout)["jobs"][0]
    assert job["status"] == "failed" and named in job["reason"] and "nothing was stored" in job["reason"], job
    assert not list((cache / "manifests").glob("*/*.json")) and not list((cache / "blobs").glob("*/*"))
    # and nothing left behind; verify reads the store only: in this process (no stand-in imported here)
    assert invoke_cli("verify", "--cache", str(cache)).returncode == 0
    log = Path(re.search(r"\(log: (\S+)\)$", job["reason"]).group(1))
    assert log.is_file() and log.parent == cache / "logs"


def test_folder_targets_count_files_the_compiler_wrote_not_files_laid(tmp_path, monkeypatch):
    """The proof counts from before the load: the files install() lays are not compiles, any other
    file in the compiler's folder is."""
    from aotbuild.targets.registry import get_target

    target = get_target("neuron")
    monkeypatch.setenv(target.cache_env, str(tmp_path / "neff-cache"))
    name, count = target.compile_counter()
    assert count() == 0 and "TORCH_NEURONX_NEFF_CACHE_DIR" in name
    blob = tmp_path / "model.neff"
    blob.write_bytes(b"neff")
    target.install([("MODULE_a/model.neff", blob)], "neuron")
    assert count() == 0
    (tmp_path / "neff-cache" / "MODULE_b").mkdir()
    (tmp_path / "neff-cache" / "MODULE_b" / "model.neff").write_bytes(b"compiled here")
    assert count() == 1


def test_a_serving_process_s_own_compiler_folder_is_removed_when_it_exits(tmp_path):
    """A load with no compiler cache folder set makes one for the process (the compiler reads it at
    compile time); it is that process's alone, so it does not outlive it."""
    proc = run_python(textwrap.dedent("""
        import os, sys
        from aotbuild.targets.registry import get_target
        target = get_target("neuron")
        os.environ.pop(target.cache_env, None)
        folder = target.install([], "cpu").folder
        child = os.fork()
        if child == 0:
            sys.exit(0)  # a forked worker exits normally, running the inherited atexit handlers
        os.waitpid(child, 0)
        print("FOLDER", folder, os.path.isdir(folder))
    """), env={"TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("FOLDER "))
    folder, kept_after_child = Path(line.split()[1]), line.split()[2]
    assert kept_after_child == "True"  # the child did not remove its parent's folder
    assert folder.parent == tmp_path and folder.name.startswith("aotbuild-neuron-cache-")
    assert not folder.exists()


def test_a_bfloat16_recipe_on_a_cpu_without_native_bfloat16_is_warned_about(monkeypatch):
    """bfloat16 where oneDNN has no native instruction for it is slower than float32 (1.6x with AVX-512
    alone, 66x at AVX2, docs/targets.md): the build says so; where it has one, nothing is said."""
    import warnings

    import torch

    from aotbuild.builder.build import _warn_slow_formats
    from aotbuild.recipe.rules import parse_recipe
    from aotbuild.targets.inductor import slow_bfloat16

    recipe = parse_recipe({"model": {"id": "builtin:tiny-sd", "dtype": "bfloat16"}, "target": "inductor",
                           "device": "cpu", "shapes": [{"height": 64, "width": 64}]})
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    assert slow_bfloat16() == ""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_slow_formats([recipe])  # native: no warning
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "avx512_core")
    assert slow_bfloat16().startswith("ONEDNN_MAX_CPU_ISA=AVX512_CORE keeps oneDNN from its bfloat16 instructions")
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    with pytest.warns(UserWarning, match=r"no native bfloat16 instruction .*dtype: float32 serves faster"):
        _warn_slow_formats([recipe])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _warn_slow_formats([parse_recipe({"model": {"id": "builtin:tiny-sd", "dtype": "float32"}, "target": "inductor",
                                          "device": "cpu", "shapes": [{"height": 64, "width": 64}]})])
