"""Importing the runtime loads only what loading needs: an allow-list of aotbuild's modules, and no
third-party package at all (torch comes when the load needs it: click's test_imports)."""

from __future__ import annotations

import json

from tests.conftest import run_python

#: What ``from aotbuild import load_compiled`` may load of aotbuild (docs/architecture.md, "The runtime
#: import rule"). A module added here is a module every serving process imports: keep it light.
RUNTIME_MODULES = {
    "aotbuild", "aotbuild.blocks", "aotbuild.builtin", "aotbuild.constants", "aotbuild.errors", "aotbuild.frozen",
    "aotbuild.keys", "aotbuild.layout", "aotbuild.locks", "aotbuild.manifest", "aotbuild.models",
    "aotbuild.context", "aotbuild.explain", "aotbuild.recipe", "aotbuild.recipe_file", "aotbuild.recipes",
    "aotbuild.registry", "aotbuild.runtime", "aotbuild.safeio", "aotbuild.store",
    "aotbuild.strategies", "aotbuild.strategies.base", "aotbuild.suggest", "aotbuild.targets", "aotbuild.targets.base",
    "aotbuild.text", "aotbuild.pipecall", "aotbuild.deprecated",
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
