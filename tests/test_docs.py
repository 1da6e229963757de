"""The recipe reference cannot drift from the schema: every field is documented, nothing else."""

from __future__ import annotations

import re

from aotbuild.recipe import SCHEMA, SHAPE_SCHEMA, Field
from tests.conftest import REPO


def schema_keys() -> set[str]:
    keys = set()
    for name, spec in SCHEMA.items():
        if isinstance(spec, Field):
            keys.add(name)
        else:
            keys.update(f"{name}.{k}" for k in spec)
    keys.update(f"shapes[].{k}" for k in SHAPE_SCHEMA)
    return keys


def test_recipe_reference_matches_schema():
    text = (REPO / "docs" / "recipes.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    assert documented == schema_keys()


def test_documented_choices_match_schema():
    text = (REPO / "docs" / "recipes.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", text, flags=re.M)}
    for name, spec in SCHEMA.items():
        specs = {name: spec} if isinstance(spec, Field) else {f"{name}.{k}": v for k, v in spec.items()}
        for key, field in specs.items():
            for choice in field.choices:
                assert choice in rows[key], f"{key}: {choice} is allowed but not documented"


def test_every_command_has_help_with_an_example():
    from click.testing import CliRunner

    from aotbuild.cli import main

    runner = CliRunner()
    for name in [None, *main.commands]:
        result = runner.invoke(main, [name, "--help"] if name else ["--help"])
        assert result.exit_code == 0, name
        assert "Example" in result.output and "aotbuild " in result.output.split("Example", 1)[1], name


def test_cli_reference_lists_every_command():
    from aotbuild.cli import main

    text = (REPO / "docs" / "cli.md").read_text()
    for name in main.commands:
        assert f"aotbuild {name} " in text and f"`{name}`" in text, name
