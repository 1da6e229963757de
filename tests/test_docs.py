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
