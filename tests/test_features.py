"""Features behind one protocol (issue 33 item 2): quantization, LoRA, tensor parallelism and the
declared changes each implement ``features.base.Feature`` and are listed once, in
``features.registry.FEATURES``; context, planner, runtime and proof iterate them."""

from __future__ import annotations

import copy
import importlib
import json
import sys
import types

from aotbuild.features import registry
from aotbuild.features.base import Feature, Where
from aotbuild.planner import plan
from aotbuild.recipe.rules import parse_recipe
from tests.conftest import TINY_DICT, run_python


def _recipe(**extra):
    data = copy.deepcopy(TINY_DICT)
    for key, value in extra.items():
        if key == "quantization":
            data["model"]["quantization"] = value
        else:
            data[key] = value
    return parse_recipe(data)


def test_every_feature_is_one_module_with_one_class_behind_the_protocol():
    assert registry.names() == ("quantization", "lora", "parallel", "changes")
    for entry in registry.FEATURES:
        cls = getattr(importlib.import_module(entry.module), entry.cls)
        assert issubclass(cls, Feature) and cls.section == entry.section, entry


def test_a_recipe_uses_the_features_its_sections_name_in_the_tables_order():
    assert registry.used(_recipe()) == []
    quant = {"backend": "torchao", "quant_type": "int8wo"}
    changes = {"memory_format": "channels_last"}
    used = registry.used(_recipe(quantization=quant, changes=changes))
    assert [f.section for f in used] == ["quantization", "changes"]


def test_a_plain_recipe_imports_no_features_module():
    """Only ``used`` imports a feature's module, and only for a recipe that uses it."""
    code = ("import json, sys\nfrom aotbuild.recipe.rules import parse_recipe\n"
            "from aotbuild.features.registry import used\n"
            f"recipe = parse_recipe({TINY_DICT!r})\nassert used(recipe) == []\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith('aotbuild.features.'))))")
    proc = run_python(code)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == ["aotbuild.features.base", "aotbuild.features.registry"]


class _Stamp(Feature):
    """A feature of a test's own, as a new one would be written: a key factor, a prepared pipe."""

    section = "stamp"
    prepared: list[str] = []

    def factors(self, recipe, where: Where):
        return {"component": where.component, "class": where.component_class}

    def prepare(self, pipe, recipe):
        _Stamp.prepared.append(type(pipe).__name__)


def test_a_new_feature_is_one_module_and_one_line(cache, monkeypatch):
    """A feature added to the table keys its jobs (its section's factor) and prepares the pipeline
    every process loads, with nothing else changed; recipes that do not use it keep their keys."""
    from aotbuild.context import prepare_pipeline

    module = types.ModuleType("stamp_feature")
    module.Stamp = _Stamp
    monkeypatch.setattr(_Stamp, "prepared", [])
    monkeypatch.setitem(sys.modules, "stamp_feature", module)
    recipe = _recipe(changes={"memory_format": "channels_last"})
    before = [j.key for j in plan([recipe], cache=cache)]
    entry = registry._Entry("stamp", "stamp_feature", "Stamp", lambda r: r.changes is not None)
    monkeypatch.setattr(registry, "FEATURES", (*registry.FEATURES, entry))
    jobs = plan([recipe], cache=cache)
    assert [j.factors["stamp"] for j in jobs] == [{"component": "unet", "class": "UNet2DConditionModel"}]
    assert [j.key for j in jobs] != before
    assert "stamp" not in plan([_recipe()], cache=cache)[0].factors
    prepare_pipeline(types.SimpleNamespace(), recipe)
    assert _Stamp.prepared == ["SimpleNamespace"]


def test_tensor_parallelism_asks_for_its_ranks_and_a_rank_s_thread_count(monkeypatch):
    tp = registry.used(_recipe(parallel={"tensor": 2}))
    assert [f.section for f in tp] == ["parallel"] and tp[0].ranks(_recipe(parallel={"tensor": 2})) == 2
    settings = tp[0].compile_settings(_recipe(parallel={"tensor": 2}), {"cpu_threads": 7, "mode": None})
    from aotbuild.features.parallel import rank_threads

    assert settings == {"cpu_threads": rank_threads(2), "mode": None}
    assert tp[0].compile_settings(_recipe(parallel={"tensor": 2}), {"mode": None}) == {"mode": None}
