"""Recipe validation: each bad input is one line naming file and key, exit code 2, no traceback."""

from __future__ import annotations

import textwrap

import pytest

from aotbuild.errors import RecipeError
from aotbuild.recipe.rules import load_recipe, parse_recipe
from tests.conftest import MAIN_RECIPE, TINY_DICT, TINY_RECIPE, invoke_cli, run_cli

GOOD = """
model: {id: builtin:tiny-sd}
target: inductor
device: cpu
shapes: [{height: 64, width: 64}]
warmup: {num_inference_steps: 2, guidance_scale: 0.0}
"""


def write(tmp_path, text: str):
    path = tmp_path / "r.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_tiny_recipe_loads_with_defaults():
    r = load_recipe(MAIN_RECIPE)
    assert r.name == "tiny_sd_cpu" and r.target == "inductor" and r.compile.components == ("unet",)
    assert r.strategy == "auto"  # the README's main job shows the default (issue 54)
    assert [str(s) for s in r.shapes] == ["64x64", "64x96"]
    assert r.compile.fullgraph is True and r.compile.dynamic is False
    with pytest.raises(AttributeError):
        r.target = "tpu"  # immutable
    with pytest.raises(TypeError):
        r.warmup["guidance_scale"] = 1.0  # type: ignore[index]


def test_the_suites_tiny_recipe_is_the_main_job_naming_jit_cache():
    """tests/recipes/tiny_sd_cpu.yaml (the shared jit-cache build's) cannot drift from the README's main job:
    the same settings, `strategy: jit-cache` apart, and the same name (job names, reports)."""
    import yaml

    main, suite = yaml.safe_load(MAIN_RECIPE.read_text()), yaml.safe_load(TINY_RECIPE.read_text())
    assert "strategy" not in main and suite == {**main, "strategy": "jit-cache"}
    assert load_recipe(TINY_RECIPE).name == load_recipe(MAIN_RECIPE).name


BAD = [
    ("shape:\n  - {height: 64, width: 64}\n" + GOOD.replace("shapes: [{height: 64, width: 64}]\n", ""),
     "shape: unknown key; did you mean 'shapes'?"),
    (GOOD.replace("target: inductor", "target: indcutor"),
     "target: 'indcutor' is not allowed; did you mean 'inductor'?"),
    (GOOD.replace("model: {id: builtin:tiny-sd}", ""), "model.id: is required"),
    (GOOD.replace("[{height: 64, width: 64}]", "[]"), "shapes: expected a non-empty list"),
    (GOOD.replace("[{height: 64, width: 64}]", "[{height: 64, width: 64}, {height: 64, width: 64}]"),
     "shapes[1]: duplicates shapes[0] (64x64)"),
    (GOOD.replace("height: 64", "height: 60"),
     "shapes[0].height: 60 is not allowed: sizes must be positive multiples of 8"),
    (GOOD.replace("height: 64", "height: -8"), "shapes[0].height: -8 is not allowed"),
    (GOOD.replace("height: 64", "height: '64'"), "shapes[0].height: expected an integer, got '64' (str)"),
    (GOOD.replace("height: 64", "height: true"), "shapes[0].height: expected an integer, got True (bool)"),
    (GOOD.replace("device: cpu", "device: cuda:x"), "device: 'cuda:x' is not a device of target inductor"),
    (GOOD + "compile: {dynamic: true}\n", "compile.dynamic: target inductor needs static shapes"),
    (GOOD + "compile: {fullgraph: 'yes'}\n", "compile.fullgraph: expected true or false"),
    (GOOD + "compile: {scopе: full}\n", "compile.scopе: unknown key; did you mean 'scope'?"),
    (GOOD + "offload: model\n", "offload: model offload needs compile.scope: regional"),
    (GOOD + "strategy: aot_package\n", "strategy: 'aot_package' is not allowed; did you mean 'aot-package'?"),
    (GOOD.replace("guidance_scale: 0.0", "height: 64"), "warmup.height: cannot be set here: shapes sets it"),
    ("model: [unclosed\n", "is not valid YAML: line"),
    ("- just\n- a list\n", "expected a mapping of recipe keys at the top level"),
    ("", "is empty: a recipe needs at least model and shapes"),
    (GOOD.replace("builtin:tiny-sd", "builtin:tiny-sd2"),
     "model.id: unknown built-in model 'builtin:tiny-sd2'; did you"),
    (GOOD.replace("{id: builtin:tiny-sd}", "{id: builtin:tiny-sd, revision: main}"),
     "model.revision: a built-in model has no revisions"),
    (GOOD + "compile: {options: {max_autotun: true}}\n",
     "compile.options.max_autotun: not an Inductor option; did you mean 'max_autotune'?"),
    (GOOD + "compile: {options: {cpp.dynamic_threads: 'no'}}\n",
     "compile.options.cpp.dynamic_threads: 'no' does not fit this option's type (bool)"),
]


@pytest.mark.parametrize("text,expected", BAD, ids=[e.split(":")[0] + str(i) for i, (_, e) in enumerate(BAD)])
def test_bad_recipe_is_one_clear_error(tmp_path, text, expected):
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ")
    assert expected in message, message
    assert "\n" not in message


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError, match="no such file"):
        load_recipe(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text,expected", [
    (GOOD.replace("target: inductor", "target: indcutor"), "did you mean 'inductor'?"),
    ("model: [unclosed\n", "is not valid YAML"),
])
def test_cli_exit_code_2_without_traceback(tmp_path, text, expected):
    path = write(tmp_path, text)
    for command in ("plan", "build"):
        proc = run_cli(command, str(path))
        assert proc.returncode == 2, proc.stderr
        assert expected in proc.stderr
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_cli_missing_recipe_file(tmp_path):
    proc = invoke_cli("plan", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "no such file" in proc.stderr and "Traceback" not in proc.stderr


def test_component_checks_need_the_model(tmp_path, models_dir):
    """Unknown component and regional scope without _repeated_blocks are found against the model."""
    from aotbuild.pipeline.models import check_components, resolve_model

    unknown = parse_recipe({**_good(), "compile": {"components": ["unte"]}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"compile.components: 'unte' is not a component .*did you mean 'unet'"):
        check_components(unknown, resolve_model(unknown, models_dir))
    regional = parse_recipe({**_good(), "compile": {"components": ["vae"], "scope": "regional"}}, "r.yaml")
    with pytest.raises(RecipeError, match="compile.scope: regional scope needs a component with _repeated_blocks"):
        check_components(regional, resolve_model(regional, models_dir))
    tokenizer = parse_recipe({**_good(), "compile": {"components": ["tokenizer"]}}, "r.yaml")
    with pytest.raises(RecipeError, match=r"'tokenizer' \(CLIPTokenizer\) is not a torch module: .*"
                                          r"\(compilable: text_encoder, unet, vae\)"):
        check_components(tokenizer, resolve_model(tokenizer, models_dir))
    ok = parse_recipe({**_good(), "compile": {"components": ["unet"], "scope": "regional"}}, "r.yaml")
    check_components(ok, resolve_model(ok, models_dir))


def test_cli_unknown_component_exit_2(tmp_path, models_dir):
    path = write(tmp_path, GOOD + "compile: {components: [unte]}\n")
    proc = invoke_cli("plan", "--cache", str(models_dir), str(path))
    assert proc.returncode == 2 and "did you mean 'unet'" in proc.stderr and "Traceback" not in proc.stderr


def _good() -> dict:
    import yaml

    return yaml.safe_load(GOOD)


def test_list_and_mapping_options_reach_torch_compile_and_the_key_as_plain_values(monkeypatch):
    """YAML lists and mappings are frozen in a Recipe; the compile settings (what torch.compile
    gets and what the key hashes) hold plain lists and dicts again. (Free-form options: the
    operator allows them, docs/security.md.)"""
    import json

    monkeypatch.setenv("AOTBUILD_ALLOW_OPTIONS", "custom_should_partition_ops,post_grad_fusion_options")
    from aotbuild.targets.registry import get_target

    options = {"custom_should_partition_ops": ["aten::mm"], "post_grad_fusion_options": {}}
    recipe = parse_recipe({**_good(), "compile": {"options": options}}, "r.yaml")
    settings = get_target("inductor").compile_settings(recipe, "cpu")
    assert settings["options"]["custom_should_partition_ops"] == ["aten::mm"]
    assert type(settings["options"]["post_grad_fusion_options"]) is dict
    json.dumps(settings)  # keys are sha256 of canonical JSON


@pytest.mark.parametrize("strategy", ["aot-compile"])
def test_freezing_is_refused_where_an_artifact_would_keep_the_weights(strategy):
    """Weights are not a key factor: an AOT artifact built with the build's weights folded in would
    serve another checkpoint of the same model (same key) with the build's weights. (aot-package
    re-derives every folded constant from the served weights: tests/test_prepack.py.)"""
    frozen = {**TINY_DICT, "compile": {"options": {"freezing": True}}}
    with pytest.raises(RecipeError, match=f"strategy {strategy} would keep the build's weights"):
        parse_recipe({**frozen, "strategy": strategy})
    parse_recipe({**frozen, "strategy": strategy, "compile": {"options": {"freezing": False}}})
    parse_recipe(frozen)  # jit-cache: the FX graph cache re-binds frozen weights from the serving module


def test_every_schema_section_is_made_by_the_one_table():
    """parse_structure makes each section of SCHEMA through SECTIONS, the same way for all: the two
    tables name the same sections, each a field of Recipe, and each section's keys are its spec's."""
    import dataclasses

    from aotbuild.recipe.schema import SCHEMA, SECTIONS, Recipe

    mappings = {k for k, v in SCHEMA.items() if isinstance(v, dict)}
    assert set(SECTIONS) == mappings
    fields = {f.name for f in dataclasses.fields(Recipe)}
    for name, how in SECTIONS.items():
        assert name in fields
        assert set(SCHEMA[name]) == {f.name for f in dataclasses.fields(how.spec)}, name


def test_an_optional_section_absent_is_none_and_a_required_one_has_its_defaults():
    from aotbuild.recipe.schema import parse_structure

    recipe = parse_structure({"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}]})
    assert recipe.model.id == "builtin:tiny-sd" and recipe.compile.components == ("unet",)
    assert recipe.lora is None and recipe.parallel is None and recipe.changes is None and recipe.text_length is None
    assert parse_structure({"model": {"id": "x"}, "shapes": [{"height": 64, "width": 64}],
                            "parallel": {}}).parallel.tensor == 1  # present, empty: its defaults
    assert parse_structure({"model": {"id": "x"}, "shapes": [{"height": 64, "width": 64}],
                            "changes": {}}).changes is None  # declares nothing
