"""``aotbuild build``: run every missing job in its own subprocess and store what it compiled.

Order of work per job: plan says miss -> staging folder under ``<cache>/tmp`` -> worker subprocess
with the target's capture environment -> collect files -> blobs -> manifest (last). A failed job is
reported with the end of its log (kept under ``<cache>/logs``) and never stored; the other jobs run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import __version__
from aotbuild.layout import resolve_cache_root
from aotbuild.planner import HIT, MISS, UNAVAILABLE, Job, plan, shard_jobs
from aotbuild.recipe import Recipe, recipe_to_dict
from aotbuild.store import Store
from aotbuild.targets import get_target

if TYPE_CHECKING:
    from aotbuild.remote import Remote

BUILT, CACHED, FAILED, SKIPPED, ON_REMOTE = "built", "cached", "failed", "skipped", "remote"


@dataclass
class JobResult:
    job: Job
    status: str  # built | cached | failed | skipped | remote (on the remote named, not built here)
    seconds: float = 0.0
    size: int = 0
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {**self.job.as_json(), "status": self.status, "seconds": round(self.seconds, 3), "size": self.size,
                "reason": self.reason}


@dataclass
class BuildReport:
    cache: str
    results: list[JobResult]

    @property
    def failed(self) -> list[JobResult]:
        return [r for r in self.results if r.status == FAILED]

    def as_json(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r.status] = counts.get(r.status, 0) + 1
        return {"cache": self.cache, "jobs": [r.as_json() for r in self.results], "counts": counts}


#: progress(event, n, total, job, result): event is "start", "tick" (result.status holds the worker's
#: phase, result.seconds the time so far; about twice a second) or "end".
Progress = Callable[[str, int, int, Job, "JobResult | None"], None]


def build(recipes: list[str] | list[Recipe], cache: str | Path | None = None, *,
          progress: Progress | None = None, shard: tuple[int, int] | None = None,
          remote: Remote | None = None) -> BuildReport:
    """Build every missing job of ``recipes``; jobs already cached are left alone.

    ``shard=(I, N)`` builds only shard I of N of the full job list (planner.shard). With ``remote``,
    a job the remote already holds is not built ("on remote"): pushing it again would send nothing."""
    root = resolve_cache_root(cache)
    store = Store(root)
    jobs = plan(recipes, root)
    if shard is not None:
        jobs = shard_jobs(jobs, *shard)
    on_remote = remote.keys() if remote is not None and any(j.status == MISS for j in jobs) else set()
    results: dict[int, JobResult] = {}
    for i, job in enumerate(jobs):
        if job.status == HIT:
            results[i] = JobResult(job, CACHED, size=_entry_size(store, job.key))
        elif job.status == UNAVAILABLE:
            results[i] = JobResult(job, SKIPPED, reason=job.reason)
        elif job.key in on_remote:
            results[i] = JobResult(job, ON_REMOTE, reason=f"already on {remote.url if remote else ''}")
    todo = [j for i, j in enumerate(jobs) if i not in results]
    done_keys: dict[str, JobResult] = {}
    for n, (i, job) in enumerate((i, j) for i, j in enumerate(jobs) if i not in results):
        assert job.key is not None
        if progress:
            progress("start", n + 1, len(todo), job, None)
        if job.key in done_keys:  # two recipes with the same job: build once
            prior = done_keys[job.key]
            result = JobResult(job, prior.status if prior.status != BUILT else CACHED, size=prior.size,
                               reason=prior.reason)
        else:
            result = _build_one(store, job, _ticker(progress, n + 1, len(todo), job) if progress else None)
            done_keys[job.key] = result
        results[i] = result
        if progress:
            progress("end", n + 1, len(todo), job, result)
    return BuildReport(str(root), [results[i] for i in range(len(jobs))])


def _entry_size(store: Store, key: str | None) -> int:
    manifest = store.read_manifest(key) if key else None
    return store.blob_size(manifest) if manifest else 0


def _build_one(store: Store, job: Job, tick: Callable[[float, str], None] | None = None) -> JobResult:
    assert job.key is not None and job.factors is not None
    target = get_target(job.recipe.target)
    store.layout.tmp.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f"job-{job.key[:12]}.", dir=store.layout.tmp))
    started = time.perf_counter()
    log_path = store.root / "logs" / f"{job.key[:16]}.log"
    try:
        spec = {"recipe": str(Path(job.recipe.source).absolute()), "component": job.component,
                "shape": job.shape.as_dict(), "cache_root": str(store.root), "key": job.key,
                "factors": job.factors, "result": str(staging / "result.json")}
        (staging / "job.json").write_text(json.dumps(spec))
        env = {**os.environ, **target.capture_env(staging), "PYTHONUNBUFFERED": "1"}
        env = {k: v for k, v in env.items() if v is not None}
        with open(staging / "worker.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "aotbuild.worker", str(staging / "job.json")],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            try:
                while proc.poll() is None:
                    if tick:
                        tick(time.perf_counter() - started, _read_phase(staging))
                    time.sleep(0.5)
            except BaseException:  # Ctrl-C: stop the job, keep nothing
                proc.kill()
                proc.wait()
                raise
        seconds = time.perf_counter() - started
        result = _read_result(staging / "result.json")
        if proc.returncode != 0 or "error" in result:
            reason = result.get("error") or f"worker exited with {proc.returncode}{_tail(staging / 'worker.log')}"
            _keep_log(staging / "worker.log", log_path)
            return JobResult(job, FAILED, seconds, reason=f"{reason} (log: {log_path})")
        files = target.collect(staging, job.recipe.strategy)
        if not files:
            return JobResult(job, FAILED, seconds, reason="the job compiled nothing: no artifact to store")
        entries = []
        for rel, path in files:
            digest, size = store.put_blob(path)
            entries.append({"path": rel, "sha256": digest, "size": size})
        manifest = {
            "format": job.factors["format"], "key": job.key, "recipe": job.recipe.name,
            "component": job.component, "shape": job.shape.as_dict(), "target": job.recipe.target,
            "strategy": job.recipe.strategy, "factors": job.factors, "files": entries,
            "signatures": result["signatures"],
            # True only if AOTInductor compiled a tensor's value into a package: see packages[].baked
            "embeds_weights": target.embeds_weights or any(p["baked"] for p in result.get("packages", [])),
            **({"packages": result["packages"]} if "packages" in result else {}),
            "build": {"created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                      "seconds": round(seconds, 3), "aotbuild": __version__, **{k: result.get(k) for k in
                                                                              ("seconds", "counters")}},
            "recipe_data": recipe_to_dict(job.recipe),
        }
        store.put_manifest(job.key, manifest)
        return JobResult(job, BUILT, seconds, size=sum(e["size"] for e in entries), details=result)
    except OSError as exc:
        return JobResult(job, FAILED, time.perf_counter() - started, reason=f"cannot store the result: {exc}")
    finally:
        store.clean_staging(staging)


def _ticker(progress: Progress, n: int, total: int, job: Job) -> Callable[[float, str], None]:
    def tick(seconds: float, phase: str) -> None:
        progress("tick", n, total, job, JobResult(job, phase or "starting", seconds))

    return tick


def _read_phase(staging: Path) -> str:
    try:
        return (staging / "phase").read_text().strip()
    except OSError:
        return ""


def _read_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _tail(log: Path, lines: int = 3) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return (": " + " | ".join(t.strip() for t in text)) if text else ""


def _keep_log(source: Path, dest: Path) -> None:
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(source.read_bytes())
    except OSError:
        pass


__all__ = ["build", "BuildReport", "JobResult", "BUILT", "CACHED", "FAILED", "SKIPPED", "UNAVAILABLE"]
