"""Nothing wrong is ever loaded: each key factor alone makes a miss that names it, and modules whose
code differs do not share a regional package.
"""

from __future__ import annotations

import pytest

from aotbuild.cache.store import Store
from tests import manifests
from tests.conftest import TINY_RECIPE

# -- 14: each key factor alone is a miss naming it -------------------------------------------------

@pytest.mark.parametrize("path,value,named", [
    (("env", "torch"), "2.99.0+cpu", "env.torch: 2.99.0+cpu in the cache, "),  # then this torch's, whatever it is
    (("device", "cpu_isa"), "SVE256", "device.cpu_isa: SVE256 in the cache"),
    (("shape", "height"), 128, "shape.height: 128 in the cache"),
    (("compile", "options"), {"cpp.dynamic_threads": False}, "compile.options.cpp.dynamic_threads"),
    (("warmup", "guidance_scale"), 7.5, "warmup.guidance_scale: 7.5 in the cache"),
])
def test_each_key_factor_alone_is_a_miss_naming_it(cache, path, value, named):
    import copy

    from aotbuild.keys import key_of as key_for
    from aotbuild.planner import plan
    job = plan([str(TINY_RECIPE)], cache)[0]
    cached = copy.deepcopy(job.factors)
    cached[path[0]][path[1]] = value
    assert key_for(cached) != job.key
    store = Store(cache)
    store.put_manifest(manifests.manifest(cached, recipe=job.recipe.name))
    why = next(j.reason for j in plan([str(TINY_RECIPE)], cache) if j.key == job.key)  # as `aotbuild plan` says
    assert named in why and why.count(";") == 0  # that factor and only that one


# -- code that differs behind equal shapes ---------------------------------------------------------

def test_instances_whose_code_differs_do_not_share_a_regional_package():
    from diffusers.models.attention import BasicTransformerBlock

    from aotbuild.strategies.aoti import structure

    a, b, c = (BasicTransformerBlock(8, 2, 4, cross_attention_dim=16) for _ in range(3))
    assert structure(a) == structure(b)  # same shapes, same code: one package serves both
    c.set_chunk_feed_forward(2, 1)  # a plain attribute that changes what forward runs
    assert structure(c) != structure(a)
