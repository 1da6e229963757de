"""aot-package serves models that make tensors of their own in ``forward``: torch.export lifts them as
constants that are neither parameters nor buffers; the package must not ask the module for them."""

from __future__ import annotations

import pytest
import torch

from aotbuild.dispatch import signature
from aotbuild.strategies import aoti
from aotbuild.strategies.calls import snapshot


class Guidance(torch.nn.Module):
    """Chroma's ``time_text_embed`` (issue 36 item 4): a submodule embeds ``torch.tensor([0] * batch)``
    at batch 1, a value Inductor computes at compile time, so the package never asks for that lifted
    constant (at batch 3 above it does)."""

    def __init__(self):
        super().__init__()
        from diffusers.models.embeddings import Timesteps

        self.proj = Timesteps(num_channels=8, flip_sin_to_cos=True, downscale_freq_shift=0)

    def forward(self, x):
        return self.proj(torch.tensor([0] * 1)).to(dtype=x.dtype, device=x.device).expand(x.shape[0], -1)


class MakesTensors(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.offset = torch.full((8,), 0.25)  # a plain attribute, not a buffer: lifted too
        self.guidance = Guidance()
        # Tensors under two names (issue 36 item 4): the package asks for the name its graph read,
        # which named_parameters() and named_buffers() leave out (they keep the first).
        self.tied = torch.nn.Linear(8, 8)
        self.tied.weight = self.lin.weight
        self.register_buffer("scale", torch.full((8,), 0.5))
        self.alias = torch.nn.Module()
        self.alias.register_buffer("scale", self.scale)

    def forward(self, x):
        index = torch.tensor([0] * x.shape[0])  # made in forward (issue: PackageMismatch '_tensor_constant0')
        return (self.lin(x) + index[:, None].float() + self.offset + self.guidance(x) + self.tied(x)
                + self.alias.scale * self.scale)


@pytest.mark.slow  # one AOTInductor compile (~1 min)
def test_a_model_that_makes_tensors_in_forward_is_packaged_and_served(tmp_path):
    torch.manual_seed(0)
    module = MakesTensors().eval()
    x = torch.randn(3, 8)
    with torch.no_grad():
        expected = module(x)
    calls = {signature((x,), {}): snapshot((x,), {})}
    settings = dict(torch._inductor.config.aot_inductor.metadata)
    records = aoti.build_packages(module, calls, tmp_path, {})
    # torch writes device facts into the process's setting in place: a key factor of later loads here
    assert torch._inductor.config.aot_inductor.metadata == settings
    record = records[0]
    assert set(record["lifted"]) and record["lifted_path"].endswith(aoti.LIFTED_SUFFIX)
    # only what the package asks for: the folded one, named here, failed every load ("Constant not found")
    assert not any(name.startswith("guidance.") for name in record["lifted"]), record["lifted"]
    assert not set(record["lifted"]) & set(record["constants"])  # weights are the module's, constants ours
    # the shared weight is supplied under one of its names (torch 2.13 asks for tied.weight), none compiled in
    assert {"lin.weight", "tied.weight"} & set(record["constants"]) and record["baked"] == {}
    first_names = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    assert set(record["constants"]) - set(first_names)  # a second name, asked for: the build refused it
    files = {rel: tmp_path / rel for rel in (record["path"], record["lifted_path"])}
    routes = aoti.load_packages(module, "m", [(record, files)], "cpu")
    with torch.no_grad():
        out = routes[""][record["signature"]](x)
    assert torch.allclose(out, expected, atol=1e-6)
    module.lin.weight.data.mul_(2)  # weights stay live: the package reads the module's own tensors
    with torch.no_grad():
        assert torch.allclose(routes[""][record["signature"]](x), module(x), atol=1e-6)


def test_a_constants_file_that_does_not_hold_what_the_record_says_is_refused(tmp_path):
    from safetensors.torch import save_file

    from aotbuild.errors import PackageMismatch

    save_file({"lifted_tensor_0": torch.zeros(2, dtype=torch.int64)}, str(tmp_path / "c.safetensors"))
    record = {"path": "aoti/x.pt2", "lifted": {"lifted_tensor_0": [[3], "int64"]}, "lifted_path": "c.safetensors"}
    with pytest.raises(PackageMismatch, match="does not hold lifted_tensor_0 as int64 \\[3\\]"):
        aoti._lifted(record, {"c.safetensors": tmp_path / "c.safetensors"}, "cpu")
