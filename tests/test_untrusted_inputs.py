"""What a pull request's model folder or pyproject.toml can do: nothing it should.

A model folder is data inside its folder (no symlink out, plain component names, only diffusers and
transformers imported, bounded JSON; miss reasons never print a secret), and configuration from the
repo cannot reach outside it (a cache root in pyproject.toml stays in its folder, its max_size
never shrinks a cache named on the command line, ``verify --fix`` deletes only what aotbuild wrote).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from aotbuild.errors import UsageError
from tests import manifests
from tests.conftest import MAIN_RECIPE, invoke_cli, run_cli

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
RECIPE = ("model: {{id: {model}, dtype: float32}}\nshapes: [{{height: 64, width: 64}}]\n"
          "warmup: {{guidance_scale: 0.0}}\n")


@pytest.fixture
def model_folder(models_dir, tmp_path) -> Path:
    """A copy of the built-in tiny SD pipeline as a pull request's local model folder, with a recipe."""
    folder = tmp_path / "pr" / "model"
    shutil.copytree(next((models_dir / "models").glob("tiny-sd-v*")), folder)
    (tmp_path / "pr" / "r.yaml").write_text(RECIPE.format(model="./model"))
    return folder


def plan_json(recipe: Path, cache: Path) -> tuple[int, dict, str]:
    proc = invoke_cli("plan", "--json", "--cache", str(cache), str(recipe))
    return proc.returncode, json.loads(proc.stdout) if proc.stdout.strip() else {}, proc.stderr


def test_a_config_symlinked_outside_the_model_folder_is_never_read(model_folder, tmp_path):
    """git keeps symlinks: unet/config.json -> a credentials file elsewhere was read as the config and
    plan's miss reason printed its values; a build copied them into <cache>/logs/."""
    secrets = tmp_path / "aws.json"
    secrets.write_text(json.dumps({"Credentials": {"SecretAccessKey": SECRET}}))
    (model_folder / "unet" / "config.json").unlink()
    (model_folder / "unet" / "config.json").symlink_to(secrets)
    code, out, err = plan_json(model_folder.parent / "r.yaml", tmp_path / "cache")
    assert code == 0 and [j["status"] for j in out["jobs"]] == ["unavailable"]
    assert "links outside the model folder" in out["jobs"][0]["reason"]
    assert SECRET not in json.dumps(out) + err and "Traceback" not in err
    proc = run_cli("build", "--cache", str(tmp_path / "cache"), str(model_folder.parent / "r.yaml"))
    assert SECRET not in proc.stdout + proc.stderr
    logs = tmp_path / "cache" / "logs"
    assert not logs.exists() or all(SECRET not in p.read_text(errors="replace") for p in logs.rglob("*"))


def test_a_weights_file_linked_outside_is_refused_too(model_folder, tmp_path):
    weights = next((model_folder / "unet").glob("*.safetensors"))
    outside = tmp_path / "elsewhere.safetensors"
    shutil.move(str(weights), outside)
    weights.symlink_to(outside)
    code, out, _ = plan_json(model_folder.parent / "r.yaml", tmp_path / "cache")
    assert "links outside the model folder" in out["jobs"][0]["reason"]
    (model_folder / "unet" / "inside.safetensors").symlink_to("diffusion_pytorch_model.safetensors")
    weights.unlink()
    shutil.move(str(outside), weights)  # a link that stays inside the folder is fine
    code, out, _ = plan_json(model_folder.parent / "r.yaml", tmp_path / "cache")
    assert out["jobs"][0]["status"] == "miss", out


@pytest.mark.parametrize("component,library", [("../../x", "diffusers"), ("unet", "aotbuild_planted_marker")])
def test_model_index_names_only_plain_components_of_diffusers_and_transformers(model_folder, tmp_path,
                                                                                monkeypatch, component, library):
    """A model_index.json whose library was any installed module made plan import it (one ran a GUI demo)."""
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "aotbuild_planted_marker.py").write_text(
        f"import pathlib; pathlib.Path({str(tmp_path / 'marker')!r}).write_text('imported')\n"
        "class UNet2DConditionModel: _repeated_blocks = ['X']\n")
    monkeypatch.syspath_prepend(str(planted))
    index = json.loads((model_folder / "model_index.json").read_text())
    index[component] = [library, "UNet2DConditionModel"]
    (model_folder / "model_index.json").write_text(json.dumps(index))
    from aotbuild import plan
    from aotbuild.recipe.rules import load_recipe

    recipe = load_recipe(model_folder.parent / "r.yaml")
    jobs = plan([recipe], tmp_path / "cache")
    assert jobs[0].status == "unavailable"
    assert ("plain names" if "/" in component else "loads components of diffusers and transformers only") \
        in jobs[0].reason
    assert not (tmp_path / "marker").exists() and "aotbuild_planted_marker" not in sys.modules


@pytest.mark.parametrize("text,says", [
    ("[" * 200_000 + "]" * 200_000, "nested more than 64 levels"),
    ('{"in_channels": NaN}', "NaN is not JSON"),
    ('{"a": Infinity}', "Infinity is not JSON"),
])
def test_a_config_json_is_read_with_bounded_work_in_one_line(model_folder, tmp_path, text, says):
    (model_folder / "unet" / "config.json").write_text(text)
    code, out, err = plan_json(model_folder.parent / "r.yaml", tmp_path / "cache")
    assert code == 0 and out["jobs"][0]["status"] == "unavailable" and says in out["jobs"][0]["reason"]
    assert "Traceback" not in err


def test_a_recipe_component_is_a_plain_name():
    from aotbuild.errors import RecipeError
    from aotbuild.recipe.rules import parse_recipe

    with pytest.raises(RecipeError, match="compile.components: '../../x' is not a component name"):
        parse_recipe({"model": "builtin:tiny-sd", "compile": {"components": ["../../x"]},
                      "shapes": [{"height": 64, "width": 64}]})


def test_a_miss_reason_names_what_differs_and_prints_no_secret():
    from aotbuild.keys import differences

    lines = differences({"component": {"config": {"Credentials": {"SecretAccessKey": SECRET}, "layers": 2,
                                                  "token": "short", "note": "x" * 100}}},
                        {"component": {"config": {"Credentials": {"SecretAccessKey": "other"}, "layers": 3,
                                                  "token": "other", "note": "y" * 100}}})
    text = "\n".join(lines)
    assert "component.config.Credentials.SecretAccessKey: a value of 40 characters in the cache" in text
    assert "component.config.layers: 2 in the cache, 3 here" in text  # short, plain: shown
    assert "component.config.token: a value of 5 characters" in text  # a secret's key name: never shown
    assert "component.config.note: a value of 100 characters" in text and SECRET not in text
    assert differences({"a\n::error::x": 1}, {"a\n::error::x": 2}) == ["a\\n::error::x: 1 in the cache, 2 here"]


# -- pyproject.toml ---------------------------------------------------------------------------------

def _project(tmp_path: Path, body: str) -> Path:
    project = tmp_path / "checkout"
    project.mkdir(exist_ok=True)
    (project / "pyproject.toml").write_text(body)
    return project


@pytest.mark.parametrize("value", ["/", "..", "../elsewhere", "~/cache", "sub/../../x", "."])
def test_a_cache_root_from_pyproject_must_stay_inside_its_folder(tmp_path, monkeypatch, value):
    from aotbuild.cache.layout import resolve_cache_root

    project = _project(tmp_path, f'[tool.aotbuild]\ncache = "{value}"\n')
    monkeypatch.delenv("AOTBUILD_CACHE", raising=False)
    with pytest.raises(UsageError, match="is not a folder inside .*--cache or AOTBUILD_CACHE"):
        resolve_cache_root(start=project)
    proc = run_cli("verify", "--fix", env={"AOTBUILD_CACHE": ""}, cwd=project)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_a_cache_root_inside_the_project_and_one_named_on_the_command_line_are_fine(tmp_path, monkeypatch):
    from aotbuild.cache.layout import resolve_cache_root

    project = _project(tmp_path, '[tool.aotbuild]\ncache = "build/aot-cache"\n')
    monkeypatch.delenv("AOTBUILD_CACHE", raising=False)
    assert resolve_cache_root(start=project) == project / "build" / "aot-cache"
    _project(tmp_path, '[tool.aotbuild]\ncache = "/"\n')
    assert resolve_cache_root("/srv/shared", start=project) == Path("/srv/shared")  # the operator's choice


@pytest.mark.parametrize("body", ["x = " + "[" * 100_000 + "]" * 100_000 + "\n", "[tool.aotbuild\n",
                                  "x = 1\n" * 200_000])
def test_a_hostile_pyproject_is_one_line(tmp_path, body):
    project = _project(tmp_path, body)
    proc = run_cli("plan", str(MAIN_RECIPE), env={"AOTBUILD_CACHE": ""}, cwd=project)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "pyproject.toml" in proc.stderr, proc.stderr


def test_max_size_from_pyproject_never_shrinks_a_cache_named_on_the_command_line(tmp_path, monkeypatch):
    """CI's routine `gc --stale --cache SHARED` with a PR's max_size = "1" removed every entry (since issue
    55 a size needs its unit: "1B")."""
    from aotbuild.cache.layout import resolve_max_size
    from aotbuild.cache.store import Store

    project = _project(tmp_path, '[tool.aotbuild]\ncache = "cache"\nmax_size = "1B"\n')
    monkeypatch.delenv("AOTBUILD_MAX_SIZE", raising=False)
    assert resolve_max_size(start=project) is None  # gc, and a build into another cache
    assert resolve_max_size(start=project, project=True) == 1  # a build into the project's own cache
    shared = tmp_path / "shared"
    store = Store(shared)
    key = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    proc = run_cli("gc", "--cache", str(shared), env={"AOTBUILD_CACHE": "", "AOTBUILD_MAX_SIZE": ""}, cwd=project)
    assert proc.returncode == 2 and "say what to collect" in proc.stderr  # pyproject's max_size is not a limit
    assert store.layout.manifest(key).is_file()


def test_verify_fix_deletes_only_what_aotbuild_wrote(tmp_path):
    """A cache root pointed at a folder that holds other files: verify reports them, --fix leaves them."""
    from aotbuild.cache.store import Store

    root = tmp_path / "root"
    store = Store(root)
    key = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    store.layout.tmp.mkdir(parents=True, exist_ok=True)
    theirs = [store.layout.tmp / "notes.txt", store.layout.tmp / "ssh-agent.sock", store.layout.blobs / "ab" / "x",
              store.layout.manifests / "zz" / "readme.json"]
    for path in theirs:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("not aotbuild's")
    ours = store.layout.tmp / "w.abc123xy"  # a dead writer's temp file: aotbuild's own name
    ours.write_text("leftover")
    proc = invoke_cli("verify", "--fix", "--json", "--cache", str(root))
    data = json.loads(proc.stdout)
    assert proc.returncode == 1 and all(p.exists() for p in theirs) and not ours.exists()
    assert sorted(p["path"] for p in data["remaining"]) == sorted(map(str, theirs))
    assert {p["kind"] for p in data["remaining"]} == {"foreign"} and store.open_entry(key)[0] is not None
    assert os.path.exists(store.layout.manifest(key))


# -- output that cannot inject --------------------------------------------------------------------

def test_a_recipe_file_name_cannot_print_a_ci_workflow_command(models_dir, tmp_path):
    """GitHub Actions runs `::error::...` lines of a job's output as commands; an OSC escape drives the terminal."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "x\n::error::pwned\x1b]0;title\x07.yaml").write_text(RECIPE.format(model="builtin:tiny-sd"))
    proc = invoke_cli("plan", "--cache", str(models_dir), str(folder))
    assert proc.returncode == 0, proc.stderr
    lines = (proc.stdout + proc.stderr).splitlines()
    assert not any(line.startswith("::") for line in lines) and "\x1b" not in proc.stdout + proc.stderr
    assert "x\\n::error::pwned\\x1b]0;title\\x07" in proc.stdout
    data = json.loads(invoke_cli("plan", "--json", "--cache", str(models_dir), str(folder)).stdout)
    assert data["jobs"][0]["recipe"] == "x\\n::error::pwned\\x1b]0;title\\x07"  # --json stays JSON


def test_a_manifest_field_with_control_characters_is_malformed_and_build_fields_are_escaped(tmp_path):
    from aotbuild.cache.store import Store

    store = Store(tmp_path / "c")
    key = manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    data = json.loads(store.layout.manifest(key).read_text())
    data["build"]["created"] = "2026\x1b]0;owned\x07\n::error::x"
    manifests.write_raw(store, key, data)
    shown = invoke_cli("show", "--cache", str(store.root), key[:12])
    assert shown.returncode == 0 and "\x1b" not in shown.stdout
    assert not any(line.startswith("::") for line in shown.stdout.splitlines())
    data["recipe"] = "r\n::error::x"
    manifests.write_raw(store, key, data)
    entry, why = store.open_entry(key)
    assert entry is None and "recipe: holds control characters" in why
    listed = invoke_cli("ls", "--cache", str(store.root))
    assert "0 entries" in listed.stdout and not any(line.startswith("::") for line in listed.stdout.splitlines())


# -- signals ------------------------------------------------------------------------------------------

@pytest.mark.slow  # a real build job, interrupted
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGHUP"])
def test_sigterm_and_sighup_stop_a_build_as_ctrl_c_does(models_dir, tmp_path, signame):
    """What a CI runner sends on cancel: the worker was orphaned and kept running, tmp/job-* stayed."""
    import signal
    import subprocess
    import time

    cache = tmp_path / "cache"
    shutil.copytree(models_dir / "models", cache / "models")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(RECIPE.format(model="builtin:tiny-sd"))
    proc = subprocess.Popen([sys.executable, "-m", "aotbuild.cli", "build", "--cache", str(cache), str(recipe)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "AOTBUILD_CACHE": "", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "i")})
    deadline = time.time() + 120
    while time.time() < deadline and not list((cache / "tmp").glob("job-*/worker.log")):
        time.sleep(0.2)
    assert list((cache / "tmp").glob("job-*")), "the job never started"
    time.sleep(2)  # the worker is loading the pipeline
    proc.send_signal(getattr(signal, signame))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and f"interrupted ({signame})" in err, err[-2000:]
    workers = subprocess.run(["pgrep", "-f", str(cache / "tmp")], capture_output=True, text=True).stdout.split()
    assert workers == []  # no orphaned worker, no loader (aotbuild/builder/loader.py)
    assert not list((cache / "tmp").glob("job-*")) and not list((cache / "tmp").glob("load.*"))
    assert run_cli("verify", "--cache", str(cache)).returncode == 0


@pytest.mark.parametrize("served,eager,says", [
    (float("nan"), float("nan"), "eager output holds NaN or Inf"),
    (float("inf"), 1.0, "served NaN or Inf where eager's output is finite"),
])
def test_the_proof_fails_on_nan_or_inf(served, eager, says):
    """With sigmas [1e308, 1e308] both outputs were NaN and the proof recorded a difference of 0.0."""
    import torch

    from aotbuild.builder.proof import _replay

    module = lambda *a, **k: torch.full((2,), served)  # noqa: E731 - the served component
    with pytest.raises(RuntimeError, match=says):
        _replay(module, "unet", [((), {}, [torch.full((2,), eager)])], lambda: None)
    assert _replay(lambda *a, **k: torch.ones(2), "unet", [((), {}, [torch.ones(2)])], lambda: None) == 0.0


# -- bounded work -------------------------------------------------------------------------------------

@pytest.mark.parametrize("over,key,variable", [
    ({"warmup": {"num_inference_steps": 1_000_000}}, "warmup.num_inference_steps", "AOTBUILD_MAX_STEPS"),
    ({"warmup": {"prompt": ["a cat"] * 65}}, "warmup.prompt", "AOTBUILD_MAX_PROMPTS"),  # 99,000: over the batch too
    ({"shapes": [{"height": 8 * (i + 1), "width": 64} for i in range(65)]}, "shapes", "AOTBUILD_MAX_SHAPES"),
    ({"compile": {"components": ["unet", "vae", "text_encoder", "a", "b"]},
      "shapes": [{"height": 8 * (i + 1), "width": 64} for i in range(60)]}, "compile.components", "AOTBUILD_MAX_JOBS"),
])
def test_the_work_a_recipe_asks_for_is_bounded_and_the_operator_can_raise_it(monkeypatch, over, key, variable):
    from aotbuild.errors import RecipeError
    from aotbuild.recipe.rules import parse_recipe

    data = {"model": "builtin:tiny-sd", "shapes": [{"height": 64, "width": 64}], **over}
    with pytest.raises(RecipeError) as info:
        parse_recipe(data)
    assert info.value.key == key and variable in info.value.message
    monkeypatch.setenv(variable, "10000000")
    parse_recipe(data)  # the operator's choice


def test_a_child_past_its_time_limit_is_killed_with_the_reason(tmp_path):
    from aotbuild.builder import child

    planted = tmp_path / "pp"
    planted.mkdir()
    (planted / "aotbuild_slow_child.py").write_text("import time\ntime.sleep(60)\n")
    code, result = child.spawn("aotbuild_slow_child", {}, tmp_path / "c" / "spec.json", tmp_path / "c" / "log",
                               env={"PYTHONPATH": str(planted)}, name="worker", timeout=1)
    assert code != 0 and "worker ran past its time limit of 1 s (AOTBUILD_JOB_TIMEOUT" in result["error"]


def test_explaining_a_miss_compares_a_bounded_number_of_entries(monkeypatch):
    """plan cost jobs x entries full comparisons (1,000 shapes against 501 entries: 96 s)."""
    from aotbuild import keys
    from aotbuild.cache import explain

    entries = [manifests.manifest(manifests.factors(f"v{i}"), recipe="other") for i in range(600)]
    index = explain.Entries(entries)
    flattened = []
    real = keys.flatten
    monkeypatch.setattr(keys, "flatten", lambda f, prefix="": (prefix or flattened.append(1)) and 0 or real(f, prefix))
    diffs = []
    real_diff = keys.differences
    monkeypatch.setattr(keys, "differences", lambda a, b: diffs.append(1) or real_diff(a, b))
    for _ in range(50):  # 50 misses
        assert explain.explain_miss(index, "mine", "unet", manifests.factors("x")).startswith("not built")
    assert len(diffs) == 50  # one full difference per miss, against its nearest entry only
    assert len(flattened) == 50 * 3  # per miss: the job's factors, and differences' two; entries once, at the index


# -- hostile files in a store or a repository: one line, never a traceback or a hang (aotbuild/utils/safeio.py) ----

def _invoke(*args: str):
    """An aotbuild command in this process (click's CliRunner): (exit code, stdout, stderr); an exception
    the command did not turn into an exit code is raised (a subprocess would print its traceback)."""
    import signal

    from click.testing import CliRunner

    from aotbuild.cli.commands import main

    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM))}
    try:
        result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result.exit_code, result.stdout, result.stderr


def test_a_deeply_nested_failure_record_is_ignored_by_plan(cache):
    from aotbuild.cache.layout import Layout
    from tests.conftest import TINY_RECIPE

    code, out, _ = _invoke("plan", "--json", "--cache", str(cache), str(TINY_RECIPE))
    keys = [job["key"] for job in json.loads(out)["jobs"]]
    assert code == 0 and keys
    deep = '{"reason": "x", "more": ' + "[" * 20_000 + "]" * 20_000 + "}"  # under the 64 KiB cap
    for key in keys:
        path = Layout(cache).failure(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(deep)
    code, out, err = _invoke("plan", "--json", "--cache", str(cache), str(TINY_RECIPE))
    assert "Traceback" not in out + err and "RecursionError" not in out + err
    assert code == 0 and {job["status"] for job in json.loads(out)["jobs"]} != {"failed"}  # not a failure record


def _fifo_guard(fifo: Path):
    """A hang guard for a reader of ``fifo`` in this process, not a speed threshold: if the reader is
    still blocked after 60 s, a writer opens and closes the FIFO (the reader gets EOF, the test ends)
    and ``released`` is set, which the test asserts is not."""
    import threading

    done, released = threading.Event(), threading.Event()

    def release() -> None:
        if not done.wait(60):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                released.set()

    guard = threading.Thread(target=release, daemon=True)
    guard.start()

    @contextlib.contextmanager
    def guarded():
        try:
            yield released
        finally:
            done.set()
            guard.join()

    return guarded()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_at_the_reclaimed_log_does_not_hang_verify(tmp_path):
    from aotbuild.cache.layout import Layout
    from aotbuild.cache.store import Store

    store = Store(tmp_path / "root")
    manifests.add_entry(store, tmp_path / "src", "a", {"x.so": b"kernel"})
    log = Layout(store.root).reclaimed_log
    log.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(log)
    with _fifo_guard(log) as released:  # before, verify waited for a writer forever
        code, out, err = _invoke("verify", "--json", "--cache", str(store.root))
    assert not released.is_set(), "verify --json blocked on a FIFO at logs/reclaimed.jsonl"
    assert "Traceback" not in err and json.loads(out)["notes"] == []


def _safetensors(path: Path, header: str, data: bytes) -> Path:
    import struct

    path.parent.mkdir(parents=True, exist_ok=True)
    raw = header.encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def test_a_lora_file_with_a_deeply_nested_header_is_one_line(cache, tmp_path):
    repo = tmp_path / "repo"
    deep = '{"unet.a.lora_A.weight": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}, "x": ' \
           + "[" * 100_000 + "]" * 100_000 + "}"
    _safetensors(repo / "loras" / "deep" / "pytorch_lora_weights.safetensors", deep, b"\0" * 128)
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    (repo / "r.yaml").write_text(RECIPE.format(model="builtin:tiny-sd")
                                 + "lora: {rank: 8, adapters: [{path: loras/deep, adapter_name: deep}]}\n")
    code, out, err = _invoke("plan", "--cache", str(cache), str(repo / "r.yaml"))
    assert "Traceback" not in out + err and "RecursionError" not in out + err
    assert code == 2 and "nested more than 8 levels deep" in err
    assert len([line for line in err.splitlines() if "safetensors" in line]) == 1


def test_a_truncated_lora_file_is_refused_when_it_is_read(tmp_path):
    """safetensors itself checks the header against the file it was handed: data cut short is refused
    when the recipe is planned, not when the adapter is loaded (docs/security.md)."""
    from aotbuild.features import lora as adapters

    header = '{"unet.a.lora_A.weight": {"dtype": "F32", "shape": [4, 8], "data_offsets": [0, 128]}}'
    whole = _safetensors(tmp_path / "whole.safetensors", header, b"\0" * 128)
    assert adapters.read(whole).rank == 4
    cut = _safetensors(tmp_path / "cut.safetensors", header, b"\0" * 100)
    with pytest.raises(UsageError, match="cannot read its safetensors header"):
        adapters.read(cut)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_named_as_a_trusted_key_is_one_line_not_a_hang(tmp_path):
    from aotbuild.cache.signing import load_trusted

    fifo = tmp_path / "ci.pub"
    os.mkfifo(fifo)
    with _fifo_guard(fifo) as released:  # before, open() waited for a writer forever
        with pytest.raises(UsageError, match="ci.pub") as info:
            load_trusted([fifo])
    assert not released.is_set() and "\n" not in str(info.value)


def test_a_deeply_nested_call_signature_is_a_value_error_not_a_recursion_error():
    from aotbuild.dispatch import describe

    with pytest.raises(ValueError):  # a manifest's signature may be any string of 4096 characters
        describe("[" * 4096)
