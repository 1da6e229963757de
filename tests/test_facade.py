"""The public API has one shape (issue 33): the facade's export lists agree, optional arguments are
keyword-only (positional ones still work for one release, with a warning), every function that takes
a remote takes a URL or a Remote, and every report has ``.text()`` and ``.as_json()``."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import re
import warnings

import pytest

import aotbuild
from tests.conftest import REPO, TINY_DICT

INIT = REPO / "aotbuild" / "__init__.py"


def _facade() -> tuple[list[str], dict[str, str], dict[str, str], set[str]]:
    """From the facade's source: ``__all__``, the lazy table (name -> module), the ``TYPE_CHECKING``
    imports (name -> module) and the names imported eagerly (huggingface_hub's check_static_imports)."""
    tree = ast.parse(INIT.read_text())
    all_names: list[str] = []
    lazy: dict[str, str] = {}
    static: dict[str, str] = {}
    eager: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id == "__all__":
                all_names = ast.literal_eval(node.value)
            elif node.targets[0].id == "_LAZY":
                lazy = ast.literal_eval(node.value)
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom), ast.dump(imp)
                static.update({a.asname or a.name: imp.module for a in imp.names})
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aotbuild"):
            eager.update(a.asname or a.name for a in node.names)
    return all_names, lazy, static, eager


def test_the_facade_export_lists_agree():
    all_names, lazy, static, eager = _facade()
    assert lazy and static and all_names
    assert len(all_names) == len(set(all_names)), "a name twice in __all__"
    assert static == lazy, "the TYPE_CHECKING imports and the lazy table name other things"
    public_eager = {n for n in eager if not n.startswith("_") and n != "VERSION"}
    assert set(all_names) == set(lazy) | public_eager | {"__version__"}
    for name, module in lazy.items():
        assert getattr(aotbuild, name) is getattr(importlib.import_module(module), name), name
    assert set(all_names) <= set(dir(aotbuild)), "dir(aotbuild) hides a lazy name"


def test_the_report_job_and_shape_types_are_exported():
    for name in ("LoadReport", "BuildReport", "JobResult", "PushReport", "PullReport", "PullItem", "Job", "Shape",
                 "Remote", "JobStatus", "ResultStatus", "PullStatus"):
        assert name in aotbuild.__all__, name
    for report in (aotbuild.LoadReport, aotbuild.BuildReport, aotbuild.PushReport, aotbuild.PullReport):
        assert callable(getattr(report, "text", None)) and callable(getattr(report, "as_json", None)), report


#: Each report's statuses as ``--json`` writes them (issue 33 item 4: typed, with these values unchanged).
VOCABULARIES = {
    "aotbuild.planner.JobStatus": {"HIT": "hit", "MISS": "miss", "FAILED_BEFORE": "failed",
                                   "UNAVAILABLE": "unavailable", "REMOTE": "remote"},
    "aotbuild.builder.build.ResultStatus": {"BUILT": "built", "CACHED": "cached", "FAILED": "failed",
                                            "SKIPPED": "skipped", "ON_REMOTE": "remote", "UNCACHED": "uncached"},
    "aotbuild.remote.sync.PullStatus": {"PULLED": "pulled", "CACHED": "cached", "MISSING": "missing",
                                        "REFUSED": "refused", "UNAVAILABLE": "unavailable"},
    "aotbuild.cache.manage.Finding": {"CORRUPT": "corrupt", "MISSING": "missing", "MALFORMED": "malformed",
                                "UNREADABLE": "unreadable", "ORPHAN": "orphan", "TEMP": "temp", "FOREIGN": "foreign",
                                "UNTRUSTED": "untrusted"},
    "aotbuild.strategies.order.Outcome": {"BUILT": "built", "FAILED": "failed", "FAILED_BEFORE": "failed before",
                              "DROPPED": "dropped"},
}


@pytest.mark.parametrize("path", sorted(VOCABULARIES))
def test_each_report_has_its_own_typed_statuses_that_read_as_before(path):
    """A status is a member of its report's own enum (``JobStatus.FAILED_BEFORE`` is not
    ``ResultStatus.FAILED``, though both read "failed"), and prints, formats, compares and serializes
    as the string it was, so ``--json``, manifests and ``job.status == "hit"`` are unchanged."""
    from aotbuild.constants import Vocabulary

    module, _, name = path.rpartition(".")
    vocabulary = getattr(importlib.import_module(module), name)
    assert issubclass(vocabulary, Vocabulary)
    assert {m.name: m.value for m in vocabulary} == VOCABULARIES[path]
    for member in vocabulary:
        assert str(member) == f"{member}" == f"{member:<1}" == member.value and member == member.value
        assert json.dumps({"status": member}) == json.dumps({"status": member.value})
        assert vocabulary(member.value) is member


def test_the_report_fields_hold_their_vocabulary():
    """The dataclasses' status fields are annotated with their enum (not ``str``)."""
    from aotbuild import planner
    from aotbuild.builder import build as builder
    from aotbuild.cache import manage
    from aotbuild.remote import sync
    from aotbuild.strategies import order as auto

    for cls, field, vocabulary in ((planner.Job, "status", "JobStatus"), (builder.JobResult, "status", "ResultStatus"),
                                   (sync.PullItem, "status", "PullStatus"), (manage.Problem, "kind", "Finding"),
                                   (auto.Attempt, "outcome", "Outcome")):
        assert cls.__annotations__[field].split(" ")[0] == vocabulary, (cls, field)


def _public_functions() -> dict[str, object]:
    return {n: getattr(aotbuild, n) for n in aotbuild.__all__ if inspect.isfunction(getattr(aotbuild, n))}


def test_optional_arguments_are_keyword_only():
    functions = _public_functions()
    assert {"load_compiled", "build", "plan", "push", "pull", "sign", "parse_recipe"} <= set(functions)
    positional = {name: [p.name for p in inspect.signature(fn).parameters.values()
                         if p.default is not p.empty and p.kind != p.KEYWORD_ONLY]
                  for name, fn in functions.items()}
    assert {name: params for name, params in positional.items() if params} == {}


def test_optional_arguments_by_position_still_work_for_one_release_with_a_warning(tmp_path):
    with pytest.warns(FutureWarning, match=r"aotbuild.parse_recipe\(\): pass source=, name= by keyword"):
        recipe = aotbuild.parse_recipe(TINY_DICT, "r.yaml", "named")
    assert recipe.name == "named" and recipe.source == "r.yaml"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the keyword form warns nothing
        assert aotbuild.parse_recipe(TINY_DICT, source="r.yaml", name="named") == recipe
    with pytest.raises(TypeError, match="multiple values for argument 'source'"):
        aotbuild.parse_recipe(TINY_DICT, "r.yaml", source="s.yaml")
    with pytest.raises(TypeError, match="positional argument"):
        aotbuild.parse_recipe(TINY_DICT, "r.yaml", "named", "extra")


def test_every_function_that_takes_a_remote_takes_a_url(cache, tmp_path, fake_compiles):
    """push, plan, pull and build with ``"file:///..."`` (push and pull raised AttributeError on one);
    pull's report reads like push's and iterates like the list it was. Nothing inside them passes an
    optional argument by position (the shim's warning is an error here)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        _push_plan_build_pull(cache, tmp_path, fake_compiles)


def _push_plan_build_pull(cache, tmp_path, fake_compiles):
    url = f"file://{tmp_path / 'remote'}"
    (tmp_path / "remote").mkdir()
    built = aotbuild.build(TINY_DICT, cache=cache)
    keys = [r.job.key for r in built.results]
    assert [r.status for r in built.results] == ["built"] and len(fake_compiles) == 1

    pushed = aotbuild.push([], url, cache=cache)
    assert isinstance(pushed, aotbuild.PushReport) and pushed.result.sent == keys
    assert pushed.as_json()["remote"] == url and url in pushed.text()

    other = tmp_path / "other"
    import shutil

    shutil.copytree(cache / "models", other / "models")
    job, = aotbuild.plan(TINY_DICT, cache=other, remote=url)
    assert isinstance(job, aotbuild.Job) and (job.status, job.reason) == ("remote", f"on {url}")

    assert [r.status for r in aotbuild.build(TINY_DICT, cache=tmp_path / "third", remote=url).results] == ["remote"]
    assert len(fake_compiles) == 1  # the remote had it: nothing built

    report = aotbuild.pull([TINY_DICT], url, cache=other)
    assert isinstance(report, aotbuild.PullReport) and report.remote == url
    assert [i.status for i in report] == ["pulled"] and len(report) == 1 and report[0].job.key == keys[0]
    assert json.loads(json.dumps(report.as_json())) == {"remote": url, "jobs": [report[0].as_json()]}
    assert report.text().splitlines()[0].split() == ["job", "key", "status", "reason"]
    assert "pulled" in report.text().splitlines()[2] and not report.refused and not report.missing
    assert [i.status for i in aotbuild.pull([TINY_DICT], url, cache=other)] == ["cached"]


def _bare(fn) -> str:
    """``fn``'s signature as help() readers type it: no annotations."""
    sig = inspect.signature(fn)
    return str(sig.replace(parameters=[p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()],
                           return_annotation=inspect.Signature.empty))


def test_help_shows_load_compiled_build_and_plan_their_signatures_and_an_example_first():
    """``help(aotbuild)`` was 3,099 lines, ``load_compiled`` at line 2,990 after the exceptions'
    inherited methods (issue 55): its first 60 lines now hold the three functions with their real
    signatures (held to ``inspect.signature``) and an example that loads a recipe this repo has."""
    import pydoc

    from aotbuild.recipe.rules import load_recipe

    head = pydoc.render_doc(aotbuild, renderer=pydoc.plaintext).splitlines()[:60]
    flat = re.sub(r"\s+", " ", "\n".join(head))
    for name in ("load_compiled", "build", "plan"):
        assert f" {name}{_bare(getattr(aotbuild, name))}" in flat, name
    example = re.search(r'aotbuild\.load_compiled\("([^"]+)"', flat)
    assert example and "print(pipe.aotbuild_report)" in flat
    recipe = load_recipe(REPO / example[1])  # the repo's CPU recipe: the example runs here
    assert (recipe.target, recipe.device) == ("inductor", "cpu")


def test_a_clone_folder_named_aotbuild_shadows_the_install_and_the_readme_says_so(tmp_path):
    """A script run beside a clone named ``aotbuild/`` imports that folder (an empty namespace package)
    instead of the editable install the README's commands make; the README warns in the error's own words."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    where = subprocess.run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('aotbuild').origin)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True).stdout
    if "site-packages" in where:  # a regular install on sys.path wins over a namespace folder
        pytest.skip(f"aotbuild is installed into site-packages here ({where.strip()}): no folder shadows it")
    (tmp_path / "aotbuild" / "aotbuild").mkdir(parents=True)  # the clone, holding the package
    proc = subprocess.run([sys.executable, "-c", "from aotbuild import load_compiled"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    error = proc.stderr.strip().splitlines()[-1].removeprefix("ImportError: ")
    readme = re.sub(r"\s+", " ", (REPO / "README.md").read_text())
    assert error.startswith("cannot import name 'load_compiled' from 'aotbuild'") and error in readme, error
    assert "never from the folder that holds a clone named `aotbuild/`" in readme
