"""``aotbuild bench``: the table, the plot, its errors, and real fresh-process measurements."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from aotbuild.cli import bench
from aotbuild.cli.commands import main
from aotbuild.errors import UsageError
from aotbuild.recipe.rules import load_recipe
from aotbuild.recipe.schema import Shape
from tests.conftest import MAIN_RECIPE, REPO, TINY_RECIPE, invoke_cli, run_cli
from tests.standins import NEURON_BENCH_GROUP, neuron_bench


def report(repeats: int = 1) -> bench.BenchReport:
    r = bench.BenchReport("tiny", "tiny.yaml", "builtin:tiny-sd", "inductor", "jit-cache", "full", ["unet"],
                          "64x64", {"cpus": 2, "arch": "x86_64", "cpu_model": "Test CPU", "capability": "AVX2",
                                    "torch": "2.13.0", "python": "3.11", "device": "cpu"}, repeats, 3)
    r.runs = {"eager": [bench.Run(7.0 + i, 0.030, 390, 0, 0, 0) for i in range(repeats)],
              "cold": [bench.Run(70.0 + i, 0.025, 550, 1, 0, 1) for i in range(repeats)],
              "warm": [bench.Run(17.5 + i, 0.026, 500, 1, 1, 0) for i in range(repeats)]}
    return r


def test_table_shows_min_median_max_cache_counters_and_ratios():
    text = report(repeats=3).text()
    lines = text.splitlines()
    assert "2 CPUs, Test CPU, ISA AVX2, torch 2.13.0" in text
    assert "3 fresh process(es) per mode; times are min / median / max" in text
    cold = next(x for x in lines if x.startswith("cold compile"))
    assert "70.00 / 71.00 / 72.00 s" in cold and "25.0 ms" in cold and "550 MB" in cold and "0 hit, 1 miss" in cold
    warm = next(x for x in lines if x.startswith("aotbuild warm load"))
    assert "17.50 / 18.50 / 19.50 s" in warm and "1 hit, 0 miss" in warm
    assert "warm load / cold compile   = 0.261  (saves 52.5 s per fresh process)" in text
    assert "warm load / eager          = 2.312" in text


def test_json_has_every_run_and_the_medians():
    data = report(repeats=3).as_json()
    assert len(data["runs"]["cold"]) == 3 and data["medians"]["warm"]["first"] == 18.5
    assert data["spread"]["eager"]["first"] == {"min": 7.0, "median": 8.0, "max": 9.0}
    assert data["repeats"] == 3 and data["cold_repeats"] == 1
    assert data["ratios"]["warm load / cold compile"] == pytest.approx(18.5 / 71.0)
    json.dumps(data)


def test_cold_once_by_default_is_said_per_mode():
    r = report(repeats=3)
    r.runs["cold"] = r.runs["cold"][:1]
    text = r.text()
    assert "fresh processes: 3 eager, 1 cold, 3 warm" in text
    cold = next(x for x in text.splitlines() if x.startswith("cold compile"))
    assert " 70.00 s" in cold and "/" not in cold.split("70.00 s")[0].split("cold compile")[1]


def test_defaults_three_processes_for_eager_and_warm_one_cold(monkeypatch, tmp_path):
    """The parent's loop, with the child and the build faked: who runs how often, in which order."""
    import aotbuild.builder.build

    ran = []

    def fake_child(mode, recipe, index, root, calls, workdir):
        ran.append(mode)
        return bench.Run(1.0, 0.01, 100, 0, 0, 0), {"cpus": 2}

    class Built:
        results, failed = [], []

    monkeypatch.setattr(bench, "_run_child", fake_child)
    monkeypatch.setattr(aotbuild.builder.build, "build", lambda *a, **k: Built())
    monkeypatch.setattr(bench, "load_warning", lambda: "warning: busy")
    warned = []
    r = bench.bench(TINY_RECIPE, tmp_path / "c", warn=warned.append)
    assert ran == ["eager", "cold", "warm", "eager", "warm", "eager", "warm"]
    assert {m: len(v) for m, v in r.runs.items()} == {"eager": 3, "cold": 1, "warm": 3}
    assert warned == ["warning: busy"]
    ran.clear()
    bench.bench(TINY_RECIPE, tmp_path / "c", repeats=1, cold_repeats=2, modes=("eager", "cold"))
    assert ran == ["eager", "cold", "cold"]


def test_the_header_of_a_recipe_naming_no_strategy_says_what_auto_chose(monkeypatch, tmp_path):
    """A recipe naming no strategy (the README's main job): the header names the strategy auto chose for
    the shape's entry, as `aotbuild plan` does, not a bare "auto"; before its entry is built, "auto"."""
    import dataclasses

    import aotbuild.builder.build
    import aotbuild.planner

    class Built:
        results, failed = [], []

    monkeypatch.setattr(bench, "_run_child", lambda *a: (bench.Run(1.0, 0.01, 100, 0, 0, 0), {"cpus": 2}))
    monkeypatch.setattr(aotbuild.builder.build, "build", lambda *a, **k: Built())
    assert "strategy" not in yaml.safe_load(MAIN_RECIPE.read_text())
    report = bench.bench(MAIN_RECIPE, tmp_path / "c", repeats=1, modes=("eager",))
    assert report.strategy == "auto" and ", auto" in report.text().splitlines()[0]
    real = aotbuild.planner.plan

    def built(recipes, **options):  # the shape's entry stored by auto as aot-package+freezing
        return [dataclasses.replace(j, status=aotbuild.planner.JobStatus.HIT, chosen="aot-package+freezing")
                for j in real(recipes, **options)]

    monkeypatch.setattr(aotbuild.planner, "plan", built)
    report = bench.bench(MAIN_RECIPE, tmp_path / "c", repeats=1, modes=("eager",))
    assert report.strategy == "auto: aot-package+freezing", report.strategy
    assert ", auto: aot-package+freezing" in report.text().splitlines()[0]
    assert bench.bench(TINY_RECIPE, tmp_path / "c", repeats=1, modes=("eager",)).strategy == "jit-cache"


@pytest.mark.parametrize(("load", "cores", "warns"), [(1.2, 2, True), (0.9, 2, False), (3.0, 8, False)])
def test_a_busy_machine_is_warned_about(monkeypatch, load, cores, warns):
    monkeypatch.setattr(bench.os, "getloadavg", lambda: (load, 0.0, 0.0))
    monkeypatch.setattr(bench.os, "cpu_count", lambda: cores)
    line = bench.load_warning()
    assert bool(line) is warns
    if warns:
        assert line.startswith(f"warning: the load average is {load:.1f} on {cores} cores") and "\n" not in line


def test_ratios_only_for_measured_modes():
    r = report()
    del r.runs["cold"]
    labels = [label for label, _, _ in r.ratios()]
    assert labels == ["warm load / eager", "warm steady / eager steady"]


def test_plot_writes_a_png(tmp_path):
    out = bench.plot(report(repeats=3), tmp_path / "sub" / "bench.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_matplotlib_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(UsageError, match=r"pip install 'aotbuild\[plot\]'"):
        bench.plot(report(), tmp_path / "b.png")
    # The CLI checks before measuring anything: it fails at once and builds nothing.
    result = CliRunner().invoke(main, ["bench", str(TINY_RECIPE), "--plot", str(tmp_path / "b.png")])
    assert result.exit_code == 2 and "aotbuild[plot]" in result.output
    assert "round 1/1" not in result.output and not (tmp_path / "aotcache").exists()  # nothing ran or was built


def test_the_plot_install_hint_reads_the_same_everywhere():
    """The README, the docs and the CLI's message give the same command (an extra, then a clone's)."""
    import re

    hint = "`pip install 'aotbuild[plot]'` (from a clone: `pip install -e '.[plot]'`)"
    assert bench.PLOT_INSTALL == hint.replace("`", "")
    for doc in ("README.md", "docs/cli.md", "docs/quickstart.md"):
        text = " ".join((REPO / doc).read_text().split())
        assert hint in text, doc
        assert len(re.findall(r"aotbuild\[plot\]", text)) == text.count(hint), doc


sizes = st.integers(min_value=1, max_value=10**6)
labelled = st.builds(Shape, sizes, sizes, sizes, st.none() | sizes)


@settings(max_examples=300, deadline=None)
@given(labelled)
def test_a_shape_label_reads_back_as_the_shape(shape):
    """Shape.parse is the exact inverse of the label every command prints (with and without frames and
    batch): a label of three numbers that could be a batch or frames was the bug (issue 30)."""
    assert Shape.parse(str(shape)) == shape
    assert Shape.parse(str(shape).upper()) == shape


@pytest.mark.parametrize("text,expected", [
    ("64x96", Shape(64, 96)), ("64X64b2", Shape(64, 64, 2)), ("9x64x64", Shape(64, 64, 1, 9)),
    (" 9x64x96B3 ", Shape(64, 96, 3, 9)),
])
def test_parse_shape(text, expected):
    assert Shape.parse(text) == expected


@pytest.mark.parametrize("text", ["64", "64x", "axb", "64x64x2x1", "0x64", "64x64b0", "64x64b", "b2x64x64",
                                  "-8x64", "\u0663x8", "64x64x"])
def test_bad_shape_text(text):
    with pytest.raises(UsageError, match=r"^--shape '.*' is not a shape: "):
        bench.pick_shape(load_recipe(TINY_RECIPE), text)


def test_shape_not_in_the_recipe_names_the_recipes_shapes():
    recipe = load_recipe(TINY_RECIPE)
    assert str(bench.pick_shape(recipe, "64x96")) == "64x96"
    with pytest.raises(UsageError, match=r"its shapes: 64x64, 64x96\); add it to the recipe"):
        bench.pick_shape(recipe, "128x128")


@pytest.mark.parametrize("name", ["tiny_wan_cpu", "tiny_sd_cpu"])
def test_every_shape_a_built_in_recipe_prints_is_one_bench_takes(name):
    """What plan and the report print for a shape is what --shape takes: `--shape 9x64x64` on the Wan
    recipe was refused as height 9, width 64, batch 64."""
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    assert [bench.pick_shape(recipe, str(s)) for s in recipe.shapes] == list(recipe.shapes)


def test_bad_mode_is_a_usage_error():
    proc = run_cli("bench", str(TINY_RECIPE), "--modes", "eager,hot")
    assert proc.returncode == 2 and "--modes: hot: allowed: eager, cold, warm" in proc.stderr


@pytest.mark.slow  # compiles for real
def test_real_eager_and_warm_load_in_fresh_processes(built_cache):
    """On the tiny recipe built for real: the warm process takes its kernels from the aotbuild
    cache (an FX graph cache hit, no miss) with an empty Inductor cache; nothing is rebuilt. bench's
    own process is this one: its promise is a fresh process per mode, which it still starts, and a CLI
    process of its own only imported torch and diffusers again."""
    root, _ = built_cache
    proc = invoke_cli("bench", "--json", "--cache", str(root), str(TINY_RECIPE), "--modes", "eager,warm",
                      "--calls", "1", "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(proc.stdout)
    assert data["built"] == []  # everything was cached
    eager, warm = data["runs"]["eager"][0], data["runs"]["warm"][0]
    assert eager["graphs"] == 0 and eager["cache_hits"] == 0
    assert warm["cache_hits"] >= 1 and warm["cache_misses"] == 0
    assert warm["first"] > 0 and eager["steady"] > 0 and data["machine"]["cpus"] >= 1
    assert "round 1/1: aotbuild warm load in a fresh process" in proc.stderr


@pytest.fixture
def bench_run(tmp_path_factory, models_dir) -> dict:
    return neuron_bench(tmp_path_factory, models_dir)


@pytest.mark.slow  # builds and proves through the stand-in
@pytest.mark.xdist_group(NEURON_BENCH_GROUP)
def test_standin_target_builds_what_is_missing_then_measures_all_three(bench_run):
    """Through the Neuron stand-in (a fast compile): bench builds the missing job first, the cold
    process compiles, and the table names every mode. The run is tests/standins.py's ``neuron_bench``:
    tests/test_targets.py reads the entry it built, instead of building the same one again."""
    proc = bench_run
    assert proc["returncode"] == 0, proc["stderr"][-3000:]
    assert "building 1 job(s) the cache lacks for 32x32 first" in proc["stderr"]
    for label in ("eager (no compile)", "cold compile", "aotbuild warm load", "warm load / cold compile"):
        assert label in proc["stdout"]
    assert "Inductor FX cache" not in proc["stdout"]  # Inductor's counters say nothing about another backend
    # only the job of the shape asked for was built (the warm load above hit it); read in this process
    # (no stand-in imported: ls reads manifests only), not by a plan in a third fresh interpreter
    entries = json.loads(invoke_cli("ls", "--json", "--cache", proc["cache"]).stdout)["entries"]
    assert [(e["shape"]["height"], e["shape"]["width"], e["target"]) for e in entries] == [(32, 32, "neuron")]


def test_a_failing_child_sends_its_whole_error_back(monkeypatch, tmp_path):
    """A CacheMiss spans lines: the child sends it whole, on one line of its result, for the parent to show."""
    from aotbuild.builder import child as protocol
    from aotbuild.errors import CacheMiss

    def miss(*args):
        raise CacheMiss("aotbuild: tiny: 0 hit, 1 miss\n  MISS unet 64x64 ab12  not built: shape.height\n  next: build")

    monkeypatch.setattr(bench, "_measure", miss)
    spec = tmp_path / "bench.json"
    spec.write_text(json.dumps({"mode": "warm", "recipe": {}, "index": 0, "cache": "/c", "calls": 1, "start": 0.0,
                                "result": str(tmp_path / "result.json")}))
    assert protocol.main([str(spec)], bench.child) == 1
    assert protocol.read_result(tmp_path / "result.json") == {
        "error": "aotbuild: tiny: 0 hit, 1 miss MISS unet 64x64 ab12 not built: shape.height next: build"}
