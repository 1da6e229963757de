"""A refusal in the caller's terms (issue 55, item 4), on a small pipeline written as diffusers writes one.

The denoiser sees latents; the user called the pipeline at a height and width. Where load_compiled knows
the pipeline, a ShapeNotBuilt says what the pipeline was called at and what was built, in those terms, then
the latents; a component called directly, or by a pipeline whose call holds no height and width, gives the
latents and says so; the policy is named as the user wrote it. The real pipelines: tests/test_schedulers.py
(tiny-sd), the proofs' refusals in tests/test_regional.py (tiny-flux) and tests/test_architectures.py (tiny-wan).
"""

from __future__ import annotations

import pytest
import torch

from aotbuild.dispatch import install_dispatcher, signature
from aotbuild.errors import ShapeNotBuilt
from aotbuild.pipeline.callterms import Caller, Terms, policy_words


class Unet(torch.nn.Module):
    def forward(self, sample):
        return sample * 2


class Pipeline:
    """Keeps height, width, the prompts (``batch_size``) and images per prompt as locals of ``__call__``."""

    def __init__(self):
        self.unet = Unet()

    def __call__(self, prompt="a cat", height=None, width=None, num_images_per_prompt=1):
        height, width = height or 64, width or 64
        batch_size = 1 if isinstance(prompt, str) else len(prompt)
        return self.unet(torch.zeros(batch_size * num_images_per_prompt, 4, height // 8, width // 8))


class Unknown:
    """A pipeline whose call says nothing of its height and width."""

    def __init__(self, unet):
        self.unet = unet

    def __call__(self, size=12):
        return self.unet(torch.zeros(1, 4, size, size))


def served(policy='on_miss="error"'):
    pipe = Pipeline()
    built = {signature((torch.zeros(1, 4, 8, 8),), {}): Terms(64, 64, None, 1),
             signature((torch.zeros(1, 4, 8, 12),), {}): Terms(64, 96, None, 1)}
    d = install_dispatcher(pipe.unet, "unet", {sig: pipe.unet.forward for sig in built}, None, "error")
    d.caller = Caller(pipe, policy, built)
    return pipe, d


def test_a_refusal_says_what_the_pipeline_was_called_at_and_what_was_built_then_the_latents():
    pipe, _ = served()
    with pytest.raises(ShapeNotBuilt) as info:
        pipe(height=96, width=96)
    message = str(info.value)
    assert message.startswith('unet: the pipeline was called at 96x96 (1 image), which this cache did not build '
                              '(on_miss="error"); built: 64x64 and 64x96 (each 1 image, as called). Call the pipeline '
                              'at a built size, or add {height: 96, width: 96} to the recipe\'s shapes and rebuild. '
                              'In latents, unet was called with arg[0]=1x4x12x12:float32; built: '), message
    assert "strict_shapes" not in message  # the user passed on_miss="error" only
    with pytest.raises(ShapeNotBuilt, match=r"called at 64x64 \(2 images\), which this cache did not build.*The "
                                            r"images of a call follow its prompts.*add \{height: 64, width: 64, "
                                            r"batch_size: 2\}"):
        pipe(num_images_per_prompt=2)


def test_the_words_are_the_policy_the_user_chose():
    assert policy_words("error", False) == policy_words("error", True) == 'on_miss="error"'
    assert policy_words("compile", True) == policy_words("eager", True) == "strict_shapes=True"
    pipe, _ = served(policy_words("compile", True))
    with pytest.raises(ShapeNotBuilt, match=r"which this cache did not build \(strict_shapes=True\)"):
        pipe(height=96, width=96)


def test_a_component_called_directly_or_by_a_call_it_cannot_read_gives_the_latents_and_says_so():
    pipe, d = served()
    with pytest.raises(ShapeNotBuilt, match=r"^unet was called directly, not by its pipeline, so only its inputs can "
                                            r"be compared: unet was called with arg\[0\]=1x4x12x12:float32, which "
                                            r"this cache did not build \(on_miss=\"error\"\); built: arg\[0\]="):
        pipe.unet(torch.zeros(1, 4, 12, 12))
    other = Unknown(pipe.unet)
    d.caller = Caller(other, 'on_miss="error"', d.caller.built)
    with pytest.raises(ShapeNotBuilt, match=r"^unet was called by Unknown, whose call does not say its height and "
                                            r"width, so only its inputs can be compared: unet was called with"):
        other(size=12)


def test_a_copied_pipelines_refusal_reads_the_copy():
    import copy

    pipe, _ = served()
    twin = copy.deepcopy(pipe)
    with pytest.raises(ShapeNotBuilt, match=r"the pipeline was called at 96x96"):
        twin(height=96, width=96)
