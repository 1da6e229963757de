"""Recipes are data: a recipe from a pull request is read with bounded work, refused in one line
(exit 2, no traceback), and can neither hang the reader nor run a program."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from aotbuild.errors import RecipeError
from aotbuild.recipe import files as recipe_module
from aotbuild.recipe.rules import load_recipe
from tests.conftest import REPO

HEAD = "model: {id: builtin:tiny-sd}\nshapes: [{height: 64, width: 64}]\n"


def laughs(levels: int, width: int = 10) -> str:
    lines = ["a0: &a0 [" + ", ".join(["lol"] * width) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * width) + "]" for i in range(1, levels)]
    return HEAD + "warmup:\n  " + "\n  ".join(lines) + "\n"


CASES = {  # name: (file text, what the one-line error says)
    "billion laughs in warmup": (laughs(10), "expands to more than 100000 values"),
    "billion laughs in compile.options": (
        HEAD + "compile:\n  options:\n    " + "\n    ".join(
            line.strip() for line in laughs(9).split("warmup:\n")[1].splitlines()) + "\n",
        "expands to more than 100000 values"),
    "recursive alias": (HEAD.replace("shapes: [{height: 64, width: 64}]", "shapes: &x [*x]"),
                        "an alias refers to itself"),
    "recursive mapping alias": (HEAD + "warmup: &w {a: *w}\n", "an alias refers to itself"),
    "nesting 100000 deep": ("model: " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),
    "nesting 65 deep": (HEAD + "warmup: {a: " + "[" * 64 + "]" * 64 + "}\n", "nested more than 64 levels deep"),
    "a 300 kB model.id": ("model: {id: '" + "a" * 300_000 + "'}\nshapes: [{height: 64, width: 64}]\n",
                          "a value of 300000 characters; at most 4096"),
    "a 5 kB prompt": (HEAD + "warmup: {prompt: '" + "k" * 5000 + "'}\n", "a value of 5000 characters"),
    "over 1 MiB": (HEAD + "# " + "x" * (1 << 20) + "\n", "a recipe may have at most 1048576"),
    "python tag": (HEAD + "warmup: {x: !!python/object/apply:os.system [touch /tmp/aotbuild-pwned]}\n",
                   "is not plain YAML data"),
    "not UTF-8": ("model: {id: \udcff}\n", "is not UTF-8 text"),
    "binary garbage": ("\x00\x01\x02 model", "is not valid YAML"),
    "a list at the top": ("- model\n- shapes\n", "expected a mapping"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_recipe_is_one_line_exit_2_with_bounded_work(tmp_path, name):
    text, says = CASES[name]
    path = tmp_path / "r.yaml"
    path.write_bytes(text.encode("utf-8", "surrogateescape"))
    proc = subprocess.run([sys.executable, "-m", "aotbuild.cli", "plan", str(path)], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env={**os.environ, "AOTBUILD_CACHE": str(tmp_path / "c")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert says in proc.stderr, proc.stderr
    assert not os.path.exists("/tmp/aotbuild-pwned")


def test_a_fifo_named_as_a_recipe_is_refused_at_once(tmp_path):
    fifo = tmp_path / "r.yaml"
    os.mkfifo(fifo)
    with pytest.raises(RecipeError, match="is not a regular file"):
        load_recipe(fifo)


def test_a_bomb_is_measured_in_steps_not_expanded(tmp_path, monkeypatch):
    """Counting visits each distinct YAML node once: 12 levels of 10 aliases (10**12 values if
    expanded) cost about 130 steps before the refusal."""
    import yaml

    visits = []
    real = yaml.SequenceNode.__init__

    def counting(self, *args, **kwargs):
        visits.append(1)
        real(self, *args, **kwargs)

    monkeypatch.setattr(yaml.SequenceNode, "__init__", counting)
    path = tmp_path / "r.yaml"
    path.write_text(laughs(12))
    with pytest.raises(RecipeError, match="expands to more than"):
        load_recipe(path)
    assert len(visits) < 50  # nodes composed: one per sequence written, none per expansion


@pytest.mark.parametrize("limit,value,says", [("MAX_RECIPE_NODES", 30, "expands to more than 30 values"),
                                              ("MAX_RECIPE_DEPTH", 3, "is nested more than 3 levels deep")])
def test_the_caps_are_the_module_constants(tmp_path, monkeypatch, limit, value, says):
    """The refusal names the patched cap: the reader reads the constant, not a copy of it."""
    monkeypatch.setattr(recipe_module, limit, value)
    path = tmp_path / "r.yaml"
    path.write_text(HEAD + "warmup: {a: [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]}\n")
    with pytest.raises(RecipeError, match=f"^{re.escape(str(path))}: {says}"):
        load_recipe(path)


OPTION_CASES = [  # (target, options, refused?, what the error says)
    ("inductor", {"cpp.cxx": [None, "/tmp/aotbuild-evil.sh"]}, True, "free-form option (tuple[None, str])"),
    ("inductor", {"cpp.march": "native -B/tmp/aotbuild-evil"}, True, "AOTBUILD_ALLOW_OPTIONS=cpp.march"),
    ("inductor", {"cpp.cxx": "g++"}, True, "does not fit this option's type"),  # type-checked even unallowed
    ("inductor", {"max_autotune_gemm_backends": "ATEN"}, True, "free-form option (str)"),
    ("inductor", {"post_grad_custom_pre_pass": None}, True, "free-form option"),
    ("inductor", {"cpp.simdlen": "8"}, True, "'8' does not fit this option's type (int | None)"),
    ("inductor", {"compile_threads": 1.5}, True, "does not fit"),
    ("inductor", {"max_autotune": True, "cpp.simdlen": 8, "cpp.dynamic_threads": False}, False, ""),
    ("neuron", {"optlevel": "--cc=/bin/sh"}, True, "free-form option (str)"),
    ("tpu", {"flags": ["--xla_dump_to=/tmp"]}, True, "free-form option (list)"),
    ("neuron", {"optlevel": 2, "fast_math": True}, False, ""),
]


@pytest.mark.parametrize("target,options,refused,says", OPTION_CASES,
                         ids=[f"{t}-{next(iter(o))}-{r}" for t, o, r, _ in OPTION_CASES])
def test_a_recipe_sets_only_options_that_are_data(monkeypatch, target, options, refused, says):
    from aotbuild.recipe.rules import parse_recipe

    monkeypatch.delenv("AOTBUILD_ALLOW_OPTIONS", raising=False)
    data = {"model": {"id": "builtin:tiny-sd"}, "target": target, "compile": {"options": options},
            "shapes": [{"height": 64, "width": 64}]}
    if not refused:
        assert parse_recipe(data, "r.yaml").compile.options
        return
    with pytest.raises(RecipeError) as info:
        parse_recipe(data, "r.yaml")
    assert says in str(info.value) and "\n" not in str(info.value)


def test_the_operator_allows_a_free_form_option_by_name_but_never_a_wrong_type(monkeypatch):
    from aotbuild.recipe.rules import parse_recipe

    data = {"model": {"id": "builtin:tiny-sd"}, "compile": {"options": {"cpp.march": "x86-64-v3"}},
            "shapes": [{"height": 64, "width": 64}]}
    monkeypatch.setenv("AOTBUILD_ALLOW_OPTIONS", "cpp.cxx, cpp.march")
    assert parse_recipe(data, "r.yaml").compile.options["cpp.march"] == "x86-64-v3"
    monkeypatch.setenv("AOTBUILD_ALLOW_OPTIONS", "*")
    data["compile"]["options"] = {"cpp.march": ["not", "a", "string"]}
    with pytest.raises(RecipeError, match="does not fit"):
        parse_recipe(data, "r.yaml")
    monkeypatch.setenv("AOTBUILD_ALLOW_OPTIONS", "cpp.cxx")
    data["compile"]["options"] = {"cpp.march": "native"}
    with pytest.raises(RecipeError, match="free-form"):
        parse_recipe(data, "r.yaml")


# -- issue 53's leftovers: a Hub id that cannot be one; a warmup tensor a recipe cannot write ----------
#: model.id values that are no local folder and no Hub repo id. huggingface_hub's HFValidationError
#: read as "cannot fetch": plan "unavailable" (exit 0), build exit 1, a Hub failure instead of the
#: recipe's (exit 2).
BAD_HUB_IDS = ["bad id with spaces//x", "a/b/c", "-x", "x" * 200, "x" * 300, "org/..", "org/x--y", "org/.x",
               "org/x.git", "ｏｒｇ/ｘ", "hf://org/x", "org/x\n::error::y", "org/x?", "org/x\x1b]0;t\x07"]
TINY = "shapes: [{height: 64, width: 64}]\nwarmup: {num_inference_steps: 2, guidance_scale: 0.0}\n"


@pytest.fixture
def no_hub(monkeypatch) -> list[str]:
    """No Hub to reach, and no probe of it allowed: a malformed id is refused before any network."""
    from aotbuild.pipeline import hub

    asked: list[str] = []
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "unreachable", lambda *a, **k: asked.append("probe") or "cannot reach the Hub (test)")
    return asked


def _recipe(tmp_path, text: str):
    import json

    path = tmp_path / "r.yaml"
    path.write_text(text if text.startswith("model") else f"model: {{id: {json.dumps(text)}}}\n" + TINY)
    return path


def _one_line_exit_2(proc, *says: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(s in errors[0] for s in says), (says, errors[0])


@pytest.mark.parametrize("command", ["plan", "build"])
def test_a_malformed_hub_id_is_the_recipe_s_fault_exit_2(tmp_path, cache, no_hub, command):
    from tests.conftest import invoke_cli

    for bad in BAD_HUB_IDS:
        proc = invoke_cli(command, "--cache", str(cache), str(_recipe(tmp_path, bad)))
        _one_line_exit_2(proc, "model.id", "not a Hub repo id")
        assert "\n::error::" not in proc.stderr and "\x1b" not in proc.stderr
    assert no_hub == []  # never a probe, never a fetch


def test_a_well_formed_hub_id_still_goes_to_the_hub(tmp_path, cache, no_hub):
    from tests.conftest import invoke_cli

    for good in ("org/name", "stabilityai/stable-diffusion-2.1", "a_b/C-1.x", "x" * 96):
        proc = invoke_cli("plan", "--cache", str(cache), str(_recipe(tmp_path, good)))
        assert proc.returncode == 0 and "cannot reach the Hub (test)" in proc.stdout, proc.stdout + proc.stderr


def test_a_malformed_hub_id_for_a_lora_adapter_is_exit_2(tmp_path, cache, no_hub):
    from tests.conftest import invoke_cli

    (tmp_path / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    for bad in ("a/b/c", "org/x--y", "-lora"):
        text = ("model: {id: builtin:tiny-sd}\n" + TINY +
                f"lora: {{rank: 8, adapters: [{{path: '{bad}', adapter_name: a}}]}}\n")
        proc = invoke_cli("plan", "--cache", str(cache), str(_recipe(tmp_path, text)))
        _one_line_exit_2(proc, "lora.adapters[0].path", "not a Hub repo id")
    assert no_hub == []


@pytest.mark.parametrize("command", ["plan", "build"])
def test_a_malformed_hub_id_in_a_process_of_its_own(tmp_path, command):
    path = _recipe(tmp_path, "a/b/c")
    proc = subprocess.run([sys.executable, "-m", "aotbuild.cli", command, str(path)], capture_output=True, text=True,
                          timeout=300, cwd=REPO, env={**os.environ, "AOTBUILD_CACHE": str(tmp_path / "c"),
                                                      "HF_HUB_OFFLINE": "1"})
    _one_line_exit_2(proc, "model.id", "'a/b/c': no such folder, and not a Hub repo id")


#: Warmup arguments that StableDiffusionPipeline.__call__ annotates as tensors only, and values a recipe
#: can write for them: each passed plan (a null is not even a wrong type there) and failed the build.
TENSOR_WARMUPS = [("negative_prompt_embeds", "null"), ("ip_adapter_image_embeds", "null"),
                  ("negative_prompt_embeds", "[[0.0, 1.0]]"), ("ip_adapter_image_embeds", "[null]"),
                  ("negative_prompt_embeds", "'x'"), ("negative_prompt_embeds", "{a: 1}"),
                  ("negative_prompt_embeds", "0")]


@pytest.mark.parametrize("key,value", TENSOR_WARMUPS)
def test_plan_refuses_a_tensor_argument_a_recipe_cannot_write(tmp_path, cache, key, value):
    from tests.conftest import invoke_cli

    warmup = TINY.replace("guidance_scale: 0.0", f"guidance_scale: 0.0, {key}: {value}")
    text = f"model: {{id: builtin:tiny-sd}}\n{warmup}"
    proc = invoke_cli("plan", "--cache", str(cache), str(_recipe(tmp_path, text)))
    _one_line_exit_2(proc, f"warmup.{key}: StableDiffusionPipeline.__call__ takes a tensor for {key}")


def test_a_warmup_value_a_recipe_can_write_still_plans(tmp_path, cache):
    from tests.conftest import invoke_cli

    text = ("model: {id: builtin:tiny-sd}\nshapes: [{height: 64, width: 64}]\nwarmup: {num_inference_steps: 2, "
            "guidance_scale: 0.0, timesteps: [999, 500], guidance_rescale: 0.0, cross_attention_kwargs: {scale: 1.0}, "
            "negative_prompt: null}\n")
    proc = invoke_cli("plan", "--cache", str(cache), str(_recipe(tmp_path, text)))
    assert proc.returncode == 0, proc.stderr


def test_tensor_arguments_are_read_from_each_pipeline_s_signature():
    """Which arguments are tensors is the pipeline's own annotation, read without importing it (plan)
    and from the imported class (jobs, load_compiled): the same answer, for every built-in's pipeline."""
    import diffusers

    from aotbuild.pipeline.pipecall import CallSignature, signature_of, takes_only_tensors

    for annotation in ("torch.Tensor | None", "Optional[torch.FloatTensor]", "list[torch.Tensor] | None",
                       "typing.Optional[typing.List[torch.Tensor]]", "'torch.Tensor'"):
        assert takes_only_tensors(annotation), annotation
    for annotation in ("PipelineImageInput", "list[float, torch.Tensor] | None", "float | list[float] | torch.Tensor",
                       "Callable[[int, int, torch.Tensor], None] | None", "None", "str | list[str]", "dict[str, Any]",
                       "np.ndarray | None", "not python ("):
        assert not takes_only_tensors(annotation), annotation
    expected = {"StableDiffusionPipeline": {"negative_prompt_embeds", "ip_adapter_image_embeds"},
                "StableDiffusionXLPipeline": {"pooled_prompt_embeds", "negative_pooled_prompt_embeds"},
                "PixArtSigmaPipeline": {"prompt_attention_mask", "negative_prompt_attention_mask"},
                "QwenImagePipeline": {"prompt_embeds_mask", "negative_prompt_embeds_mask"},
                "FluxPipeline": {"negative_ip_adapter_image_embeds"}, "WanPipeline": {"negative_prompt_embeds"},
                "StableDiffusion3Pipeline": {"pooled_prompt_embeds"}}
    for name, some in expected.items():
        read = signature_of(name)
        assert read is not None and some | {"latents", "prompt_embeds"} <= set(read.tensors), (name, read)
        assert read.tensors == CallSignature.of(getattr(diffusers, name)).tensors, name
        assert not {"prompt", "num_inference_steps", "guidance_scale", "generator"} & set(read.tensors)
