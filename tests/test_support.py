"""The supported stack (issue 54): pyproject.toml's floors are aotbuild.constants.FLOORS and the README's
table, and an older library is refused in one line where a command or an API call starts."""

from __future__ import annotations

import re
import textwrap

import pytest

from aotbuild import constants
from tests.conftest import REPO, run_python


def test_the_floors_are_pyprojects_and_the_readmes():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = {}
    for requirement in project["dependencies"]:
        match = re.match(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement)
        if match:
            declared[match.group(1).lower().replace("-", "_")] = match.group(2)
    assert {name: declared.get(name) for name in constants.FLOORS} == constants.FLOORS
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("### Supported versions"):readme.index("## Then")]
    for name, floor in constants.FLOORS.items():
        assert re.search(rf"\| {name} \| {re.escape(floor)}\b", table), (name, floor)


@pytest.mark.parametrize(("have", "refused"), [("2.6.0", True), ("2.12.1+cu121", True), ("2.13.0+cpu", False),
                                               ("2.14.1", False), ("3.0.0a0", False)])
def test_an_older_torch_is_named_with_the_floor(monkeypatch, have, refused):
    real = constants.dist_version
    monkeypatch.setattr(constants, "dist_version", lambda name: have if name == "torch" else real(name))
    why = constants.stack_problem()
    assert bool(why) == refused
    if refused:
        assert f"torch {have} (needs >=2.13)" in why and "pip install -U 'torch>=2.13'" in why and "\n" not in why


FAKE = textwrap.dedent("""
    import importlib.metadata as metadata, sys
    real = metadata.version
    metadata.version = lambda name: "2.6.0" if name == "torch" else real(name)
    what = sys.argv[1]
    if what == "cli":
        sys.argv = ["aotbuild", "plan", sys.argv[2]]
        from aotbuild.cli import main
        main()
    else:
        import aotbuild
        try:
            aotbuild.load_compiled(sys.argv[2], on_miss="error")
        except aotbuild.UsageError as exc:
            print("REFUSED " + str(exc))
""")


def test_an_older_torch_is_one_line_at_a_command_and_at_load_compiled(tmp_path):
    recipe = str(REPO / "recipes" / "tiny_sd_cpu.yaml")
    proc = run_python(f"import sys; sys.argv = ['x', 'cli', {recipe!r}]; exec({FAKE!r})", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "does not support torch 2.6.0 (needs >=2.13)" in proc.stderr
    proc = run_python(f"import sys; sys.argv = ['x', 'api', {recipe!r}]; exec({FAKE!r})", cwd=tmp_path)
    assert proc.returncode == 0 and "REFUSED aotbuild 0.1.0 does not support torch 2.6.0" in proc.stdout, proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_readmes_two_commands_agree_with_each_other_and_with_ci():
    """Run in order in one venv, the README's two commands install the same libraries (the main job's
    entries still hit after the test install: issue 54 item 4), and ``.ci/run`` installs as the test command."""
    readme = (REPO / "README.md").read_text()
    main, tests = re.findall(r"```bash\n(python3 -m venv .*)\n```", readme)[:2]
    assert "aotbuild build recipes/tiny_sd_cpu.yaml" in main and "python -m pytest" in tests
    installs = [[step.strip() for step in command.split("&&") if step.strip().startswith("pip install")]
                for command in (main, tests)]
    torch_main, project_main = installs[0]
    torch_tests, project_tests = installs[1]
    assert torch_main == torch_tests and "-c .ci/constraints.txt" in project_main and \
        "-c .ci/constraints.txt" in project_tests
    ci = (REPO / ".ci" / "run").read_text().replace(" -q", "")  # CI installs quietly
    assert f"python -m {torch_tests}" in ci and f"python -m {project_tests}" in ci
    # the torch line is docs/ci.md's: PyTorch's own CPU wheel index, not PyPI's multi-GB CUDA build
    assert "--index-url https://download.pytorch.org/whl/cpu" in torch_tests
    assert torch_tests in (REPO / "docs" / "ci.md").read_text()
    quickstart = (REPO / "docs" / "quickstart.md").read_text()  # its copy of the two commands
    assert main in quickstart and tests in quickstart
