"""The child-process protocol (aotbuild/builder/child.py): results, errors, and no import from the cwd."""

from __future__ import annotations

import json

import pytest

from aotbuild.builder import child

CHILDREN = ["aotbuild.builder.worker", "aotbuild.builder.proof", "aotbuild.cli.bench"]

def _plant(folder, marker):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "json.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).write_text('planted json ran')\n"
                                    "raise SystemExit('a planted module ran')\n")


@pytest.mark.parametrize("module", CHILDREN)
def test_a_child_never_imports_a_module_planted_in_its_working_directory(tmp_path, module):
    """A pull request's checkout is CI's cwd: its json.py must not run in a build job (issue: code
    runs from the PR's checkout, with HF_TOKEN in the environment)."""
    checkout, marker = tmp_path / "checkout", tmp_path / "marker"
    _plant(checkout, marker)
    code, result = child.spawn(module, {}, tmp_path / "c" / "spec.json", tmp_path / "c" / "log", cwd=checkout)
    assert not marker.exists(), (tmp_path / "c" / "log").read_text()
    assert code == 1 and "KeyError" in result["error"]  # it ran aotbuild's code, which refused the empty spec


def test_the_python_310_shim_drops_the_cwd_too(tmp_path, monkeypatch):
    monkeypatch.setattr(child, "SAFE_PATH_FLAG", False)
    checkout, marker = tmp_path / "checkout", tmp_path / "marker"
    _plant(checkout, marker)
    assert child.command("aotbuild.builder.worker", "x")[1] == "-c"
    code, result = child.spawn("aotbuild.builder.worker", {}, tmp_path / "c" / "spec.json", tmp_path / "c" / "log",
                               cwd=checkout)
    assert not marker.exists() and code == 1 and "KeyError" in result["error"]


def test_pythonpath_keeps_working(tmp_path):
    """The operator's PYTHONPATH is trusted (-I would drop it): the same planted module, named there, runs.
    This is also what shows the cwd test above can fail."""
    folder, marker = tmp_path / "pp", tmp_path / "marker"
    _plant(folder, marker)
    child.spawn("aotbuild.builder.worker", {}, tmp_path / "c" / "spec.json", tmp_path / "c" / "log",
                env={"PYTHONPATH": str(folder)})
    assert marker.read_text() == "planted json ran"


def test_a_child_that_writes_no_result_is_an_error_with_its_log(tmp_path):
    spec = tmp_path / "spec.json"
    code, result = child.spawn("aotbuild.no_such_module", {}, spec, tmp_path / "log", name="worker")
    assert code == 1 and result["error"].startswith("worker exited with 1: ")
    assert "No module named aotbuild.no_such_module" in result["error"]


def test_main_writes_the_result_or_the_error(tmp_path):
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"result": str(tmp_path / "r.json"), "x": 2}))
    assert child.main([str(spec)], lambda s: {"double": s["x"] * 2}) == 0
    assert child.read_result(tmp_path / "r.json") == {"double": 4}

    def fails(s):
        raise ValueError("no")

    assert child.main([str(spec)], fails) == 1
    assert child.read_result(tmp_path / "r.json") == {"error": "ValueError: no"}
