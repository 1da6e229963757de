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
    d.timesteps = timesteps.Conversions.of(model, [record])
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
    d.timesteps = timesteps.Conversions.of(model, [None])
    with pytest.raises(ShapeNotBuilt, match=r"records no timestep proof \(built by an aotbuild before issue 56"):
        call(model, torch.tensor(999))


@pytest.mark.parametrize("change, named", [
    ({"alike": {"int64": ["sideways"]}}, "alike"),
    ({"form": "2-d"}, "form"),
    ({"dtype": "complex64"}, "dtype"),
    ({"name": "sample"}, "name"),
    ({"batch": 0}, "batch"),
    ({"unlike": {"int64": 3}}, "unlike"),
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
