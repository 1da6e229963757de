"""Names and defaults that more than one module needs, and every environment variable we read.

Environment variables live here alone (huggingface_hub ``constants.py``), so a reader can see at a
glance what the environment can change.
"""

from __future__ import annotations

import os

#: aotbuild's version (``aotbuild.__version__``; recorded in every manifest's ``build``).
VERSION = "0.1.0"

#: Bumped whenever the meaning of a key factor or the manifest layout changes: old entries then miss.
FORMAT_VERSION = 3  # 3: manifests record the component's structure (aotbuild/structure.py)

#: Cache root from the environment; ``--cache`` wins over it, ``pyproject.toml`` loses to it.
ENV_CACHE = "AOTBUILD_CACHE"
#: The remote cache the CLI pushes to and pulls from when ``--remote`` is not given.
ENV_REMOTE = "AOTBUILD_REMOTE"
#: Seconds to wait for another aotbuild process's store lock before giving up with the lock's path.
ENV_LOCK_TIMEOUT = "AOTBUILD_LOCK_TIMEOUT"
DEFAULT_LOCK_TIMEOUT = 60.0
#: The cache's size limit ("20GB"); ``[tool.aotbuild] max_size`` loses to it, ``--max-size`` wins.
ENV_MAX_SIZE = "AOTBUILD_MAX_SIZE"
#: Set by the CLI: the library variables it quieted itself (build jobs get their verbosity back).
ENV_QUIETED = "AOTBUILD_QUIETED"
#: Compiler options a recipe may set although they are free-form (strings, paths, lists): comma-separated
#: names, or "*". An environment variable, because in CI a pull request controls recipes and pyproject.toml.
ENV_ALLOW_OPTIONS = "AOTBUILD_ALLOW_OPTIONS"
#: Set to 0: every build job gets a fresh worker that loads the pipeline itself, instead of a child
#: forked from the recipe's loader process (aotbuild/loader.py).
ENV_SHARED_LOADS = "AOTBUILD_SHARED_LOADS"
#: Where PyTorch Inductor keeps its own on-disk cache (FX graphs, kernels).
ENV_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"

DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "aotbuild")

#: Warmup arguments that never change what a component sees, so they are not key factors.
PROMPT_ARGUMENTS = frozenset({"prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2",
                              "negative_prompt_3"})
#: The prompt used for warmup when the recipe names none.
DEFAULT_WARMUP_PROMPT = "a photo of a cat"


#: Bounds on the work one recipe can ask for (recipes come from pull requests), each raisable by the
#: operator with its variable: warmup steps, prompts in a warmup, shapes, jobs (components x shapes)
#: per recipe, and seconds per build job and per proof.
LIMITS = {"steps": ("AOTBUILD_MAX_STEPS", 200), "prompts": ("AOTBUILD_MAX_PROMPTS", 64),
          "shapes": ("AOTBUILD_MAX_SHAPES", 64), "jobs": ("AOTBUILD_MAX_JOBS", 256),
          "job_seconds": ("AOTBUILD_JOB_TIMEOUT", 4 * 3600),
          # What one manifest may name (manifests come from stores and remotes others write): files,
          # and bytes in all (an entry embedding a 12B model's bf16 weights is ~24 GB).
          "entry_files": ("AOTBUILD_MAX_ENTRY_FILES", 100_000),
          "entry_bytes": ("AOTBUILD_MAX_ENTRY_BYTES", 256 * 1024 ** 3)}


def limit(name: str) -> int:
    """A bound of LIMITS, from its environment variable when that is a positive integer."""
    variable, default = LIMITS[name]
    value = os.environ.get(variable, "")
    return int(value) if value.isdigit() and int(value) > 0 else default


#: Public keys (comma-separated ``.pub`` paths) whose signatures make an entry loadable: with any
#: set, unsigned or otherwise signed entries are misses (aotbuild/signing.py).
ENV_TRUSTED_KEYS = "AOTBUILD_TRUSTED_KEYS"


def env_trusted_keys() -> str:
    return os.environ.get(ENV_TRUSTED_KEYS, "")


def env_cache_root() -> str | None:
    return os.environ.get(ENV_CACHE) or None


def lock_timeout() -> float:
    value = os.environ.get(ENV_LOCK_TIMEOUT)
    try:
        return float(value) if value else DEFAULT_LOCK_TIMEOUT
    except ValueError:
        return DEFAULT_LOCK_TIMEOUT


def env_max_size() -> str | None:
    return os.environ.get(ENV_MAX_SIZE) or None


def env_allowed_options() -> str:
    return os.environ.get(ENV_ALLOW_OPTIONS, "")
