"""Stand-ins for compiled entries: small real files stored the way the builder stores them.

The builder's plan, verification, store, locks and gc run for real on these; only the compile is
replaced (the ``fake_compiles`` fixture of tests/conftest.py returns ``artifacts`` for each job).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from aotbuild.cache.store import Store
from tests import manifests

ARTIFACT_SIZE = 3000


def key_of(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()


def add_entry(store: Store, tmp_path: Path, name: str, files: dict[str, bytes]) -> str:
    """A stand-in entry made of small real files, stored the way the builder stores one."""
    return manifests.add_entry(store, tmp_path / "src", name, files)


def entries(store: Store, *keys: str):
    out = []
    for key in keys:
        entry, why = store.open_entry(key)
        assert entry is not None, why
        out.append(entry)
    return out


def artifacts(folder: Path, key: str, n: int = 3) -> list[tuple[str, Path]]:
    """A job's stand-in output: n files whose bytes depend only on the key (builds are reproducible)."""
    out = []
    for i in range(n):
        path = folder / key[:12] / f"inductor/{i}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        seed = hashlib.sha256(f"{key}:{i}".encode()).digest()
        path.write_bytes(seed * (ARTIFACT_SIZE // len(seed)))
        out.append((f"inductor/{i}.bin", path))
    return out


def check_no_dangling(store: Store) -> None:
    """The invariant: every manifest on disk names blobs that exist."""
    for m in store.iter_manifests():
        for item in m.files:
            assert store.layout.blob(item.sha256).is_file(), f"{m.key[:12]} points at a missing blob"


# -- one stand-in target build, shared -----------------------------------------------------------

#: A Neuron stand-in recipe at two shapes (tests/fakes: the compile is Dynamo's trace, written where the
#: real compiler writes): ``aotbuild bench --shape 32x32`` builds the one job it lacks, then measures it.
NEURON_BENCH_RECIPE = """\
model: {id: builtin:tiny-sd, dtype: float32}
target: neuron
device: cpu
strategy: jit-cache
compile: {components: [unet]}
shapes: [{height: 64, width: 64}, {height: 32, width: 32}]
warmup: {guidance_scale: 0.0}
"""


def neuron_bench(tmp_path_factory, models_dir: Path) -> dict:
    """``aotbuild bench`` of NEURON_BENCH_RECIPE on a cache holding only the tiny model, once per run
    (tests/conftest.py ``once_per_run``): {"recipe", "cache", "returncode", "stdout", "stderr"}. Its build is
    the one test_bench.py watches bench make and test_targets.py reads the Neuron entry of: a build of the
    stand-in, then three fresh processes, is a minute of CPU, and each test would pay it (issue 30).
    The tests reading it share one xdist group (NEURON_BENCH_GROUP): no worker waits on another's build."""
    import shutil

    from tests.conftest import FAKES, once_per_run, run_cli

    def build(folder: Path) -> dict:
        folder.mkdir(parents=True, exist_ok=True)
        recipe = folder / "tiny_neuron.yaml"
        recipe.write_text(NEURON_BENCH_RECIPE)
        cache = folder / "cache"
        shutil.copytree(models_dir / "models", cache / "models")  # the model is not what bench builds
        proc = run_cli("bench", "--cache", str(cache), str(recipe), "--shape", "32x32", "--calls", "1",
                       "--repeats", "1", env=FAKES)
        return {"recipe": str(recipe), "cache": str(cache), "returncode": proc.returncode, "stdout": proc.stdout,
                "stderr": proc.stderr}

    return once_per_run(tmp_path_factory, "neuron-standin-bench", build)


NEURON_BENCH_GROUP = "neuron-standin-bench"
