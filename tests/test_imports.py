"""Importing the runtime loads no CLI, YAML, rich, Hub client or diffusers (click's test_imports)."""

from __future__ import annotations

import json

from tests.conftest import run_python

FORBIDDEN = {"click", "yaml", "rich", "huggingface_hub", "diffusers", "transformers", "diskcache", "requests",
             "httpx", "tqdm"}


def test_runtime_import_is_light():
    proc = run_python("import sys, json\nfrom aotbuild import load_compiled, CacheMiss, ShapeNotBuilt\n"
                      "import aotbuild.runtime\nprint(json.dumps(sorted(sys.modules)))")
    assert proc.returncode == 0, proc.stderr
    loaded = {m.split(".")[0] for m in json.loads(proc.stdout)}
    assert not loaded & FORBIDDEN, loaded & FORBIDDEN
    aotbuild_modules = {m for m in json.loads(proc.stdout) if m.startswith("aotbuild")}
    assert "aotbuild.cli" not in aotbuild_modules and "aotbuild.builder" not in aotbuild_modules
