"""Timesteps in any dtype and rank the model treats alike (issue 56, item 1), on tiny models of each kind.

A model that reads its timestep as a number (diffusers' sinusoidal ``Timesteps``) gives the same output
for 999 as int64 and 999.0 as float32, 0-d or one per sample: its build proves it (``measure``) and a
dispatcher converts a scheduler's timestep to the built one, under every policy, before any fallback. A
model that reads it as an index (an embedding table), or reads an integer one way and a float another,
is refused, never served wrong. No compile here: the route is a stand-in that records what it was given
(the tiny-sd scheduler matrix, tests/test_schedulers.py, serves the same through real entries).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from aotbuild.dispatch import install_dispatcher, signature
from aotbuild.errors import ShapeNotBuilt
from aotbuild.pipeline import timesteps


class Sinusoidal(torch.nn.Module):
    """Reads its timestep as diffusers' ``Timesteps`` does: a float, 0-d or one per sample."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 4)

    def forward(self, sample, timestep, encoder_hidden_states=None):
        t = (timestep if timestep.dim() else timestep[None]).expand(sample.shape[0]).float()
        freqs = torch.exp(-math.log(10000) * torch.arange(4, dtype=torch.float32) / 4)
        emb = torch.cat([torch.sin(t[:, None] * freqs), torch.cos(t[:, None] * freqs)], dim=-1)
        return (sample * self.proj(emb)[:, :, None, None],)


class Table(torch.nn.Module):
    """Reads its timestep as an index of an embedding table (a float cannot be one)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.table = torch.nn.Embedding(1000, 4)

    def forward(self, sample, timestep, encoder_hidden_states=None):
        t = (timestep if timestep.dim() else timestep[None]).expand(sample.shape[0])
        return (sample * self.table(t)[:, :, None, None],)


class Either(Table):
    """An integer timestep an index, a float one a number: the same value read two ways."""

    def forward(self, sample, timestep, encoder_hidden_states=None):
        if timestep.is_floating_point():
            t = (timestep if timestep.dim() else timestep[None]).expand(sample.shape[0])
            return (sample * torch.sin(t)[:, None, None, None],)
        return super().forward(sample, timestep, encoder_hidden_states)


SAMPLE = torch.randn(2, 4, 3, 3, generator=torch.Generator().manual_seed(1))
TEXT = torch.zeros(2, 5, 8)


def serve(model, built_timestep, policy="error"):
    """``model`` behind a dispatcher built for the call with ``built_timestep`` (its record measured as a
    build does), whose route records the timestep it was given and runs the model; the fallback records
    that it ran. Returns (dispatcher, what the route saw, what the fallback saw, the record)."""
    args, kwargs = (SAMPLE, built_timestep), {"encoder_hidden_states": TEXT}
    record = timesteps.measure(model, args, kwargs)
    seen, fell = [], []

    def route(sample, timestep, **kw):
        seen.append((timestep.dtype, tuple(timestep.shape), timestep.stride()))
        return type(model).forward(model, sample, timestep, **kw)

    def fallback(*a, **k):
        fell.append(a[1].dtype)
        return type(model).forward(model, *a, **k)

    d = install_dispatcher(model, "unet", {signature(args, kwargs): route}, fallback, policy)
    d.timesteps = timesteps.Conversions.of(model, [(record, [signature(args, kwargs)])])
    return d, seen, fell, record


def call(model, timestep):
    return model(SAMPLE, timestep, encoder_hidden_states=TEXT)[0]


def eager(model, timestep):
    return type(model).forward(model, SAMPLE, timestep, encoder_hidden_states=TEXT)[0]


def test_a_model_that_reads_its_timestep_as_a_number_is_proven_alike_in_every_dtype_and_rank():
    model = Sinusoidal()
    d, seen, fell, record = serve(model, torch.tensor(999.0))
    assert record["dtype"] == "float32" and record["form"] == "scalar" and record["batch"] == 2
    assert record["alike"] == {dtype: ["scalar", "one", "batch"] for dtype in ("float32", "float64", "int64")}
    assert record["unlike"] == {} and record["max_abs_diff"] == 0.0 and not timesteps.check_record(record)
    # DDIM's int64, DPM-Solver SDE's float64, a pipeline's t.expand(batch), one value for the batch: each
    # converted to the built float32 0-d and served by the route, as eager gives it for what was passed
    for t in (torch.tensor(999), torch.tensor(999.0, dtype=torch.float64), torch.tensor(999).expand(2),
              torch.tensor([999.0]), torch.tensor([999.0, 999.0], dtype=torch.float64)):
        assert torch.equal(call(model, t), eager(model, t)), t
    assert seen == [(torch.float32, (), ())] * 5 and fell == [] and d.calls == {"built": 5, "unbuilt": 0}
    # a value the built dtype holds as built: another step of the same scheduler
    assert torch.equal(call(model, torch.tensor(499.5)), eager(model, torch.tensor(499.5)))


@pytest.mark.parametrize("timestep, words", [
    (torch.tensor(2**24 + 1), r"timestep 16777217 \(int64\) cannot be written exactly in float32"),
    (torch.tensor([999, 500]), r"one value per sample \(\[999, 500\]\), and the entry was built for one value per "
                               r"call \(float32 0-d\)"),
])
def test_a_value_no_conversion_writes_exactly_is_refused(timestep, words):
    model = Sinusoidal()
    d, seen, fell, _ = serve(model, torch.tensor(999.0))
    with pytest.raises(ShapeNotBuilt, match=words):
        call(model, timestep)
    assert seen == [] and fell == []


@pytest.mark.parametrize("policy", ["compile", "eager", "error"])
def test_a_timestep_is_converted_before_any_fallback_under_every_policy(policy):
    model = Sinusoidal()
    d, seen, fell, _ = serve(model, torch.tensor(999.0), policy)
    assert torch.equal(call(model, torch.tensor(999)), eager(model, torch.tensor(999)))
    assert len(seen) == 1 and fell == [] and d.calls["built"] == 1


def test_a_one_per_sample_build_gets_the_pipelines_layout_back():
    """Flux, Wan and PixArt pass ``t.expand(batch)`` (stride 0): a graph guards strides, so a converted
    timestep is given the built layout, not a dense copy (the proof's clone_layout lesson)."""
    model = Sinusoidal()
    d, seen, _, record = serve(model, torch.tensor(999.0).expand(2))
    assert record["form"] == "batch" and record["expanded"] is True
    assert torch.equal(call(model, torch.tensor(999)), eager(model, torch.tensor(999)))
    assert seen == [(torch.float32, (2,), (0,))]


def test_a_model_that_reads_its_timestep_as_an_index_is_refused_never_served():
    model = Table()
    d, seen, fell, record = serve(model, torch.tensor(999))
    assert record["dtype"] == "int64" and set(record["alike"]) == {"int64"}
    assert set(record["unlike"]) == {"float32", "float64"} and "RuntimeError" in record["unlike"]["float32"]
    with pytest.raises(ShapeNotBuilt, match=r"its timestep is float32 0-d, the entry was built for int64 0-d, and "
                                            r"the build's proof found the model reads float32 timesteps differently"):
        call(model, torch.tensor(999.0))
    assert seen == [] and fell == []
    # under another policy the call is not served by the entry either: it compiles (the fallback)
    d.on_unbuilt = "compile"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError):  # the fallback runs the model, which cannot take a float index
            call(model, torch.tensor(999.0))
    assert seen == [] and fell == [torch.float32] and "reads float32 timesteps differently" in str(warned[0].message)


def test_a_model_that_reads_an_integer_and_a_float_differently_is_refused():
    model = Either()
    d, seen, _, record = serve(model, torch.tensor(999))
    assert "float32" not in record["alike"] and "the output differs by" in record["unlike"]["float32"]
    with pytest.raises(ShapeNotBuilt, match="reads float32 timesteps differently"):
        call(model, torch.tensor(999.0))
    assert seen == []


def test_an_entry_without_a_record_converts_nothing_and_says_so():
    model = Sinusoidal()
    args, kwargs = (SAMPLE, torch.tensor(999.0)), {"encoder_hidden_states": TEXT}
    d = install_dispatcher(model, "unet", {signature(args, kwargs): lambda *a, **k: a}, None, "error")
    d.timesteps = timesteps.Conversions.of(model, [(None, [signature(args, kwargs)])])
    with pytest.raises(ShapeNotBuilt, match=r"records no timestep proof \(built by an aotbuild before issue 56"):
        call(model, torch.tensor(999))


@pytest.mark.parametrize("change, named", [
    ({"alike": {"int64": ["sideways"]}}, "alike"),
    ({"form": "2-d"}, "form"),
    ({"dtype": "complex64"}, "dtype"),
    ({"name": "sample"}, "name"),
    ({"batch": 0}, "batch"),
    ({"unlike": {"int64": 3}}, "unlike"),
    ({"unlike": {"int64": "\x1b[31mred"}}, "unlike"),
    ({"unlike": {"int64": "x" * 4097}}, "unlike"),
    ({"values": [1.0, float("nan")]}, "values"),
    ({"why": "not measured\n::error::injected"}, "why"),
    ({"why": "x" * 4097}, "why"),
])
def test_the_manifest_refuses_a_malformed_timestep_record(change, named):
    from aotbuild.cache.manifest import from_dict
    from aotbuild.errors import ManifestError
    from tests import manifests

    record = timesteps.measure(Sinusoidal(), (SAMPLE, torch.tensor(999.0)), {"encoder_hidden_states": TEXT})
    good = manifests.manifest(manifests.factors(), build={"timestep": record})
    assert from_dict(good.as_json(), good.key).build["timestep"] == record
    bad = manifests.manifest(manifests.factors(), build={"timestep": {**record, **change}})
    with pytest.raises(ManifestError, match=rf"build\.timestep: {named}"):
        from_dict(bad.as_json(), bad.key)


# -- entries of several batches, several proofs (issue 56 review) -------------------------------------------

def _entries(model, route, calls, proven=None):
    """``model`` behind a dispatcher with one entry per call ((args, kwargs)), each served by ``route``: its
    record measured as a build does, or None where ``proven`` says not (an entry from before issue 56)."""
    entries = []
    for i, (args, kwargs) in enumerate(calls):
        record = timesteps.measure(model, args, kwargs) if proven is None or proven[i] else None
        entries.append((record, [signature(args, kwargs)]))
    d = install_dispatcher(model, "unet", {sigs[0]: route for _, sigs in entries}, None, "error")
    d.timesteps = timesteps.Conversions.of(model, entries)
    return d, [r for r, _ in entries]


def _recording(model, seen):
    def route(sample, timestep, *rest, **kw):
        seen.append((timestep.dtype, tuple(timestep.shape), timestep.stride()))
        return type(model).forward(model, sample, timestep, *rest, **kw)

    return route


def test_buckets_of_one_and_several_samples_with_an_expanded_timestep_convert_at_each():
    """A pipeline passing ``t.expand(batch)`` (Flux, Wan, PixArt) built for batches [1, 2]: one sample is no
    expansion, so batch 1's record says not expanded and batch 2's expanded. Both entries were built for one
    dtype and rank: an int64 scheduler's timestep is converted at each batch, in the layout each was built."""
    model, seen = Sinusoidal(), []
    one = (SAMPLE[:1], torch.tensor(999.0).expand(1)), {"encoder_hidden_states": TEXT[:1]}
    two = (SAMPLE, torch.tensor(999.0).expand(2)), {"encoder_hidden_states": TEXT}
    d, records = _entries(model, _recording(model, seen), [one, two])
    assert [r["expanded"] for r in records] == [False, True] and [r["form"] for r in records] == ["batch", "batch"]
    for (args, kwargs), n in ((one, 1), (two, 2)):
        t = torch.tensor(999).expand(n)
        got = model(args[0], t, **kwargs)[0]
        assert torch.equal(got, type(model).forward(model, args[0], t, **kwargs)[0])
    assert seen == [(torch.float32, (1,), (1,)), (torch.float32, (2,), (0,))] and d.calls["built"] == 2


def test_an_entry_without_a_proof_has_no_say_in_the_calls_of_another():
    """An old entry (no ``build.timestep``) beside a proven one: a call the proven one serves, converted, is
    converted; a call only the old one would serve is refused naming why (rebuild it)."""
    model, seen = Sinusoidal(), []
    new = (SAMPLE, torch.tensor(999.0)), {"encoder_hidden_states": TEXT}
    old = (SAMPLE[:1], torch.tensor(999.0)), {"encoder_hidden_states": TEXT[:1]}
    _entries(model, _recording(model, seen), [new, old], proven=[True, False])
    assert torch.equal(call(model, torch.tensor(999)), eager(model, torch.tensor(999)))
    assert seen == [(torch.float32, (), ())]
    with pytest.raises(ShapeNotBuilt, match=r"arg\[1\]=scalar:int64.*records no timestep proof \(built by an aotbuild "
                                            r"before issue 56"):
        model(SAMPLE[:1], torch.tensor(999), encoder_hidden_states=TEXT[:1])


class Guided(Sinusoidal):
    """Flux's transformer: a 1-d ``guidance`` beside its timestep."""

    def forward(self, sample, timestep, guidance=None, encoder_hidden_states=None):
        out, = super().forward(sample, timestep, encoder_hidden_states)
        return (out * guidance[:, None, None, None],)


def test_a_call_whose_timestep_is_as_built_is_not_refused_over_its_timestep():
    """A call that differs from the built one in its ``guidance`` (another 1-d tensor), its timestep exactly as
    built, is no scheduler's problem, whatever the entry's proof: the refusal is the shape's."""
    model = Guided()
    built = (SAMPLE, torch.tensor(999.0), torch.ones(2)), {"encoder_hidden_states": TEXT}
    _entries(model, _recording(model, []), [built], proven=[False])
    with pytest.raises(ShapeNotBuilt) as info:
        model(SAMPLE, torch.tensor(999.0), torch.ones(2, dtype=torch.float64), encoder_hidden_states=TEXT)
    message = str(info.value)
    assert "arg[2]=2:float64" in message and "timestep" not in message, message


def test_a_converted_call_that_is_then_refused_shows_the_callers_own_call():
    """The refusal of a call converted and still not built (another size) shows what the caller passed: its
    int64 timestep, not the float32 one it was converted to."""
    model = Sinusoidal()
    d, _, _, _ = serve(model, torch.tensor(999.0))
    with pytest.raises(ShapeNotBuilt) as info:
        model(torch.zeros(2, 4, 5, 5), torch.tensor(999), encoder_hidden_states=TEXT)
    message = str(info.value)
    assert "unet was called with arg[0]=2x4x5x5:float32, arg[1]=scalar:int64" in message, message


# -- the cost of a converted call (issue 56 review): counted, never timed -------------------------------------

def test_a_signature_is_planned_once_and_a_schedulers_timesteps_read_once_per_set_timesteps():
    """What a call of a signature needs is planned at its first call (the converted call's signature
    included: never encoded again); a scheduler's timesteps, views of one tensor, are read once (one
    device-to-host copy on an accelerator) however many steps; an in-place write is another version: read
    again, and a value it cannot convert refused; a new tensor is read once more."""
    model = Sinusoidal()
    d, seen, _, _ = serve(model, torch.tensor(999.0))
    steps = torch.tensor([999, 749, 499, 249])  # what set_timesteps leaves: step i is the view steps[i]
    for t in steps:
        assert torch.equal(call(model, t), eager(model, t))
    conversions = d.timesteps
    plan, = conversions._plans.values()
    assert plan.name == "float32"
    assert plan.sig == signature((SAMPLE, torch.tensor(0.0)), {"encoder_hidden_states": TEXT})  # the built one
    assert conversions._values.reads == 1 and len(seen) == 4
    steps[2] = 2 ** 24 + 1
    with pytest.raises(ShapeNotBuilt, match=r"timestep 16777217 \(int64\) cannot be written exactly in float32"):
        call(model, steps[2])
    assert torch.equal(call(model, steps[1]), eager(model, steps[1])) and conversions._values.reads == 2
    fresh = torch.tensor([999, 749])
    call(model, fresh[0])
    call(model, fresh[1])
    assert conversions._values.reads == 3 and len(conversions._plans) == 1


def test_a_refused_conversion_is_not_worked_out_again_at_every_call(monkeypatch):
    """Under on_miss="eager" a timestep that cannot be converted runs eagerly each step: why (and whether the
    call differs from a built one in its timestep alone) is worked out once per signature, never by reading
    every built signature again."""
    from aotbuild.utils import safeio

    model = Table()
    d, seen, _, _ = serve(model, torch.tensor(999), policy="eager")
    read = []

    def counted(*args, **kwargs):
        read.append(1)
        return safeio.loads_json.__wrapped__(*args, **kwargs)

    counted.__wrapped__ = safeio.loads_json
    monkeypatch.setattr(safeio, "loads_json", counted)
    monkeypatch.setattr(timesteps, "loads_json", counted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError):  # eager: the model cannot take a float index
            call(model, torch.tensor(999.0))
        first = len(read)
        for _ in range(3):
            with pytest.raises(RuntimeError):
                call(model, torch.tensor(999.0))
    assert first > 0 and len(read) == first and seen == []


# -- more than one value (issue 56 review) ----------------------------------------------------------------------

class EvenIntegers(Sinusoidal):
    """Reads an integer timestep rounded down to an even one (a branch of its own), a float as it is: the two
    agree at 998, not at 499."""

    def forward(self, sample, timestep, encoder_hidden_states=None):
        if not timestep.is_floating_point():
            timestep = timestep // 2 * 2
        return super().forward(sample, timestep, encoder_hidden_states)


def test_a_dtype_read_alike_at_the_first_step_only_is_not_proven_alike():
    """The build tries the schedule's middle and last step too (as the pipeline left them in its scheduler):
    an integer path that agrees with the float one at the first step only is unlike, and refused."""
    model = EvenIntegers()
    args, kwargs = (SAMPLE, torch.tensor(998.0)), {"encoder_hidden_states": TEXT}

    class Pipe:
        scheduler = type("Scheduler", (), {"timesteps": torch.tensor([998, 749, 499, 1])})()

    values = timesteps.schedule_values(Pipe(), model, args, kwargs)
    assert values == [499.0, 1.0]
    record = timesteps.measure(model, args, kwargs, values=values)
    assert record["values"] == [998.0, 499.0, 1.0] and "int64" not in record["alike"], record
    assert record["unlike"]["int64"].startswith("scalar at 499.0: the output differs by"), record["unlike"]
    assert record["alike"]["float64"] == ["scalar", "one", "batch"] and not timesteps.check_record(record)
    d = install_dispatcher(model, "unet", {signature(args, kwargs): lambda *a, **k: a}, None, "error")
    d.timesteps = timesteps.Conversions.of(model, [(record, [signature(args, kwargs)])])
    with pytest.raises(ShapeNotBuilt, match=r"reads int64 timesteps differently \(scalar at 499.0: the output"):
        model(SAMPLE, torch.tensor(998), encoder_hidden_states=TEXT)
    # a pipeline that scales the scheduler's timesteps (Flux divides by 1000) is followed by the ratio; a
    # scheduler without a schedule: half the first value
    scaled = (SAMPLE, torch.tensor(0.998)), {"encoder_hidden_states": TEXT}
    assert [round(v, 6) for v in timesteps.schedule_values(Pipe(), model, *scaled)] == [0.499, 0.001]
    assert timesteps.schedule_values(object(), model, args, kwargs) == [499.0]
