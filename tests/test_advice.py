"""Advice that works when followed (issue 55, item 2): every command aotbuild/advice.py makes, run in
the situation it was made for, reaches the cache and the remote of that situation (``plan --json``
standing in for a build); Python callers are told Python (``cache=``), shell users flags."""

from __future__ import annotations

import ast
import inspect
import json
import re
import shlex
import shutil

import pytest
import yaml

import aotbuild
from aotbuild import advice
from aotbuild.cache.layout import resolve_cache_root
from tests.conftest import TINY_DICT, invoke_cli


@pytest.fixture
def place(cache, tmp_path, monkeypatch):
    """A working folder holding ``tiny.yaml``, with ``cache`` as the default root (AOTBUILD_CACHE), a
    second root ``other`` (both with the tiny model: nothing is created while planning) and an empty
    folder remote."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiny.yaml").write_text(yaml.safe_dump(TINY_DICT))
    monkeypatch.chdir(work)
    monkeypatch.setenv("AOTBUILD_CACHE", str(cache))
    other = tmp_path / "other root"  # a space: the command must quote it
    shutil.copytree(cache / "models", other / "models")
    (tmp_path / "remote").mkdir()
    return {"default": cache, "other": other, "remote": f"file://{tmp_path / 'remote'}"}


def _situations(place) -> list[advice.Situation]:
    default, other, remote = place["default"], place["other"], place["remote"]
    return [advice.Situation(("tiny.yaml",), default), advice.Situation(("tiny.yaml",), other),
            advice.Situation(("tiny.yaml",), other, remote), advice.Situation(("tiny.yaml",), default, remote),
            advice.Situation((), default), advice.Situation((), other), advice.Situation((), other, remote),
            advice.Situation(("tiny.yaml",), other, pipe=True)]


def _run_shell(command: str) -> dict:
    """``aotbuild build ...`` as ``aotbuild plan --json ...`` (``--push URL``: ``--remote URL``), here."""
    words = shlex.split(command)
    assert words[:2] == ["aotbuild", "build"], command
    words = ["plan", "--json", *("--remote" if w == "--push" else w for w in words[2:])]
    proc = invoke_cli(*words)
    assert proc.returncode == 0, (command, proc.stderr)
    return json.loads(proc.stdout)


def _run_python(command: str) -> str:
    """``aotbuild.build(recipe, ...)`` checked against build's signature, then run as ``aotbuild.plan``
    with the same cache: the root it reads."""
    call = ast.parse(command, mode="eval").body
    assert isinstance(call, ast.Call) and ast.unparse(call.func) == "aotbuild.build", command
    assert [ast.unparse(a) for a in call.args] == ["recipe"], command
    names = {k.arg: ast.unparse(k.value) for k in call.keywords}
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg != "pipe"}
    inspect.signature(aotbuild.build).bind(TINY_DICT, **{**kwargs, **({"pipe": None} if "pipe" in names else {})})
    [job] = aotbuild.plan(TINY_DICT, cache=kwargs.get("cache"))
    assert job.status == "miss"
    return str(resolve_cache_root(kwargs.get("cache")))


def test_every_advice_command_reaches_the_cache_and_remote_of_its_situation(place):
    ran = 0
    for name, make in advice.COMMANDS.items():
        for situation in _situations(place):
            for voice in (False, True):
                if voice:
                    with advice.cli_voice():
                        command = make(situation)
                else:
                    command = make(situation)
                if situation.recipes and not situation.pipe:
                    out = _run_shell(command)
                    assert out["cache"] == str(situation.cache), (name, situation, command)
                    assert out["remote"] == (situation.remote or None), (name, situation, command)
                    assert ("--cache" in command) == (situation.cache != place["default"]), command
                else:
                    assert _run_python(command) == str(situation.cache), (name, situation, command)
                    assert ("cache=" in command) == (situation.cache != place["default"]), command
                    assert ("pipe=pipe" in command) == situation.pipe, command
                ran += 1
    assert ran == 2 * len(advice.COMMANDS) * len(_situations(place))


def test_a_load_with_cache_is_advised_a_build_into_that_cache_in_python_words(place):
    """``load_compiled(recipe, cache=X)`` said ``aotbuild build tiny_sd_cpu.yaml`` (the default cache: the
    next load missed again) and told a Python caller to "pass --cache"."""
    other = place["other"]
    with pytest.raises(aotbuild.CacheMiss) as info:
        aotbuild.load_compiled("tiny.yaml", cache=other, on_miss="error")
    text = str(info.value)
    assert "pass cache= or set AOTBUILD_CACHE" in text and "--cache or" not in text
    command = re.search(r"next: `([^`]+)` builds them here", text)[1]
    assert _run_shell(command)["cache"] == str(other)
    with pytest.warns(UserWarning) as warned:  # the warning of on_miss="compile" names the same command
        aotbuild.load_compiled("tiny.yaml", cache=other, remote=place["remote"])
    said = str(warned[-1].message)
    command = re.search(r"`(aotbuild build [^`]+)` builds them", said)[1]
    assert _run_shell(command) | {"jobs": None} == {"cache": str(other), "remote": place["remote"], "jobs": None}


def test_the_gate_says_neither_side_and_what_fixes_it(place):
    """``plan --remote URL --fail-on-miss`` explained a job on neither side as "the cache at X is
    empty"; it is "not in the cache, not on URL either", and its next line builds into that cache and
    pushes to that remote."""
    other, remote = place["other"], place["remote"]
    proc = invoke_cli("plan", "tiny.yaml", "--cache", str(other), "--remote", remote, "--fail-on-miss")
    assert proc.returncode == 3, proc.stderr
    [row] = [line for line in proc.stdout.splitlines() if line.startswith("tiny ")]
    assert row.endswith(f"miss    not in the cache, not on {remote} either"), row
    assert "is empty" not in proc.stdout
    command = re.search(r"^next: `([^`]+)` builds them into this cache and pushes them to ", proc.stdout, re.M)[1]
    out = _run_shell(command)
    assert (out["cache"], out["remote"]) == (str(other), remote)
    # and an empty cache without a remote, at a shell: flags
    proc = invoke_cli("plan", "tiny.yaml", "--cache", str(other))
    assert "(built into another? pass --cache or set AOTBUILD_CACHE)" in proc.stdout, proc.stdout
    [job] = aotbuild.plan("tiny.yaml", cache=other)  # in Python: the argument
    assert job.reason.startswith(f"not built: the cache at {other} is empty (built into another? pass cache= or")
