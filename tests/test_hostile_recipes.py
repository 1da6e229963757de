"""Recipes are data: a recipe from a pull request is read with bounded work, refused in one line
(exit 2, no traceback), and can neither hang the reader nor run a program."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from aotbuild.errors import RecipeError
from aotbuild.recipe import files as recipe_module
from aotbuild.recipe.rules import load_recipe
from tests.conftest import REPO

HEAD = "model: {id: builtin:tiny-sd}\nshapes: [{height: 64, width: 64}]\n"


def laughs(levels: int, width: int = 10) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return HEAD + "warmup:\n  " + "\n  ".join(lines) + "\n"


CASES = {  # name: (file text, what the one-line error says)
    "billion laughs in warmup": (laughs(10), "expands to more than 100000 values"),
    "billion laughs in compile.options": (
        HEAD + "compile:\n  options:\n    " + "\n    ".join(
            line.strip() for line in laughs(9).split("warmup:\n")[1].splitlines()) + "\n",
        "expands to more than 100000 values"),
    "recursive alias": (HEAD.replace("shapes: [{height: 64, width: 64}]", "shapes: &x [*x]"),
                        "an alias refers to itself"),
    "recursive mapping alias": (HEAD + "warmup: &w {a: *w}\n", "an alias refers to itself"),
    "nesting 100000 deep": ("model: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    "nesting 65 deep": (HEAD + "warmup: {a: " + "[" * 64 + "]" * 64 + "}\n", "nested more than 64 levels deep"),
    "a 300 kB model.id": ("model: {id: '" + "a" * 300_000 + "'}\nshapes: [{height: 64, width: 64}]\n",
                          "a value of 300000 characters; at most 4096"),
    "a 5 kB prompt": (HEAD + "warmup: {prompt: '" + "k" * 5000 + "'}\n", "a value of 5000 characters"),
    "over 1 MiB": (HEAD + "# " + "x" * (1 << 20) + "\n", "a recipe may have at most 1048576"),
    "python tag": (HEAD + "warmup: {x: !!python/object/apply:os.system [touch /tmp/aotbuild-pwned]}\n",
                   "is not plain YAML data"),
    "not UTF-8": ("model: {id: \udcff}\n", "is not UTF-8 text"),
    "binary garbage": ("\x00\x01\x02 model", "is not valid YAML"),
    "a list at the top": ("- model\n- shapes\n", "expected a mapping"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_recipe_is_one_line_exit_2_with_bounded_work(tmp_path, name):
    text, says = CASES[name]
    path = tmp_path / "r.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    proc = subprocess.run([sys.executable, "-m", "aotbuild.cli", "plan", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "AOTBUILD_CACHE": str(tmp_path / "c")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert says in proc.stderr, proc.stderr
    assert not os.path.exists("/tmp/aotbuild-pwned")


def test_a_fifo_named_as_a_recipe_is_refused_at_once(tmp_path):
    fifo = tmp_path / "r.yaml"
    os.mkfifo(fifo)
    with pytest.raises(RecipeError, match="is not a regular file"):
        load_recipe(fifo)


def test_a_bomb_is_measured_in_steps_not_expanded(tmp_path, monkeypatch):
    """Counting visits each distinct YAML node once: 12 levels of 10 aliases (10**12 values if
    expanded) cost about 130 steps before the refusal."""
    import yaml

    visits = []
    real = yaml.SequenceNode.__init__

    def counting(self, *args, **kwargs):
        visits.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(yaml.SequenceNode, "__init__", counting)
    path = tmp_path / "r.yaml"
    path.write_text(laughs(12))
    with pytest.raises(RecipeError, match="expands to more than"):
        load_recipe(path)
    assert len(visits) < 50  # nodes composed: one per sequence written, none per expansion


@pytest.mark.parametrize("limit,value,says", [("MAX_RECIPE_NODES", 30, "expands to more than 30 values"),
                                              ("MAX_RECIPE_DEPTH", 3, "is nested more than 3 levels deep")])
def test_the_caps_are_the_module_constants(tmp_path, monkeypatch, limit, value, says):
    """The refusal names the patched cap: the reader reads the constant, not a copy of it."""
    monkeypatch.setattr(recipe_module, limit, value)
    path = tmp_path / "r.yaml"
    path.write_text(HEAD + "warmup: {a: [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]}\n")
    with pytest.raises(RecipeError, match=f"^{re.escape(str(path))}: {says}"):
        load_recipe(path)


OPTION_CASES = [  # (target, options, refused?, what the error says)
    ("inductor", {"cpp.cxx": [None, "/tmp/aotbuild-evil.sh"]}, True, "free-form option (tuple[None, str])"),
    ("inductor", {"cpp.march": "native -B/tmp/aotbuild-evil"}, True, "AOTBUILD_ALLOW_OPTIONS=cpp.march"),
    ("inductor", {"cpp.cxx": "g++"}, True, "does not fit this option's type"),  # type-checked even unallowed
    ("inductor", {"max_autotune_gemm_backends": "ATEN"}, True, "free-form option (str)"),
    ("inductor", {"post_grad_custom_pre_pass": None}, True, "free-form option"),
    ("inductor", {"cpp.simdlen": "8"}, True, "'8' does not fit this option's type (int | None)"),
    ("inductor", {"compile_threads": 1.5}, True, "does not fit"),
    ("inductor", {"max_autotune": True, "cpp.simdlen": 8, "cpp.dynamic_threads": False}, False, ""),
    ("neuron", {"optlevel": "--cc=/bin/sh"}, True, "free-form option (str)"),
    ("tpu", {"flags": ["--xla_dump_to=/tmp"]}, True, "free-form option (list)"),
    ("neuron", {"optlevel": 2, "fast_math": True}, False, ""),
]


@pytest.mark.parametrize("target,options,refused,says", OPTION_CASES,
                         ids=[f"{t}-{next(iter(o))}-{r}" for t, o, r, _ in OPTION_CASES])
def test_a_recipe_sets_only_options_that_are_data(monkeypatch, target, options, refused, says):
    from aotbuild.recipe.rules import parse_recipe

    monkeypatch.delenv("AOTBUILD_ALLOW_OPTIONS", raising=False)
    data = {"model": {"id": "builtin:tiny-sd"}, "target": target, "compile": {"options": options},
            "shapes": [{"height": 64, "width": 64}]}
    if not refused:
        assert parse_recipe(data, "r.yaml").compile.options
        return
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "r.yaml")
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_operator_allows_a_free_form_option_by_name_but_never_a_wrong_type(monkeypatch):
    from aotbuild.recipe.rules import parse_recipe

    data = {"model": {"id": "builtin:tiny-sd"}, "compile": {"options": {"cpp.march": "x86-64-v3"}},
            "shapes": [{"height": 64, "width": 64}]}
    monkeypatch.setenv("AOTBUILD_ALLOW_OPTIONS", "cpp.cxx, cpp.march")
    assert parse_recipe(data, "r.yaml").compile.options["cpp.march"] == "x86-64-v3"
    monkeypatch.setenv("AOTBUILD_ALLOW_OPTIONS", "*")
    data["compile"]["options"] = {"cpp.march": ["not", "a", "string"]}
    with pytest.raises(RecipeError, match="does not fit"):
        parse_recipe(data, "r.yaml")
    monkeypatch.setenv("AOTBUILD_ALLOW_OPTIONS", "cpp.cxx")
    data["compile"]["options"] = {"cpp.march": "native"}
    with pytest.raises(RecipeError, match="free-form"):
        parse_recipe(data, "r.yaml")
