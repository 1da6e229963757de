"""Importing the runtime loads only what loading needs: an allow-list of aotbuild's modules, and no
third-party package at all (torch comes when the load needs it: click's test_imports)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_python

#: What ``from aotbuild import load_compiled`` may load of aotbuild (docs/architecture.md, "The runtime
#: import rule"). A module added here is a module every serving process imports: keep it light.
RUNTIME_MODULES = {
    "aotbuild", "aotbuild.runtime", "aotbuild.constants", "aotbuild.errors", "aotbuild.forwards", "aotbuild.keys",
    "aotbuild.advice",  # the advice of a miss (issue 55): stdlib and cache.layout only
    "aotbuild.context", "aotbuild.builtin",
    "aotbuild.recipe", "aotbuild.recipe.schema", "aotbuild.recipe.files", "aotbuild.recipe.rules",
    "aotbuild.recipe.frozen",
    "aotbuild.utils.secrets",  # stdlib only: load_compiled's exceptions leave it scrubbed (issue 53)
    "aotbuild.cache", "aotbuild.cache.layout", "aotbuild.cache.locks", "aotbuild.cache.manifest",
    "aotbuild.cache.store", "aotbuild.cache.explain",
    "aotbuild.pipeline", "aotbuild.pipeline.blocks", "aotbuild.pipeline.models", "aotbuild.pipeline.pipecall",
    "aotbuild.strategies", "aotbuild.strategies.base", "aotbuild.strategies.registry",
    "aotbuild.targets", "aotbuild.targets.base", "aotbuild.targets.registry",
    "aotbuild.utils", "aotbuild.utils.registry", "aotbuild.utils.safeio", "aotbuild.utils.suggest",
    "aotbuild.utils.text", "aotbuild.utils.deprecated",
}


def test_runtime_import_is_light():
    proc = run_python("import sys, json\nbefore = set(sys.modules)\n"
                      "from aotbuild import load_compiled, CacheMiss, ShapeNotBuilt\nimport aotbuild.runtime\n"
                      "new = set(sys.modules) - before\n"
                      "print(json.dumps({'aotbuild': sorted(m for m in new if m.split('.')[0] == 'aotbuild'),\n"
                      "                  'other': sorted({m.split('.')[0] for m in new} - set(sys.stdlib_module_names)"
                      " - {'aotbuild'})}))")
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout)
    assert loaded["other"] == []  # no torch, click, yaml, rich, huggingface_hub, diffusers ... at import
    assert "aotbuild.runtime" in loaded["aotbuild"]
    assert sorted(set(loaded["aotbuild"]) - RUNTIME_MODULES) == []


#: What serving an aot-package entry must not import (each module with what it is): AOTInductor's
#: C++ loader opens a package without them (aotbuild/strategies/aoti.py, ``open_package``). Dynamo
#: itself is not in the list: diffusers imports it (``diffusers.utils.torch_utils``), eager included.
NOT_SERVING = {
    "torch._inductor.codecache": "Inductor's compile cache, redis and opentelemetry behind it",
    "torch._inductor.package": "torch's package loader (it picks the vector ISA: probes)",
    "torch.export.pt2_archive._package": "the .pt2 archive reader and export's serializer",
    "torch._inductor.compile_fx": "Inductor's compiler",
    "aotbuild.strategies.aot_compile": "another strategy (and its Dynamo API check)",
    "aotbuild.strategies.jit_cache": "another strategy",
    # a plain recipe uses no feature (aotbuild/features/registry.py imports a feature's module only
    # for a recipe that uses it)
    "aotbuild.features.lora": "LoRA hot-swap (peft)",
    "aotbuild.features.quantization": "torchao quantization",
    "aotbuild.features.parallel": "tensor parallelism (torch.distributed)",
}

SERVE = """
import json, sys
from aotbuild import load_compiled
from aotbuild.pipeline.pipecall import warmup_kwargs
from aotbuild.recipe.rules import load_recipe

recipe = load_recipe({recipe!r})
pipe = load_compiled(recipe, cache={cache!r}, on_miss="error")
pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe))
from torch._dynamo.utils import counters

hits = [e.strategy for e in pipe.aotbuild_report.hits]
print(json.dumps({{"hits": hits, "graphs": counters["stats"]["unique_graphs"],
                  "loaded": sorted(m for m in {heavy!r} if m in sys.modules)}}))
"""


@pytest.mark.slow  # the session's aot-package build, and auto's (prepacked aot-package: its packages carry recipes)
@pytest.mark.parametrize("strategy", ["aot-package", "auto"])
def test_serving_an_aot_package_entry_imports_no_compiler(strategy, strategy_build):
    """A fresh process serves the entry (load and first image) without importing Inductor's compile
    path or the package reader torch's ``aoti_load_package`` uses (with it: codecache, the ISA pick,
    redis; 1061 modules in a process with only torch)."""
    recipe, cache, _ = strategy_build(strategy)
    proc = run_python(SERVE.format(recipe=str(recipe), cache=str(cache), heavy=sorted(NOT_SERVING)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    served = json.loads(proc.stdout.strip().splitlines()[-1])
    assert served["hits"] == ["aot-package"] and served["graphs"] == 0  # served by its package, nothing traced
    assert {m: NOT_SERVING[m] for m in served["loaded"]} == {}
