"""A store's prepacked recipes are data, not a program (issue 53): a closed list of operators per format,
what the build's recorder emits (held here by recording each), no operator that writes to its inputs, a
file or makes a tensor from nothing, every reference and size checked when a manifest is read and by
``verify`` (nothing loaded), each replayed value checked against the one the build recorded, and a
recipe missing or extra refused before anything is handed over (aotbuild/strategies/prepack.py).
The end-to-end tampering of a real package: tests/test_prepack.py."""

from __future__ import annotations

import collections
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

from aotbuild.cache.manage import Finding, verify
from aotbuild.strategies import prepack
from aotbuild.strategies.aot_package import AotPackage
from aotbuild.strategies.registry import checked_store
from tests.conftest import REPO, run_cli
from tests.manifests import add_entry, write_raw

VALUE = {"shape": [1, 4], "dtype": "float32", "layout": "strided", "stride": [4, 1], "nbytes": 16}
GOOD = [["input", [0], {}], ["aten.reshape.default", [{"ref": 0}, [1, 4]], {}]]


def record(program=GOOD, value=VALUE, inputs=("w",), **fields):
    """An AOT package record with one derived constant, made from the weight ``w`` (4 floats)."""
    out = {"constants": {"b": [[4], "float32", "cpu"]},
           "derived": {"_frozen_param0": {"inputs": list(inputs), "program": program, "value": value}},
           "derived_from": {"w": [[4], "float32", "cpu"]}, "asks": ["_frozen_param0", "b"]}
    out.update(fields)
    return out


def test_a_well_formed_recipe_passes_and_replays_to_what_the_build_recorded():
    assert AotPackage().check_records((record(),)) == ""
    w = torch.arange(4.0)
    assert torch.equal(prepack.replay(record()["derived"]["_frozen_param0"], {"w": w}), w.reshape(1, 4))


HOSTILE = {
    # operators outside the closed list: a file, an in-place write to a weight, a tensor from nothing
    "from_file": ["aten.from_file.default", ["/tmp/aotbuild-planted", True, 1 << 20], {}],
    "fill_": ["aten.fill_.Scalar", [{"ref": 0}, 1.0], {}],
    "zero_": ["aten.zero_.default", [{"ref": 0}], {}],
    "copy_": ["aten.copy_.default", [{"ref": 0}, {"ref": 0}], {}],
    "empty": ["aten.empty.memory_format", [[1 << 40]], {}],
    "out=": ["aten.mul.out", [{"ref": 0}, {"ref": 0}], {"out": {"ref": 0}}],
    "eval": ["builtins.eval", ["1"], {}],
    "torch.load": ["torch.load", ["x"], {}],
    "unknown": ["aten.no_such_op.default", [], {}],
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_an_operator_outside_what_freezing_records_is_refused_when_the_manifest_is_read(name, tmp_path):
    step = HOSTILE[name]
    why = AotPackage().check_records((record([["input", [0], {}], step]),))
    assert "not one aotbuild replays for float32 constants" in why, why
    # and a replay that was never checked refuses it too, before it runs: no file, the weight unchanged
    w = torch.arange(4.0)
    recipe = record([["input", [0], {}], step])["derived"]["_frozen_param0"]
    with pytest.raises(prepack.RecipeError, match="not one aotbuild replays"):
        prepack.replay(recipe, {"w": w})
    assert torch.equal(w, torch.arange(4.0)) and not os.path.exists("/tmp/aotbuild-planted")


@pytest.mark.parametrize("fmt,dtype,allowed", [
    ("float32", "float32", True),  # a bf16 weight cast up for a package computing in float32 (compute_dtype)
    ("float32", "float64", False), ("float32", "bfloat16", False), ("float32", "int8", False),
    ("bfloat16", "float32", True), ("bfloat16", "bfloat16", True), ("bfloat16", "float64", False),
])
def test_a_recipe_casts_only_to_float32_or_its_constants_own_dtype(fmt, dtype, allowed):
    """Casts are what freezing records for low-precision folds and for a float32 package over bf16 weights;
    a cast anywhere else (to float64, twice the bytes; to an integer) is refused when the manifest is read
    and by a replay that was never checked."""
    itemsize = {"float32": 4, "bfloat16": 2}[fmt]
    value = {"shape": [4], "dtype": fmt, "layout": "strided", "stride": [1], "nbytes": 4 * itemsize}
    program = [["input", [0], {}], ["prims.convert_element_type.default", [{"ref": 0}, {"dtype": dtype}], {}]]
    rec = record(program, value, derived_from={"w": [[4], "bfloat16", "cpu"]})
    why = AotPackage().check_records((rec,))
    w = torch.arange(4.0).to(torch.bfloat16)
    if allowed:
        assert why == ""
        if dtype == fmt:
            assert torch.equal(prepack.replay(rec["derived"]["_frozen_param0"], {"w": w}), w.to(getattr(torch, fmt)))
        return
    assert f"casts to {{'dtype': '{dtype}'}}: a {fmt} constant's recipe casts only to float32" in why, why
    with pytest.raises(prepack.RecipeError, match=r"step 1 \(prims.convert_element_type.default\) casts to"):
        prepack.replay(rec["derived"]["_frozen_param0"], {"w": w})


def test_the_closed_list_holds_no_operator_that_writes_reads_files_or_makes_tensors_from_nothing():
    for fmt, names in prepack.OPERATORS.items():
        for name in names:
            op = prepack.resolve_op(name, fmt)
            overloads = [op] if isinstance(op, torch._ops.OpOverload) else [getattr(op, o) for o in op.overloads()]
            for overload in overloads:
                schema = overload._schema
                assert not schema.is_mutable, name
                assert any(a.type.isSubtypeOf(torch._C.TensorType.get()) for a in schema.arguments), name


@pytest.mark.parametrize(("fields", "expected"), [
    ({"value": None}, ".value: not {shape, dtype, layout, nbytes}"),
    ({"value": {**VALUE, "dtype": "int16", "nbytes": 8}},
     "no recipe is replayed for int16 constants (prepacked formats: float32"),
    ({"value": {**VALUE, "dtype": "os.system"}}, "is no torch dtype"),
    ({"value": {**VALUE, "nbytes": 1 << 30}}, "nbytes is not what its shape and strides reach"),
    ({"value": {"shape": [1 << 28], "dtype": "float32", "layout": "strided", "stride": [1], "nbytes": 1 << 30}},
     "declares 1073741824 bytes, more than 32x the 16 it reads"),
    ({"value": {"shape": [4], "dtype": "float32", "layout": "mkldnn", "nbytes": 8}}, "smaller than its elements"),
    ({"inputs": ("text_encoder.secret",)}, "which is not among the weights it is derived from"),
    ({"program": [["input", [0], {}], ["aten.clone.default", [{"ref": 0}], {"memory_format": {"device": "disk"}}]]},
     "an argument of no known kind"),
    ({"program": [["input", [0], {}], ["aten.clone.default", [{"ref": 0}], {"memory_format": {"eval": "x"}}]]},
     "an argument of no known kind"),
    ({"program": [["input", [0], {}], ["aten.reshape.default", [{"ref": 5}, [4]], {}]]},
     "reads a value not computed before it"),
    ({"program": [["input", [3], {}]]}, "names no input"),
    ({"program": [["input", [0], {}]] + [["aten.clone.default", [{"ref": 0}], {}]] * prepack.MAX_STEPS},
     f"more than {prepack.MAX_STEPS}"),
])
def test_a_recipe_whose_references_or_declared_sizes_are_wrong_is_malformed(fields, expected):
    kwargs = {k: v for k, v in fields.items() if k in ("program", "value", "inputs")}
    assert expected in AotPackage().check_records((record(**kwargs),))


def test_a_lifted_constant_s_shape_is_bounded_as_a_weight_s_is():
    """A recipe may make at most PACK_FACTOR times the bytes it reads; a lifted constant it reads declares
    its shape, so a huge declared shape would loosen that bound: it is refused as a derived-from one is."""
    for shape in ([1 << 41], [2] * 9, [-1]):
        lying = record(inputs=("c",), lifted={"c": [shape, "float32"]}, lifted_path="l.pt")
        assert "packages[].lifted: not {name: [shape, dtype]}" in AotPackage().check_records((lying,)), shape
    fine = record(inputs=("c",), lifted={"c": [[4], "float32"]}, lifted_path="l.pt", asks=["_frozen_param0", "b", "c"])
    assert AotPackage().check_records((fine,)) == ""


def test_a_missing_or_extra_recipe_or_a_name_both_derived_and_a_weight_is_malformed():
    removed = record()
    del removed["derived"]["_frozen_param0"]  # the package still asks for it: its first call read freed memory
    assert "asks for '_frozen_param0', which no weight, recipe or lifted constant supplies" in \
        AotPackage().check_records((removed,))
    extra = record(asks=["b"])
    assert "'_frozen_param0' is supplied but the package does not ask for it" in AotPackage().check_records((extra,))
    both = record(constants={"b": [[4], "float32", "cpu"], "_frozen_param0": [[1, 4], "float32", "cpu"]})
    assert "also a weight the package is handed as it is" in AotPackage().check_records((both,))
    assert "packages[].asks" in AotPackage().check_records((record(asks="all"),))


def test_prepacked_records_of_an_older_aotbuild_are_stale_and_every_other_entry_still_serves(tmp_path):
    """Recipes recorded before each constant's value and the package's constant names were (issue 53): a
    stale entry (a miss build rebuilds, gc --stale removes), not a malformed one; a package without
    recipes, of the same age, is checked against what its record supplies and still serves."""
    from aotbuild.errors import StaleManifest

    old = record()
    del old["asks"], old["derived"]["_frozen_param0"]["value"]
    assert AotPackage().check_records((old,)) == prepack.STALE
    plain = {"constants": {"b": [[4], "float32", "cpu"]}, "path": "packages/p.pt2", "signature": "s"}
    assert AotPackage().check_records((plain,)) == ""
    store = checked_store(tmp_path / "cache")
    key = add_entry(store, tmp_path / "src", "e", {"packages/p.pt2": b"package"},
                    target={"name": "inductor", "strategy": "aot-package"})
    data = json.loads(store.layout.manifest(key).read_text())
    data["packages"] = [{**old, "path": "packages/p.pt2", "signature": "s"}]
    write_raw(store, key, data)
    with pytest.raises(StaleManifest, match="recorded by an older aotbuild"):
        store.load_manifest(key)
    assert not [p for p in verify(store) if p.kind == Finding.MALFORMED]


def test_a_step_that_would_make_more_than_its_recipe_may_is_refused_before_it_runs():
    """(N,1) x (1,N): two reshapes of a weight broadcast to N^2 elements; the bound is twice the larger of
    the recorded constant and the largest input (plus 64 KiB): refused before the multiplication runs."""
    n = 4096
    program = [["input", [0], {}], ["aten.reshape.default", [{"ref": 0}, [n, 1]], {}],
               ["aten.reshape.default", [{"ref": 0}, [1, n]], {}],
               ["aten.mul.Tensor", [{"ref": 1}, {"ref": 2}], {}]]
    value = {"shape": [n, n], "dtype": "float32", "layout": "strided", "stride": [n, 1], "nbytes": 4 * n * n}
    # declared as it is, it is malformed: 64 MiB from a 16 KiB weight
    rec = record(program, value, derived_from={"w": [[n], "float32", "cpu"]})
    assert "more than 32x" in AotPackage().check_records((rec,))
    # declared small (a lie), it passes the static check and the replay refuses the step before it runs
    small = {"shape": [n], "dtype": "float32", "layout": "strided", "stride": [1], "nbytes": 4 * n}
    rec = record(program, small, derived_from={"w": [[n], "float32", "cpu"]})
    assert AotPackage().check_records((rec,)) == ""
    with pytest.raises(prepack.RecipeError, match=r"step 3 \(aten.mul.Tensor\) would make 67108864 bytes"):
        prepack.replay(rec["derived"]["_frozen_param0"], {"w": torch.ones(n)})


def test_a_replayed_value_unlike_the_recorded_one_or_a_failing_step_is_a_recipe_error():
    w = torch.arange(4.0)
    other = record(value={"shape": [4, 1], "dtype": "float32", "layout": "strided", "stride": [1, 1], "nbytes": 16})
    with pytest.raises(prepack.RecipeError, match=r"it made \{'shape': \[1, 4\]"):
        prepack.replay(other["derived"]["_frozen_param0"], {"w": w})
    failing = record([["input", [0], {}], ["aten.reshape.default", [{"ref": 0}, [3]], {}]])
    with pytest.raises(prepack.RecipeError, match=r"step 1 \(aten.reshape.default\) fails: RuntimeError"):
        prepack.replay(failing["derived"]["_frozen_param0"], {"w": w})


def test_verify_finds_a_hostile_recipe_without_loading_anything(tmp_path):
    """``verify`` applies the strategy's static checks, as every manifest read does (before: exit 0 on
    every hostile recipe of the closed list's namespaces)."""
    store = checked_store(tmp_path / "cache")
    key = add_entry(store, tmp_path / "src", "e", {"packages/p.pt2": b"not a package: never loaded"},
                    target={"name": "inductor", "strategy": "aot-package"})
    data = json.loads(store.layout.manifest(key).read_text())
    hostile = record([["input", [0], {}], HOSTILE["zero_"]], path="packages/p.pt2", signature="s")
    data["packages"] = [hostile]
    write_raw(store, key, data)
    found = [p for p in verify(store) if p.kind == Finding.MALFORMED]
    assert len(found) == 1 and "aten.zero_.default" in found[0].detail, found
    proc = run_cli("verify", "--cache", str(tmp_path / "cache"))
    assert proc.returncode == 1 and "aten.zero_.default" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    proc = run_cli("verify", "--fix", "--cache", str(tmp_path / "cache"))
    assert not store.layout.manifest(key).exists() and not list(store.blob_files())  # its blob reclaimed too
    good = copy.deepcopy(data)
    good["packages"] = [record(path="packages/p.pt2", signature="s")]
    assert AotPackage().check_records(tuple(good["packages"])) == ""


def _recorded_by_format(module, *args) -> dict[str, set[str]]:
    """The operators freezing records for ``module`` called with ``args``, by the dtype of the constant each
    recipe makes (a torch.compile stopped once freezing ends: no code generation)."""
    import torch._inductor.config as inductor_config
    import torch._inductor.freezing as freezing

    from aotbuild.strategies.runner import named_tensors

    class Stop(Exception):
        pass

    recorder = prepack.FoldRecorder({k: v.detach() for k, v in named_tensors(module).items()})
    with torch.no_grad(), inductor_config.patch(freezing=True), recorder.active():
        recording = freezing.freeze

        stopped = []

        def stop(*args, **kwargs):
            recording(*args, **kwargs)
            stopped.append(True)
            raise Stop  # the recipes are recorded: no code generation

        freezing.freeze = stop
        try:
            torch.compile(module, fullgraph=True)(*args)
        except Exception:  # Dynamo wraps it
            pass
        finally:
            freezing.freeze = recording
    assert stopped
    names = prepack._tensor_names(recorder.tensors)
    recorded: dict[str, set[str]] = collections.defaultdict(set)
    for tensor in recorder.final.values():
        inputs, program = [], []
        try:
            prepack._inline(tensor, recorder._folded, names, inputs, program, {})
        except prepack.RecipeError:
            continue  # a value Inductor made (under torch.compile, not export): no recipe, as at a build
        recorded[str(tensor.dtype).replace("torch.", "")].update(step[0] for step in program if step[0] != "input")
    return recorded


class _CastUp(torch.nn.Module):
    """A bf16 convolution computed in float32, as aoti.computing_in exports a bf16 module on a CPU without
    native bf16: the weight's cast is a graph node freezing folds."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(4, 32, 3, padding=1).to(torch.bfloat16)

    def forward(self, x):
        return torch.nn.functional.conv2d(x, self.conv.weight.float(), self.conv.bias.float(), padding=1)


@pytest.mark.slow  # two freezing passes (fp32, bf16) of a small module, stopped before code generation (~15 s)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_closed_list_is_what_freezing_records(dtype):
    """Every operator of a format's list is one freezing records for a module with the patterns it folds
    (a batch norm and a following multiplication folded into a convolution, a GroupNorm's reshapes, large
    linears packed), and every operator it records is on the list: each listed operator is held here."""

    class Folded(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(4, 32, 3, padding=1)
            self.conv2 = torch.nn.Conv2d(32, 32, 3, padding=1, bias=False)
            self.bn = torch.nn.BatchNorm2d(32)
            self.gn = torch.nn.GroupNorm(4, 32)
            self.lin = torch.nn.Linear(320, 320)
            self.small = torch.nn.Linear(32, 32)  # left unpacked (prepack.SMALL_LINEAR): addmm reads it permuted
            self.register_buffer("scale", torch.randn(32, 1, 1))

        def forward(self, x, y):
            h = self.gn(self.bn(self.conv2(self.conv(x) * self.scale + 1.0)))
            return self.small(h.mean((2, 3))), self.lin(y)

    torch.manual_seed(0)
    module = Folded().eval().to(dtype)
    fmt = str(dtype).replace("torch.", "")
    recorded = _recorded_by_format(module, torch.randn(1, 4, 8, 8, dtype=dtype), torch.randn(8, 320, dtype=dtype))
    recorded = set().union(*recorded.values())  # a bf16 module's folds make float32 constants on the way too
    if dtype == torch.float32:  # and a float32 package over bf16 weights (compute_dtype): each weight cast up
        cast_up = _recorded_by_format(_CastUp(), torch.randn(1, 4, 8, 8))
        assert cast_up["float32"] >= {prepack.CAST, "mkldnn._reorder_convolution_weight"}, cast_up
        recorded |= cast_up["float32"]
    listed = set(prepack.OPERATORS[fmt])
    # one of the two linear reorders, by whether this torch has MKL
    unused = {"mkldnn._reorder_linear_weight" if torch._C.has_mkl and dtype == torch.float32 else
              "mkl._mkl_reorder_linear_weight"}
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        # oneDNN has no bfloat16 on this CPU (AVX2): freezing packs no bf16 convolution or linear here
        unused |= {"mkldnn._reorder_convolution_weight", "mkldnn._reorder_linear_weight"}
    assert recorded == listed - unused, (sorted(recorded), sorted(listed))


#: What freezing records for int8dq's linears, by the CPU's int8 instructions and the versions: with VNNI
#: (torch 2.13, torchao 0.18) the int8 weight transposed and its columns' int32 sums times the activation's
#: zero point; on an AVX2 CPU without VNNI the weight made contiguous, transposed and reordered for oneDNN's
#: int8 linear; the newest torch and torchao of 2026-12-07 on that CPU, the transposed weight alone.
INT8DQ_RECORDS = {"vnni": {"int8": {"aten.permute.default"},
                           "int32": {"aten.permute.default", "aten.sum.dim_IntList", "aten.mul.Tensor"}},
                  "avx2": {"int8": {"aten.contiguous.default", "aten.permute.default", "onednn.qlinear_prepack"}},
                  "avx2, newest": {"int8": {"aten.permute.default"}}}


def test_the_int8_formats_are_what_freezing_records_for_torchaos_int8dq_and_int8static():
    """torchao's int8dq linears (quant_type int8dq) record one of INT8DQ_RECORDS, by the CPU and versions.
    int8static (PT2E, calibrate.py): each float weight quantized per channel, then oneDNN's int8 convolution
    or linear reorder (int8). What this CPU and torch record is on the formats' lists (else that build would
    not prepack), and the lists are exactly what the known records hold (no operator without a reason)."""
    pytest.importorskip("torchao")
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    from aotbuild.strategies import calibrate

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
    quantize_(module, Int8DynamicActivationInt8WeightConfig())
    recorded = _recorded_by_format(module, torch.randn(4, 64))
    dq = {fmt: ops for fmt, ops in recorded.items() if fmt in ("int8", "int32")}
    assert dq and all(ops <= prepack.OPERATORS[fmt] for fmt, ops in dq.items()), dict(recorded)
    net = torch.nn.Sequential(torch.nn.Conv2d(4, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(2),
                              torch.nn.Linear(64, 600)).eval()  # a linear large enough to be packed
    calls = [((torch.randn(1, 4, 8, 8),), {}) for _ in range(2)]
    static = _recorded_by_format(calibrate.convert(net, calls), *calls[0][0])
    assert static["int8"] == {"quantized_decomposed.quantize_per_channel.default", "onednn.qconv_prepack",
                              "onednn.qlinear_prepack"}, dict(static)
    for fmt in ("int8", "int32"):
        known = set().union(*(r.get(fmt, set()) for r in INT8DQ_RECORDS.values()), static.get(fmt, set()))
        assert known == set(prepack.OPERATORS[fmt]), fmt


def test_a_recipe_that_fails_at_load_is_a_miss_naming_it_or_a_fallback_that_says_so():
    """aot_package's install: a RecipeError from loading a component's packages is a CacheMiss under
    on_miss="error" (or strict shapes), else a warning and no routes (each call falls back as at a miss)."""
    from types import SimpleNamespace

    from aotbuild.errors import CacheMiss
    from aotbuild.strategies.aot_package import _unservable

    planned = SimpleNamespace(component="unet", entries=[SimpleNamespace(key="ab" * 32)])
    why = prepack.RecipeError("unet: the recipe of '_frozen_param3': it made {'dtype': 'float32'}, where ...")
    with pytest.raises(CacheMiss, match=r"unet \(abababababab\): its entry cannot be served: unet: the recipe of "
                                        r"'_frozen_param3'"):
        _unservable(planned, why, "error")
    for policy, then in (("eager", "runs eagerly"), ("compile", "compiles on first call")):
        with pytest.warns(UserWarning, match=f"the recipe of '_frozen_param3'.*; it {then}"):
            assert _unservable(planned, why, policy) == {}


def test_a_recipe_that_computes_another_value_is_served_unsigned_and_a_miss_with_trusted_keys(tmp_path):
    """``aten.mul(w, 2)`` is a well-formed recipe: no check can tell its value from a right one (an unsigned
    store serves it, docs/security.md says so); with trusted keys the manifest edited after signing is a
    miss, before any blob is read."""
    from aotbuild.cache import signing
    from aotbuild.cache.store import Unusable

    ci, _ = signing.keygen(tmp_path / "keys" / "ci")
    store = checked_store(tmp_path / "cache")
    key = add_entry(store, tmp_path / "src", "e", {"packages/p.pt2": b"package"},
                    target={"name": "inductor", "strategy": "aot-package"})
    data = json.loads(store.layout.manifest(key).read_text())
    data["packages"] = [record(path="packages/p.pt2", signature="s")]
    write_raw(store, key, data)
    store.put_manifest(signing.sign(store.read_manifest(key), ci))
    trusting = checked_store(store.root, signing.load_trusted([tmp_path / "keys" / "ci.pub"]))
    assert trusting.open_entry(key)[0] is not None
    data = json.loads(store.layout.manifest(key).read_text())
    doubled = [["input", [0], {}], ["aten.reshape.default", [{"ref": 0}, [1, 4]], {}],
               ["aten.mul.Tensor", [{"ref": 1}, 2.0], {}]]
    data["packages"][0]["derived"]["_frozen_param0"]["program"] = doubled
    write_raw(store, key, data)
    assert checked_store(store.root).open_entry(key)[0] is not None  # unsigned trust: served (wrong values)
    w = torch.arange(4.0)
    assert torch.equal(prepack.replay(data["packages"][0]["derived"]["_frozen_param0"], {"w": w}), w.reshape(1, 4) * 2)
    entry, why = trusting.open_entry(key)
    assert entry is None and why.kind is Unusable.UNTRUSTED and "bad signature by ci" in why, why


CONV = [["input", [0], {}], ["aten.clone.default", [{"ref": 0}], {"memory_format": {"memory_format": "channels_last"}}],
        ["mkldnn._reorder_convolution_weight", [{"ref": 1}, [1, 1], [1, 1], [1, 1], 1, [1, 8, 16, 16]], {}]]


def _raw(t):
    import ctypes

    n = int(torch.ops.mkldnn._nbytes(t))
    return bytes((ctypes.c_char * n).from_address(int(torch.ops.mkldnn.data_ptr(t))))


def test_a_clone_only_a_reorder_reads_is_made_in_reused_scratch_memory_and_the_result_is_the_same():
    """Freezing clones each 3x3 convolution weight to channels_last before oneDNN reorders it: at load that
    clone went to fresh memory for every weight (at SD 1.5 size 1.3 s of a 3.3 s derivation); one scratch
    buffer reused across a run of replays makes the same constants."""
    torch.manual_seed(0)
    recipe = {"inputs": ["w"], "program": CONV, "value": {}}
    weights = [torch.randn(16, 8, 3, 3), torch.randn(16, 8, 3, 3), torch.randn(8, 8, 3, 3)]
    plain = [prepack.replay({**recipe, "value": prepack.describe(
        torch.ops.mkldnn._reorder_convolution_weight(w.clone(memory_format=torch.channels_last), [1, 1], [1, 1],
                                                     [1, 1], 1, [1, 8, 16, 16]))}, {"w": w}) for w in weights]
    scratch = prepack.Scratch()
    reused = [prepack.replay({**recipe, "value": prepack.describe(p)}, {"w": w}, scratch)
              for p, w in zip(plain, weights, strict=True)]
    assert scratch.used == 3 and len(scratch._buffers) == 1  # one buffer for all three
    for p, r in zip(plain, reused, strict=True):
        assert _raw(p) == _raw(r) and not scratch.holds(r)
    # the result itself, or a clone read twice, is never scratch
    assert prepack._scratch_clones(CONV[:2]) == set()
    assert prepack._scratch_clones([*CONV, ["aten.add.Tensor", [{"ref": 1}, {"ref": 1}], {}]]) == set()
    assert prepack._scratch_clones(CONV) == {1}


def test_an_operator_that_returns_a_view_of_a_scratch_clone_gets_memory_of_its_own(monkeypatch):
    """Should a reorder return its input (a weight already in the wanted layout), the constant would be the
    scratch buffer, overwritten by the next replay: it is made again from a clone of its own."""
    real = prepack.resolve_op

    def resolve(name, fmt=None):
        if name == "mkldnn._reorder_convolution_weight":
            return lambda x, *rest: x  # a view of its input
        return real(name, fmt)

    monkeypatch.setattr(prepack, "resolve_op", resolve)
    w = torch.randn(16, 8, 3, 3)
    expected = w.clone(memory_format=torch.channels_last)
    scratch = prepack.Scratch()
    got = prepack.replay({"inputs": ["w"], "program": CONV, "value": prepack.describe(expected)}, {"w": w}, scratch)
    assert scratch.used == 1 and not scratch.holds(got) and torch.equal(got, w)
    prepack.replay({"inputs": ["w"], "program": CONV, "value": prepack.describe(expected)}, {"w": w * 2}, scratch)
    assert torch.equal(got, w)  # the next replay wrote the scratch, not this constant


def test_show_ls_and_verify_check_a_prepacked_entry_without_importing_torch(tmp_path):
    """The static checks of a stored recipe (its operators, dtypes and sizes) need no torch: ``show``,
    ``ls`` and ``verify`` read an aot-package entry with recipes in a fraction of a second instead of
    importing torch (3.6-6 s), and still refuse a hostile one."""
    store = checked_store(tmp_path / "cache")
    keys = []
    for name, program in (("good", GOOD), ("hostile", [["input", [0], {}], HOSTILE["zero_"]])):
        key = add_entry(store, tmp_path / name, name, {"packages/p.pt2": b"never loaded"},
                        target={"name": "inductor", "strategy": "aot-package"})
        data = json.loads(store.layout.manifest(key).read_text())
        data["packages"] = [record(program, path="packages/p.pt2", signature="s",
                                   derived_from={"w": [[4], "bfloat16", "cpu"]})]
        write_raw(store, key, data)
        keys.append(key)
    # each command as the console script runs it; at exit, whether torch was imported
    code = ("import atexit, sys\natexit.register(lambda: print('TORCH', 'torch' in sys.modules, file=sys.stderr))\n"
            "sys.argv = ['aotbuild', *sys.argv[1:]]\nfrom aotbuild.cli import main\nmain()")
    cache = ["--cache", str(tmp_path / "cache")]
    for args, code_expected in (["show", keys[0][:12]], 0), (["ls"], 0), (["verify"], 1):
        proc = subprocess.run([sys.executable, "-c", code, *args, *cache], capture_output=True, text=True,
                              cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
        assert proc.returncode == code_expected, (args, proc.stdout[-2000:] + proc.stderr[-2000:])
        assert "TORCH False" in proc.stderr, (args, proc.stderr[-2000:])
        if args == ["verify"]:
            assert "aten.zero_.default" in proc.stdout + proc.stderr  # the hostile recipe, found without torch


def test_the_itemsize_table_is_torch_s_own():
    """prepack.ITEMSIZE (what a record's static check reads without torch) says what this torch says for
    every dtype both name, and holds every dtype a prepacked constant or its weights use; a dtype only a
    newer torch has is looked up in torch (torch 2.14 added ``bcomplex32``; the table holds it since)."""
    dtypes = {name: value for name in dir(torch) if isinstance(value := getattr(torch, name), torch.dtype)}
    both = set(dtypes) & set(prepack.ITEMSIZE)
    assert {n: prepack.ITEMSIZE[n] for n in both} == {n: dtypes[n].itemsize for n in both}
    assert {*prepack.OPERATORS, "float64", "int64", "uint8", "bool", "float8_e4m3fn"} <= both
    assert all(prepack._itemsize(n) == d.itemsize for n, d in dtypes.items())  # the table's or torch's
    assert prepack._itemsize("os.system") is None and prepack._itemsize("__class__") is None
