"""Several processes on one store at once: two builders of one recipe, readers while writers and gc
replace a manifest, and a lock held by another process (a clear timeout naming it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from dataclasses import replace

import pytest

from aotbuild.builder.build import ResultStatus, store_job
from aotbuild.cache.manage import verify
from aotbuild.cache.store import Store
from tests.conftest import FAKES, REPO, TINY_RECIPE, run_cli
from tests.standins import add_entry, artifacts

# -- 5: two builders at once -----------------------------------------------------------------------

@pytest.mark.slow
def test_two_processes_building_one_recipe_at_once(tmp_path, models_dir):
    """The real builder and worker, twice at once on one cache, with the stand-in neuron backend.
    One job: both builders want the same key, so one of them waits for the other's per-key lock and
    then finds the entry (a second shape only repeated that wait, at the cost of another compile)."""
    recipe = tmp_path / "tiny_neuron.yaml"
    recipe.write_text("model: {id: builtin:tiny-sd, dtype: float32}\ntarget: neuron\ndevice: cpu\n"
                      "strategy: jit-cache\ncompile: {components: [unet]}\nshapes: [{height: 64, width: 64}]\n"
                      "warmup: {guidance_scale: 0.0}\n")
    root = tmp_path / "cache"
    shutil.copytree(models_dir / "models", root / "models")  # the model made once, as a plan would
    cmd = [sys.executable, "-m", "aotbuild.cli", "build", "--json", "--cache", str(root), str(recipe)]
    env = {**os.environ, **FAKES}
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
             for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    store = Store(root)
    manifests = list(store.iter_manifests())
    assert len(manifests) == 1  # one entry for the key both built
    assert verify(store) == []  # identical bytes: every blob hashes to its name, nothing left over
    reports = [json.loads(out) for out, _ in outs]
    for report in reports:
        assert {j["status"] for j in report["jobs"]} <= {"built", "cached"}
    # The job compiled once: the second builder waited for the first (per-key lock), then found it.
    assert sorted(j["status"] for r in reports for j in r["jobs"]) == ["built", "cached"], reports
    assert [j["key"] for r in reports for j in r["jobs"] if j["status"] == "built"] == [manifests[0].key]


# -- 6: readers never see a partial manifest -------------------------------------------------------

def test_readers_never_see_a_partial_manifest_while_writers_and_gc_replace_it(tmp_path):
    store = Store(tmp_path / "c")
    key = add_entry(store, tmp_path, "a", {"x.so": b"kernel"})
    manifest = store.read_manifest(key)
    stop = threading.Event()
    errors: list[str] = []

    def writer():
        i = 0
        while not stop.is_set():
            store.put_manifest(replace(manifest, build={"padding": "p" * (i % 5000), "n": i}))
            i += 1

    def collector():
        while not stop.is_set():
            store.remove_manifest(key)

    threads = [threading.Thread(target=writer), threading.Thread(target=collector)]
    for t in threads:
        t.start()
    try:
        for _ in range(3000):
            path = store.layout.manifest(key)
            try:
                text = path.read_text()
            except FileNotFoundError:
                continue
            try:
                data = json.loads(text)
            except ValueError:
                errors.append(text[:80])
                continue
            if data.get("key") != key or data["files"] != [f.as_json() for f in manifest.files]:
                errors.append("wrong content")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == []


# -- 7: a lock held by another process -------------------------------------------------------------

HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from aotbuild.cache.locks import store_lock
    with store_lock(Path(sys.argv[1]), exclusive=sys.argv[2] == "x"):
        print("held", flush=True)
        time.sleep(60)
""")


@pytest.mark.parametrize("held", ["x", "s"])
def test_a_held_lock_gives_a_clear_timeout_naming_it(tmp_path, monkeypatch, held):
    store = Store(tmp_path / "c")
    add_entry(store, tmp_path, "a", {"x.so": b"kernel"})
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(store.root), held], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        out = run_cli("gc", "--max-size", "1B", "--cache", str(store.root), env={"AOTBUILD_LOCK_TIMEOUT": "0.5"})
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert f"timed out after 0.5 s waiting for the lock {store.root / 'locks' / 'store.lock'}" in out.stderr
        if held == "x":  # a writer facing gc: the job is compiled but not stored, and says why
            from aotbuild.planner import plan

            job = plan([str(TINY_RECIPE)], store.root)[0]
            monkeypatch.setenv("AOTBUILD_LOCK_TIMEOUT", "0.5")
            result = store_job(store, job, artifacts(tmp_path, job.key), {"signatures": []}, 1.0)
            assert result.status == ResultStatus.UNCACHED and "timed out" in result.reason
    finally:
        proc.kill()
        proc.wait()
