"""Shards of a build: which worker of N this is (``--shard I/N``, or ``--shard auto`` from the
scheduler's own variables), and what identifies a job the same way on every host.

A key holds host facts (the CPU's ISA, the GPU's capability): a matrix whose runners land on AVX2
and AVX-512 machines computes other keys on each, so a split by key would leave jobs to no shard or
to two. Shards are dealt by :func:`job_identity` instead (recipe, component, shape; every rank of a
tensor-parallel job together), which is the same on every host; :func:`list_digest` of the full
list is printed by every shard, so two shards' logs show whether they split the same list.

:func:`from_environment` reads the schedulers that name a worker's index (docs/ci.md, "--shard
auto"); it refuses (a UsageError, exit 2) when it finds none, half of one, a Slurm array that is not
contiguous, or two schedulers that disagree: a shard that guessed "1 of 1" would build everything
and go green.

Every number of ``--shard I/N`` and of a scheduler's variables goes through one parser (:func:`_whole`):
1 to 9 ASCII digits, nothing else (issue 53).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from aotbuild import constants
from aotbuild.errors import UsageError
from aotbuild.utils.text import printable

__all__ = ["AUTO", "Shard", "parse_shard", "whole_number", "from_environment", "resolve", "job_identity",
           "list_digest"]

#: ``--shard auto``: the index and count come from the scheduler's variables.
AUTO = "auto"


class Shard(NamedTuple):
    index: int  # 1-based
    count: int
    #: where (index, count) came from: "--shard" or the scheduler and its variables
    source: str = "--shard"


#: A shard's index or count as text: ASCII digits, 1 to 9 of them. ``str.isdigit()`` passes "²" and
#: "③", which ``int()`` then refuses (a traceback, exit 1), and ``int()`` itself takes "٣", "+3",
#: "3_0" and " 3" (issue 53): neither is asked here.
_WHOLE_NUMBER = re.compile(r"[0-9]{1,9}")
#: What is ignored around a scheduler variable's value (the newline a YAML block scalar leaves):
#: ASCII whitespace only (``str.strip()`` would drop U+00A0 or U+3000 too). ``--shard`` takes none.
_ASCII_SPACE = " \t\n\r\x0b\x0c"


def _escaped(text: str) -> str:
    """A value as an error names it: quoted, at most 20 characters, every non-ASCII or control character
    escaped (a "²" reads ``'\\xb2'``, not as a 2)."""
    return ascii(text[:20]) + (" ..." if len(text) > 20 else "")


def _whole(text: str) -> int | None:
    """The one parser of a shard's numbers: ``text`` as an int if it is 1 to 9 ASCII digits, else None."""
    return int(text) if _WHOLE_NUMBER.fullmatch(text) else None


def whole_number(text: str, what: str) -> int:
    """``text`` (a scheduler variable's value) as a whole number (:func:`_whole`); else a UsageError
    naming ``what`` and the value, escaped."""
    number = _whole(text)
    if number is None:
        raise UsageError(f"{what}={_escaped(text)} is not a whole number (1 to 9 ASCII digits)")
    return number


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` (1-based) -> (I, N): two whole numbers (:func:`_whole`), nothing around them."""
    head, slash, tail = text.partition("/")
    index, count = _whole(head), _whole(tail)
    if not slash or index is None or count is None:
        raise UsageError(f"--shard {_escaped(text)}: expected I/N, two whole numbers of ASCII digits (e.g. 2/4), "
                         f"or auto")
    check(index, count, f"--shard {_escaped(text)}")
    return index, count


def check(index: int, count: int, what: str = "shard") -> None:
    """A shard (1-based) that exists: ``1 <= index <= count``, both ints (the Python API's
    ``build(shard=(I, N))`` too: shard 0 or 5 of 4 would silently build nothing)."""
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (index, count)):
        raise UsageError(f"{what}: expected (I, N), two whole numbers, got {printable(repr((index, count)))[:60]}")
    if count < 1 or not 1 <= index <= count:
        raise UsageError(f"{what}: I must be between 1 and N")


def resolve(text: str, environ: Mapping[str, str] | None = None) -> Shard:
    """``--shard``'s value: ``I/N``, or ``auto`` (:func:`from_environment`). An empty or blank value
    is refused: it is what an unset variable in a CI template gives (``--shard "$SHARD"``), and read
    as "no shard" every worker would build every job and go green (issue 53)."""
    if not text.strip(_ASCII_SPACE):
        raise UsageError(f"--shard {_escaped(text)}: empty (an unset variable in the CI command?): expected I/N "
                         f"(e.g. 2/4) or auto")
    if text.isascii() and text.lower() == AUTO:
        return from_environment(environ)
    return Shard(*parse_shard(text))


def _value(environ: Mapping[str, str], name: str) -> str:
    """A scheduler variable's value, ASCII whitespace around it ignored; "" when unset."""
    return environ.get(name, "").strip(_ASCII_SPACE)


def _number(environ: Mapping[str, str], name: str) -> int:
    return whole_number(_value(environ, name), f"--shard auto: {name}")


def _scheduler(name: str, environ: Mapping[str, str], index_var: str, count_var: str,
               base: int) -> Shard | None:
    """One scheduler's (index, count): None when neither variable is set; a half is refused."""
    have = [v for v in (index_var, count_var) if _value(environ, v)]
    if not have:
        return None
    if len(have) == 1:
        if name == "GitLab" and have == [count_var] and _number(environ, count_var) == 1:
            return Shard(1, 1, "GitLab (CI_NODE_TOTAL=1: the job has no parallel:)")  # as GitLab documents
        missing = ({index_var, count_var} - set(have)).pop()
        hint = " (Kubernetes gives no count: set it to the Job's completions)" \
            if missing == constants.ENV_SHARD_COUNT else ""
        raise UsageError(f"--shard auto: {have[0]} is set but {missing} is not{hint}")
    index, count = _number(environ, index_var), _number(environ, count_var)
    if count < 1 or not base <= index < count + base:
        raise UsageError(f"--shard auto: {index_var}={index} is outside {base}..{count + base - 1} "
                         f"({count_var}={count})")
    return Shard(index - base + 1, count, f"{name} ({index_var}={index}, {count_var}={count})")


def _slurm(environ: Mapping[str, str]) -> Shard | None:
    """A Slurm array task: its index normalised by the array's MIN and STEP; a non-contiguous array
    (``--array=1,3,7``) is refused, naming the variables seen."""
    names = constants.SLURM_ARRAY_VARIABLES
    seen = {v: _value(environ, v) for v in names if _value(environ, v)}
    if not seen:
        return None
    task, count, low, high, step = names
    missing = [v for v in (task, count, low) if v not in seen]
    if missing:
        raise UsageError(f"--shard auto: a Slurm array needs {', '.join((task, count, low))}; "
                         f"{', '.join(missing)} not set (seen: {_shown(seen)})")
    index, total, first = _number(environ, task), _number(environ, count), _number(environ, low)
    stride = _number(environ, step) if step in seen else 1
    last = _number(environ, high) if high in seen else first + stride * (total - 1)
    if stride < 1 or total < 1 or last != first + stride * (total - 1) or (index - first) % stride \
            or not first <= index <= last:
        raise UsageError(f"--shard auto: the Slurm array is not contiguous (--array=A-B or A-B:S): {_shown(seen)}")
    return Shard((index - first) // stride + 1, total, f"Slurm ({_shown(seen)})")


def _shown(seen: Mapping[str, str]) -> str:
    return ", ".join(f"{k}={printable(v[:20])}" for k, v in seen.items())


def from_environment(environ: Mapping[str, str] | None = None) -> Shard:
    """(index, count) from the scheduler running this process: GitLab ``parallel:`` (1-based),
    Buildkite ``parallelism`` (0-based), a Kubernetes Indexed Job (0-based; the count from
    ``AOTBUILD_SHARD_COUNT``, since Kubernetes gives none), a Slurm array, an AWS Batch array job
    (0-based), a Google Cloud Batch task group (0-based). A UsageError names what was looked for
    when none is set, half of one is, or two disagree."""
    import os

    env = os.environ if environ is None else environ
    k8s, aws, gcb, gitlab, buildkite = (constants.KUBERNETES_SHARD_VARIABLES, constants.AWS_BATCH_SHARD_VARIABLES,
                                       constants.GCP_BATCH_SHARD_VARIABLES, constants.GITLAB_SHARD_VARIABLES,
                                       constants.BUILDKITE_SHARD_VARIABLES)
    found = [s for s in (_scheduler("GitLab", env, *gitlab, base=1), _scheduler("Buildkite", env, *buildkite, base=0),
                         _kubernetes(env), _slurm(env), _scheduler("AWS Batch", env, *aws, base=0),
                         _scheduler("Google Cloud Batch", env, *gcb, base=0)) if s is not None]
    if not found:
        looked = [*gitlab, *buildkite, *k8s, *constants.SLURM_ARRAY_VARIABLES[:3], *aws, *gcb]
        raise UsageError(f"--shard auto: no scheduler's shard variables are set (looked for {', '.join(looked)}); "
                         f"on GitHub Actions pass --shard I/N from the matrix")
    if len({(s.index, s.count) for s in found}) > 1:
        raise UsageError("--shard auto: schedulers disagree: " + "; ".join(
            f"{s.source} says {s.index}/{s.count}" for s in found))
    return found[0]


def _kubernetes(env: Mapping[str, str]) -> Shard | None:
    """An Indexed Job's pod: JOB_COMPLETION_INDEX (0-based), the count from AOTBUILD_SHARD_COUNT."""
    return _scheduler("Kubernetes", env, *constants.KUBERNETES_SHARD_VARIABLES, base=0)


def job_identity(recipe: str, component: str, shape: str) -> str:
    """What a job is, the same on every host: its recipe's name, its component, its shape's label.
    A tensor-parallel job's ranks share it (they are built in one launch)."""
    return json.dumps([recipe, component, shape], ensure_ascii=True)


def list_digest(identities: Iterable[str]) -> str:
    """A short sha256 of the distinct job identities, sorted: equal on every shard of one build."""
    text = "\n".join(sorted(set(identities)))
    return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]


def deal(identities: Iterable[str], index: int, count: int) -> set[str]:
    """The identities of shard ``index`` of ``count`` (1-based): the distinct identities, sorted, dealt
    round-robin (identity number k, 0-based, goes to shard k % count + 1)."""
    check(index, count)
    return {ident for k, ident in enumerate(sorted(set(identities))) if k % count == index - 1}


def summary(shard: Shard, picked: int, total: int, digest: str) -> dict[str, Any]:
    return {"index": shard.index, "count": shard.count, "source": shard.source, "jobs": picked,
            "of": total, "digest": digest}
