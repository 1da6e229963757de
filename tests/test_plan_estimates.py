"""Cost in the plan: each miss's build time and size, estimated from the nearest cached entry."""

from __future__ import annotations

import json

from aotbuild.cache.explain import estimate
from aotbuild.cache.store import Store
from aotbuild.planner import plan
from tests import manifests as m
from tests.conftest import invoke_cli

TINY = {
    "model": {"id": "builtin:tiny-sd", "dtype": "float32"}, "device": "cpu", "strategy": "jit-cache",
    "shapes": [{"height": 64, "width": 64}, {"height": 64, "width": 96}],
    "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0},
}


def _entry(f, seconds, size, recipe="r", digest="a" * 64):
    return m.manifest(f, [("x.so", digest, size)], recipe=recipe, build={"seconds": seconds})


def test_the_nearest_entry_of_the_same_kind_estimates():
    here = m.factors(shape={"height": 64, "width": 128})
    near = _entry(m.factors(shape={"height": 64, "width": 96}), 30.0, 1000)  # 1 factor differs
    far = _entry(m.factors(shape={"height": 32, "width": 32}, env={"torch": "2.12.0"}), 99.0, 9)  # 3 differ
    assert estimate([far, near], here) == (30.0, 1000)
    assert estimate([far], here) == (99.0, 9)


def test_another_class_target_strategy_scope_or_device_does_not_qualify():
    here = m.factors()
    others = [
        _entry(m.factors(component={"class": "SD3Transformer2DModel"}), 1.0, 1),
        _entry(m.factors(target={"strategy": "aot-package"}), 2.0, 2),
        _entry(m.factors(target={"name": "neuron"}), 3.0, 3),
        _entry(m.factors(compile={"scope": "regional"}), 4.0, 4),
        _entry(m.factors(device={"device_kind": "cuda", "capability": "9.0"}), 5.0, 5),
        _entry(m.factors(shape={"height": 8, "width": 8}), "n/a", 6),  # no recorded build time
    ]
    assert estimate(others, here) is None
    assert estimate([], here) is None


def test_a_tie_prefers_the_same_recipe():
    here = m.factors(shape={"height": 64, "width": 128})
    a = _entry(m.factors(shape={"height": 64, "width": 96}), 10.0, 10, recipe="other")
    b = _entry(m.factors(shape={"height": 64, "width": 32}), 20.0, 20, recipe="mine")
    assert estimate([a, b], here, "mine") == (20.0, 20)


def _store_with_model(tmp_path, models_dir):
    root = tmp_path / "cache"
    (root / "models").parent.mkdir(parents=True)
    (root / "models").symlink_to(models_dir / "models", target_is_directory=True)
    return root


def test_plan_estimates_misses_from_a_cached_neighbour(tmp_path, models_dir):
    root = _store_with_model(tmp_path, models_dir)
    jobs = plan(TINY, root)
    assert [j.estimated_build_s for j in jobs] == [None, None]
    assert all(j.as_json()["estimated_size"] is None for j in jobs)
    # one shape cached (a hand-made entry with the real factors): the other is estimated from it
    cached, missing = jobs
    store = Store(root)
    blob = tmp_path / "x.so"
    blob.write_bytes(b"k" * 4096)
    digest, _ = store.put_blob(blob)
    store.put_manifest(_entry(cached.factors, 42.5, 4096, recipe=cached.recipe.name, digest=digest))
    jobs = {j.key: j for j in plan(TINY, root)}
    assert jobs[cached.key].status == "hit" and "estimated_size" not in jobs[cached.key].as_json()
    assert (jobs[missing.key].estimated_build_s, jobs[missing.key].estimated_size) == (42.5, 4096)

    recipe = tmp_path / "r.yaml"
    recipe.write_text(json.dumps(TINY))  # JSON is YAML
    proc = invoke_cli("plan", "--json", "--cache", str(root), str(recipe))
    assert proc.returncode == 0, proc.stderr
    out = {j["key"]: j for j in json.loads(proc.stdout)["jobs"]}
    assert out[missing.key]["estimated_build_s"] == 42.5 and out[missing.key]["estimated_size"] == 4096
    text = invoke_cli("plan", "--cache", str(root), str(recipe)).stdout
    assert "to build 1 job(s): about 42 s and 4.1 KB (estimated from the nearest cached entries)" in text, text
