"""Any scheduler the user picks (issue 56, items 1, 2, 4, 5) and refusals in the caller's terms (issue 55, item 4).

The matrix: tiny-sd built by a recipe that names no strategy (auto: the suite's shared build), each of the
15 classes of ``pipe.scheduler.compatibles`` swapped after load: served with 0 compiles and within 1e-4 of
eager, or refused naming the scheduler and why. Its Flux half is in tests/test_regional.py (the suite's
tiny-flux package). A recipe's ``schedulers`` (item 2) are checked when it is read and planned, keyed, and
warmed up with by the build and the proof.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from aotbuild.errors import RecipeError, ShapeNotBuilt
from tests.conftest import TINY_DICT
from tests.scheduler_matrix import REFUSED, UNUSABLE, Cell, no_codegen, run

#: tiny-sd (EulerDiscrete's config, float32 0-d timesteps as built): every compatible class. The int64 ones
#: are converted (the build proved the UNet reads 999 and 999.0 alike); DPM-Solver SDE's float64 steps
#: (e.g. 851.759...) hold more than float32 can, so no conversion writes them: refused, naming the fix;
#: EDM-Euler cannot be made from an SD scheduler's config (sigma_min is None), in eager either.
TINY_SD = {name: Cell(name) for name in (
    "DDIMScheduler", "DDPMScheduler", "DPMSolverMultistepScheduler", "DPMSolverSinglestepScheduler",
    "UniPCMultistepScheduler", "DEISMultistepScheduler", "HeunDiscreteScheduler", "EulerDiscreteScheduler",
    "EulerAncestralDiscreteScheduler", "KDPM2DiscreteScheduler", "KDPM2AncestralDiscreteScheduler")} | {
    "LMSDiscreteScheduler": Cell("LMSDiscreteScheduler", needs=("scipy",)),
    "DPMSolverSDEScheduler": Cell("DPMSolverSDEScheduler", REFUSED,
                                  r"`pipe\.scheduler` is DPMSolverSDEScheduler, and its timestep [0-9.]+ \(float64\) "
                                  r"cannot be written exactly in float32.*schedulers: \[DPMSolverSDEScheduler\]",
                                  needs=("torchsde",)),
    "EDMEulerScheduler": Cell("EDMEulerScheduler", UNUSABLE, r"TypeError: unsupported operand"),
    # its Runge-Kutta warmup needs 4 steps or more (fewer raise in eager, diffusers 0.42)
    "PNDMScheduler": Cell("PNDMScheduler", call={"num_inference_steps": 4}),
}
CALL = {"prompt": "a cat", "height": 64, "width": 64, "num_inference_steps": 2, "guidance_scale": 0.0}


def _served(recipe_path, cache, **options):
    from aotbuild import load_compiled
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.recipe.rules import load_recipe

    recipe = load_recipe(recipe_path)
    eager = load_pipeline(recipe, resolve_model(recipe, cache), "float32")
    import copy

    return load_compiled(recipe, copy.deepcopy(eager), cache=cache, **options), eager


def _compatibles(pipe):
    """``pipe.scheduler.compatibles``' class names."""
    return sorted(c.__name__ for c in pipe.scheduler.compatibles)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto"])  # groups it with that shared build (tests/conftest.py)
def test_every_compatible_scheduler_swapped_after_load_is_served_or_refused_naming_it(strategy, strategy_build):
    import yaml

    from aotbuild.planner import plan

    recipe, cache, report = strategy_build(strategy)
    unnamed = {k: v for k, v in yaml.safe_load(recipe.read_text()).items() if k != "strategy"}
    assert plan(unnamed, cache=cache)[0].key == report["jobs"][0]["key"]  # the entry of a recipe naming no strategy
    served, eager = _served(recipe, cache, on_miss="error")
    assert sorted(TINY_SD) == _compatibles(served) and len(TINY_SD) == 15  # pipe.scheduler.compatibles
    results = run("tiny-sd (auto)", served, eager, TINY_SD, CALL, "unet")
    done_when = ("DDIM", "DDPM", "PNDM", "DPMSolverMultistep", "DPMSolverSinglestep", "UniPCMultistep",
                 "DEISMultistep", "HeunDiscrete", "EulerDiscrete", "EulerAncestralDiscrete")
    assert all(results[f"{name}Scheduler"].startswith("served") for name in done_when)
    # LMS and DPM-Solver SDE need the schedulers extra (pyproject.toml): run where it is installed (CI's newest
    # job), said to be not run where it is not (the pinned job)
    for name, library in (("LMSDiscreteScheduler", "scipy"), ("DPMSolverSDEScheduler", "torchsde")):
        assert results[name].startswith("not run here") == (importlib.util.find_spec(library) is None), results[name]
    # what the build proved, and its proof served converted, is in the entry
    from aotbuild.cache.store import Store

    manifest = Store(cache).load_manifest(report["jobs"][0]["key"])
    assert manifest.build["timestep"]["alike"]["int64"] == ["scalar", "batch"]
    assert manifest.proof.served["timestep"]["calls"] == 5 and "int64 scalar" in manifest.proof.served["timestep"][
        "converted"]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto"])
def test_a_refusal_on_tiny_sd_speaks_the_callers_terms_and_policy(strategy, strategy_build):
    recipe, cache, _ = strategy_build(strategy)
    served, _ = _served(recipe, cache, on_miss="error")
    with no_codegen(), pytest.raises(ShapeNotBuilt) as info:
        served(**{**CALL, "height": 96, "width": 96, "num_inference_steps": 1})
    message = str(info.value)
    assert message.startswith('unet: the pipeline was called at 96x96 (1 image, guidance off), which this cache did '
                              'not build (on_miss="error"); built: 64x64 (1 image, guidance off, as called). Call the '
                              'pipeline at a built size, or add {height: 96, width: 96} to the recipe\'s shapes and '
                              'rebuild. In latents, unet was called with arg[0]=1x4x12x12:float32'), message
    assert "strict_shapes" not in message
    # guidance on per request, against a build with it off: refused by name (SD runs both halves in one call)
    with pytest.raises(ShapeNotBuilt, match=r"called at 64x64 \(1 image, guidance on\), which this cache did not "
                                            r"build.*built: 64x64 \(1 image, guidance off\)\. Guidance on changes the "
                                            r"batch this pipeline calls unet with"):
        served(**{**CALL, "guidance_scale": 7.5, "num_inference_steps": 1})
    with pytest.raises(ShapeNotBuilt, match=r"^unet was called directly, not by its pipeline, so only its inputs can "
                                            r"be compared: unet was called with arg\[0\]=1x4x4x4:float32"):
        served.unet(torch.zeros(1, 4, 4, 4), torch.tensor(999.0), encoder_hidden_states=torch.zeros(1, 77, 16))
    strict, _ = _served(recipe, cache, on_miss="eager", strict_shapes=True)
    with pytest.raises(ShapeNotBuilt, match=r"which this cache did not build \(strict_shapes=True\)"):
        strict(**{**CALL, "height": 96, "width": 96, "num_inference_steps": 1})


# -- schedulers declared in a recipe (item 2) ---------------------------------------------------------------

def test_schedulers_are_checked_when_the_recipe_is_read():
    from aotbuild.recipe.rules import parse_recipe

    with pytest.raises(RecipeError, match=r"schedulers\[1\]: 'DPMSolverMultistepSchedulr' is not a diffusers scheduler "
                                          r"class; did you mean 'DPMSolverMultistepScheduler'\?"):
        parse_recipe({**TINY_DICT, "schedulers": ["DDIMScheduler", "DPMSolverMultistepSchedulr"]})
    with pytest.raises(RecipeError, match=r"schedulers: lists a name twice"):
        parse_recipe({**TINY_DICT, "schedulers": ["DDIMScheduler", "DDIMScheduler"]})
    recipe = parse_recipe({**TINY_DICT, "schedulers": "DDIMScheduler"})
    assert recipe.schedulers == ("DDIMScheduler",)


def test_the_sorted_schedulers_are_a_key_factor_and_a_recipe_without_keeps_its_key(cache):
    from aotbuild.planner import plan

    plain, = plan(dict(TINY_DICT), cache=cache)
    one, = plan({**TINY_DICT, "schedulers": ["UniPCMultistepScheduler", "DDIMScheduler"]}, cache=cache)
    other, = plan({**TINY_DICT, "schedulers": ["DDIMScheduler", "UniPCMultistepScheduler"]}, cache=cache)
    assert "schedulers" not in plain.factors and one.factors["schedulers"] == ["DDIMScheduler",
                                                                                "UniPCMultistepScheduler"]
    assert one.key == other.key != plain.key


def test_a_scheduler_listed_twice_or_none_listed_changes_neither_the_key_nor_the_warmup(cache):
    """A file's ``schedulers: []`` or a name twice is refused when read (above); a Recipe made in Python is
    taken as it is, so the key takes each name once and an empty list as none. The pipeline's own class may
    be listed (it is in the key, as written) but is not warmed up with twice."""
    import dataclasses
    import types

    from diffusers import EulerDiscreteScheduler

    from aotbuild.pipeline.schedulers import each
    from aotbuild.planner import plan
    from aotbuild.recipe.rules import parse_recipe

    recipe = parse_recipe(dict(TINY_DICT))
    plain, = plan(recipe, cache=cache)
    none, = plan(dataclasses.replace(recipe, schedulers=()), cache=cache)
    once, = plan(dataclasses.replace(recipe, schedulers=("DDIMScheduler",)), cache=cache)
    twice, = plan(dataclasses.replace(recipe, schedulers=("DDIMScheduler", "DDIMScheduler")), cache=cache)
    assert none.key == plain.key and twice.key == once.key != plain.key
    pipe = types.SimpleNamespace(scheduler=EulerDiscreteScheduler())
    listed = types.SimpleNamespace(schedulers=("EulerDiscreteScheduler", "DDIMScheduler", "DDIMScheduler"))
    assert list(each(pipe, listed)) == ["EulerDiscreteScheduler", "DDIMScheduler"]
    assert type(pipe.scheduler) is EulerDiscreteScheduler


def test_plan_makes_each_scheduler_from_the_models_config_as_the_build_will(cache):
    from aotbuild.planner import plan

    with pytest.raises(RecipeError, match=r"schedulers\[0\]: EDMEulerScheduler\.from_config\(pipe\.scheduler\.config\) "
                                          r"fails for this model: TypeError"):
        plan({**TINY_DICT, "schedulers": ["EDMEulerScheduler"]}, cache=cache)


def test_the_build_and_the_proof_warm_up_once_per_scheduler(cache):
    """Every strategy warms up through BuildJob.run_warmup and the proof records through record_eager: each
    runs the call with the pipeline's own scheduler, then each declared one, and puts its own back."""
    from aotbuild.builder.proof import record_eager
    from aotbuild.dispatch import signature
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from aotbuild.recipe.rules import parse_recipe
    from aotbuild.strategies.base import BuildJob

    recipe = parse_recipe({**TINY_DICT, "schedulers": ["DPMSolverMultistepScheduler"]})
    pipe = load_pipeline(recipe, resolve_model(recipe, cache), "float32")
    own = pipe.scheduler
    seen = []
    inner = pipe.unet.forward
    pipe.unet.forward = lambda *a, **k: seen.append((type(pipe.scheduler).__name__, a[1].dtype)) or inner(*a, **k)
    BuildJob(type("Ctx", (), {"recipe": recipe})(), pipe, "unet", pipe.unet,
             warmup_kwargs(recipe, recipe.shapes[0], pipe), cache).run_warmup()
    del pipe.unet.forward
    assert seen == [("EulerDiscreteScheduler", torch.float32)] * 2 + [("DPMSolverMultistepScheduler", torch.int64)] * 2
    assert pipe.scheduler is own
    calls, _ = record_eager(pipe, recipe, "unet", warmup_kwargs(recipe, recipe.shapes[0], pipe))
    assert {signature(a, k).count('"int64"') for a, k, _ in calls} == {0, 1} and pipe.scheduler is own
