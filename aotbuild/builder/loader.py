"""One pipeline load for all of a recipe's build jobs: a loader process that forks a worker per job.

Without it every job's worker loads the pipeline again (for a 12B transformer, minutes per shape).
The loader (``python -m aotbuild.builder.loader SPEC``, started like every child, aotbuild/builder/child.py) loads
the recipe's pipeline on the CPU (:func:`aotbuild.context.cpu_pipeline`), then serves jobs: for
each job spec path the builder writes to its stdin, it forks, and the forked child runs
:func:`aotbuild.builder.worker.run` on the loaded pipeline, exactly as a fresh worker would from there on
(places it on the device, prepares, compiles, writes its result).

What keeps each job's entry complete and each job's failure its own:

- The loader compiles nothing, so every forked child starts with empty in-process compiler caches:
  a kernel two jobs share is compiled (or read from that job's own, empty, cache folder) and stored
  in both entries, never served from memory. Each child applies its job's capture environment
  before compiling; the loader itself runs with the target's capture environment, so settings that
  compilers read once at import (``TORCHINDUCTOR_FX_GRAPH_CACHE``) are already the job's.
  Only targets that read their cache folder at call time share loads (``Target.shares_loads``).
- The pipeline is the loader's, copy-on-write: what one job does to it (compiling, quantizing,
  moving to the device) is that child's copy, never the next job's.
- A job that crashes, is killed for memory or runs past its time limit ends its forked child; the
  next job forks from the loader (a time-out stops the loader too, and the next job starts another).
- The loader dies with the builder, and each forked job with the loader, however either dies
  (SIGKILL included): both ask for a parent-death signal (aotbuild/builder/child.py ``guard``), the forked
  job again after the fork, which drops it.
- The loader never initialises CUDA (forked children could not use it) and runs torch on one thread
  until it forks: GNU OpenMP's thread pool does not survive a fork (a child that inherits it hangs
  in its first parallel op); each child sets the thread count back.

Every entry is still proven by a fresh process (aotbuild/builder/proof.py), which loads the pipeline itself.

Protocol on the loader's stdout, one line each: ``ready`` (or ``error MESSAGE``) after loading,
then per job ``started PID`` and ``exit CODE``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aotbuild import constants
from aotbuild.builder import child
from aotbuild.cache.locks import flocked
from aotbuild.recipe.schema import recipe_spec

if TYPE_CHECKING:
    from aotbuild.cache.store import Store
    from aotbuild.planner import Job

ENV_SHARED_LOADS = constants.ENV_SHARED_LOADS


def available() -> bool:
    """Whether this platform can share loads: fork (Linux; macOS's fork breaks system frameworks) and
    not turned off by ``AOTBUILD_SHARED_LOADS=0``."""
    return sys.platform.startswith("linux") and os.environ.get(ENV_SHARED_LOADS, "1") != "0"


# -- the loader process ---------------------------------------------------------------------------


#: The loader's protocol stream: its stdout as started. Its fd 1 then points at its log (stderr), so
#: that what a library prints never reads as a protocol line.
_protocol: Any = None


def _say(line: str) -> None:
    _protocol.write(line.replace("\n", " ") + "\n")
    _protocol.flush()


def serve(spec: dict[str, Any]) -> int:
    global _protocol
    child.guard()  # dies with the builder (aotbuild/builder/child.py)
    _protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP pool to inherit (see the module's docstring)
    from aotbuild.context import cpu_pipeline
    from aotbuild.recipe.rules import recipe_from_spec

    started = time.perf_counter()
    constants.pause_for_tests("loading")
    try:
        pipe = cpu_pipeline(recipe_from_spec(spec["recipe"]), Path(spec["cache_root"]))
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            raise RuntimeError("loading the pipeline initialised CUDA: a forked job could not use it")
    except Exception as exc:
        import traceback

        traceback.print_exc()
        _say(f"error {type(exc).__name__}: {exc}")
        return 1
    seconds = round(time.perf_counter() - started, 3)
    _say("ready")
    for line in sys.stdin:
        job_path = line.strip()
        if not job_path:
            continue
        loader = os.getpid()
        pid = os.fork()
        if pid == 0:  # the job
            code = 1
            try:
                child.guard(loader)  # a forked child lost the loader's parent-death signal: dies with the loader
                code = _job(Path(job_path), pipe, threads, seconds)
            except BaseException:  # before child.main took over (its spec unreadable): say why in the log
                import traceback

                traceback.print_exc()
            finally:  # never back into the loader's loop, whatever happened
                try:
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        _say(f"started {pid}")
        _, status = os.waitpid(pid, 0)
        _say(f"exit {os.waitstatus_to_exitcode(status)}")
    return 0


def _job(job_path: Path, pipe: Any, threads: int, load_seconds: float) -> int:
    import torch

    _protocol.close()
    job = json.loads(job_path.read_text())
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdin.close()
    for name, value in job["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.chdir(job["cwd"]) if job.get("cwd") else None
    torch.set_num_threads(threads)
    from aotbuild.builder import worker

    return child.main([str(job_path)], lambda spec: worker.run(spec, loaded=(pipe, load_seconds)))


def main(argv: list[str]) -> int:
    return serve(json.loads(Path(argv[0]).read_text()))


# -- the builder's side ---------------------------------------------------------------------------


class Loader:
    """The builder's handle on one loader process (its recipe's pipeline, loaded once)."""

    def __init__(self, recipe_spec: dict[str, Any], cache_root: Path, folder: Path,
                 env: Mapping[str, str | None]) -> None:
        self.spec = {"recipe": recipe_spec, "cache_root": str(cache_root)}
        self.folder = folder
        self.log = folder / "loader.log"
        self.proc: subprocess.Popen | None = None
        self.problem = ""  # why it could not load: every job it was asked to run fails with it
        self.env = {**{name: None for name in child.LAUNCHER_VARIABLES}, **env}
        self.loads = 0  # loader processes started (a time-out or a crash of the loader starts another)
        self._buffer = b""

    def _start(self, tick: child.Tick | None, started: float, timeout: float | None) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "cwd").mkdir(exist_ok=True)
        spec_path = self.folder / "loader.json"
        spec_path.write_text(json.dumps(self.spec))
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(child.command("aotbuild.builder.loader", str(spec_path)),
                                         env=child.environment(self.env), stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, cwd=self.folder / "cwd",
                                         start_new_session=True, bufsize=0)
        self.loads += 1
        self._buffer = b""
        line = self._line(tick, started, "loading the pipeline", timeout)
        if line != "ready":
            self.problem = line[len("error "):] if line.startswith("error ") else \
                f"the loader exited before loading the pipeline{child.tail(self.log)}"
            self.close()

    def _line(self, tick: child.Tick | None, started: float, phase: str | Path, timeout: float | None) -> str:
        """The loader's next line ("" when it ended), ticking meanwhile; TimeoutError past ``timeout``."""
        assert self.proc is not None and self.proc.stdout is not None
        launched = time.perf_counter()
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            if select.select([fd], [], [], 0.5)[0]:
                data = os.read(fd, 4096)
                if not data:  # the loader ended
                    line, self._buffer = self._buffer, b""
                    return line.decode(errors="replace").strip()
                self._buffer += data
                continue
            if tick:
                tick(time.perf_counter() - started, phase if isinstance(phase, str) else child.read_phase(phase))
            if timeout is not None and time.perf_counter() - launched > timeout:
                raise TimeoutError
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode(errors="replace").strip()

    def run(self, spec: dict[str, Any], spec_path: Path, log: Path, *, env: Mapping[str, str | None],
            cwd: Path | None, phase_file: Path, tick: child.Tick | None, started: float, name: str,
            timeout: float | None) -> tuple[int, dict[str, Any]]:
        """:func:`aotbuild.builder.child.spawn`'s contract for one job, run by a child forked from the loader."""
        spec = {**spec, "result": str(spec_path.with_name("result.json")), "phase": str(phase_file),
                "log": str(log), "env": dict(env), "cwd": str(cwd) if cwd else None}
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(spec))
        try:
            if self.proc is None and not self.problem:
                self._start(tick, started, timeout)
            if self.problem:
                try:  # the job's log, which the builder keeps, says why its pipeline did not load
                    log.write_bytes(self.log.read_bytes())
                except OSError:
                    pass
                return 1, {"error": self.problem, "load_failed": True}  # no strategy's code ran
            assert self.proc is not None and self.proc.stdin is not None
            try:
                self.proc.stdin.write(f"{spec_path}\n".encode())
            except OSError:  # the loader ended since the last job: read why below
                pass
            line = self._line(tick, started, phase_file, timeout)
            if line.startswith("started "):
                line = self._line(tick, started, phase_file, timeout)
        except TimeoutError:
            self.close()  # the job with it; the next job starts another loader
            return -9, {"error": f"{name} ran past its time limit of {timeout:.0f} s "
                                 f"(AOTBUILD_JOB_TIMEOUT raises it)"}
        except BaseException:  # Ctrl-C, SIGTERM: stop the loader and its job, keep nothing
            self.close()
            raise
        if not line.startswith("exit "):  # the loader itself died (killed for memory?)
            self.close()
            why = f"the build's loader process ended{child.tail(self.log)}"
            return 1, {"error": f"{name}: {why}"}
        code = int(line.split()[1])
        result = child.read_result(Path(spec["result"]))
        if code != 0 and "error" not in result:
            result = {"error": f"{name} exited with {code}{child.tail(log)}"}
        return code, result

    def close(self) -> None:
        """Stop the loader (and a job it runs): its pipeline is freed."""
        if self.proc is None:
            return
        child.kill_group(self.proc)
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close() if stream else None
            except OSError:
                pass
        self.proc = None


# -- the build's pool of loaders ----------------------------------------------------------------


class SharedLoads:
    """The build's loader processes (aotbuild/builder/loader.py): one per recipe whose target shares loads,
    started at the recipe's first job and stopped after its last job's worker, before that job's
    proof (which loads its own copy), so the host holds at most the loader's copy and one other."""

    def __init__(self, store: Store, jobs: list[Job]) -> None:
        self.store = store
        self.remaining = Counter(self._identity(j) for j in jobs if self._shares(j))
        self.current: tuple[str, Any, contextlib.ExitStack] | None = None
        self.counts = {"jobs": 0, "build": 0, "proof": 0}

    @staticmethod
    def _shares(job: Job) -> bool:
        return job.ctx is not None and job.ctx.target.shares_loads and job.recipe.tensor_parallel == 1 \
            and available()

    @staticmethod
    def _identity(job: Job) -> str:
        """The pipeline the loader holds: the recipe's, whatever its strategy and compile options, which
        no load reads (an auto job's attempts each name a strategy, its prepacked try adds
        ``compile.options``; all load the same pipeline). The rest of ``compile`` stays: the load applies
        the recipe's ``changes`` to ``compile.components`` (aotbuild/pipeline/changes.py)."""
        spec = recipe_spec(job.recipe)
        spec["data"].pop("strategy", None)
        spec["data"].get("compile", {}).pop("options", None)
        return json.dumps(spec, sort_keys=True, default=str)

    def again(self, job: Job) -> None:
        """``job`` runs another worker (an auto job's next attempt): its loader is kept for it."""
        if self._shares(job):
            self.remaining[self._identity(job)] += 1

    def worker(self, jobs: list[Job]) -> Callable[..., tuple[int, dict[str, Any]]]:
        """What runs the worker of ``jobs`` (one job's ranks), with :func:`aotbuild.builder.child.spawn`'s
        signature: a child forked from its recipe's loader, or (a target that cannot share loads, or
        a job of several ranks, each of which loads its own share) a fresh launch."""
        self.counts["jobs"] += 1
        job = jobs[0]
        if not self._shares(job):
            self.counts["build"] += len(jobs)
            return child.spawn
        assert job.ctx is not None and len(jobs) == 1
        identity = self._identity(job)
        if self.current is None or self.current[0] != identity:
            self._stop()
            self.store.layout.tmp.mkdir(parents=True, exist_ok=True)
            folder = Path(tempfile.mkdtemp(prefix="load.", dir=self.store.layout.tmp))
            held = contextlib.ExitStack()
            held.enter_context(flocked(folder / ".lock", exclusive=True, timeout=0))  # verify --fix keeps out
            held.callback(self.store.clean_staging, folder)
            loader = Loader(recipe_spec(job.recipe), self.store.root, folder, job.ctx.target.capture_env(folder))
            held.callback(loader.close)
            self.current = (identity, loader, held)
        loader = self.current[1]

        def run(module: str, spec: dict[str, Any], spec_path: Path, log: Path, **options: Any) -> tuple[int, dict]:
            assert module == "aotbuild.builder.worker" and options.pop("ranks", 1) == 1
            before = loader.loads
            try:
                return loader.run(spec, spec_path, log, cwd=options.pop("cwd", None), **options)
            finally:
                self.counts["build"] += loader.loads - before

        return run

    def done(self, job: Job) -> None:
        """``job``'s worker ended: after its recipe's last one, that recipe's loader stops."""
        if not self._shares(job):
            return
        identity = self._identity(job)
        self.remaining[identity] -= 1
        if self.remaining[identity] <= 0 and self.current is not None and self.current[0] == identity:
            self._stop()

    def _stop(self) -> None:
        if self.current is not None:
            self.current[2].close()
            self.current = None

    def close(self) -> None:
        self._stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
