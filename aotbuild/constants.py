"""Names and defaults that more than one module needs, and every environment variable we read.

Environment variables live here alone (huggingface_hub ``constants.py``), so a reader can see at a
glance what the environment can change.
"""

from __future__ import annotations

import enum
import os


class Vocabulary(str, enum.Enum):
    """Base of a report's statuses (planner.JobStatus, builder.ResultStatus, sync.PullStatus,
    manage.Finding, auto.Outcome): code names a status by what it means in its own report, while a
    member prints, formats, compares and serializes as its value, so ``--json``, the manifests and
    ``job.status == "hit"`` read as they did when the statuses were plain strings."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


#: aotbuild's version (``aotbuild.__version__``; recorded in every manifest's ``build``).
VERSION = "0.1.0"

#: Bumped whenever the meaning of a key factor or the manifest layout changes: old entries then miss.
#: 3: manifests record the component's structure (aotbuild/pipeline/structure.py); 4: what its graphs depend on
#: (aotbuild/pipeline/dependencies.py), so an entry built before that is stale: plan and build see a miss and
#: rebuild it.
FORMAT_VERSION = 4

#: Cache root from the environment; ``--cache`` wins over it, ``pyproject.toml`` loses to it.
ENV_CACHE = "AOTBUILD_CACHE"
#: The remote cache the CLI pushes to and pulls from when ``--remote`` is not given.
ENV_REMOTE = "AOTBUILD_REMOTE"
#: Seconds to wait for another aotbuild process's store lock before giving up with the lock's path
#: (0 to MAX_LOCK_TIMEOUT; anything else is an error naming the variable, constants.env_number).
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
#: forked from the recipe's loader process (aotbuild/builder/loader.py).
ENV_SHARED_LOADS = "AOTBUILD_SHARED_LOADS"
#: Seconds between the lines that show life in a log (not a terminal, where one line is redrawn in
#: place): a build job's phase, a push's or pull's bytes (0 to 86400; 0: a line for every update).
ENV_PROGRESS_INTERVAL = "AOTBUILD_PROGRESS_INTERVAL"
DEFAULT_PROGRESS_INTERVAL = 60.0
#: Where PyTorch Inductor keeps its own on-disk cache (FX graphs, kernels).
ENV_INDUCTOR_CACHE = "TORCHINDUCTOR_CACHE_DIR"
#: Set by aotbuild in each child's environment: the pid of the process that started it, which the
#: child checks is still its parent once it asked to die with it (aotbuild/builder/child.py ``guard``).
ENV_PARENT_PID = "AOTBUILD_PARENT_PID"
#: Tests only: a process of a build that reaches this point sleeps there (:data:`PAUSE_SECONDS`), so
#: a test can kill the build at that phase cheaply. Points: a phase's first word as a child reports
#: it ("loading", "compiling"; the loader's load is "loading"), or a child's module at its start
#: ("worker", "proof", "aoti", "bench").
ENV_TEST_PAUSE = "AOTBUILD_TEST_PAUSE"
PAUSE_SECONDS = 300

DEFAULT_CACHE_ROOT = os.path.join("~", ".cache", "aotbuild")

#: Warmup arguments that never change what a component sees, so they are not key factors.
PROMPT_ARGUMENTS = frozenset({"prompt", "prompt_2", "prompt_3", "negative_prompt", "negative_prompt_2",
                              "negative_prompt_3"})
#: The image arguments a warmup supplies where the pipeline's call takes them (aotbuild/pipeline/images.py):
#: the input image (img2img, inpainting, instruct-pix2pix, image-to-video; a ControlNet pipeline's control
#: image), an inpainting mask, a ControlNet img2img pipeline's control image. A file's path is no key factor.
IMAGE_ARGUMENTS = ("image", "mask_image", "control_image")
#: The attribute a build job sets on an exception the pipeline's own eager warmup call raised, with no
#: aotbuild code below it (aotbuild/strategies/base.py ``Job.run_warmup``); the child protocol reports it
#: (aotbuild/builder/child.py) and auto then tries no other strategy (aotbuild/builder/build.py).
EAGER_CALL_FAILED = "aotbuild_eager_call_failed"
#: The attribute a build job sets on an exception raised while its pipeline was loaded or placed, before
#: any strategy's code ran (aotbuild/builder/worker.py; a build's loader process says so in its protocol,
#: aotbuild/builder/loader.py): auto tries no other strategy, each of which would load it the same way, and
#: no failure record is kept (the cause, a missing library, a download, memory, is no key factor).
LOAD_FAILED = "aotbuild_load_failed"
#: The prompt used for warmup when the recipe names none.
DEFAULT_WARMUP_PROMPT = "a photo of a cat"


#: Bounds on the work one recipe can ask for (recipes come from pull requests), each raisable by the
#: operator with its variable: warmup steps, prompts in a warmup, shapes, jobs (components x shapes x
#: ranks) per recipe, and seconds per build job and per proof.
LIMITS = {"steps": ("AOTBUILD_MAX_STEPS", 200), "prompts": ("AOTBUILD_MAX_PROMPTS", 64),
          "shapes": ("AOTBUILD_MAX_SHAPES", 64), "jobs": ("AOTBUILD_MAX_JOBS", 256),
          # jobs of one command (plan or build of many recipe files, each within "jobs")
          "total_jobs": ("AOTBUILD_MAX_TOTAL_JOBS", 1024),
          # One warmup call's images (batch_size x prompts) and pixels (height x width x frames x images),
          # and its text encoders' max_sequence_length.
          "batch": ("AOTBUILD_MAX_BATCH", 1024), "pixels": ("AOTBUILD_MAX_PIXELS", 2 ** 27),
          "sequence": ("AOTBUILD_MAX_SEQUENCE", 4096),
          # Every other warmup value (aotbuild/recipe/rules.py WARMUP_CLASSES): the values in all (list items and
          # mapping values, nested or not), seconds of output (audio_length_in_s), and any count or number
          # whose name says nothing else (it may be a size).
          "warmup_items": ("AOTBUILD_MAX_WARMUP_ITEMS", 10_000), "warmup_seconds": ("AOTBUILD_MAX_WARMUP_SECONDS", 600),
          "warmup_number": ("AOTBUILD_MAX_WARMUP_NUMBER", 65536),
          # A LoRA's target modules (a key factor): lora.target_modules, or the distinct names its file's header
          # gives a component (an "all linear" adapter of a large model has tens).
          "lora_targets": ("AOTBUILD_MAX_LORA_TARGETS", 256),
          # compile.options.compile_threads: Inductor starts (and warms) that many compile processes at once.
          "compile_threads": ("AOTBUILD_MAX_COMPILE_THREADS", 64),
          # A component built on the meta device at plan time (aotbuild/pipeline/models.py): its config's layer
          # counts, and every other size it gives.
          "model_layers": ("AOTBUILD_MAX_MODEL_LAYERS", 1024), "model_width": ("AOTBUILD_MAX_MODEL_WIDTH", 2 ** 19),
          "job_seconds": ("AOTBUILD_JOB_TIMEOUT", 4 * 3600),
          # What one manifest may name (manifests come from stores and remotes others write): files,
          # and bytes in all (an entry embedding a 12B model's bf16 weights is ~24 GB).
          "entry_files": ("AOTBUILD_MAX_ENTRY_FILES", 100_000),
          "entry_bytes": ("AOTBUILD_MAX_ENTRY_BYTES", 256 * 1024 ** 3)}


#: The largest value an operator may raise a bound of LIMITS to (a value beyond is a typo): a week for
#: a job's seconds, 2**62 for counts and bytes.
MAX_LIMIT = 2 ** 62
LIMIT_MAX = {"job_seconds": 7 * 86400}


def env_number(variable: str, default: float, low: float, high: float, *, integer: bool = False) -> float:
    """The number in environment variable ``variable`` (``default`` when unset or empty), which must
    be finite and within [low, high]: anything else (``inf``, ``nan``, ``-1``, ``10s``) is a
    UsageError naming the variable, the value and the range, never a silent default or an unbounded
    wait."""
    import math

    text = os.environ.get(variable, "").strip()
    if not text:
        return default
    try:
        value: float = int(text) if integer else float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or not low <= value <= high:
        from aotbuild.errors import UsageError
        from aotbuild.utils.text import printable

        kind = "an integer" if integer else "a number"
        raise UsageError(f"{variable}={printable(text[:40])}: must be {kind} from {low:g} to {high:g}")
    return value


def limit(name: str) -> int:
    """A bound of LIMITS, from its environment variable (a positive integer up to MAX_LIMIT)."""
    variable, default = LIMITS[name]
    return int(env_number(variable, default, 1, LIMIT_MAX.get(name, MAX_LIMIT), integer=True))


def pause_for_tests(point: str) -> None:
    """Sleep here when ``AOTBUILD_TEST_PAUSE`` names ``point`` (tests only, :data:`ENV_TEST_PAUSE`)."""
    if point and os.environ.get(ENV_TEST_PAUSE) == point:
        import sys
        import time

        print(f"{ENV_TEST_PAUSE}: pausing at {point}", file=sys.stderr, flush=True)  # what the test waits for
        time.sleep(PAUSE_SECONDS)


#: Public keys (comma-separated ``.pub`` paths) whose signatures make an entry loadable: with any
#: set, unsigned or otherwise signed entries are misses (aotbuild/cache/signing.py).
ENV_TRUSTED_KEYS = "AOTBUILD_TRUSTED_KEYS"


def env_trusted_keys() -> str:
    return os.environ.get(ENV_TRUSTED_KEYS, "")


def env_cache_root() -> str | None:
    return os.environ.get(ENV_CACHE) or None


#: The longest AOTBUILD_LOCK_TIMEOUT may ask a process to wait for a lock: a day.
MAX_LOCK_TIMEOUT = 86400.0


def lock_timeout() -> float:
    return env_number(ENV_LOCK_TIMEOUT, DEFAULT_LOCK_TIMEOUT, 0, MAX_LOCK_TIMEOUT)


def progress_interval() -> float:
    return env_number(ENV_PROGRESS_INTERVAL, DEFAULT_PROGRESS_INTERVAL, 0, 86400)


def env_max_size() -> str | None:
    return os.environ.get(ENV_MAX_SIZE) or None


def env_allowed_options() -> str:
    return os.environ.get(ENV_ALLOW_OPTIONS, "")


#: ``--shard auto`` (aotbuild/shards.py): the count of a Kubernetes Indexed Job's shards (its
#: ``completions``; Kubernetes puts only the index in a pod's environment).
ENV_SHARD_COUNT = "AOTBUILD_SHARD_COUNT"
#: The schedulers' own variables ``--shard auto`` reads: (index, count) each.
GITLAB_SHARD_VARIABLES = ("CI_NODE_INDEX", "CI_NODE_TOTAL")  # 1-based
BUILDKITE_SHARD_VARIABLES = ("BUILDKITE_PARALLEL_JOB", "BUILDKITE_PARALLEL_JOB_COUNT")  # 0-based
KUBERNETES_SHARD_VARIABLES = ("JOB_COMPLETION_INDEX", ENV_SHARD_COUNT)  # 0-based
AWS_BATCH_SHARD_VARIABLES = ("AWS_BATCH_JOB_ARRAY_INDEX", "AWS_BATCH_JOB_ARRAY_SIZE")  # 0-based
GCP_BATCH_SHARD_VARIABLES = ("BATCH_TASK_INDEX", "BATCH_TASK_COUNT")  # 0-based
#: A Slurm array task: its id, the array's count, min, max and step (in that order).
SLURM_ARRAY_VARIABLES = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN",
                         "SLURM_ARRAY_TASK_MAX", "SLURM_ARRAY_TASK_STEP")

#: Set to 1: build jobs keep the compiler's remote-cache variables (REMOTE_COMPILER_CACHE_VARIABLES),
#: which are otherwise removed from their environment (aotbuild/targets/side_channels.py); the variables
#: kept are then a key factor.
ENV_ALLOW_REMOTE_COMPILER_CACHE = "AOTBUILD_ALLOW_REMOTE_COMPILER_CACHE"
#: What makes torch or Triton read or write a cache outside the entry (torch/_inductor/config.py,
#: remote_cache.py, _functorch/config.py, _dynamo/config.py, torch/compiler/config.py; Triton's knobs):
#: a side channel that can fill or skip what an entry captures.
REMOTE_COMPILER_CACHE_VARIABLES = (
    "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE",
    "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
    "TORCHINDUCTOR_NON_BLOCKING_REMOTE_CACHE_WRITE", "TORCHINDUCTOR_REDIS_URL", "TORCHINDUCTOR_REDIS_HOST",
    "TORCHINDUCTOR_REDIS_PORT", "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO", "TORCH_COMPILE_STICKY_PGO_KEY",
    "TORCH_COMPILE_STICKY_PGO_READ", "TORCH_COMPILE_STICKY_PGO_WRITE", "TORCH_COMPILE_JOB_ID",
    "TRITON_CACHE_MANAGER", "TRITON_REMOTE_CACHE_BACKEND")
#: ... and any variable with one of these prefixes (torch's and Triton's future remote caches).
REMOTE_COMPILER_CACHE_PREFIXES = ("TORCHINDUCTOR_REMOTE_", "TRITON_REMOTE_")


def env_allow_remote_compiler_cache() -> bool:
    return os.environ.get(ENV_ALLOW_REMOTE_COMPILER_CACHE, "") == "1"


#: fsspec storage options for object-store remotes (s3://, gs://, az://), a JSON object; from the
#: environment only: a repository's pyproject.toml cannot point a push at another endpoint or bucket.
ENV_REMOTE_OPTIONS = "AOTBUILD_REMOTE_OPTIONS"
#: An S3-compatible store's endpoint (botocore's own variable), used when the options name none.
ENV_AWS_ENDPOINT = "AWS_ENDPOINT_URL"
#: Tries per object-store request (1 to 20, default 3) and the first backoff in seconds (doubling).
ENV_REMOTE_RETRIES = "AOTBUILD_REMOTE_RETRIES"
ENV_REMOTE_BACKOFF = "AOTBUILD_REMOTE_BACKOFF"


def env_remote_options() -> str:
    return os.environ.get(ENV_REMOTE_OPTIONS, "")


def env_aws_endpoint() -> str:
    return os.environ.get(ENV_AWS_ENDPOINT, "")


#: A GCS-compatible endpoint (google-cloud-storage's and gcsfs's own variable; the emulator's address).
ENV_GCS_EMULATOR = "STORAGE_EMULATOR_HOST"


def env_gcs_emulator() -> str:
    value = os.environ.get(ENV_GCS_EMULATOR, "")
    return "" if value == "default" else value


#: The object stores' own credential variables: never used by aotbuild, read only so that their
#: values can be scrubbed from everything aotbuild prints (aotbuild/utils/secrets.py, SECRET_ENV there).
SECRET_ENV = ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID", "AZURE_STORAGE_KEY",
              "AZURE_STORAGE_SAS_TOKEN", "AZURE_STORAGE_CONNECTION_STRING", "AZURE_CLIENT_SECRET",
              "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_CLIENT_SECRET", "GOOGLE_OAUTH_ACCESS_TOKEN")


def dist_version(name: str) -> str | None:
    """The installed version of the distribution ``name`` (``importlib.metadata``), or None when it is
    not installed: the one helper key factors, toolchain checks and quantization read versions with."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


# -- the supported stack (issue 54) -----------------------------------------------------------------
#: The oldest version of each library aotbuild supports: pyproject.toml's floors and the README's table,
#: the versions CI's pinned job runs (.ci/constraints.txt; torch 2.13.0, the first with what the AOT
#: strategies use: AOTInductor's user-managed constants, save_compiled_function). Older ones were never
#: run; :func:`check_stack` refuses them in one line where a command or an API call starts.
FLOORS = {"torch": "2.13", "diffusers": "0.42", "transformers": "5.24", "huggingface_hub": "2.4",
          "accelerate": "1.16", "numpy": "2.0"}


def _release(text: str) -> tuple[int, ...]:
    """The leading release numbers of a version string ("2.13.0+cpu" -> (2, 13, 0)); () when none."""
    import re

    match = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    return tuple(int(p) for p in match.group(1).split(".")) if match else ()


def stack_problem() -> str:
    """Why the installed libraries are below :data:`FLOORS`, in one line, or "" (a library not installed
    is pip's to report: aotbuild's dependencies name them)."""
    old = []
    for name, floor in FLOORS.items():
        have = dist_version(name)
        if have is not None and _release(have) < _release(floor):
            old.append(f"{name} {have} (needs >={floor})")
    if not old:
        return ""
    pins = " ".join(f"'{name}>={FLOORS[name]}'" for name in (o.split(" ", 1)[0] for o in old))
    return (f"aotbuild {VERSION} supports {', '.join(old)}: older versions were never run (README, "
            f"\"Supported versions\"); pip install -U {pins}")


def check_stack() -> None:
    """A UsageError (one line, exit 2) when an installed library is older than aotbuild supports."""
    why = stack_problem()
    if why:
        from aotbuild.errors import UsageError

        raise UsageError(why.replace(" supports ", " does not support ", 1))


# -- bounds on every read from a remote (issue 53; aotbuild/remote/bounds.py, docs/security.md) ------
#: Seconds one metadata request to a remote may take in all, per try (a listing's page, a manifest, a
#: failure record, an info/exists): a black hole or a drip fails it, then it is retried.
ENV_REMOTE_DEADLINE = "AOTBUILD_REMOTE_DEADLINE"
DEFAULT_REMOTE_DEADLINE = 60.0
#: Seconds a blob transfer may go without receiving a byte (a progress deadline, not a total one).
ENV_REMOTE_STALL = "AOTBUILD_REMOTE_STALL"
DEFAULT_REMOTE_STALL = 60.0
#: The slowest rate, in bytes per second, a transfer may keep up: each ranged read of a blob gets
#: AOTBUILD_REMOTE_DEADLINE plus its length at this rate, and a listing its deadline plus
#: remote.bounds.KEY_BYTES per key listed (a drip of one byte every few seconds never trips a
#: progress deadline). 256 KiB/s: 2 Mbit/s, slower than any link a replica pulls GBs over.
ENV_REMOTE_MIN_RATE = "AOTBUILD_REMOTE_MIN_RATE"
DEFAULT_REMOTE_MIN_RATE = 256 * 1024
#: Keys (objects) one listing of a remote's manifests/ or failures/ may return before it stops, one
#: line naming this variable: 1,000,000 is ten times the largest store we support (100,000 entries).
ENV_REMOTE_MAX_KEYS = "AOTBUILD_REMOTE_MAX_KEYS"
DEFAULT_REMOTE_MAX_KEYS = 1_000_000
