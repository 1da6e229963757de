"""What aotbuild prints of a value from a pull request's files cannot drive a CI log or a terminal
(issue 32, item 5): every error goes through one printer in aotbuild/cli/commands.py (``_error``) that puts it
on one line with newlines and control characters escaped, whatever the raise site embedded. The
corpus's case: a Hub adapter's name holding a newline and ``::error::`` (GitHub Actions runs such a
line as a workflow command) reached stderr through a Hub error's message."""

from __future__ import annotations

import json

import pytest

from tests.conftest import invoke_cli, run_cli

HOSTILE = "\n::error::x\x1b[31m"
SHOWN = "\\n::error::x\\x1b[31m"
GOOD = "model: {id: builtin:tiny-sd, dtype: float32}\nshapes: [{height: 64, width: 64}]\n"
#: name: recipe text (the hostile value in a YAML double-quoted string: \n and \e are its escapes)
RECIPES = {
    "hub adapter": GOOD + 'lora: {rank: 4, adapters: [{path: "org/lora\\n::error::x\\e[31m", adapter_name: a}]}\n',
    "hub model": 'model: {id: "org/model\\n::error::x\\e[31m", dtype: float32}\nshapes: [{height: 64, width: 64}]\n',
    "local model": 'model: {id: "./model\\n::error::x\\e[31m", dtype: float32}\nshapes: [{height: 64, width: 64}]\n',
    "warmup key": GOOD + 'warmup: {"k\\n::error::x\\e[31m": 1}\n',
}
ENV = {"HF_HUB_OFFLINE": "1", "AOTBUILD_CACHE": ""}


def assert_escaped(out: str) -> None:
    """No line a CI runner would take for a workflow command, no escape sequence, the value shown."""
    assert "\x1b" not in out, out[-2000:]
    assert not any(line.lstrip().startswith("::") for line in out.splitlines()), out[-2000:]
    assert "Traceback" not in out, out[-2000:]


@pytest.fixture
def folder(tmp_path):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    return recipes


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("command", ["plan", "pull"])
def test_an_error_naming_a_hostile_value_is_one_escaped_line(cache, folder, tmp_path, name, command):
    (folder / "r.yaml").write_text(RECIPES[name])
    remote = ["--remote", (tmp_path / "remote").as_uri()] if command == "pull" else []
    proc = invoke_cli(command, *remote, "--cache", str(cache), str(folder / "r.yaml"), env=ENV)
    assert proc.returncode != 0 or name == "hub model"  # plan lists that one's jobs as unavailable, with the reason
    assert_escaped(proc.stdout + proc.stderr)
    assert SHOWN in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.parametrize("command", ["build", "bench"])
def test_build_and_bench_print_a_hostile_value_escaped(cache, folder, command):
    """In a fresh process, as CI runs them."""
    (folder / "r.yaml").write_text(RECIPES["hub adapter"])
    proc = run_cli(command, "--cache", str(cache), str(folder / "r.yaml"), env=ENV)
    assert proc.returncode != 0
    assert_escaped(proc.stdout + proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"org/lora{SHOWN}" in errors[0], proc.stderr


def test_json_output_stays_json_and_errors_stay_on_stderr(cache, folder):
    """plan --json of a folder with good and hostile recipes: the good one planned as JSON on stdout
    (a value inside it JSON-escaped), each bad one an escaped line on stderr."""
    (folder / "good.yaml").write_text(GOOD)
    (folder / "bad.yaml").write_text(RECIPES["warmup key"])
    # A Hub id holding a newline is no Hub id: a recipe error since issue 53 (it was a job "unavailable"
    # with the id in its reason); the value inside the JSON is now a recipe's name, from its file's.
    (folder / "hub.yaml").write_text(RECIPES["hub model"])
    (folder / f"named{HOSTILE}.yaml").write_text(GOOD)
    proc = invoke_cli("plan", "--json", "--cache", str(cache), str(folder), env=ENV)
    assert proc.returncode == 2
    data = json.loads(proc.stdout)
    names = {job["recipe"] for job in data["jobs"]}
    assert names == {"good", f"named{SHOWN}"}, names
    assert_escaped(proc.stdout + proc.stderr)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 2 and all(SHOWN in line for line in errors), proc.stderr
    assert any(f"org/model{SHOWN}" in line and "not a Hub repo id" in line for line in errors), proc.stderr


@pytest.mark.parametrize("error,shown", [
    ("usage", f"error: cannot fetch org/x{SHOWN}"),
    ("os", f"error: /tmp/d{SHOWN}: No such file or directory"),
])
def test_whatever_a_raise_site_embeds_the_cli_prints_one_escaped_line(capsys, error, shown):
    """The choke point itself: an error whose message holds a raw newline and escape (a raise site that
    forgot printable(), or an OSError's file name) is still printed on one line."""
    import errno

    from aotbuild.cli.commands import _run
    from aotbuild.errors import UsageError

    def fail():
        if error == "usage":
            raise UsageError(f"cannot fetch org/x{HOSTILE}")
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", f"/tmp/d{HOSTILE}")

    with pytest.raises(SystemExit):
        _run(fail)
    err = capsys.readouterr().err
    assert err.startswith(shown) and err.count("\n") == 1 and "\x1b" not in err, err


def test_a_note_logged_with_a_hostile_value_is_one_line(capsys):
    """aotbuild's log notes go through the same kind of printer as errors."""
    import logging

    from aotbuild.cli.commands import _EchoHandler

    handler = _EchoHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.emit(logging.LogRecord("aotbuild", logging.WARNING, __file__, 1, "shard from %s", (HOSTILE,), None))
    err = capsys.readouterr().err
    assert err == f"shard from {SHOWN}\n"


def test_verify_and_gc_report_a_hostile_file_name_in_a_shared_store_escaped(tmp_path):
    """Another writer's files in a shared store: a manifest-like name and a job folder holding a newline,
    ``::error::`` and an escape. verify reports both by path (the value itself, shown escaped)."""
    from aotbuild.cache.store import Store
    from tests import manifests

    store = Store(tmp_path / "c")
    key = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    (store.layout.manifest(key).parent / f"zz{HOSTILE}.json").write_text("{}")
    (store.root / "tmp").mkdir(exist_ok=True)
    (store.root / "tmp" / f"job-{HOSTILE}").mkdir()
    for command in (["verify"], ["verify", "--json"], ["gc", "--dry-run"], ["ls"], ["ls", "--json"]):
        proc = invoke_cli(*command, "--cache", str(store.root))
        assert_escaped(proc.stdout + proc.stderr)
        if "--json" in command:
            json.loads(proc.stdout)
    shown = invoke_cli("verify", "--cache", str(store.root)).stdout
    assert f"zz{SHOWN}.json: not a name aotbuild writes" in shown and f"job-{SHOWN}: not a name" in shown, shown


@pytest.mark.parametrize("command", ["ls", "plan", "verify"])
def test_a_pull_requests_pyproject_cache_with_a_newline_is_refused_not_printed(tmp_path, monkeypatch, command):
    """Found in review: ``[tool.aotbuild] cache`` comes from the pull request's pyproject.toml, and
    every command prints its cache root (``no cache at ROOT``, ``... jobs cached in ROOT``) through the
    multi-line printer, which keeps newlines: ``::error::`` reached CI's log on a line of its own."""
    (tmp_path / "pyproject.toml").write_text('[tool.aotbuild]\ncache = "c\\n::error::x\\u001b[31m"\n')
    (tmp_path / "r.yaml").write_text(GOOD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AOTBUILD_CACHE", raising=False)
    proc = invoke_cli(command, *(["r.yaml"] if command == "plan" else []), env={"HF_HUB_OFFLINE": "1"})
    assert_escaped(proc.stdout + proc.stderr)
    assert proc.returncode == 2 and "[tool.aotbuild] cache must be a folder path" in proc.stderr, proc.stderr


def test_bench_names_a_local_model_folder_holding_a_newline_on_one_escaped_line(capsys):
    """Found in review: bench's report starts with the recipe's ``model.id``, which a pull request can
    make a folder whose name holds ``\\n::error::`` (git keeps such a name); the CLI prints the report
    through the multi-line printer, which keeps newlines."""
    from aotbuild.cli.bench import BenchReport, Run
    from aotbuild.cli.commands import _echo

    report = BenchReport("r", "r.yaml", f"./m{HOSTILE}", "inductor", "jit-cache", "full", ["unet"], "64x64",
                         {"device": "cpu"}, 1, 1, {"eager": [Run(1.0, 0.1, 100.0, 0, 0, 0)]})
    _echo(report.text())
    out = capsys.readouterr().out
    assert_escaped(out)
    assert out.startswith(f"r (./m{SHOWN}): unet at 64x64; inductor on cpu, jit-cache\n"), out


def test_load_compileds_miss_warning_names_a_reason_holding_a_newline_on_one_line():
    """Found in review: the report's text escapes each miss's reason, the warning naming the same
    misses did not (a reason quotes a store's or a remote's word: a manifest's value, a path)."""
    import warnings

    from aotbuild.advice import Situation
    from aotbuild.recipe.rules import parse_recipe
    from aotbuild.recipe.schema import Shape
    from aotbuild.runtime import LoadReport, ReportEntry, _announce

    recipe = parse_recipe({"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}]})
    report = LoadReport("r", "/c", [ReportEntry("unet", Shape(64, 64), "a" * 64, False, f"no entry{HOSTILE}")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _announce(report, recipe, "compile", "", Situation())
    text = str(caught[0].message)
    assert f"no entry{SHOWN}" in text and "\n" not in text and "\x1b" not in text, text


def test_builds_skipped_reasons_and_note_are_printed_escaped():
    """Found in review: a skipped job's reason (a target's or a device's word) and the report's note (an
    exception's text from gc) reached the multi-line printer raw, so a newline in either put ``::error::``
    on a line of its own in CI's log."""
    from aotbuild.builder.build import BuildReport, JobResult, ResultStatus
    from aotbuild.planner import plan

    job = plan({"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}]})[0]
    report = BuildReport("/c", [JobResult(job, ResultStatus.SKIPPED, 0.0, reason=f"no device{HOSTILE}")],
                         note=f"gc: {HOSTILE}")
    text = report.text()
    assert_escaped(text)
    assert f"no device{SHOWN}" in text and f"note: gc: {SHOWN}" in text, text


@pytest.mark.parametrize(("args", "shown"), [
    (["plan", f"--x{HOSTILE}"], f"error: No such option '--x{SHOWN}'. (see `aotbuild plan --help`)"),
    (["plan"], "error: Missing argument 'RECIPES...'. (see `aotbuild plan --help`)"),
    ([f"pla{HOSTILE}"], f"error: No such command 'pla{SHOWN}'. (see `aotbuild --help`)"),
])
def test_clicks_own_usage_errors_are_one_escaped_line(args, shown):
    """Found in review: docs/cli.md says every error is one line, but click printed its own (an unknown
    option, a missing argument, an unknown command) in three (Usage / Try / Error), the offending value
    raw: an option holding ``\\n::error::`` became a workflow command in CI's log."""
    proc = invoke_cli(*args, env=ENV)
    assert proc.returncode == 2
    assert_escaped(proc.stdout + proc.stderr)
    lines = [line.replace("`main", "`aotbuild") for line in proc.stderr.splitlines()]  # CliRunner's prog name
    assert lines == [shown], proc.stderr
