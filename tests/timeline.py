"""Where the suite's time goes: an opt-in pytest plugin, and a reader for what it writes.

``python -m pytest -p tests.timeline`` appends one JSON line per test to ``$AOTBUILD_TIMELINE``
(default ``timeline.jsonl`` in the working directory): its node id, the xdist worker that ran it,
start and end (wall clock), and the CPU seconds it spent, its own process's and those of the
subprocesses it waited for (builds' workers and proofs, fresh replicas). ``python -m tests.timeline
FILE`` then prints each worker's busy time and end, and the tests by CPU.

What it showed (issue 30's budget, stop 45): three workers ending within a second of each other,
the run bound by total CPU on 2 cores (95 % busy), not by one group's critical path. A test's
``--durations`` wall time is contended (three workers share two cores); its CPU time is not.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

_started: dict[str, tuple[float, float]] = {}
#: Whether this process runs tests (a worker, or a run without workers), not xdist's controller,
#: which hears every worker's tests too.
_runs_tests = [True]


def _cpu() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def pytest_configure(config):
    _runs_tests[0] = bool(os.environ.get("PYTEST_XDIST_WORKER")) or not config.getoption("numprocesses", None)


def pytest_runtest_logstart(nodeid, location):
    if _runs_tests[0]:
        _started[nodeid] = (time.time(), _cpu())


def pytest_runtest_logfinish(nodeid, location):
    if nodeid not in _started:
        return
    start, cpu = _started.pop(nodeid)
    line = {"id": nodeid, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": start,
            "end": time.time(), "cpu": round(_cpu() - cpu, 3)}
    with open(os.environ.get("AOTBUILD_TIMELINE", "timeline.jsonl"), "a") as out:
        out.write(json.dumps(line) + "\n")


def summary(path: Path, top: int = 30) -> str:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        return f"{path}: no tests recorded"
    first = min(r["start"] for r in rows)
    workers = defaultdict(list)
    for r in rows:
        workers[r["worker"]].append(r)
    out = [f"{len(rows)} tests, {sum(r['cpu'] for r in rows):.0f} s of CPU"]
    for name, mine in sorted(workers.items()):
        out.append(f"  {name}: {len(mine)} tests, busy {sum(r['end'] - r['start'] for r in mine):.0f} s, "
                   f"ends at {max(r['end'] for r in mine) - first:.0f} s, {sum(r['cpu'] for r in mine):.0f} s of CPU")
    out.append(f"the {top} tests with the most CPU (s of CPU, s of wall):")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        out.append(f"  {r['cpu']:7.1f} {r['end'] - r['start']:7.1f}  {r['id']}")
    return "\n".join(out)


if __name__ == "__main__":
    print(summary(Path(sys.argv[1] if len(sys.argv) > 1 else "timeline.jsonl")))
