"""One protocol for every Python child process aotbuild starts: build jobs (aotbuild/builder/worker.py), proofs
(aotbuild/builder/proof.py), benchmark runs (aotbuild/cli/bench.py) and the aot-package load probe.

Parent side, :func:`spawn`: the child's spec (JSON data, never a pickle) is written to a file; the
child runs as ``python -m MODULE SPEC``, in the environment and working directory the parent
chose, its output going to a log file; the parent polls it, showing what the child says it is
doing (:func:`phase`) next to the elapsed time, and kills it if the parent is interrupted. The
result is the JSON the child wrote where ``spec["result"]`` says, or ``{"error": ...}`` with the
end of the log when it wrote none.

Child side, :func:`main`: read the spec, run one function on it, write what it returns (or
``{"error": "Type: message"}`` when it raised, the traceback going to the log) as the result, and
exit 1 on an error.

A child never imports from its working directory: ``python -m`` puts the cwd first on
``sys.path``, and CI runs aotbuild in a pull request's checkout, where a planted ``json.py`` would
run with the job's secrets (``HF_TOKEN``). So children start with ``-P`` (Python >= 3.11; and
``PYTHONSAFEPATH=1`` in their environment, which processes they launch inherit), and on 3.10
through :data:`SHIM`, which drops the cwd entry before anything else is imported. ``PYTHONPATH``
keeps working (``-I`` would drop it too).

A child never outlives its parent (:func:`guard`): a CI runner kills a build with SIGKILL after its
grace period, and a child in its own session (``start_new_session``, so that the parent can kill it
whole) is not in the group the runner kills. On Linux each child asks the kernel for SIGKILL when
its parent dies (``prctl(PR_SET_PDEATHSIG)``; a forked child loses it, so the loader's forked jobs
ask again), then checks that the parent it was started by (``AOTBUILD_PARENT_PID``) is still its
parent, in case it died first; elsewhere a watchdog thread polls the parent's pid and kills the
child's process group. Ranks of a launch are guarded the same way, the launcher too (it runs through
this module's ``__main__``). What a dead build left in ``<cache>/tmp`` is reclaimed by the next
build (aotbuild/cache/journal.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from aotbuild import constants
from aotbuild.targets import side_channels

#: tick(seconds since ``started``, the child's phase): called about twice a second while it runs.
Tick = Callable[[float, str], None]

#: Python 3.10 has no ``-P``: ``python -c SHIM MODULE ARGS`` removes the entry ``-c`` put first on
#: ``sys.path`` (the cwd, as "") using only the built-in ``sys``, then runs MODULE as ``-m`` would.
SHIM = ("import sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; import runpy; "
        "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")
#: What torch's launcher sets in a rank's environment.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE")
#: Whether this Python has ``-P`` / ``PYTHONSAFEPATH`` (3.11+).
SAFE_PATH_FLAG = sys.version_info >= (3, 11)


def command(module: str, *args: str, ranks: int = 1) -> list[str]:
    """The command line that runs ``python -m module args`` without the cwd on ``sys.path``; with
    ``ranks`` > 1, ``ranks`` processes of it through torch's own launcher (``torch.distributed.run``,
    what ``torchrun`` runs: a local rendezvous on a free port, RANK, WORLD_SIZE and LOCAL_RANK set),
    itself run through this module (``python -m aotbuild.builder.child torch.distributed.run ...``) so that
    the launcher is guarded (:func:`guard`) like the ranks it starts."""
    if ranks > 1:
        module, args = "aotbuild.builder.child", ("torch.distributed.run", "--standalone", "--nproc-per-node",
                                                  str(ranks), "--max-restarts", "0", "-m", module, *args)
    if SAFE_PATH_FLAG:
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", SHIM, module, *args]


def rank_result(path: Path, rank: int) -> Path:
    """Where rank ``rank`` of a multi-rank child writes its result: ``result.rank1.json``."""
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def _rank() -> int | None:
    """This process's rank when a launcher started it (RANK set), else None."""
    value = os.environ.get("RANK", "")
    return int(value) if value.isdigit() and os.environ.get("WORLD_SIZE") else None


def environment(extra: Mapping[str, str | None]) -> dict[str, str]:
    """This process's environment with ``extra`` applied (None removes a variable); the library
    verbosity that the CLI quieted for itself is given back (a child's log is for a human chasing a
    failure)."""
    env = {**os.environ, **extra, "PYTHONUNBUFFERED": "1", "PYTHONSAFEPATH": "1",
           constants.ENV_PARENT_PID: str(os.getpid())}
    for name in os.environ.get(constants.ENV_QUIETED, "").split(","):
        if name.endswith("_VERBOSITY"):
            env.pop(name, None)
    side_channels.scrub(env)  # no remote compiler cache in a build's children (aotbuild/targets/side_channels.py)
    return {k: v for k, v in env.items() if v is not None}


def spawn(module: str, spec: dict[str, Any], spec_path: Path, log: Path, *,
          env: Mapping[str, str | None] | None = None, cwd: Path | None = None, phase_file: Path | None = None,
          tick: Tick | None = None, started: float | None = None, name: str = "",
          timeout: float | None = None, ranks: int = 1) -> tuple[int, dict[str, Any]]:
    """Run ``python -m module spec_path`` to completion: (exit code, result).

    ``spec["result"]`` (default: ``result.json`` beside the spec) is where the child writes its
    result; ``phase_file`` (also given to the child as ``spec["phase"]``) is what ``tick`` shows;
    ``name`` names the child in the error of one that wrote no result ("worker exited with 1: ...");
    ``timeout`` (seconds) kills a child that runs longer, with that as its error. With ``ranks`` >
    1 the child runs as that many ranks (:func:`command`), each writing :func:`rank_result`; the
    result is then ``{"ranks": [rank 0's, rank 1's, ...]}``, or the first rank's error. The child
    runs in its own process group, killed whole (a launcher's ranks with it)."""
    spec = dict(spec)
    spec.setdefault("result", str(spec_path.with_name("result.json")))
    if phase_file is not None:
        spec.setdefault("phase", str(phase_file))
    # A child is never a rank of the caller's own launch (aotbuild run under torchrun): its ranks, if
    # any, are the ones the launcher below gives it.
    env = {**{name: None for name in LAUNCHER_VARIABLES}, **(env or {})}
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec))
    result_path = Path(spec["result"])
    started = time.perf_counter() if started is None else started
    with open(log, "wb") as out:
        proc = subprocess.Popen(command(module, str(spec_path), ranks=ranks), env=environment(env),
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd,
                                start_new_session=True)
        launched = time.perf_counter()
        try:
            while proc.poll() is None:
                if tick:
                    tick(time.perf_counter() - started, read_phase(phase_file))
                if timeout is not None and time.perf_counter() - launched > timeout:
                    kill_group(proc)
                    return -9, {"error": f"{name or module} ran past its time limit of {timeout:.0f} s "
                                         f"(AOTBUILD_JOB_TIMEOUT raises it)".strip()}
                time.sleep(0.5)
        except BaseException:  # Ctrl-C, SIGTERM: stop the child, keep nothing
            kill_group(proc)
            raise
        kill_group(proc)  # a rank a launcher left behind
    if ranks > 1:
        results = [read_result(rank_result(result_path, r)) for r in range(ranks)]
        failed = [(r, res) for r, res in enumerate(results) if "error" in res or not res]
        if not failed and proc.returncode == 0:
            return 0, {"ranks": results}
        r, res = failed[0] if failed else (0, {})
        why = res.get("error") or f"{name} exited with {proc.returncode}{tail(log)}"
        return proc.returncode or 1, {"error": f"rank {r} of {ranks}: {why}".strip()}
    result = read_result(result_path)
    if proc.returncode != 0 and "error" not in result:
        result = {"error": f"{name} exited with {proc.returncode}{tail(log)}".strip()}
    return proc.returncode, result


def per_rank(outcome: dict[str, Any], ranks: int) -> list[dict[str, Any]]:
    """A successful :func:`spawn`'s result as one result per rank (a launch of one rank writes its
    own result; a launch of several, ``{"ranks": [...]}``)."""
    return list(outcome["ranks"]) if ranks > 1 else [outcome]


def kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's whole process group (a launcher and its ranks, a loader and the job it
    forked) and reap the child."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


#: How often the watchdog (platforms without a parent-death signal) looks at the parent's pid.
WATCHDOG_SECONDS = 1.0
#: ``prctl`` options (linux/prctl.h).
_PR_SET_PDEATHSIG = 1
_guarded_in: int | None = None  # the pid that ran guard(): a forked child runs it again


def guard(parent: int | None = None) -> None:
    """Make this process die with its parent: ``parent`` (default: the pid the parent put in
    ``AOTBUILD_PARENT_PID``; after a fork, the pid that forked). On Linux the kernel sends SIGKILL
    when the parent dies; if it died before that was set (this process then has another parent, its
    subreaper or init), this process exits now. Elsewhere a daemon thread polls the parent's pid
    and kills this process's group. The processes this one starts are told its pid in turn."""
    global _guarded_in
    if _guarded_in == os.getpid():
        return
    _guarded_in = os.getpid()
    if parent is None:
        value = os.environ.get(constants.ENV_PARENT_PID, "")
        parent = int(value) if value.isdigit() else None
    os.environ[constants.ENV_PARENT_PID] = str(os.getpid())
    if parent is None or parent == os.getpid():  # not started by aotbuild
        return
    if not _parent_death_signal():
        _watchdog(os.getppid())
    if os.getppid() != parent and not _alive(parent):  # the parent died before the signal was asked for
        os._exit(137)


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another parent than ``parent`` can also mean that ``python``
    is a wrapper that started this interpreter: then the parent lives and this process runs on).
    A zombie does not: a parent killed before this process asked for the signal, not yet reaped by
    its own parent, still answers signal 0 (seen under load in tests/test_kill.py: the child ran on)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it exists
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # gone meanwhile, or no /proc (not Linux: signal 0 is all there is)
        return not Path("/proc/self/stat").is_file()
    return state not in ("Z", "X")


def _parent_death_signal() -> bool:
    """Ask Linux for SIGKILL when the parent dies; False where there is no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watchdog(parent: int) -> None:
    """A thread that kills this process (its group, when it leads one) once ``parent``, its parent
    now, is no longer its parent."""
    import signal
    import threading

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(WATCHDOG_SECONDS)
        try:  # the whole group: a child is its session's leader, and what it started is in it
            if os.getpgrp() == os.getpid():
                os.killpg(os.getpgrp(), signal.SIGKILL)
        finally:
            os._exit(137)

    threading.Thread(target=watch, name="aotbuild-parent-watchdog", daemon=True).start()


def main(argv: list[str], fn: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """The child: read the spec file ``argv[0]``, run ``fn`` on it, write the result where it says."""
    guard()
    constants.pause_for_tests(_module_of(fn).rsplit(".", 1)[-1])
    spec = json.loads(Path(argv[0]).read_text())
    try:
        result = fn(spec)
    except BaseException as exc:  # the parent reads the reason from the result file
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {exc}".strip()}
        if getattr(exc, constants.EAGER_CALL_FAILED, False):  # the pipeline failed eagerly: so would any strategy
            result["eager_call_failed"] = True
        if getattr(exc, constants.LOAD_FAILED, False):  # the pipeline did not load: no strategy ran
            result["load_failed"] = True
    rank = _rank()
    path = Path(spec["result"]) if rank is None else rank_result(Path(spec["result"]), rank)
    path.write_text(json.dumps(result))
    return 1 if "error" in result else 0


def _module_of(fn: Callable[..., Any]) -> str:
    """The module ``fn`` is from: for one run as ``python -m``, its name, not ``__main__``."""
    name = getattr(fn, "__module__", "") or ""
    if name == "__main__":
        main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        name = main_spec.name if main_spec is not None else name
    return name


def phase(spec: Mapping[str, Any], text: str) -> None:
    """In the child: tell the parent what it is doing (shown next to the elapsed time); of a
    multi-rank child, rank 0 speaks for all."""
    constants.pause_for_tests(text.split(" ", 1)[0])
    if spec.get("phase") and not _rank():
        Path(spec["phase"]).write_text(text)


def read_phase(path: Path | None) -> str:
    try:
        return path.read_text().strip() if path is not None else ""
    except OSError:
        return ""


def read_result(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def tail(log: Path, lines: int = 3) -> str:
    """``": last | lines | of the log"``, or "" when there is none."""
    try:
        text = log.read_text(errors="replace").strip().splitlines()[-lines:]
    except OSError:
        return ""
    return (": " + " | ".join(t.strip() for t in text)) if text else ""


if __name__ == "__main__":  # ``python -m aotbuild.builder.child MODULE ARGS``: MODULE run as ``-m`` would, guarded
    import runpy

    guard()
    sys.argv = sys.argv[1:]
    runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
