"""The recipe reference cannot drift from the schema: every field is documented, nothing else."""

from __future__ import annotations

import re

from aotbuild.recipe.schema import ADAPTER_SCHEMA, QUANT_SCHEMA, SCHEMA, SHAPE_SCHEMA, Field
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
    from aotbuild.recipe.rules import registry_choices

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

    from aotbuild.cli.commands import main

    runner = CliRunner()
    for name in [None, *main.commands]:
        result = runner.invoke(main, [name, "--help"] if name else ["--help"])
        assert result.exit_code == 0, name
        assert "Example" in result.output and "aotbuild " in result.output.split("Example", 1)[1], name


def test_cli_reference_lists_every_command():
    from aotbuild.cli.commands import main

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


# -- docs that cannot drift (issue 33 item 7) ------------------------------------------------------


def _synopsis() -> dict[str, str]:
    """docs/cli.md's synopsis block: command -> its text (continuation lines joined)."""
    block = re.search(r"^# Command line\n\n```\n(.*?)```", (REPO / "docs" / "cli.md").read_text(), flags=re.S | re.M)
    assert block, "docs/cli.md has no synopsis block"
    commands: dict[str, str] = {}
    name = ""
    for line in block.group(1).splitlines():
        match = re.match(r"aotbuild (\S+)(.*)", line)
        if match:
            name = match.group(1)
            assert name not in commands, f"{name} twice in the synopsis"
            commands[name] = match.group(2)
        else:
            assert name and line.startswith(" "), f"not a command or a continuation: {line!r}"
            commands[name] += " " + line.strip()
    return commands


def test_cli_synopsis_matches_click():
    """Every command and every option click offers is in docs/cli.md's synopsis, and nothing else:
    options by name, and whether the command takes arguments."""
    import click

    from aotbuild.cli.commands import main

    synopsis = _synopsis()
    assert set(synopsis) == set(main.commands)
    for name, command in main.commands.items():
        text = synopsis[name]
        options = {o for p in command.params if isinstance(p, click.Option) and not p.hidden
                   for o in p.opts if o.startswith("--")}
        assert set(re.findall(r"(--[a-z][a-z-]*)", text)) == options, name
        takes_arguments = any(isinstance(p, click.Argument) for p in command.params)
        assert bool(re.search(r"[A-Z]{3,}", text.split("--")[0])) == takes_arguments, name


def test_exit_codes_table_matches_the_cli():
    import aotbuild.cli.commands as cli

    codes = {getattr(cli, n) for n in dir(cli) if n.startswith("EXIT_")}
    text = (REPO / "docs" / "cli.md").read_text()
    table = text.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    assert {int(c) for c in re.findall(r"^\| (\d+) \|", table, flags=re.M)} == codes


def _aotbuild_variables() -> dict[str, int | None]:
    """Every AOTBUILD_* variable constants.py names -> its default where LIMITS holds one."""
    from aotbuild import constants

    found: dict[str, int | None] = {v: None for n, v in vars(constants).items()
                                    if n.isupper() and isinstance(v, str) and v.startswith("AOTBUILD_")}
    found.update({variable: default for variable, default in constants.LIMITS.values()})
    return found


def test_environment_table_holds_every_variable_and_no_other():
    text = (REPO / "docs" / "environment.md").read_text()
    row = re.compile(r"^\| `(AOTBUILD_\w+)` \| ([^|]*) \|", flags=re.M)
    rows = {m.group(1): m.group(2).strip() for m in row.finditer(text)}
    variables = _aotbuild_variables()
    assert sorted(set(variables) - set(rows)) == [], "undocumented in docs/environment.md"
    assert sorted(set(rows) - set(variables)) == [], "documented but gone from constants.py"
    for variable, default in variables.items():
        if default is not None:
            assert rows[variable] == str(default), f"{variable}: default {rows[variable]!r}, constants says {default}"
    # No page names a variable that does not exist (a renamed one left behind).
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    stale = {f"{p.name}: {v}" for p in pages for v in re.findall(r"\bAOTBUILD_[A-Z_]*[A-Z]\b", p.read_text())
             if v not in variables}
    assert stale == set()


def _layers() -> list[set[str]]:
    """The modules of each layer docs/architecture.md's layer list names, bottom layer first
    (``targets/{a,b}`` expanded; a layer's number and name and the prose in parentheses left out)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"^## The layers\n.*?```\n(.*?)```", text, flags=re.S | re.M)
    assert block, "docs/architecture.md has no layer list"
    body = re.sub(r"\([^()]*\)", " ", block.group(1), flags=re.S)
    layers: list[set[str]] = []
    for line in body.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells and cells[0].isdigit():
            assert int(cells[0]) == len(layers) + 1, f"layer {cells[0]} out of order"
            layers.append(set())
            cells = cells[2:]
        for word in " ".join(cells).split():
            group = re.fullmatch(r"([a-z_]+)/\{([a-z_,]+)\}", word)
            if group:
                layers[-1].update(f"{group[1]}/{n}" for n in group[2].split(","))
            else:
                layers[-1].add(word)
    return layers


def _layer_list() -> set[str]:
    return set().union(*_layers())


def _package_modules() -> set[str]:
    """aotbuild's modules as the layer list names them: ``targets/base``, ``targets`` for a package's
    ``__init__``, ``aotbuild`` for the facade."""
    root = REPO / "aotbuild"
    names = set()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).with_suffix("").as_posix()
        names.add("aotbuild" if rel == "__init__" else rel.removesuffix("/__init__"))
    return names


def test_architecture_layer_list_names_every_module_and_no_other():
    documented, modules = _layer_list(), _package_modules()
    assert sorted(modules - documented) == [], "modules missing from docs/architecture.md's layer list"
    assert sorted(documented - modules) == [], "docs/architecture.md's layer list names modules that are gone"


def test_store_layout_in_cache_md_is_layout_py_s():
    from aotbuild.cache import layout

    def paths(text: str) -> set[str]:
        return set(re.findall(r"^\s*(<root>/\S+)", text, flags=re.M))

    section = (REPO / "docs" / "cache.md").read_text().split("## Store layout", 1)[1].split("\n## ", 1)[0]
    assert paths(section) and paths(section) == paths(layout.__doc__ or "")


def test_every_builtin_model_is_documented_with_its_version():
    from aotbuild.builtin import BUILTINS

    text = (REPO / "docs" / "recipes.md").read_text()
    table = dict(re.findall(r"^\| `builtin:([\w-]+)` \(v(\d+)\) \|", text, flags=re.M))
    assert table == {name: str(model.version) for name, model in BUILTINS.items()}
    model_id = re.search(r"^\| `model\.id` \|.*$", text, flags=re.M).group(0)
    assert set(re.findall(r"`builtin:([\w-]+)`", model_id)) == set(BUILTINS)
    architecture = (REPO / "docs" / "architecture.md").read_text().split("**`builtin/__init__.py`**", 1)[1]
    named = set(re.findall(r"`(Tiny\w+)`", architecture.split("\n\n", 1)[0]))
    assert named == {type(model).__name__ for model in BUILTINS.values()}


def test_architecture_layer_list_is_the_import_contract():
    """The page's layers are pyproject.toml's import-linter ``layers`` contract, layer by layer (the
    contract lists the top layer first). The facade and the packages' empty ``__init__`` are left out of
    the contract: a layer names a module with everything under it."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: import-linter's own dependency
        import tomli as tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    contract = next(c for c in config["contracts"] if c["id"] == "layers")
    in_contract = [{m.strip() for m in re.split(r"[:|]", layer)} for layer in reversed(contract["layers"])]
    packages = {"aotbuild", "targets", "strategies", "features", "cache", "pipeline", "recipe", "remote", "builder",
                "cli", "utils"}
    documented = [{"aotbuild." + m.replace("/", ".") for m in layer - packages} for layer in _layers()]
    assert documented == in_contract
