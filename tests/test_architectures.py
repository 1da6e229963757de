"""A hit is a promise on diffusers' real architectures: Flux, SD3 and SDXL (the built-in tiny ones).

Each case builds one recipe for real with the CLI (the build's own proof must pass), then moves the
cache elsewhere and serves it from a fresh process in another working directory with an empty
Inductor folder, as a new replica would: every entry a hit, 0 compiles by the compiler's own
counters, and the denoiser's output equal to eager's within 1e-5 on the same inputs. Together the
cases, with tests/test_regional.py's two (Flux 2+2 and SD3 with compile.blocks, aot-package
regional), cover each architecture, each strategy and each scope; tiny-sd is covered by
test_e2e.py and test_aot.py, and the whole matrix by benchmarks/arch_matrix.py.
"""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli, run_python

pytestmark = pytest.mark.slow

SERVE = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from aotbuild import load_compiled, load_recipe
    from aotbuild.models import load_pipeline, resolve_model, warmup_kwargs

    recipe_path, cache = sys.argv[1], sys.argv[2]
    recipe = load_recipe(recipe_path)
    component = recipe.compile.components[0]

    def outputs(pipe):
        seen = []
        module = getattr(pipe, component)
        inner = module.forward  # the dispatcher, when loaded: wrapped outside anything compiled
        def watch(*args, **kwargs):
            out = inner(*args, **kwargs)
            seen.append((out[0] if isinstance(out, tuple) else out.sample).detach().clone())
            return out
        module.forward = watch
        with torch.no_grad():
            pipe(**warmup_kwargs(recipe, recipe.shapes[0]), output_type="latent")
        module.forward = inner
        return seen

    eager = outputs(load_pipeline(recipe, resolve_model(recipe, Path(cache)), "float32"))
    from torch._dynamo.utils import counters
    pipe = load_compiled(recipe_path, cache=cache, on_miss="error", strict_shapes=True)
    served = outputs(pipe)
    print("RESULT " + json.dumps({
        "hits": len(pipe.aotbuild_report.hits), "misses": len(pipe.aotbuild_report.misses),
        "calls": len(served), "max_diff": max((a - b).abs().max().item() for a, b in zip(served, eager)),
        "fx_miss": counters["inductor"]["fxgraph_cache_miss"], "fx_hit": counters["inductor"]["fxgraph_cache_hit"],
        "graphs": counters["stats"]["unique_graphs"],
    }))
""")


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
    ("tiny_flux_cpu.yaml", "jit-cache", "full", {}, {}, 1),
    ("tiny_sd3_cpu.yaml", "jit-cache", "regional", {"blocks": ["JointTransformerBlock"]},
     {"prompt": ["a cat", "a dog"]}, 3),  # no _repeated_blocks in diffusers; a list of prompts
    ("tiny_sdxl_cpu.yaml", "aot-package", "full", {}, {}, 1),
    ("tiny_sdxl_cpu.yaml", "jit-cache", "regional", {}, {}, 8),  # 8 BasicTransformerBlocks
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
    (replica / "cwd").mkdir()
    script = replica / "serve.py"
    script.write_text(SERVE)
    proc = run_python(f"import runpy, sys; sys.argv = ['s', {str(recipe)!r}, {str(replica / 'cache')!r}]; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(replica / "inductor"), "AOTBUILD_CACHE": ""},
                      cwd=replica / "cwd")
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert result["hits"] == 1 and result["misses"] == 0 and result["calls"] >= 1, result
    assert result["fx_miss"] == 0, result
    if strategy == "aot-package":
        assert result["graphs"] == 0, result  # every call reached a package: Dynamo traced nothing
    else:
        assert result["fx_hit"] >= 1, result
    assert result["max_diff"] <= 1e-5, result
