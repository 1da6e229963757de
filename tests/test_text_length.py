"""Any prompt length from one build (issue 34): the text length measured as a shape, served in a range.

Fast: the signature patterns, the dispatcher's routing and refusal, the recipe's checks and the key.
Slow (one real build of builtin:tiny-qwenimage with ``text_length``, shared by the module's slow
tests): what the build measured and proved, a fresh process serving prompts of the range's ends and
several lengths between with 0 compiles and output equal to eager, plan's warning for a recipe that
serves one length; and the tiny-sd entry the suite builds anyway measured as fixed-length (CLIP pads
to 77).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from aotbuild.dispatch import Dispatcher, signature
from aotbuild.errors import RecipeError, ShapeNotBuilt
from aotbuild.pipeline import textlen
from tests.conftest import invoke_cli, once_per_run, run_python

QWEN_RECIPE = """\
model: {id: builtin:tiny-qwenimage, dtype: float32}
target: inductor
device: cpu
strategy: jit-cache
compile: {components: [transformer]}
shapes: [{height: 32, width: 32}]
text_length: {min: 2, max: 512}
warmup: {num_inference_steps: 2}
"""


def _call(length: int, mask: bool = False) -> tuple[tuple, dict]:
    import torch

    kwargs = {"hidden_states": torch.zeros(1, 16, 16), "encoder_hidden_states": torch.zeros(1, length, 16),
              "timestep": torch.zeros(1), "img_shapes": [(1, 4, 4)]}
    if mask:
        kwargs["encoder_hidden_states_mask"] = torch.ones(1, length)
    return (), kwargs


def _pattern(lo: int = 2, hi: int = 512) -> textlen.Pattern:
    a, b = signature(*_call(30)), signature(*_call(45))
    dims, why = textlen.compare(a, b)
    assert why == "" and [str(d) for d in dims] == ["encoder_hidden_states[dim 1]"]
    return textlen.Pattern(textlen.generalize(a, dims, lo, hi))


def test_compare_finds_the_dimension_that_follows_the_prompt_and_nothing_else():
    a = signature(*_call(30, mask=True))
    dims, why = textlen.compare(a, signature(*_call(45, mask=True)))
    assert why == "" and {(d.path, d.dim, d.sizes) for d in dims} == {
        ("encoder_hidden_states", 1, (30, 45)), ("encoder_hidden_states_mask", 1, (30, 45))}
    assert textlen.compare(a, a) == ([], "")  # a fixed length (CLIP's 77): nothing follows the prompt
    # A call whose structure changes with the prompt (a mask appears) is not a text length: said, not guessed.
    dims, why = textlen.compare(signature(*_call(30)), signature(*_call(45, mask=True)))
    assert dims == [] and "encoder_hidden_states_mask" in why


def test_a_pattern_serves_lengths_in_its_range_only():
    p = _pattern(2, 512)
    assert '"text:2-512"' in p.sig and (p.lo, p.hi) == (2, 512)
    for n in (2, 3, 257, 512):
        assert p.serves(signature(*_call(n))), n
    for n in (1, 513, 4096):
        assert not p.serves(signature(*_call(n))) and p.sizes(signature(*_call(n))) == [n]
    import torch  # any other difference is another signature: not served by the pattern

    args, kwargs = _call(40)
    kwargs["hidden_states"] = torch.zeros(1, 64, 16)
    assert p.sizes(signature(args, kwargs)) is None


def test_the_dispatcher_routes_every_length_of_the_range_marks_it_dynamic_and_names_a_prompt_outside_it():
    p = _pattern(2, 512)
    served: list[tuple[int, object]] = []

    def route(*args, **kwargs):
        t = kwargs["encoder_hidden_states"]
        served.append((t.shape[1], getattr(t, "_dynamo_dynamic_indices", set())))
        return t

    d = Dispatcher("transformer", lambda *a, **k: None, {p.sig: route}, None, "error")
    assert d.patterns and d.patterns[0].sig == p.sig  # read off the route's signature: a load needs nothing else
    for n in (2, 100, 512):
        args, kwargs = _call(n)
        d(*args, **kwargs)
    assert [n for n, _ in served] == [2, 100, 512] and all(1 in marked for _, marked in served)
    assert d.calls == {"built": 3, "unbuilt": 0}
    args, kwargs = _call(513)
    with pytest.raises(ShapeNotBuilt) as caught:
        d(*args, **kwargs)
    message = str(caught.value)
    assert "prompt of 513 tokens" in message and "2 to 512" in message and "text_length" in message
    assert "encoder_hidden_states" not in message  # the user's prompt, not an internal tensor


def test_call_at_resizes_the_text_dimensions_to_a_dense_layout():
    import torch

    p = _pattern()
    args, kwargs = _call(30)
    kwargs["encoder_hidden_states"] = torch.arange(30 * 16, dtype=torch.float32).reshape(1, 30, 16)
    for n in (2, 30, 75):
        _, k = textlen.call_at(p, args, kwargs, n)
        t = k["encoder_hidden_states"]
        assert t.shape == (1, n, 16) and t.stride() == (16 * n, 16, 1)  # Dynamo guards these strides
        assert torch.equal(t[0, : min(n, 30)], kwargs["encoder_hidden_states"][0, : min(n, 30)])
        assert k["hidden_states"] is kwargs["hidden_states"]
    assert textlen.proof_lengths(2, 512) == [2, 257, 512]


@pytest.mark.parametrize(("change", "key", "words"), [
    ({"strategy": "aot-package"}, "text_length", "use strategy jit-cache"),
    ({"strategy": "aot-compile"}, "text_length", "use strategy jit-cache"),
    ({"compile": {"components": ["unet"], "scope": "regional"}}, "text_length", "compile.scope: full"),
    ({"text_length": {"min": 1, "max": 512}}, "text_length", "2 <= min <= max"),
    ({"text_length": {"min": 64, "max": 32}}, "text_length", "2 <= min <= max"),
    ({"text_length": {"min": 2}}, "text_length.max", "is required"),
    ({"target": "neuron", "device": None}, "text_length", "static shapes only"),
])
def test_what_cannot_serve_a_text_range_is_refused_when_the_recipe_is_read(change, key, words):
    from aotbuild.recipe.rules import parse_recipe

    data = {"model": "builtin:tiny-sd", "compile": {"components": ["unet"]}, "shapes": [{"height": 64, "width": 64}],
            "text_length": {"min": 2, "max": 512}, **change}
    with pytest.raises(RecipeError) as caught:
        parse_recipe(data)
    assert caught.value.key == key and words in str(caught.value)


def test_the_range_is_a_key_factor(cache):
    import aotbuild

    base = {"model": "builtin:tiny-sd", "strategy": "jit-cache", "compile": {"components": ["unet"]},
            "shapes": [{"height": 64, "width": 64}]}
    static, = aotbuild.plan([base], cache)
    ranged, = aotbuild.plan([{**base, "text_length": {"min": 2, "max": 512}}], cache)
    wider, = aotbuild.plan([{**base, "text_length": {"min": 2, "max": 1024}}], cache)
    assert "text_length" not in static.factors and ranged.factors["text_length"] == {"min": 2, "max": 512}
    assert len({static.key, ranged.key, wider.key}) == 3
    assert static.text["follows_prompt"] is None and "not measured yet" in static.text["served"]
    assert ranged.text["served"] == "text lengths 2 to 512 (text_length)"


# -- one real build ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen_build(tmp_path_factory) -> tuple[Path, Path, dict]:
    """builtin:tiny-qwenimage with text_length 2 to 512, built once per run: (recipe, cache, manifest)."""

    def build(folder: Path) -> list:
        folder.mkdir(parents=True, exist_ok=True)
        recipe = folder / "tiny_qwenimage_range.yaml"
        recipe.write_text(QWEN_RECIPE)
        proc = invoke_cli("build", "--json", "--cache", str(folder / "cache"), str(recipe),
                       env={"TORCHINDUCTOR_CACHE_DIR": str(folder / "build-inductor"), "AOTBUILD_CACHE": ""})
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        job, = json.loads(proc.stdout)["jobs"]
        manifest = json.loads(invoke_cli("show", "--json", "--cache", str(folder / "cache"), job["key"]).stdout)
        return [str(recipe), str(folder / "cache"), manifest]

    recipe, root, manifest = once_per_run(tmp_path_factory, "tiny-qwenimage-range", build)
    return Path(recipe), Path(root), manifest.get("manifest", manifest)


@pytest.mark.slow
@pytest.mark.xdist_group("tiny-qwenimage")
def test_the_build_measures_the_text_length_and_proves_the_range(qwen_build):
    _, _, manifest = qwen_build
    text = manifest["build"]["text"]
    # Measured, not listed: QwenImage's text follows the prompt in encoder_hidden_states' dimension 1 only.
    assert text["prompt_dependent"] == ["encoder_hidden_states[dim 1]"] and text["served"] == "text_length 2 to 512"
    assert manifest["factors"]["text_length"] == {"min": 2, "max": 512}
    sig, = manifest["signatures"]
    assert '"encoder_hidden_states": ["tensor", [1, "text:2-512", 16]' in sig
    proof = manifest["proof"]
    assert proof["compiles"] == 0 and proof["max_abs_diff"] <= proof["tolerance"]
    served = proof["served"]["text"]
    # every recorded call replayed at both ends and the middle, with 0 compiles, equal to eager
    assert served["lengths"] == [2, 257, 512] and served["calls"] == 3 * proof["calls"]
    assert "prompt of 513 tokens" in served["refused"] and "encoder_hidden_states" not in served["refused"]


SERVE_PROMPTS = textwrap.dedent("""
    import json, os
    import torch
    from pathlib import Path
    from aotbuild import ShapeNotBuilt, load_compiled, load_recipe
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.strategies.registry import get_strategy
    from aotbuild.targets.registry import get_target

    recipe_path, cache = os.environ["TL_RECIPE"], os.environ["TL_CACHE"]
    r = load_recipe(recipe_path)
    pipe = load_pipeline(r, resolve_model(r, Path(cache)), "float32", quiet=True)
    words = "a small red cat with a big blue dog in the photo on the sea".split()
    texts = [" ".join(words[:n]) for n in (1, 4, 9, 14)] + [" ".join(words * 12)]
    torch.manual_seed(0)
    embeds = {n: torch.randn(1, n, 16) for n in (2, 512, 513)}  # the range's ends, and one past it
    calls = [dict(prompt=t) for t in texts] + [dict(prompt_embeds=embeds[n]) for n in (2, 512)]
    lengths = []
    inner = pipe.transformer.forward
    def watch(*args, **kwargs):
        lengths.append(kwargs["encoder_hidden_states"].shape[1])
        return inner(*args, **kwargs)
    def run(call):
        kw = dict(height=32, width=32, num_inference_steps=2, output_type="latent",
                  generator=torch.Generator().manual_seed(0))
        return pipe(**call, **kw).images
    pipe.transformer.forward = watch
    eager = [run(c) for c in calls]
    del pipe.transformer.forward

    counter_name, count = get_strategy(r.strategy).compile_counter(get_target(r.target))
    from torch._dynamo.utils import counters
    load_compiled(r, pipe, cache=cache, on_miss="error", strict_shapes=True)
    before = count()
    served = [run(c) for c in calls]
    compiles = count() - before
    try:
        run(dict(prompt_embeds=embeds[513], max_sequence_length=1024))  # the pipeline cuts at 512 by default
        refused = "not refused"
    except ShapeNotBuilt as exc:
        refused = str(exc)
    print(json.dumps({"compiles": compiles, "counter": counter_name, "lengths": lengths,
                      "fx_miss": int(counters["inductor"].get("fxgraph_cache_miss", 0)),
                      "diff": max(float((a - b).abs().max()) for a, b in zip(served, eager)),
                      "hits": len(pipe.aotbuild_report.hits), "refused": refused}))
""")


@pytest.mark.slow
@pytest.mark.xdist_group("tiny-qwenimage")
def test_a_fresh_process_serves_prompts_of_every_length_in_the_range_without_compiling(qwen_build, tmp_path):
    recipe, root, _ = qwen_build
    proc = run_python(SERVE_PROMPTS, env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "AOTBUILD_CACHE": "",
                                          "TL_RECIPE": str(recipe), "TL_CACHE": str(root)}, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    # five prompts of different lengths, then the range's ends as prompt embeddings
    assert len(set(out["lengths"])) == 7 and min(out["lengths"]) == 2 and max(out["lengths"]) == 512
    assert out["hits"] == 1 and out["compiles"] == 0 and out["fx_miss"] == 0
    assert out["diff"] <= 1e-4
    assert "prompt of 513 tokens" in out["refused"]


@pytest.mark.slow
@pytest.mark.xdist_group("tiny-qwenimage")
def test_plan_warns_with_the_fix_for_a_recipe_that_serves_one_length(qwen_build, tmp_path):
    import aotbuild

    _, root, _ = qwen_build
    static = tmp_path / "tiny_qwenimage_static.yaml"
    static.write_text(QWEN_RECIPE.replace("text_length: {min: 2, max: 512}\n", ""))
    job, = aotbuild.plan([str(static)], root)
    assert job.status == "miss" and job.text["follows_prompt"] is True
    assert "text_length: {min: 2, max: 512}" in job.text["warning"]
    proc = invoke_cli("plan", "--cache", str(root), str(static))
    warned = "warning: tiny_qwenimage_static:transformer@32x32: transformer's text input follows the prompt"
    assert warned in proc.stdout
    ranged = tmp_path / "tiny_qwenimage_range.yaml"
    ranged.write_text(QWEN_RECIPE)
    job, = aotbuild.plan([str(ranged)], root)
    assert job.status == "hit" and job.text["follows_prompt"] is True and "warning" not in job.text


@pytest.mark.slow
def test_a_fixed_length_text_encoder_is_measured_as_such(built_cache):
    """tiny-sd's CLIP pads every prompt to 77 tokens: its build measured nothing that follows the prompt."""
    root, report = built_cache
    for job in report["jobs"]:
        manifest = json.loads(invoke_cli("show", "--json", "--cache", str(root), job["key"]).stdout)
        text = manifest.get("manifest", manifest)["build"]["text"]
        assert text == {"prompt_dependent": [], "served": "any prompt (a fixed length)"}


def test_a_signature_that_only_mentions_text_is_no_pattern():
    """A built signature is read back from a manifest: text that looks like a range outside a tensor's
    shape, or a signature that is not one, is a plain route, never a crash at load."""
    odd = json.dumps({"args": [], "kwargs": {"mode": "text:2-512"}}, sort_keys=True)
    d = Dispatcher("transformer", lambda *a, **k: None, {odd: lambda *a, **k: "ran", '"text:1-2"': print}, None,
                   "error")
    assert d.patterns == [] and d(mode="text:2-512") == "ran"


def test_a_static_build_that_measured_the_text_names_a_refused_prompt_s_length():
    """Without text_length, an entry whose build measured a prompt-dependent dimension (its manifest's
    build.text) still serves the warmup's length only; a strict call at another length is refused
    naming the prompt's length and the fix, not an internal tensor, and is never served by it."""
    built = signature(*_call(30))
    measured = [{"prompt_dependent": ["encoder_hidden_states[dim 1]"], "warmup_length": 30}]
    ran: list[int] = []
    d = Dispatcher("transformer", lambda *a, **k: ran.append(-1), {built: lambda *a, **k: ran.append(1)}, None,
                   "error")
    d.static_text = textlen.static_patterns(d.routes, measured)
    assert len(d.static_text) == 1 and d.patterns == []
    args, kwargs = _call(30)
    d(*args, **kwargs)
    args, kwargs = _call(44)
    with pytest.raises(ShapeNotBuilt) as caught:
        d(*args, **kwargs)
    message = str(caught.value)
    assert "prompt of 44 tokens" in message and "warmup's prompt length (30 tokens" in message
    assert "text_length" in message and "encoder_hidden_states" not in message and ran == [1]
    # what a build without the measurement (or of a fixed-length text) recorded names nothing new
    assert textlen.static_patterns(d.routes, [{"prompt_dependent": []}, None, {"warmup_length": "x"}]) == []
