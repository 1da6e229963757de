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
              "adapters": "list", "batches": "int or list of int"}


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


# -- issue 55, item 9: what the README and the guides claim, held to the code --------------------------------

GUIDES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
#: A row of a LoadReport as ``print(pipe.aotbuild_report)`` shows it (runtime.LoadReport.__str__).
REPORT_ROW = re.compile(r"^  (hit |MISS) (\S+) +(\S+) +([0-9a-f]{12})(.*)$")
REPORT_HEADER = re.compile(
    r"^(?:aotbuild\.CacheMiss: )?aotbuild: (?P<recipe>\S+?)(?: \(rank (?P<rank>\d+) of (?P<tensor>\d+)\))?: "
    r"(?P<hits>\d+) hit, (?P<misses>\d+) miss (?:\((?P<pulled>\d+) pulled from (?P<remote>\S+)\) )?"
    r"\(cache (?P<cache>[^;]+); (?P<installed>\d+) files installed into the compiler's cache (?P<folder>.+), "
    r"(?P<present>\d+) were already there\)$")


def _fenced_blocks(text: str) -> list[str]:
    return re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)


def _rendered_row(line: str) -> str:
    """What a LoadReport prints for the entry ``line`` describes: a hit names the strategy its entry
    holds (every hit has one), a miss its reason and what a call does under the load's ``on_miss``."""
    from aotbuild.recipe.schema import Shape
    from aotbuild.runtime import LoadReport, ReportEntry
    from aotbuild.strategies.registry import strategy_names

    status, component, shape, key, rest = REPORT_ROW.match(line).groups()
    if status == "hit ":
        hit = re.fullmatch(r"(  pulled)?  (\S+)", rest)
        assert hit and hit[2] in strategy_names() and hit[2] != "auto", f"a hit names its entry's strategy: {line!r}"
        entry, on_miss = ReportEntry(component, Shape.parse(shape), key, True, pulled=bool(hit[1]),
                                     strategy=hit[2]), "compile"
    else:
        reason = rest.removeprefix("  ")
        on_miss = "error"
        for policy, then in (("compile", " -> compiles on first call"), ("eager", " -> runs eager")):
            if reason.endswith(then):
                reason, on_miss = reason.removesuffix(then), policy
        entry = ReportEntry(component, Shape.parse(shape), key, False, reason)
    return str(LoadReport("r", "c", [entry], on_miss=on_miss)).splitlines()[1]


def _rendered_header(line: str, rows: int | None) -> str:
    from aotbuild.recipe.schema import Shape
    from aotbuild.runtime import LoadReport, ReportEntry

    m = REPORT_HEADER.match(line)
    assert m, f"not a LoadReport's first line: {line!r}"
    hits, misses, pulled = int(m["hits"]), int(m["misses"]), int(m["pulled"] or 0)
    if rows is not None:
        assert hits + misses == rows, f"{line!r} counts {hits + misses} entries, the block shows {rows}"
    entries = [ReportEntry("c", Shape(8, 8), "0" * 64, n < hits, pulled=n < pulled, strategy="jit-cache")
               for n in range(hits + misses)]
    report = LoadReport(m["recipe"], m["cache"], entries, int(m["installed"]), int(m["present"]),
                        "" if m["folder"] == "folder" else m["folder"], remote=m["remote"] or "",
                        rank=int(m["rank"]) if m["rank"] else None, tensor=int(m["tensor"] or 1))
    return line[:line.index("aotbuild: ")] + str(report).splitlines()[0]


def test_load_reports_in_the_guides_are_what_a_load_report_prints():
    """Every report row and first line a guide shows is a real LoadReport's rendering of what it says:
    docs/runtime.md (and docs/troubleshooting.md) showed hits without the strategy column a hit has
    had since strategy: auto (issue 55)."""
    checked = 0
    for path in GUIDES:
        for block in _fenced_blocks(path.read_text()):
            lines = block.splitlines()
            for n, line in enumerate(lines):
                if REPORT_ROW.match(line):
                    assert _rendered_row(line) == line, f"{path.name}: a report row as aotbuild prints it"
                    checked += 1
                elif re.match(r"^(?:aotbuild\.CacheMiss: )?aotbuild: \S+: \d+ hit, ", line) and "..." not in line:
                    following = [x for x in lines[n + 1:] if REPORT_ROW.match(x)]
                    assert _rendered_header(line, len(following) or None) == line, path.name
                    checked += 1
    assert checked >= 10  # the quickstart's, runtime.md's and troubleshooting.md's reports


def _paragraph(path, words: str) -> str:
    found = [p for p in re.split(r"\n\s*\n", path.read_text()) if words in p]
    assert len(found) == 1, f"{path.name}: one paragraph with {words!r}"
    return found[0]


def test_every_remote_scheme_is_named_where_remotes_are_listed():
    """README.md said "Remotes are a Hugging Face Hub repo or a shared folder" (and docs/cli.md the
    same) a release after S3, GCS and Azure arrived; ``load_compiled``'s docstring named file:// and
    hf:// only. Each list is held to the schemes parse_remote takes."""
    import aotbuild
    from aotbuild.remote.schemes import parse_remote, scheme_names

    ci = (REPO / "docs" / "ci.md").read_text()
    places = {"README.md": _paragraph(REPO / "README.md", "Remotes are "),
              "docs/cli.md": _paragraph(REPO / "docs" / "cli.md", "URL is a remote:"),
              "docs/ci.md's table": ci.split("## Remotes", 1)[1].split("\n\n", 2)[1],
              "load_compiled's docstring": aotbuild.load_compiled.__doc__}
    for where, text in places.items():
        missing = [s for s in scheme_names() if f"{s}://" not in text]
        assert missing == [], f"{where} does not name {missing}"
    for scheme in scheme_names():  # and the registry is what parse_remote takes
        url = "file:///srv/aot" if scheme == "file" else "hf://org/aot" if scheme == "hf" else f"{scheme}://bucket/p"
        try:
            assert parse_remote(url).url.startswith(f"{scheme}://")
        except aotbuild.UsageError as exc:  # an object store whose package is not installed: named as such
            assert "is not installed: pip install 'aotbuild[" in str(exc), exc


#: How each object store's bucket is created with the store's own tool (docs/ci.md, "Object stores"),
#: by the extra that installs its package (remote/objectstore.py's SCHEMES).
BUCKET_CREATION = {"s3": "aws s3 mb s3://", "gcs": "gcloud storage buckets create gs://",
                   "azure": "az storage container create"}


def test_ci_md_says_to_create_the_bucket_of_every_object_store():
    """docs/ci.md showed the S3 path from build to serving and never said to create the bucket, which
    aotbuild does not do (a missing one is an error on every command)."""
    from aotbuild.remote.objectstore import SCHEMES

    section = (REPO / "docs" / "ci.md").read_text().split("### Object stores", 1)[1].split("\n## ", 1)[0]
    assert "Create the bucket first" in section and "aotbuild creates no bucket" in section
    for extra in sorted({extra for _, package, extra in SCHEMES.values() if package}):
        assert BUCKET_CREATION[extra] in section, extra


def test_targets_gives_autos_order_as_auto_tries_it():
    """``aotbuild targets`` said auto tries "aot-package, aot-compile, jit-cache (CPU order)", where on
    a CPU it tries aot-package+freezing first (what ``plan --explain-auto`` lists)."""
    import json

    from aotbuild.recipe.rules import load_recipe
    from aotbuild.strategies.order import choice
    from aotbuild.targets.registry import get_target
    from tests.conftest import MAIN_RECIPE, invoke_cli

    recipe = load_recipe(MAIN_RECIPE)  # names no strategy: auto, on a CPU
    tries = choice(recipe, get_target(recipe.target), "cpu").tries
    assert tries[0] == "aot-package+freezing"
    proc = invoke_cli("targets", "--json")
    auto = next(s for s in json.loads(proc.stdout)["strategies"] if s["name"] == "auto")
    assert f"{', '.join(tries)} on a CPU" in auto["summary"] and auto["summary"] in invoke_cli("targets").stdout


def test_the_readmes_python_examples_load_recipes_that_run_on_this_machine():
    """The README's serving example loaded recipes/sdxl_neuron.yaml (Trainium): a new user's first
    copy-paste failed with TargetUnavailable. Every recipe a README example loads is in the repo and
    a CPU recipe, so each runs where the README's two commands ran."""
    from aotbuild.recipe.rules import load_recipe

    loaded = [name for block in re.findall(r"```python\n(.*?)```", (REPO / "README.md").read_text(), flags=re.S)
              for name in re.findall(r"load_compiled\(\"([^\"]+)\"", block)]
    assert loaded
    for name in loaded:
        recipe = load_recipe(REPO / name)
        assert (recipe.target, recipe.device) == ("inductor", "cpu"), name


def test_the_readme_states_no_test_counts():
    """The README's counts (tests, passed, skipped) were wrong a few commits after each update: a
    count goes stale at the next test added. It gives the suite's time with the commit it was measured
    on, and how to count."""
    text = (REPO / "README.md").read_text()
    counts = re.findall(r"\b\d[\d,]*\s+(?:tests?|passed|skipped|failed)\b", text)
    assert counts == []


def test_a_recipe_mistake_is_one_line_and_exit_2():
    """docs/quickstart.md, "Your own recipe": ``aotbuild plan FILE`` with a mistake is one line and
    exit 2; it printed an empty table and "0/0 jobs cached" too."""
    import tempfile

    from tests.conftest import invoke_cli

    with tempfile.TemporaryDirectory() as folder:
        bad = f"{folder}/sdxl_cuda.yaml"
        with open(bad, "w") as f:
            f.write("model: {id: builtin:tiny-sd}\nshape: [{height: 64, width: 64}]\n")
        proc = invoke_cli("plan", bad, "--cache", f"{folder}/cache")
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.strip().splitlines() == [f"error: {bad}: shape: unknown key; did you mean 'shapes'? "
                                                 f"(allowed: {proc.stderr.split('(allowed: ', 1)[1].strip()}"]
    quickstart = (REPO / "docs" / "quickstart.md").read_text()
    assert "a mistake is one line and exit 2, e.g. `error:" in quickstart
