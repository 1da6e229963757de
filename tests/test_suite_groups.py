"""The suite's own scheduling (issue 30): the tests that read one shared build run on one xdist
worker, so no worker waits on another's build lock. pytest 9.2 moved the node id out of the
attribute xdist 3.8 writes its group into, and every group silently fell apart; this runs a small
suite under ``-n 2 --dist=loadgroup`` with the real hooks of tests/conftest.py and reads where each
test ran."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # seconds of subprocesses or server traffic: the full suite runs it
def test_tests_sharing_a_build_run_on_one_worker_and_the_rest_spread(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent("""
        import pytest
        from tests.conftest import pytest_collection_modifyitems  # noqa: F401  the hook under test

        @pytest.fixture(scope="session")
        def built_cache():
            return "shared"
    """))
    grouped = "\n".join(f"def test_shared_{i}(built_cache): record('shared_{i}')" for i in range(4))
    alone = "\n".join(f"def test_alone_{i}(): record('alone_{i}')" for i in range(4))
    (tmp_path / "test_probe.py").write_text(textwrap.dedent("""
        import os, time
        from pathlib import Path

        def record(name):
            time.sleep(0.2)  # long enough that both workers take work
            with open(Path(__file__).with_name("ran.txt"), "a") as f:
                f.write(f"{name} {os.environ['PYTEST_XDIST_WORKER']}\\n")
    """) + grouped + "\n" + alone + "\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTEST_XDIST_WORKER", None)
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist=loadgroup",
         "-c", os.devnull, "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ran = dict(line.split() for line in (tmp_path / "ran.txt").read_text().splitlines())
    assert len(ran) == 8
    shared_workers = {worker for name, worker in ran.items() if name.startswith("shared")}
    assert len(shared_workers) == 1, ran  # the group stayed together
    assert {worker for worker in ran.values()} == {"gw0", "gw1"}, ran  # and the rest still spread
