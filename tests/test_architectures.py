"""A hit is a promise on diffusers' real architectures: SD3, SDXL, PixArt-Sigma and Wan 2.1 (the built-in
tiny ones), guidance on where the recipe has it (PixArt batched, Wan in two calls, a video shape).

Each case builds one recipe for real with the CLI (the build's own proof must pass), then moves the
cache elsewhere and serves it from a fresh process in another working directory with an empty
Inductor folder, as a new replica would (tests/serving.py): every entry a hit, 0 compiles by the
strategy's own counter, and the denoiser's output equal to eager's within 1e-5 on the same inputs.
Together with tests/test_regional.py (Flux 2+2 regional with aot-package and aot-compile) and
tests/test_strategies.py (tiny-sd, every strategy) they cover each architecture, each strategy and
each scope; the whole matrix (every architecture x strategy x scope) is benchmarks/arch_matrix.py,
kept out of CI for time (docs: benchmarks/README.md).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli
from tests.serving import serve_fresh

pytestmark = pytest.mark.slow

def recipe_for(tmp_path: Path, base: str, strategy: str, scope: str, compile_extra: dict | None = None,
               warmup_extra: dict | None = None) -> Path:
    data = yaml.safe_load((REPO / "recipes" / base).read_text())
    data["strategy"] = strategy
    data["compile"] = {**data.get("compile", {}), "scope": scope, **(compile_extra or {})}
    data["warmup"] = {**data.get("warmup", {}), **(warmup_extra or {})}
    path = tmp_path / "recipes" / f"{Path(base).stem}-{strategy}-{scope}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))
    return path


CASES = [  # (recipe, strategy, scope, compile extra, warmup extra, block instances the proof must call)
    ("tiny_sd3_cpu.yaml", "jit-cache", "regional", {"blocks": ["JointTransformerBlock"]},
     {"prompt": ["a cat", "a dog"]}, 3),  # no _repeated_blocks in diffusers; a list of prompts
    ("tiny_sdxl_cpu.yaml", "aot-package", "full", {}, {}, 1),
    # Guidance on, each way a pipeline applies it (Flux's, an input of the transformer, is in
    # tests/test_regional.py): PixArt batches both halves (and has no do_classifier_free_guidance);
    # Wan, a video pipeline, runs them as two calls per step.
    ("tiny_pixart_cpu.yaml", "jit-cache", "full", {}, {}, 1),
    ("tiny_wan_cpu.yaml", "aot-compile", "full", {}, {}, 1),
]


@pytest.mark.parametrize("base,strategy,scope,compile_extra,warmup_extra,instances", CASES,
                         ids=[f"{c[0].split('_')[1]}-{c[1]}-{c[2]}" for c in CASES])
def test_built_then_served_by_a_fresh_replica_with_0_compiles(tmp_path, base, strategy, scope, compile_extra,
                                                              warmup_extra, instances):
    recipe = recipe_for(tmp_path, base, strategy, scope, compile_extra, warmup_extra)
    cache = tmp_path / "ci" / "cache"
    build = run_cli("build", "--json", "--cache", str(cache), str(recipe),
                    env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "ci" / "inductor"), "AOTBUILD_CACHE": ""})
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-3000:]
    job = json.loads(build.stdout)["jobs"][0]
    assert job["status"] == "built", job
    manifest = json.loads(run_cli("show", "--json", "--cache", str(cache), job["key"][:12]).stdout)
    proof = manifest["proof"]
    assert proof["compiles"] == 0 and proof["max_abs_diff"] <= 1e-4 and proof["calls"] >= 1, proof
    if instances is not None:
        assert proof["instances"] == instances, proof
    if warmup_extra.get("prompt"):
        assert manifest["factors"]["warmup"]["prompt"] == {"texts": len(warmup_extra["prompt"])}

    replica = tmp_path / "replica"  # the cache moved, another cwd, an empty Inductor folder
    shutil.move(str(cache), replica / "cache")
    component = yaml.safe_load(recipe.read_text())["compile"]["components"][0]
    # PixArt snaps sizes to its resolution bins: 32x32 is denoised as 64x64 is (the square bin), 32x64 is not.
    result = serve_fresh(recipe, replica / "cache", replica, component=component,
                         strict_shape="32x64" if "pixart" in base else "32x32")
    assert result["hits"] == 1 and result["misses"] == 0 and result["component_calls"] >= 1, result
    assert result["compiles"] == 0 and result["counters"].get("fxgraph_cache_miss", 0) == 0, result
    if strategy == "jit-cache":
        assert result["counters"].get("fxgraph_cache_hit", 0) >= 1, result
    else:
        assert result["unique_graphs"] == 0, result  # every call reached an artifact: Dynamo traced nothing
    assert result["component_max_diff"] <= 1e-5 and result["max_diff"] <= 1e-4, result
    assert result["strict"], result  # an unbuilt shape is refused
