"""Entries built before issue 33 moved aotbuild's modules into packages still load with 0 compiles.

A build's children and some artifacts name Python paths (``python -m aotbuild.worker`` then,
``python -m aotbuild.builder.worker`` now; aot-compile's trampoline), and a replica upgraded in
place serves the entries CI built with the release before. So this builds the tiny recipe with the
package as it was at :data:`OLD` (the last commit before the first module moved, taken from this
checkout's git history) and serves the entry with this checkout's code in a fresh process, as a
replica would: it hits, nothing compiles, the output equals eager's.

Only aot-compile's entry is built: its artifact is the one that names Python paths at serve time (the
trampoline its saved function calls). jit-cache's entry is Inductor's own cache files and
aot-package's a .pt2 package, neither naming an aotbuild module, and a build's children are the
builder's, not the replica's. All three were built here until the suite's time ran over its 20 minutes
(issue 54): they cost 100-250 s of it, the most of any one test, and all three passed every run.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from tests.conftest import REPO, STRATEGY_RECIPE
from tests.serving import assert_served, serve_fresh

#: The last commit before issue 33's first module move (a675018 made the first package change).
OLD = "67580da645a677dddf512db9504e8d2b3f028e0b"
STRATEGIES = ("aot-compile",)


def _old_package(folder) -> None:
    """aotbuild/ as it was at OLD, extracted into ``folder``; skips where there is no git history."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", OLD, "aotbuild"],
                                 capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        pytest.skip(f"this checkout has no git history holding {OLD[:7]} (a source archive, a shallow clone)")
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(folder, filter="data")


@pytest.mark.slow  # an old build and a fresh serving process
def test_entries_built_before_the_packages_serve_with_0_compiles(models_dir, tmp_path):
    old = tmp_path / "old"
    _old_package(old)
    assert (old / "aotbuild" / "worker.py").is_file() and not (old / "aotbuild" / "builder").exists()
    cache = tmp_path / "cache"
    shutil.copytree(models_dir / "models", cache / "models")
    recipes = []
    for strategy in STRATEGIES:
        recipes.append(tmp_path / f"tiny_sd_{strategy}.yaml")
        recipes[-1].write_text(STRATEGY_RECIPE.format(strategy=strategy))
    build = subprocess.run([sys.executable, "-m", "aotbuild.cli", "build", "--json", "--cache", str(cache),
                            *map(str, recipes)], capture_output=True, text=True, cwd=tmp_path,
                           env={**os.environ, "PYTHONPATH": str(old), "AOTBUILD_CACHE": "",
                                "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "build-inductor")})
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    built = json.loads(build.stdout)["jobs"]
    assert [j["status"] for j in built] == ["built"] * len(STRATEGIES)
    for recipe, strategy in zip(recipes, STRATEGIES, strict=True):
        result = serve_fresh(recipe, cache, tmp_path / f"serve-{strategy}")
        assert_served(result)
        assert result["report"].count("hit") >= 1, result["report"]
