"""Names and defaults that more than one module needs, and every environment variable we read.

Environment variables live here alone (huggingface_hub ``constants.py``), so a reader can see at a
glance what the environment can change.
"""

from __future__ import annotations

import os

#: Bumped whenever the meaning of a key factor or the manifest layout changes: old entries then miss.
FORMAT_VERSION = 1

#: Cache root from the environment; ``--cache`` wins over it, ``pyproject.toml`` loses to it.
ENV_CACHE = "AOTBUILD_CACHE"
#: The remote cache the CLI pushes to and pulls from when ``--remote`` is not given.
ENV_REMOTE = "AOTBUILD_REMOTE"
#: Where PyTorch Inductor keeps its own on-disk cache (FX graphs, kernels).
ENV_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"

DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "aotbuild")

#: Warmup arguments that never change what a component sees, so they are not key factors.
PROMPT_ARGUMENTS = frozenset({"prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2",
                              "negative_prompt_3"})
#: The prompt used for warmup when the recipe names none.
DEFAULT_WARMUP_PROMPT = "a photo of a cat"


def env_cache_root() -> str | None:
    return os.environ.get(ENV_CACHE) or None
