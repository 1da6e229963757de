"""Quantized denoisers: ``model.quantization`` (torchao), keyed from the recipe alone, built, served."""

from __future__ import annotations

import copy
import json

import pytest

from aotbuild.errors import RecipeError
from tests.conftest import invoke_cli
from tests.loras import one_level_sd

QUANTIZED = {"model": {"id": "builtin:tiny-sd", "dtype": "float32",
                       "quantization": {"backend": "torchao", "quant_type": "int8wo"}},
             "target": "inductor", "device": "cpu", "strategy": "jit-cache", "compile": {"components": ["unet"]},
             "shapes": [{"height": 64, "width": 64}], "warmup": {"num_inference_steps": 2, "guidance_scale": 0.0}}


def data(**model) -> dict:
    out = json.loads(json.dumps(QUANTIZED))
    out["model"]["quantization"].update(model)
    return out


@pytest.mark.parametrize("strategy,quant_type,options,key,says", [
    ("aot-compile", "int8wo", {}, "model.quantization", "use strategy jit-cache"),
    ("aot-package", "float8wo", {}, "model.quantization", "serves quant_type int8wo, int8dq, int8static (verified); "
                                                          "float8wo: use strategy jit-cache"),
    ("aot-package", "int8wo", {"freezing": True}, "compile.options.freezing", "folds int8wo's int8 weights back")])
def test_what_a_strategy_cannot_serve_quantized_is_refused_by_name(strategy, quant_type, options, key, says):
    from aotbuild.recipe.rules import parse_recipe

    recipe = data(quant_type=quant_type)
    recipe["compile"]["options"] = options
    parse_recipe({**recipe, "strategy": "jit-cache", "compile": {**recipe["compile"], "options": {}}})  # a valid recipe
    with pytest.raises(RecipeError) as info:
        parse_recipe({**recipe, "strategy": strategy})
    assert info.value.key == key and says in info.value.message


def test_auto_offers_aot_package_to_int8_and_prepacks_only_what_keeps_int8(models_dir):
    """Under the default, a linear-only int8 recipe is tried by aot-package first: int8dq with freezing
    (its int8 weights stay int8), int8wo without (freezing would fold its weights to float32)."""
    from aotbuild import plan

    for quant_type, tries in (("int8dq", ["aot-package+freezing", "aot-package", "jit-cache"]),
                              ("int8wo", ["aot-package", "jit-cache"])):
        recipe = data(quant_type=quant_type)
        del recipe["strategy"]
        auto = plan([recipe], models_dir)[0].as_json()["auto"]
        assert auto["tries"] == tries, auto


@pytest.mark.parametrize("strategy,options,over,key,says", [
    ("jit-cache", {}, {}, "model.quantization", "calibrated at build and served by strategy aot-package"),
    ("aot-compile", {}, {}, "model.quantization", "calibrated at build and served by strategy aot-package"),
    # the key the recipe holds: the quantization where it leaves freezing out, else its option set false
    ("aot-package", {}, {}, "model.quantization", "only through Inductor's freezing"),
    ("aot-package", {"freezing": False}, {}, "compile.options.freezing", "only through Inductor's freezing"),
    ("aot-package", {"freezing": True}, {"quant_kwargs": {"reduce_range": True}}, "model.quantization.quant_kwargs",
     "takes no arguments"),
    ("aot-package", {"freezing": True}, {"device": "cuda"}, "device", "x86 CPUs only")])
def test_int8static_is_served_by_a_prepacked_package_only(strategy, options, over, key, says):
    """int8static (PT2E, calibrated at build) is served by aot-package with freezing, on a CPU: every
    other strategy and setting is refused by name before any build."""
    from aotbuild.recipe.rules import parse_recipe

    recipe = data(quant_type="int8static")
    recipe["compile"]["options"] = {"freezing": True}
    parse_recipe({**recipe, "strategy": "aot-package"})  # what serves it
    recipe["device"] = over.pop("device", "cpu")
    recipe["model"]["quantization"].update(over)
    recipe["compile"]["options"] = options
    with pytest.raises(RecipeError) as info:
        parse_recipe({**recipe, "strategy": strategy})
    assert info.value.key == key and says in info.value.message, info.value.message


def test_auto_tries_int8static_prepacked_with_activations_of_7_bits_where_the_cpu_has_no_vnni(models_dir, monkeypatch):
    """Under the default an int8static recipe has one try, aot-package with freezing; whether its activations
    keep to 7 bits (a CPU without VNNI, or oneDNN capped below it) is a key factor of that try."""
    import torch

    from aotbuild import plan

    recipe = data(quant_type="int8static")
    del recipe["strategy"]
    explicit = {**recipe, "strategy": "aot-package", "compile": {**recipe["compile"], "options": {"freezing": True}}}
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    auto = plan([recipe], cache=models_dir)[0].as_json()["auto"]
    assert auto["tries"] == ["aot-package+freezing"], auto
    assert [e["strategy"] for e in auto["excluded"]] == ["aot-package", "aot-compile", "jit-cache"], auto
    planned = plan([explicit], cache=models_dir)[0]
    assert auto["keys"]["aot-package+freezing"] == planned.key  # the try is the explicit recipe
    vnni = torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()
    assert planned.factors["compile"]["int8_reduce_range"] is (not vnni), planned.factors["compile"]
    assert planned.factors["quantization"]["inductor"] == {}  # quantize_ is not called: nothing set in Inductor
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")  # whatever this CPU has, oneDNN is kept from VNNI
    capped = plan([explicit], cache=models_dir)[0]
    assert capped.factors["compile"]["int8_reduce_range"] is True
    assert (capped.factors["compile"] == planned.factors["compile"]) is (not vnni)


def test_an_int8static_recipe_replays_with_its_closed_operator_list():
    """What freezing records for an int8static weight (quantize_per_channel with the stored scales, then
    oneDNN's int8 reorder) replays for an int8 constant, and is refused for a float one."""
    import torch

    from aotbuild.strategies import prepack

    torch.manual_seed(0)
    weight, scale, zero = torch.randn(16, 8, 3, 3), torch.rand(16) / 50 + 1e-3, torch.zeros(16, dtype=torch.int64)
    program = [["input", [0], {}], ["input", [1], {}], ["input", [2], {}],
               ["quantized_decomposed.quantize_per_channel.default",
                [{"ref": 0}, {"ref": 1}, {"ref": 2}, 0, -128, 127, {"dtype": "int8"}], {}],
               ["onednn.qconv_prepack", [{"ref": 3}, {"ref": 1}, 0.02, 128, [1, 1], [1, 1], [1, 1], 1, [1, 8, 16, 16]],
                {}]]
    quantized = torch.clamp(torch.round(weight / scale[:, None, None, None]), -128, 127).to(torch.int8)
    packed = torch.ops.onednn.qconv_prepack(quantized, scale, 0.02, 128, [1, 1], [1, 1], [1, 1], 1, [1, 8, 16, 16])
    recipe = {"inputs": ["w", "_scale_0", "_zero_point_0"], "program": program, "value": prepack.describe(packed)}
    record = {"asks": ["_frozen_param0", "_scale_0", "_zero_point_0"], "constants": {},
              "derived": {"_frozen_param0": recipe},
              "derived_from": {"w": [[16, 8, 3, 3], "float32", "cpu"]},
              "lifted": {"_scale_0": [[16], "float32"], "_zero_point_0": [[16], "int64"]}, "lifted_path": "x"}
    assert prepack.check_record(record) == ""
    replayed = prepack.replay(recipe, {"w": weight, "_scale_0": scale, "_zero_point_0": zero})
    assert replayed.is_mkldnn and prepack.same_value(replayed, packed)
    floating = {**recipe, "value": {**prepack.describe(weight)}}
    assert "not one aotbuild replays for float32" in prepack.check_record(
        {**record, "derived": {"_frozen_param0": floating}})


def test_a_calibrated_package_names_the_weights_that_differ():
    import torch

    from aotbuild.strategies.runner import calibrated_problem, tensor_digest

    a, b = torch.ones(4), torch.zeros(3)
    digests = {"a": tensor_digest(a), "b": tensor_digest(b)}
    assert calibrated_problem({"a": a, "b": b.clone()}, digests) == ""
    assert "calibrated on other weights (int8static: 2 weights, e.g. b differs)" in calibrated_problem(
        {"a": a, "b": b + 1}, digests)
    assert "e.g. b differs" in calibrated_problem({"a": a}, digests)


@pytest.mark.parametrize("over,key", [({"backend": "bitsandbytes"}, "model.quantization.backend"),
                                      ({"quant_type": "int7"}, "model.quantization.quant_type"),
                                      ({"components": ["vae"]}, "model.quantization.components")])
def test_a_bad_quantization_is_a_recipe_error_naming_the_key(over, key):
    from aotbuild.recipe.rules import parse_recipe

    with pytest.raises(RecipeError) as info:
        parse_recipe(data(**over))
    assert info.value.key == key


def test_the_quantization_and_what_it_sets_in_inductor_are_key_factors(models_dir):
    from aotbuild import plan

    quantized = plan([data()], models_dir)[0]
    factor = quantized.factors["quantization"]
    assert factor["backend"] == "torchao" and factor["version"] and factor["quant_type"] == "int8wo"
    assert factor["inductor"] == {"coordinate_descent_check_all_directions": True, "coordinate_descent_tuning": True,
                                  "force_fuse_int_mm_with_mul": True}
    plain = plan([{**QUANTIZED, "model": {"id": "builtin:tiny-sd", "dtype": "float32"}}], models_dir)[0]
    assert "quantization" not in plain.factors and plain.key != quantized.key
    assert plan([data(quant_type="int8dq")], models_dir)[0].key != quantized.key
    off = plan([data(quant_kwargs={"set_inductor_config": False})], models_dir)[0]
    assert off.factors["quantization"]["inductor"] == {} and off.key != quantized.key


def test_without_torchao_the_error_says_how_to_install_it(monkeypatch):
    import builtins

    from aotbuild.errors import UsageError
    from aotbuild.features import quantization as quantize

    real = builtins.__import__

    def no_torchao(name, *args, **kwargs):
        if name.startswith("torchao"):
            raise ImportError("No module named 'torchao'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torchao)
    with pytest.raises(UsageError, match=r"pip install 'aotbuild\[torchao\]'"):
        quantize.require()


def _int8dq_served():
    """A module of two int8dq linears behind the runner, through the fake package of tests/test_server.py's
    kind: the package asks for the first linear's quantized weight as torch.export lifts it (its inner
    tensors) and a constant derived from the second's (its int8 weight transposed, as freezing records)."""
    import torch
    from torch import nn
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    from aotbuild.strategies.runner import PackageRunner

    class Pinning:  # a loaded package as the runner sees it (tests/test_server.py's fakes)
        def __init__(self):
            self.constants, self.handed = {}, []

        def load_constants(self, tensors, check_full_update, user_managed):
            self.constants.update(tensors)
            self.handed.append(sorted(tensors))

        def __call__(self, *args, **kwargs):
            return None

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False))
    quantize_(module, Int8DynamicActivationInt8WeightConfig())
    q0, s0 = "0.parametrizations.weight.original0", "0.parametrizations.weight.original1"
    q1 = "1.parametrizations.weight.original0"
    transpose = [["input", [0], {}], ["aten.permute.default", [{"ref": 0}, [1, 0]], {}]]
    record = {"path": "aoti/fake.pt2", "strides": None, "baked": {},
              "constants": {q0: [[32, 32], "int8", "cpu"], s0: [[32, 1], "float32", "cpu"]},
              "derived": {"_frozen_param0": {"inputs": [q1], "program": transpose, "value": {
                  "shape": [32, 32], "dtype": "int8", "layout": "strided", "stride": [1, 32], "nbytes": 1024}}},
              "derived_from": {q1: [[32, 32], "int8", "cpu"]}, "asks": [q0, s0, "_frozen_param0"]}
    model = Pinning()
    return module, model, PackageRunner(model, module, "unet", record, "cpu", pinning=True), (q0, s0)


def test_a_quantized_weight_is_handed_over_as_its_inner_tensors_and_followed_when_replaced():
    """torch.export lifts a tensor-subclass weight (torchao's Int8Tensor) as its inner tensors, under
    ``<module>.parametrizations.<weight>.original<i>``: the runner hands the package the live module's,
    replays a derived constant from them, and follows a replaced or rewritten quantized weight."""
    import torch
    from torch import nn
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    module, model, run, (q0, s0) = _int8dq_served()
    assert model.handed == [sorted([q0, s0, "_frozen_param0"])]
    assert model.constants[q0].data_ptr() == module[0].weight.qdata.data_ptr()  # an alias of the live int8
    assert torch.equal(model.constants["_frozen_param0"], module[1].weight.qdata.t())
    run()
    assert run.rebinds == 0 and len(model.handed) == 1  # nothing changed: nothing handed over
    other = nn.Sequential(nn.Linear(32, 32, bias=False))
    quantize_(other, Int8DynamicActivationInt8WeightConfig())
    module[0].weight = other[0].weight  # another quantized weight: its inner tensors handed over, alone
    run()
    assert model.handed[-1] == sorted([q0, s0]) and model.constants[q0].data_ptr() == other[0].weight.qdata.data_ptr()
    with torch.no_grad():
        module[1].weight.qdata.mul_(-1)  # the int8 a derived constant comes from, changed in place
    run()
    assert torch.equal(model.constants["_frozen_param0"], module[1].weight.qdata.t()) and run.replayed == 2


def test_functional_call_takes_the_inner_tensors_by_their_exported_names():
    """prepack.check_other_weights serves other weights by the names a package asks for and runs eager on
    them: subclasses.wrapped rebuilds each quantized weight around the inner tensors given."""
    import torch

    from aotbuild.strategies.runner import named_tensors
    from aotbuild.strategies.subclasses import wrapped

    module, _, _, (q0, s0) = _int8dq_served()
    x = torch.randn(4, 32)
    tensors = named_tensors(module)
    assert q0 in tensors and "0.weight" not in tensors
    with torch.no_grad():
        same = torch.func.functional_call(module, wrapped(module, tensors), (x,))
        doubled = torch.func.functional_call(module, wrapped(module, {s0: tensors[s0] * 2}), (x,))
        half = module[1](module[0](x))
    assert torch.equal(same, half)
    assert not torch.allclose(doubled, same)
    assert torch.equal(module[0].weight.scale, tensors[s0])  # the module is unchanged


@pytest.mark.slow  # two real builds of the one-level int8 UNet (jit-cache; aot-package with freezing) and proofs
def test_int8_builds_serve_with_0_compiles_equal_to_eager_quantized(models_dir, tmp_path):
    """The build's proof is the replica (aotbuild/builder/proof.py): a fresh process, every compiler folder
    empty, quantizes the pipeline as the recipe says, loads the entry from another store and replays
    every call; what it saw is the entry's ``proof.served``. int8wo by jit-cache: its FX graph cache hit.
    int8dq by aot-package with freezing (what auto tries first for it on a CPU: test_auto_offers_...;
    named here, so the proof's speed verdict, a timing, decides nothing): prepacked, its int8 weights
    staying int8 (the derived constants are the int8 weight transposed and its int32 column sums)."""
    # the one-level tiny UNet: every kind of Linear int8 replaces, fewer kernels to compile than tiny-sd's
    model = one_level_sd(models_dir, tmp_path / "one-level-sd")
    recipes = []
    for quant_type, strategy in (("int8wo", "jit-cache"), ("int8dq", "aot-package")):
        recipe = data(quant_type=quant_type)
        recipe["model"]["id"], recipe["strategy"] = str(model), strategy
        if strategy == "aot-package":
            recipe["compile"]["options"] = {"freezing": True}
        recipes.append(tmp_path / f"tiny_sd_{quant_type}.yaml")
        recipes[-1].write_text(json.dumps(recipe))
    cache = tmp_path / "cache"
    # in this process: the build's loader, worker and proof are fresh processes already
    build = invoke_cli("build", "--json", "--cache", str(cache), *map(str, recipes),
                       env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"), "AOTBUILD_CACHE": ""})
    assert build.returncode == 0, build.stdout[-3000:]
    jobs = {job["recipe"]: job for job in json.loads(build.stdout)["jobs"]}
    manifests = {}
    for quant_type, bound in (("int8wo", 1e-5), ("int8dq", 2e-2)):
        job = jobs[f"tiny_sd_{quant_type}"]
        assert job["status"] == "built", job
        manifest = manifests[quant_type] = json.loads(
            invoke_cli("show", "--json", "--cache", str(cache), job["key"][:12]).stdout)
        proof, served = manifest["proof"], manifest["proof"]["served"]
        # equal to eager quantized the same way (the proof's own pipeline), with 0 compiles
        assert proof["compiles"] == 0 and proof["max_abs_diff"] <= bound and proof["calls"] >= 1, proof
        assert served["hits"] == 1 and served["dispatch"] == {"": {"built": proof["calls"], "unbuilt": 0}}, served
        # served with int8 weights: the entry's structure (checked before its load was a hit) names their class
        to_q = "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight: param "
        line, = (x for x in manifest["structure"]["lines"] if x.startswith(to_q))
        assert line[len(to_q):].split()[0].endswith(".Int8Tensor"), line
    served = manifests["int8wo"]["proof"]["served"]
    assert served["fxgraph_cache_miss"] == 0 and served["fxgraph_cache_hit"] >= 1, served
    dq = manifests["int8dq"]
    assert dq["proof"]["tolerance"] == 2e-2  # int8dq's bound: its activations are quantized as it runs
    package, = dq["packages"]
    # the zero points its kernels never read are not digested as compiled in: the entry holds no weights
    assert not dq["embeds_weights"] and not package["baked"], package["baked"]
    derived, sources = package["derived"], package["derived_from"]
    import torch

    # int32 column sums on a CPU with VNNI; without, oneDNN's int8 linear reorder (test_stored_recipes.py)
    vnni = torch.cpu._is_vnni_supported() or torch.cpu._is_amx_tile_supported()
    wanted = {"int8", "int32", "float32"} if vnni else {"int8", "float32"}
    assert wanted <= {r["value"]["dtype"] for r in derived.values()}, derived
    assert any(f.endswith(".to_q.parametrizations.weight.original0") for f in sources), sources  # int8 in
    # no float constant made from an int8 weight (that would be the weight dequantized)
    assert all(r["value"]["dtype"] != "float32" or all(sources[i][1] != "int8" for i in r["inputs"])
               for r in derived.values())


def test_a_frozen_constant_that_dequantizes_an_int8_weight_is_refused_and_other_weights_change_int8():
    """A float constant folded from an int8 weight would serve the quantized model dequantized (4x its
    bytes): the recorder refuses it by name. The build's check with other weights changes a quantized
    weight's integers too, so a constant derived from them is checked against other values."""
    import torch

    from aotbuild.strategies import prepack

    tensors = {"w.parametrizations.weight.original0": torch.randint(-127, 127, (4, 4), dtype=torch.int8),
               "w.parametrizations.weight.original1": torch.rand(4, 1), "mask": torch.ones(4, dtype=torch.bool)}
    recipe = {"inputs": ["w.parametrizations.weight.original0"], "value": {"dtype": "float32"}}
    with pytest.raises(prepack.RecipeError, match=r"folds the torch.int8 weight 'w.parametrizations.weight.original0' "
                                                  r"into a float32 constant \(_frozen_param3\)"):
        prepack._refuse_dequantized("_frozen_param3", recipe, tensors)
    prepack._refuse_dequantized("_frozen_param3", {**recipe, "value": {"dtype": "int8"}}, tensors)  # stays int8
    prepack._refuse_dequantized("_frozen_param3", {"inputs": ["mask"], "value": {"dtype": "float32"}}, tensors)
    other = prepack.other_weights(tensors, list(tensors))
    q = "w.parametrizations.weight.original0"
    assert other[q].dtype == torch.int8 and torch.equal(other[q], tensors[q].flip([0, 1]))
    assert other["mask"] is tensors["mask"]  # a bool is not a quantized weight


def test_a_real_parametrization_is_still_read_under_its_own_names():
    """weight_norm's parametrization holds real tensors under the names torch.export also gives a subclass
    weight's inner tensors: the runner reads those (no subclass there), follows a replaced one, and a
    call with nothing changed hands nothing over."""
    import torch
    from torch import nn

    from aotbuild.strategies.runner import PackageRunner, lookup

    class Fake:
        def __init__(self):
            self.handed = []

        def load_constants(self, tensors, check_full_update, user_managed):
            self.handed.append(sorted(tensors))

        def __call__(self, *args, **kwargs):
            return None

    module = nn.Sequential(nn.utils.parametrizations.weight_norm(nn.Linear(4, 4, bias=False)))
    g, v = "0.parametrizations.weight.original0", "0.parametrizations.weight.original1"
    assert lookup(module, v)[0] is module[0].parametrizations.weight.original1
    record = {"path": "aoti/fake.pt2", "strides": None, "baked": {},
              "constants": {g: [[4, 1], "float32", "cpu"], v: [[4, 4], "float32", "cpu"]}}
    model = Fake()
    run = PackageRunner(model, module, "vae", record, "cpu")
    run()
    assert run.rebinds == 0 and model.handed == [[g, v]]
    module[0].parametrizations.weight.original1 = nn.Parameter(torch.randn(4, 4))
    run()
    assert model.handed[-1] == [v]


@pytest.mark.slow  # one real build of the one-level UNet in int8static (export, calibration, compile) and its proof
def test_int8static_serves_its_weights_prepacked_in_int8_and_refuses_others(models_dir, tmp_path):
    """int8 that reaches the convolutions (PT2E): the build calibrates on the warmup, the package serves the
    user's float pipeline as it is with 0 compiles (the proof, a fresh process), within the job's bound of the
    same quantized model run eagerly (computed here again, calibrated on the same calls), its int8 weights
    derived at load from the float ones; other weights are a miss at load, a weight changed after load is
    refused at the next call."""
    import torch

    from aotbuild import load_compiled
    from aotbuild.errors import CacheMiss, PackageMismatch
    from aotbuild.pipeline.models import load_pipeline, resolve_model
    from aotbuild.pipeline.pipecall import warmup_kwargs
    from aotbuild.recipe.rules import load_recipe
    from aotbuild.strategies import calibrate
    from aotbuild.targets.inductor import InductorTarget

    model = one_level_sd(models_dir, tmp_path / "one-level-sd")
    recipe = data(quant_type="int8static")
    recipe["model"]["id"], recipe["strategy"] = str(model), "aot-package"
    recipe["compile"]["options"] = {"freezing": True}
    path = tmp_path / "int8static.yaml"
    path.write_text(json.dumps(recipe))
    cache = tmp_path / "cache"
    build = invoke_cli("build", "--json", "--cache", str(cache), str(path),
                       env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor"), "AOTBUILD_CACHE": ""})
    assert build.returncode == 0, build.stdout[-3000:]
    job, = json.loads(build.stdout)["jobs"]
    assert job["status"] == "built", job
    manifest = json.loads(invoke_cli("show", "--json", "--cache", str(cache), job["key"][:12]).stdout)
    proof, served = manifest["proof"], manifest["proof"]["served"]
    assert proof["compiles"] == 0 and proof["calls"] == 2, proof
    # against the quantized model run eagerly, calibrated in the proof's process as the build did (relative);
    # how far that is from the float model is a figure beside it
    relative = served["relative"]
    assert relative["max_rel_diff"] <= relative["tolerance"] == calibrate.EAGER_BOUND, relative
    assert relative["from_float"] > max(1e-3, 10 * relative["max_rel_diff"]), relative
    # the format itself as far from float as the package (each call: calibrate.accepted), nothing unaccounted
    assert relative["quantized_from_float"] == pytest.approx(relative["from_float"], rel=0.2), relative
    assert relative["unaccounted"] == 0.0 and relative["over_bound_within_format"] == 0, relative
    shown = invoke_cli("show", "--cache", str(cache), job["key"][:12]).stdout  # what it was held to, in words
    assert (f"max |compiled - eager| / |eager| {relative['max_rel_diff']:.2e} (bound 0.2); from the float model "
            f"{relative['from_float']:.2e} (the quantized model run eagerly "
            f"{relative['quantized_from_float']:.2e})") in shown, shown
    assert served["hits"] == 1 and served["dispatch"] == {"": {"built": 2, "unbuilt": 0}}, served
    package, = manifest["packages"]
    derived = package["derived"]
    ops = {step[0] for r in derived.values() for step in r["program"]}
    assert {"onednn.qconv_prepack", "onednn.qlinear_prepack"} <= ops, ops  # the convolutions and linears in int8
    assert sum(r["value"]["dtype"] == "int8" for r in derived.values()) >= 10, derived
    assert manifest["embeds_weights"] and len(package["calibrated"]) >= len(package["derived_from"]), package
    assert all(v[1] == "float32" for v in package["derived_from"].values())  # derived from the float weights
    assert any(name.startswith("x_scale") for name in package["lifted"]), package["lifted"]

    # eager quantized: the same model calibrated on the same calls (the warmup, same seed) run eagerly
    r = load_recipe(path)
    shape = r.shapes[0]
    pipe = load_pipeline(r, resolve_model(r, cache), "float32")
    calls = []
    hook = pipe.unet.register_forward_pre_hook(
        lambda _, a, k: calls.append((tuple(x.clone() for x in a), {n: v.clone() if isinstance(v, torch.Tensor) else v
                                                                     for n, v in k.items()})), with_kwargs=True)
    pipe(**warmup_kwargs(r, shape, pipe))
    hook.remove()
    with torch.no_grad():
        quantized = calibrate.convert(pipe.unet, calls, InductorTarget().int8_reduce_range("cpu"))
        expected = [quantized(*a, **k)[0] for a, k in calls]
    del quantized
    load_compiled(r, pipe=pipe, cache=cache, on_miss="error", strict_shapes=True)
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        got = [pipe.unet(*a, **k)[0] for a, k in calls]
    assert counters["stats"]["unique_graphs"] == graphs  # 0 compiles
    for g, e in zip(got, expected, strict=True):
        assert float((g - e).norm() / e.norm()) <= calibrate.EAGER_BOUND
    # a weight changed after load (one prepacked from, one handed over as it is): refused before anything is
    # handed over, at this call and the next; put back, it serves again
    for name in ("conv_in.weight", "conv_in.bias"):
        weight = pipe.unet.get_parameter(name)
        kept = weight.detach().clone()
        with torch.no_grad():
            weight.mul_(1.5)
        for _ in range(2):
            with pytest.raises(PackageMismatch, match=f"calibrated on other weights .*{name} differs"), \
                    torch.no_grad():
                pipe.unet(*calls[0][0], **calls[0][1])
        with torch.no_grad():
            weight.copy_(kept)
            assert torch.equal(pipe.unet(*calls[0][0], **calls[0][1])[0], got[0])
    # a deep copy (a server's per-request pipeline) is served by a package of its own with the same weights
    twin = copy.deepcopy(pipe)
    with torch.no_grad():
        assert torch.equal(twin.unet(*calls[0][0], **calls[0][1])[0], got[0])
    del twin
    # discard_weights: the float weights the int8 ones are derived from are dropped, and a rebind's check skips
    # them (it read the placeholders, so every rebind was refused); refit takes only the weights calibrated on
    import aotbuild
    from aotbuild.errors import WeightsDiscarded

    lean = load_pipeline(r, resolve_model(r, cache), "float32")
    load_compiled(r, pipe=lean, cache=cache, on_miss="error", strict_shapes=True, discard_weights=True)
    with torch.no_grad():
        assert torch.equal(lean.unet(*calls[0][0], **calls[0][1])[0], got[0])
    with pytest.raises(WeightsDiscarded), torch.no_grad():
        lean.unet.conv_in.weight.mul_(1)
    bias = lean.unet.conv_in.bias
    with torch.no_grad():
        bias.add_(0)  # an in-place write that changes nothing: a rebind, its check passes
        assert torch.equal(lean.unet(*calls[0][0], **calls[0][1])[0], got[0])
    kept = pipe.unet.conv_in.weight.detach().clone()
    with pytest.raises(PackageMismatch, match="refit: .*calibrated on other weights"):
        aotbuild.refit(lean.unet, {"conv_in.weight": kept * 1.5})
    bias_before = lean.unet.conv_in.bias.detach().clone()
    with pytest.raises(PackageMismatch, match="refit: .*calibrated on other weights"):  # a weight still held
        aotbuild.refit(lean.unet, {"conv_in.bias": bias_before + 1})
    assert torch.equal(lean.unet.conv_in.bias.detach(), bias_before)  # refused before anything was written
    assert aotbuild.refit(lean.unet, {"conv_in.weight": kept}) >= 1  # the weights calibrated on: replayed
    with torch.no_grad():
        assert torch.equal(lean.unet(*calls[0][0], **calls[0][1])[0], got[0])
    del lean
    # other weights at load: a miss that says so
    other = load_pipeline(r, resolve_model(r, cache), "float32")
    with torch.no_grad():
        other.unet.conv_in.weight.mul_(1.5)
    with pytest.raises(CacheMiss, match="calibrated on other weights"):
        load_compiled(r, pipe=other, cache=cache, on_miss="error")


def test_a_process_that_imported_torchaos_x86_quantizer_still_quantizes():
    """torchao's X86InductorQuantizer (int8static's conversion) sets Inductor's pre_grad_custom_pass to a pass
    object when imported, and every copy of the settings holds a copy of it that equals no other: quantize_
    in such a process read as changing it and was refused (a test worker that had converted a model)."""
    import torch
    import torch._inductor.config as inductor_config
    from torchao.quantization.pt2e.inductor_passes import x86 as x86_passes

    from aotbuild.features import quantization
    from aotbuild.recipe.rules import parse_recipe

    # what the quantizer's import does; set here because on a worker that imported it for an earlier test the
    # import is a no-op and the suite has put the pass back to its default since (restored by conftest.py:
    # monkeypatch's undo deletes a setting of Inductor's config module, which then reads as absent)
    inductor_config.pre_grad_custom_pass = x86_passes.quant_lift_up
    recipe = parse_recipe({**data(quant_type="int8dq"), "compile": {"components": ["unet"]}})
    pipe = type("Pipe", (), {})()
    pipe.unet = torch.nn.Sequential(torch.nn.Linear(64, 64))
    quantization.apply(pipe, recipe)  # raised "changed Inductor settings the key does not hold" before
    assert type(pipe.unet[0].weight).__name__ != "Parameter"


def test_int8statics_conversion_leaves_inductors_passes_as_they_were():
    """Importing torchao's X86InductorQuantizer sets Inductor's pre_grad_custom_pass for the whole process: left
    set, a later compile in the builder's process (another recipe's jit-cache build) carried it in Inductor's
    cache keys and missed in a serving process without it. The conversion and the int8 compiles have it for
    their own time alone."""
    import torch
    import torch._inductor.config as inductor_config

    from aotbuild.strategies import calibrate

    mine = object()  # what the user (or the default, None) had set
    inductor_config.pre_grad_custom_pass = mine  # put back by conftest.py
    with calibrate.quantizer_passes():
        during = inductor_config.pre_grad_custom_pass
    assert during is not mine and type(during).__name__ == "QuantLiftUp"
    assert inductor_config.pre_grad_custom_pass is mine

    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    calls = [((torch.randn(2, 8),), {}) for _ in range(2)]
    converted = calibrate.convert(module, calls)
    assert inductor_config.pre_grad_custom_pass is mine
    assert any("quantize_per_tensor" in str(n.target) for n in converted.graph.nodes)


@pytest.mark.parametrize("gap,served_from_float,quantized_from_float,ok", [
    (0.021, 0.027, 0.0268, True),    # within the bound of the quantized model run eagerly
    (0.28, 0.3146, 0.3159, True),    # SD 1.5 size, VNNI: over the bound, as far from float as the format itself
    (0.488, 0.5805, 0.5808, True),   # the same kept from VNNI (ONEDNN_MAX_CPU_ISA=AVX2), 7-bit activations
    (0.41, 0.364, 0.276, False),     # a CPU without VNNI saturating full-range activations (tiny UNet, 1.32x)
    (0.33, 0.33, 0.276, True),       # 1.196x: the margin's edge
    (0.33, 0.34, 0.276, False),      # 1.23x
    (0.47, 0.38, 0.316, False),      # a wrong output scale (0.62x the float output): as far, but elsewhere
    (0.30, 0.0, 0.30, False),        # int8 kernels lost: the package is the float model
    (0.30, 0.24, 0.30, False),       # closer to float than the format by more than the margin
    (1.0, 1.0, 0.9, False),          # an output of zeros where the format is mostly noise (FORMAT_NOISE_CAP)
    (0.25, 0.01, 0.0, False),        # the format exact, the package not: the bound alone
    (0.3, 0.3, float("inf"), False),  # a float output of zeros: no relative figure
])
def test_a_calibrated_output_over_the_bound_is_served_only_as_far_from_float_as_its_format(
        gap, served_from_float, quantized_from_float, ok):
    """int8static: an output more than EAGER_BOUND from the quantized model run eagerly is accepted only where
    the package is as far from the float model as the quantized model is (within FLOAT_MARGIN either way) and
    at most FLOAT_MARGIN times that from it, while the format is less than FORMAT_NOISE_CAP from float; the
    first figures are measured ones (calibrate.FLOAT_MARGIN)."""
    import torch

    from aotbuild.strategies import calibrate

    assert calibrate.accepted(gap, served_from_float, quantized_from_float) is ok
    zeros, ones = torch.zeros(3), torch.ones(3)
    assert calibrate.relative(zeros, zeros) == 0.0 and calibrate.relative(ones, zeros) == float("inf")
    assert calibrate.relative(ones * 1.5, ones) == pytest.approx(0.5)


def test_the_proof_holds_each_int8static_output_to_the_bound_or_to_its_formats_own_distance():
    """proof._calibrated_gaps pairs each recorded output's gap from the quantized model with its distances from
    the float model (the package's, the quantized model's) and the verdict refuses only what neither rule
    accepts; a gap of a text-length call (no float pairing) is held to the bound alone."""
    import torch

    from aotbuild.builder import proof
    from aotbuild.errors import ProofFailed

    flo = [torch.ones(4), torch.ones(4)]
    quant = [torch.ones(4) * 1.3, torch.ones(4) * 1.01]  # 0.3 and 0.01 from float
    calls = [((), {}, [quant[0]]), ((), {}, [quant[1]])]
    floats = [((), {}, [flo[0]]), ((), {}, [flo[1]])]
    within = proof._calibrated_gaps([0.28, 0.02], [0.31, 0.012], calls, floats)
    assert within["quantized_from_float"] == pytest.approx(0.3, rel=1e-5)
    assert within["over_bound_within_format"] == 1 and within["unaccounted"] == 0.0, within
    beyond = proof._calibrated_gaps([0.28, 0.02], [0.40, 0.012], calls, floats)  # 1.33x the format's distance
    assert beyond["over_bound_within_format"] == 0 and beyond["unaccounted"] == 0.28, beyond
    assert beyond["unaccounted_from_float"] == 0.40  # the refused output's own pair, for the message
    assert beyond["unaccounted_quantized_from_float"] == pytest.approx(0.3, rel=1e-5)
    text = proof._calibrated_gaps([0.1, 0.02, 0.25], [0.11, 0.012], calls, floats)  # a third, unpaired gap
    assert text["unaccounted"] == 0.25, text
    with pytest.raises(RuntimeError, match="not the same outputs"):
        proof._calibrated_gaps([0.1], [0.11, 0.012], calls, floats)

    result = {"load_s": 1.0, "compiles": 0, "max_abs_diff": 0.5, "tolerance": 1e-4, "instances": 1, "calls": 2,
              "counter": "fxgraph_cache_miss"}
    relative = {"max_rel_diff": 0.28, "tolerance": 0.2, "from_float": 0.31}
    passed = proof.verdict({**result, "served": {"relative": {**relative, **within}}}, "unet at 64x64")
    assert passed.served["relative"]["unaccounted"] == 0.0
    with pytest.raises(ProofFailed, match=r"differs from eager by 0.28 .*0.4 from the float model where the "
                                          r"quantized model is 0.3\b"):
        proof.verdict({**result, "served": {"relative": {**relative, **beyond, "from_float": 0.9}}}, "unet at 64x64")
    with pytest.raises(ProofFailed, match="differs from eager by 0.28"):  # an entry without the pairing: the bound
        proof.verdict({**result, "served": {"relative": relative}}, "unet at 64x64")
    # `aotbuild show` says what the proof held it to: the relative bound, the format's own distance from float
    from dataclasses import replace

    from aotbuild.cli.commands import _difference_text

    assert _difference_text(passed) == ("max |compiled - eager| / |eager| 2.80e-01 (bound 0.2; 1 output(s) over it "
                                        "as far from the float model as the format itself); from the float "
                                        "model 3.10e-01 (the quantized model run eagerly 3.00e-01)")
    absolute = "max |compiled - eager| 5.00e-01 (tolerance 1e-04)"
    assert _difference_text(replace(passed, served={})) == absolute
    for hostile in ({"max_rel_diff": "\x1b[2J", "tolerance": 0.2}, {"max_rel_diff": 10**400, "tolerance": 0.2},
                    {"max_rel_diff": True, "tolerance": 0.2}, [1]):  # no text, no overflow, no bool printed
        assert _difference_text(replace(passed, served={"relative": hostile})) == absolute
    odd = {"max_rel_diff": 0.1, "tolerance": 0.2, "over_bound_within_format": True, "from_float": 10**400,
           "quantized_from_float": 0.3}
    assert _difference_text(replace(passed, served={"relative": odd})) == \
        "max |compiled - eager| / |eager| 1.00e-01 (bound 0.2)"


def test_the_weights_an_int8static_load_checks_are_hashed_on_every_core_to_the_same_digests(monkeypatch):
    """runner.tensor_digests: a pool of threads past PARALLEL_DIGEST_BYTES (hashlib releases the GIL), the
    calling thread below it; the digests are tensor_digest's, in order, and calibrated_problem still names
    the first weight that differs (a bfloat16 one too)."""
    import torch

    from aotbuild.strategies import runner

    tensors = [torch.randn(6_000_000), torch.randn(3, 5).t(), torch.randn(5_000_000).to(torch.bfloat16)]
    expected = [runner.tensor_digest(t) for t in tensors]
    used = []
    monkeypatch.setattr(runner.os, "cpu_count", lambda: 4)
    import concurrent.futures

    real = concurrent.futures.ThreadPoolExecutor
    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", lambda *a, **k: used.append(a) or real(*a, **k))
    assert runner.tensor_digests(tensors) == expected and used == []  # 34 MB: below the threshold, no pool
    monkeypatch.setattr(runner, "PARALLEL_DIGEST_BYTES", 1 << 20)
    assert runner.tensor_digests(tensors) == expected and used == [(3,)]  # past it: one thread per tensor here
    named = {"a": tensors[0], "b": tensors[1], "c": tensors[2]}
    calibrated = dict(zip(named, expected, strict=True))
    assert runner.calibrated_problem(named, calibrated) == ""
    changed = {**named, "c": tensors[2].clone().add_(1), "b": tensors[1] * 2}
    assert "e.g. b differs" in runner.calibrated_problem(changed, calibrated)
    assert "e.g. c differs" in runner.calibrated_problem({**named, "c": tensors[2] * 2}, calibrated)


@pytest.mark.parametrize("quant_type,absolute,relative", [("int8static", 0.0, 0.2), ("int8dq", 2e-2, 0.0)])
def test_a_component_the_recipe_does_not_quantize_keeps_its_dtypes_bound_in_its_proof(quant_type, absolute,
                                                                                      relative):
    """The proof's recipe compiles its job's component alone: with ``model.quantization.components: [unet]``
    and the VAE compiled too, the VAE's proof is held to float32's absolute bound, not the quantized type's
    (int8static's relative 0.2 replaced it for every component of the recipe)."""
    from dataclasses import replace

    from aotbuild.features import registry as features
    from aotbuild.recipe.rules import parse_recipe

    recipe = data(quant_type=quant_type, components=["unet"])
    recipe["strategy"] = "aot-package"
    recipe["compile"] = {"components": ["unet", "vae"], "options": {"freezing": True}}
    full = parse_recipe(recipe)
    for component, expected in (("unet", (absolute, relative)), ("vae", (0.0, 0.0))):
        job = replace(full, compile=replace(full.compile, components=(component,)))  # as proof.serve scopes it
        assert (features.tolerance(job, 0.0), features.relative_tolerance(job)) == expected, component
