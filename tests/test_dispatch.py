"""The dispatcher's policies, on a tiny module (no compile: the 'compiled' path is a counter)."""

from __future__ import annotations

import pytest
import torch

from aotbuild.dispatch import install_dispatcher, signature
from aotbuild.errors import CacheMiss, ShapeNotBuilt


class Tiny(torch.nn.Module):
    def forward(self, x, scale=1.0, *, flag=None):
        return x * 2


def setup(policy):
    m = Tiny()
    seen = []

    def compiled(*a, **k):
        seen.append(a[0].shape)
        return Tiny.forward(m, *a, **k)

    built = signature((torch.zeros(2, 3),), {"flag": None})
    d = install_dispatcher(m, "tiny", {built: compiled}, compiled, policy)
    return m, d, seen


def test_built_shape_runs_compiled_other_shapes_follow_policy():
    m, d, seen = setup("compile")
    m(torch.zeros(2, 3), flag=None)
    m(torch.zeros(4, 3), flag=None)
    assert seen == [torch.Size([2, 3]), torch.Size([4, 3])] and d.calls == {"built": 1, "unbuilt": 1}


def test_the_first_call_a_route_serves_is_timed_once_and_unbuilt_calls_are_not():
    from aotbuild.dispatch import dispatchers

    m, d, _ = setup("eager")
    timed = []
    assert dispatchers(m) == [d]
    d.on_first_call = timed.append
    m(torch.zeros(4, 3), flag=None)  # unbuilt: not the compiled path's first call
    assert timed == []
    m(torch.zeros(2, 3), flag=None)
    m(torch.zeros(2, 3), flag=None)
    assert len(timed) == 1 and timed[0] >= 0 and d.on_first_call is None


def test_strict_raises_shape_not_built():
    m, _, seen = setup("error")
    assert torch.equal(m(torch.ones(2, 3), flag=None), torch.full((2, 3), 2.0))
    with pytest.raises(ShapeNotBuilt, match=r"arg\[0\]=4x3:float32") as info:
        m(torch.zeros(4, 3), flag=None)
    assert isinstance(info.value, CacheMiss)
    assert "built: arg[0]=2x3:float32" in str(info.value)
    # Another batch: prompts, images per prompt or (in pipelines that batch its halves) guidance.
    assert "The batch is 4 where the cache built 2: it follows the number of prompts" in str(info.value)
    assert "whether guidance is on" in str(info.value)
    with pytest.raises(ShapeNotBuilt) as info:
        m(torch.zeros(2, 5), flag=None)
    assert "The batch is" not in str(info.value)  # the batch is not what differs


def test_eager_policy_bypasses_compiled():
    m, d, seen = setup("eager")
    m(torch.zeros(4, 3), flag=None)
    assert seen == [] and d.calls["unbuilt"] == 1


def test_signature_specializes_like_dynamo():
    a = signature((torch.zeros(2, 3),), {"scale": 1.0})
    assert a == signature((torch.ones(2, 3),), {"scale": 7.5})  # floats are not specialized
    assert a != signature((torch.zeros(2, 3, dtype=torch.float16),), {"scale": 1.0})
    assert signature((torch.zeros(1),), {"n": 1}) != signature((torch.zeros(1),), {"n": 2})  # ints are


def test_record_policy_learns_signatures():
    m = Tiny()
    recorded = []
    d = install_dispatcher(m, "tiny", {}, m.forward, "record", on_record=lambda sig, a, k: recorded.append(sig))
    m(torch.zeros(1, 1))
    m(torch.zeros(1, 1))
    m(torch.zeros(2, 1))
    assert len(d.built) == 2 and len(recorded) == 2  # on_record sees each signature once
