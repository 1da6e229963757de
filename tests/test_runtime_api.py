"""load_compiled's argument checks, unreachable models and remotes, and the recompile limit."""

from __future__ import annotations

import json

import pytest
import torch

from aotbuild import UsageError, load_compiled
from aotbuild.recipe.rules import load_recipe, parse_recipe
from tests.conftest import TINY_RECIPE, run_cli


def test_bad_remote_url_is_a_usage_error():
    with pytest.raises(UsageError, match="is not a remote: use file:///"):
        load_compiled(TINY_RECIPE, remote="ftp://bucket/cache")  # s3:// is a remote since issue 35


def test_on_miss_must_be_known():
    with pytest.raises(UsageError, match="on_miss='sometimes' is not allowed"):
        load_compiled(TINY_RECIPE, on_miss="sometimes")


@pytest.fixture(scope="module")
def tiny_pipe(models_dir):
    from aotbuild.pipeline.models import load_pipeline, resolve_model

    recipe = load_recipe(TINY_RECIPE)
    return load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")


def test_passed_pipe_with_wrong_dtype_is_refused(tiny_pipe, models_dir, tmp_path):
    recipe = tmp_path / "bf16.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("dtype: float32", "dtype: bfloat16"))
    with pytest.raises(UsageError, match="unet is float32 but .* says bfloat16"):
        load_compiled(recipe, tiny_pipe, cache=models_dir)


def test_passed_pipe_on_wrong_device_is_refused(models_dir):
    from aotbuild.pipeline.models import load_pipeline, resolve_model

    recipe = load_recipe(TINY_RECIPE)
    pipe = load_pipeline(recipe, resolve_model(recipe, models_dir), "float32")
    pipe.unet.to("meta")
    with pytest.raises(UsageError, match=r"unet is on meta but .* says cpu: move it with pipe.to\('cpu'\)"):
        load_compiled(recipe, pipe, cache=models_dir)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asserts what a host without CUDA answers; CUDA is here")
def test_cuda_recipe_without_cuda_is_target_unavailable(tmp_path):
    from aotbuild import TargetUnavailable

    recipe = tmp_path / "cuda.yaml"
    recipe.write_text(TINY_RECIPE.read_text().replace("device: cpu", "device: cuda"))
    with pytest.raises(TargetUnavailable, match="CUDA is not available"):
        load_compiled(recipe)


def test_passed_pipe_misses_run_eager_when_asked(tiny_pipe, models_dir):
    """Nothing built, on_miss='eager': the UNet is never compiled, output is eager output."""
    from aotbuild.pipeline.pipecall import warmup_kwargs

    recipe = load_recipe(TINY_RECIPE)
    expected = tiny_pipe(**warmup_kwargs(recipe, recipe.shapes[0], tiny_pipe), output_type="pt").images
    with pytest.warns(UserWarning, match="tiny_sd_cpu: 2 of 2 entries missed, each runs eagerly: unet 64x64"):
        pipe = load_compiled(recipe, tiny_pipe, cache=models_dir, on_miss="eager")
    assert [e.hit for e in pipe.aotbuild_report.entries] == [False, False]
    out = pipe(**warmup_kwargs(recipe, recipe.shapes[0], pipe), output_type="pt").images
    assert torch.equal(out, expected)
    assert pipe.unet.forward.calls == {"built": 0, "unbuilt": 2}


def test_plan_lists_unreachable_hub_model_as_unavailable(tmp_path):
    recipe = tmp_path / "hub.yaml"
    recipe.write_text("model: {id: someorg/not-here}\ntarget: inductor\ndevice: cpu\n"
                      "shapes: [{height: 512, width: 512}]\n")
    env = {"HF_HUB_OFFLINE": "1"}
    proc = run_cli("plan", "--json", str(recipe), env=env)
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)["jobs"][0]
    assert job["status"] == "unavailable" and job["key"] is None
    assert "model unavailable: cannot fetch model_index.json of someorg/not-here" in job["reason"]
    assert run_cli("plan", "--fail-on-miss", str(recipe), env=env).returncode == 3


def test_an_unreachable_hub_is_one_line_after_one_attempt(tmp_path):
    """Not offline mode, just no network: one connection attempt, one line, no retry lines."""
    recipe = tmp_path / "hub.yaml"
    recipe.write_text("model: {id: someorg/not-here}\nshapes: [{height: 512, width: 512}]\n")
    proc = run_cli("plan", "--json", str(recipe), env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": ""})
    assert proc.returncode == 0, proc.stderr
    job = json.loads(proc.stdout)["jobs"][0]
    assert "cannot reach 127.0.0.1:9 (ConnectionRefusedError" in job["reason"]
    assert "local Hugging Face cache does not have it" in job["reason"]
    assert "Retrying" not in proc.stderr and proc.stderr.count("\n") <= 1


def test_a_hub_id_with_a_typo_is_not_blamed_on_gating(monkeypatch, no_ambient_hf_auth):
    """Issue 55: the Hub answers 401 to an unknown repo asked without a token (it cannot tell missing
    from private or gated): the message says both, the typo first. With a token it answers 404. Against
    the loopback Hub stand-in, which answers as the Hub does (tests/fakes/hub_server.py)."""
    from aotbuild.errors import ModelUnreachable
    from aotbuild.pipeline import hub
    from aotbuild.pipeline.models import hub_file
    from tests.fakes.hub_server import HubStandIn

    with HubStandIn() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)
        with pytest.raises(ModelUnreachable) as anonymous:
            hub_file("stabilityai/stable-difusion-xl", "model_index.json", None)
        monkeypatch.setenv("HF_TOKEN", "hf_some_reader")
        with pytest.raises(ModelUnreachable) as authed:
            hub_file("stabilityai/stable-difusion-xl", "model_index.json", None)
    assert str(anonymous.value) == ("cannot fetch model_index.json of stabilityai/stable-difusion-xl: the Hub "
                                    f"answered 401: {hub.NOT_FOUND_OR_GATED}")
    assert "not found, or gated/private: check the id, or accept its terms and set HF_TOKEN" in str(anonymous.value)
    assert "not found, or private and this token cannot read it: check the id" in str(authed.value)
    assert "gated" not in str(authed.value)


@pytest.mark.slow  # compiles for real
def test_more_static_shapes_than_dynamos_recompile_limit():
    """Dynamo's recompile_limit (default 8) makes one static shape too many a hard error under
    fullgraph; the inductor target raises it to cover the recipe's shapes. Tested with the limit
    lowered to 2 and three shapes: three real compiles, not ten."""
    import torch._dynamo.config as dynamo_config

    from aotbuild.targets.registry import get_target

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    # torch's own patch: pytest's monkeypatch undoes a config module's setting with delattr, which
    # hides it from every later test in the process ("recompile_limit does not exist")
    before = getattr(dynamo_config, name)
    with dynamo_config.patch({name: 2}):
        shapes = [{"height": 8 * (i + 1), "width": 8} for i in range(3)]
        recipe = parse_recipe({"model": "builtin:tiny-sd", "device": "cpu", "shapes": shapes}, "many.yaml")
        torch._dynamo.reset()
        module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        compiled = get_target("inductor").compile(module, recipe, "cpu")
        assert getattr(dynamo_config, name) >= 3
        for n in range(1, 4):
            assert compiled(torch.ones(n, 4)).shape == (n, 4)
    assert getattr(dynamo_config, name) == before


def test_an_unreachable_remote_is_a_miss_with_its_reason(tiny_pipe, models_dir, monkeypatch, no_ambient_hf_auth,
                                                         caplog):
    """Production must not crash because the remote is down: the entry misses, on_miss decides.
    One connection attempt says so: huggingface_hub's retries (a warning line each, ~25 s) never start."""
    import logging

    from aotbuild import CacheMiss
    from aotbuild.pipeline import hub
    from aotbuild.remote.schemes import HubRemote

    monkeypatch.setattr(hub, "_seen", {})
    caplog.set_level(logging.WARNING, logger="huggingface_hub")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    calls = []
    real_fetch = HubRemote.fetch
    monkeypatch.setattr(HubRemote, "fetch", lambda self, *a: calls.append(a) or real_fetch(self, *a))
    with pytest.raises(CacheMiss, match=r"hf://org/cache: .*the Hub cannot be reached") as info:
        load_compiled(TINY_RECIPE, tiny_pipe, cache=models_dir, remote="hf://org/cache", on_miss="error")
    assert str(info.value).count("the Hub cannot be reached") == 2  # both entries say why
    assert len(calls) == 1  # one wait for the remote, not one per entry
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()]


def test_a_note_every_entry_gives_is_said_once():
    """Each prepacked shape's route gives the refresh note: the main job's two entries printed it twice."""
    from aotbuild.runtime import LoadReport
    from aotbuild.strategies.runner import REFRESH_NOTE

    report = LoadReport("tiny_sd_cpu", "/c")
    for _ in range(2):  # the 64x64 and 64x96 entries' routes
        report.note(REFRESH_NOTE)
    report.note("unet: 12 MB of dense weights discarded")
    assert report.notes == [REFRESH_NOTE, "unet: 12 MB of dense weights discarded"]
    assert str(report).count("  note: ") == 2
