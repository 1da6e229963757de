"""The recipe reference cannot drift from the schema: every field is documented, nothing else."""

from __future__ import annotations

import re

from aotbuild.recipe import ADAPTER_SCHEMA, QUANT_SCHEMA, SCHEMA, SHAPE_SCHEMA, Field
from tests.conftest import REPO


def schema_keys() -> set[str]:
    keys = set()
    for name, spec in SCHEMA.items():
        if isinstance(spec, Field):
            keys.add(name)
        else:
            keys.update(f"{name}.{k}" for k in spec)
    keys.update(f"shapes[].{k}" for k in SHAPE_SCHEMA)
    keys.update(f"model.quantization.{k}" for k in QUANT_SCHEMA)
    keys.update(f"lora.adapters[].{k}" for k in ADAPTER_SCHEMA)
    return keys


def test_recipe_reference_matches_schema():
    text = (REPO / "docs" / "recipes.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \|", text, flags=re.M))
    assert documented == schema_keys()


def test_documented_choices_match_schema():
    """Every allowed value is in its row, a registered target's or strategy's too: registering one is
    one module, one registry line and its name in docs/recipes.md."""
    from aotbuild.recipes import registry_choices

    text = (REPO / "docs" / "recipes.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `([^`]+)` \|.*$", text, flags=re.M)}
    registries = registry_choices()
    for name, spec in SCHEMA.items():
        specs = {name: spec} if isinstance(spec, Field) else {f"{name}.{k}": v for k, v in spec.items()}
        for key, field in specs.items():
            for choice in registries.get(field.registry, field.choices):
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


TYPE_WORDS = {"str": "text", "str?": "text", "int": "int", "bool": "bool", "list[str]": "list of text",
              "mapping": "mapping", "shapes": "list", "float": "number", "quantization": "mapping",
              "adapters": "list"}


def _default_text(field: Field) -> str | None:
    """What the default column must say; None: a default derived elsewhere ("none" or "target's")."""
    if field.required:
        return "required"
    value = field.default
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(value) + "]"
    if isinstance(value, dict):
        return "{}" if not value else str(value)
    return str(value)


def test_documented_types_and_defaults_match_schema():
    text = (REPO / "docs" / "recipes.md").read_text()
    rows = {m.group(1): [c.strip() for c in m.group(0).split(" | ")]
            for m in re.finditer(r"^\| `([^`]+)` \|.*$", text, flags=re.M)}
    fields = {f"shapes[].{k}": v for k, v in SHAPE_SCHEMA.items()}
    fields.update({f"model.quantization.{k}": v for k, v in QUANT_SCHEMA.items()})
    fields.update({f"lora.adapters[].{k}": v for k, v in ADAPTER_SCHEMA.items()})
    for name, spec in SCHEMA.items():
        fields.update({name: spec} if isinstance(spec, Field) else {f"{name}.{k}": v for k, v in spec.items()})
    for key, field in fields.items():
        _, kind, default = rows[key][:3]
        assert kind == TYPE_WORDS[field.type], f"{key}: type {kind!r}"
        expected = _default_text(field)
        shown = default.split(" (")[0]
        if expected is None:
            assert shown == "none" or shown.endswith("'s"), f"{key}: default {default!r}"
        else:
            assert shown == expected, f"{key}: default {default!r}, the schema says {expected!r}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_links_between_docs_point_at_files_and_headings_that_exist():
    pages = [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and file.suffix == ".md":
                headings = {_slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), flags=re.M)}
                if anchor not in headings:
                    broken.append(f"{page.name}: {target}")
    assert not broken


def _interface_block(text: str, cls: str) -> str:
    match = re.search(rf"```python\nclass {cls}:.*?```", text, flags=re.S)
    assert match, f"docs/architecture.md has no interface block for {cls}"
    return match.group(0)


def _public_members(cls: type) -> set[str]:
    """Methods and class attributes the class itself defines (not inherited from object)."""
    return {n for n in vars(cls) if not n.startswith("_")}


def test_architecture_interface_blocks_name_every_public_member():
    from aotbuild.strategies.base import Strategy
    from aotbuild.targets.base import Target

    text = (REPO / "docs" / "architecture.md").read_text()
    for cls in (Strategy, Target):
        block = _interface_block(text, cls.__name__)
        named = set(re.findall(r"^\s+(?:def )?(\w+)\b", block, flags=re.M)) - {"class"}
        assert _public_members(cls) - named == set(), f"{cls.__name__}: undocumented"
        assert named - _public_members(cls) == set(), f"{cls.__name__}: documented but gone"
