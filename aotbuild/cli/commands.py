"""The ``aotbuild`` command: a thin click layer over the Python API.

Every known error becomes one line on stderr and an exit code (0 ok, 1 failed, 2 bad input, 3 a
miss under ``--fail-on-miss``, 130 interrupted), never a traceback. ``--json`` output follows docs/cli.md.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import click

from aotbuild import advice, constants
from aotbuild.cache.layout import format_size
from aotbuild.errors import AotbuildError
from aotbuild.utils.secrets import scrub
from aotbuild.utils.text import printable, table

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_MISS, EXIT_INTERRUPTED = 0, 1, 2, 3, 130


def _clean(text: Any) -> str:
    """What a command prints, every control character but the newlines aotbuild wrote escaped: names and
    fields come from files other people write (an OSC escape must not reach the terminal)."""
    return "\n".join(printable(line) for line in scrub(str(text)).split("\n"))


def _echo(text: Any = "", **kwargs: Any) -> None:
    click.echo(_clean(text), **kwargs)


def _error(text: Any) -> None:
    """An error on stderr: one line, whatever its message embeds. The one place errors are printed, so
    a value from a recipe, a model folder, a manifest or a remote that reaches a message (a newline then
    ``::error::``, an escape sequence) is shown escaped, and no raise site can forget (issue 32)."""
    click.echo(printable(scrub(f"error: {text}")), err=True)  # and scrubbed of secrets (issue 53)


def _show(report: Any, as_json: bool) -> None:
    """A command's report: its ``as_json()`` with ``--json``, else its ``text()``."""
    if as_json:
        _emit_json(report.as_json())
    else:
        _echo(report.text())


def _emit_json(data: Any) -> None:
    """``--json``: valid JSON whose every text is :func:`_line`'d too, as the tables' cells are: a
    script that prints a field (``jq -r .jobs[].reason``) prints no newline or escape from a file."""
    def clean(value: Any) -> Any:
        if isinstance(value, str):
            return printable(scrub(value))  # each value: the JSON stays JSON
        if isinstance(value, dict):
            return {clean(k): clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    _echo(json.dumps(clean(data), indent=2, sort_keys=True))


def _run(fn: Callable[[], int | None]) -> None:
    try:
        code = fn() or 0
    except AotbuildError as exc:
        _error(exc)
        code = exc.exit_code
    except BrokenPipeError:  # `aotbuild ls | head`: the reader left, nothing to say (Python docs' recipe)
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = EXIT_OK
    except OSError as exc:  # the file system said no where no module expected it: still one line
        import errno

        where = f"{exc.filename}: " if exc.filename else ""
        hint = "; check the path and its permissions (--cache DIR, AOTBUILD_CACHE)" if exc.errno in (
            errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT, errno.ENOTDIR) else ""
        _error(f"{where}{exc.strerror or exc}{hint}")
        code = EXIT_FAILED
    except KeyboardInterrupt as exc:
        click.echo(printable(f"interrupted{f' ({exc})' if str(exc) else ''}"), err=True)
        code = EXIT_INTERRUPTED
    sys.exit(code)


def command(fn: Callable[..., int | None]) -> Callable[..., None]:
    """A command's body returns its exit code; every known error becomes one line and its code
    (:func:`_run`). Goes below click's decorators, right above the function."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        with advice.cli_voice():  # what to do next, said in flags (aotbuild/advice.py)
            _run(lambda: fn(*args, **kwargs))

    return run


_QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
_QUIET = {"TRANSFORMERS_VERBOSITY": "error", "DIFFUSERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


class _EchoHandler(logging.Handler):
    """Writes to whatever stderr is at the time (click's test runner swaps it)."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(printable(scrub(self.format(record))), err=True)  # a note naming a value: one line, as errors


def _quiet_libraries() -> None:
    """What a command prints is aotbuild's: transformers' and diffusers' advisories (e.g. the
    torchvision notice on every import) and progress bars go, unless the user set these variables.
    The names set here are listed in AOTBUILD_QUIETED: build jobs, whose logs are for a human
    chasing a failure, get the verbosity back. aotbuild's own notes go to stderr."""
    import os

    from aotbuild.constants import ENV_QUIETED

    ours = set(filter(None, os.environ.get(ENV_QUIETED, "").split(",")))
    for name, value in _QUIET.items():
        if name not in os.environ or name in ours:
            os.environ[name] = value
            ours.add(name)
    os.environ[ENV_QUIETED] = ",".join(sorted(ours))  # builder gives jobs the user's settings back
    # What diffusers imports when torchao is installed logs its own advisories (kernels for other
    # hardware, deprecated pytree registrations) at import: noise in plan's output, kept in job logs.
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    log = logging.getLogger("aotbuild")
    if not log.handlers:
        handler = _EchoHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


cache_option = click.option("--cache", "cache", envvar=constants.ENV_CACHE, type=click.Path(file_okay=False),
                            help="Cache root (default: AOTBUILD_CACHE, then [tool.aotbuild] cache in the nearest "
                                 "pyproject.toml, then ~/.cache/aotbuild).")
json_option = click.option("--json", "as_json", is_flag=True, help="Machine-readable output (docs/cli.md).")
shard_option = click.option("--shard", "shard", metavar="I/N|auto",
                            help="Only shard I of N (1-based) of the full job list: one per CI runner; `auto`: I and N "
                                 "from the scheduler (GitLab, Buildkite, Kubernetes, Slurm, AWS/Google Batch; "
                                 "docs/ci.md).")


def _no_cache(root: Any, as_json: bool, empty: dict[str, Any]) -> bool:
    """A read-only command on a cache root that does not exist says so, and creates nothing (a
    mistyped --cache otherwise reads as an empty, healthy cache)."""
    if root.exists():
        return False
    if as_json:
        _emit_json({"cache": str(root), **empty})
    else:
        _echo(f"no cache at {root} (nothing was built there; the root is --cache, else AOTBUILD_CACHE, else "
                   "[tool.aotbuild] cache in the nearest pyproject.toml, else ~/.cache/aotbuild)")
    return True


def remote_option(help_text: str, name: str = "--remote") -> Callable[..., Any]:
    return click.option(name, "remote", envvar=constants.ENV_REMOTE if name == "--remote" else None,
                        metavar="URL", help=help_text)


sign_option = click.option("--sign-key", "sign_key", metavar="NAME.key", type=click.Path(dir_okay=False),
                           help="Sign each entry this build produces and proves with this private key (aotbuild "
                                "keygen NAME makes one); an entry found in the cache unsigned by it is rebuilt.")
trusted_option = click.option("--trusted-keys", "trusted_keys", metavar="A.pub,B.pub",
                              help="Accept only entries signed by one of these public keys (default: "
                                   "AOTBUILD_TRUSTED_KEYS; `none`: verify nothing, on purpose).")


def _keys(text: str | None) -> list[str] | None:
    """The paths of ``--trusted-keys``; None when it is not given. Given but empty is [], which
    signing.trusted_from_env refuses (fail closed), never "not given"."""
    return None if text is None else [p.strip() for p in text.split(",")]


def _remote(url: str | None, required: bool = False) -> Any:
    from aotbuild.errors import UsageError
    from aotbuild.remote.schemes import parse_remote

    if not url:
        if required:
            raise UsageError("name a remote with --remote URL or AOTBUILD_REMOTE (file:///shared/folder, "
                             "hf://owner/repo, hf://datasets/owner/repo, s3://bucket/prefix, gs://bucket/prefix, "
                             "az://container/prefix)")
        return None
    return parse_remote(url)


class _OneLineUsageError(click.ClickException):
    """Click's own error (an unknown option, a missing argument, a bad value) printed like every other:
    one line through :func:`_error`, exit 2, instead of click's three lines (Usage / Try / Error) that
    echo the offending value raw (an option or a path holding ``\\n::error::``)."""

    def __init__(self, exc: click.ClickException):
        super().__init__(exc.format_message())
        self.exit_code = exc.exit_code
        ctx = getattr(exc, "ctx", None)
        self.hint = f" (see `{ctx.command_path} --help`)" if isinstance(exc, click.UsageError) and ctx else ""

    def show(self, file: Any = None) -> None:
        _error(f"{self.message}{self.hint}")


class _Group(click.Group):
    """The CLI's group: click's errors, raised while parsing the group's or a command's arguments, are
    one escaped line (:class:`_OneLineUsageError`)."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        try:
            return super().make_context(*args, **kwargs)
        except click.ClickException as exc:
            raise exc if isinstance(exc, _OneLineUsageError) else _OneLineUsageError(exc) from None

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            raise exc if isinstance(exc, _OneLineUsageError) else _OneLineUsageError(exc) from None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="aotbuild")
def main() -> None:
    """Ahead-of-time compile-and-cache for PyTorch and diffusers pipelines.

    Start with `aotbuild build RECIPE`, then load it with aotbuild.load_compiled(RECIPE);
    docs/quickstart.md walks through it.

    \b
    Example:
      aotbuild build recipes/tiny_sd_cpu.yaml
      aotbuild plan recipes/
    """
    why = constants.stack_problem()
    if why:  # an older torch or library than aotbuild supports: one line, not a traceback deep in Inductor
        _error(why.replace(" supports ", " does not support ", 1))
        sys.exit(EXIT_BAD_INPUT)
    _quiet_libraries()
    _signals_interrupt()


def _signals_interrupt() -> None:
    """SIGTERM (what a CI runner sends on cancel) and SIGHUP (a closed terminal) stop a command as
    Ctrl-C does: children killed, journals reclaimed, temporary folders removed, nothing orphaned."""
    import signal

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    for name in ("SIGTERM", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), interrupt)


@main.command()
@click.argument("recipes", nargs=-1, required=True)
@cache_option
@json_option
@shard_option
@remote_option("After building, push every entry of these jobs to URL; jobs already there are not built.",
               name="--push")
@sign_option
@click.option("--retry-failed", "retry_failed", is_flag=True,
              help="Build again the jobs that failed before (by default a recorded failure is not retried).")
@command
def build(recipes: tuple[str, ...], cache: str | None, as_json: bool, shard: str | None, remote: str | None,
          sign_key: str | None, retry_failed: bool) -> int:
    """Compile every job of RECIPES (files or folders) that the cache lacks.

    Each job (component x shape) compiles in a fresh subprocess; what it compiled is stored in the
    cache. Exit 1 when any job failed (the others still run, are stored and pushed), or failed before
    and was not retried (--retry-failed builds it); 2 for a bad recipe or a model folder that cannot
    be read; 0 when every job not built was skipped because its target or device is not on this host.

    \b
    Examples:
      aotbuild build recipes/tiny_sd_cpu.yaml
      aotbuild build recipes/ --shard 2/4 --push hf://datasets/my-org/aot-cache
    """

    from aotbuild.builder.build import ResultStatus
    from aotbuild.builder.build import build as run_build
    from aotbuild.shards import resolve
    from aotbuild.strategies.order import Outcome

    target = _remote(remote)
    report = run_build(list(recipes), cache=cache, progress=None if as_json else _progress(), sign_key=sign_key,
                       shard=resolve(shard) if shard is not None else None, remote=target, retry_failed=retry_failed)
    pushed = None
    if target is not None:
        from aotbuild.cache.signing import public_of
        from aotbuild.remote.sync import push

        keys = [r.job.key for r in report.results
                if r.status in (ResultStatus.BUILT, ResultStatus.CACHED) and r.job.key]
        # The failures this build recorded go to the remote too (the one rule for failures): failed jobs,
        # and the failed attempts of strategy: auto, recorded under each attempt's own key.
        failed = [r.job for r in report.results if r.status == ResultStatus.FAILED and not r.not_retried] + \
            [a.key for r in report.results for a in r.attempts if a.outcome == Outcome.FAILED and a.key]
        # Nothing is signed on the way out; with --sign-key, a remote entry that key did not sign gives
        # way to this build's own (signed) one.
        pushed = push(keys, target, cache=cache, progress=None if as_json else _transfer_progress("push"),
                      trusted=public_of(sign_key) if sign_key else None, failed=failed) if keys or failed else None
    if as_json:
        _emit_json({**report.as_json(), **({"push": pushed.as_json()} if pushed else {})})
    else:
        _echo(report.text(pushed.text() if pushed is not None else ""))
    if report.bad_input:  # the input is at fault (a model folder it cannot read), as with a bad recipe
        return EXIT_BAD_INPUT
    return EXIT_FAILED if report.failed else EXIT_OK


@main.command()
@click.argument("items", nargs=-1)
@remote_option("Remote to push to: file:///shared/folder, hf://owner/repo[@rev], hf://datasets/owner/repo, "
               "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix.")
@cache_option
@json_option
@trusted_option
@click.option("--sign-key", "sign_key", hidden=True, help="Removed: see `aotbuild sign`.")
@command
def push(items: tuple[str, ...], remote: str | None, cache: str | None, as_json: bool, trusted_keys: str | None,
         sign_key: str | None) -> int:
    """Send cache entries to a remote: KEYS (hex prefixes, 8+ characters) or RECIPES; none = all.

    Only what the remote lacks is sent, blobs before manifests. Entries are hash-checked first:
    a corrupt one is named and not pushed (exit 1). A push never signs (`aotbuild sign` does, knowingly);
    with trusted keys, an entry on the remote that none of them signed is replaced by a pushed one that
    one of them did, and one they signed is never overwritten.

    \b
    Examples:
      aotbuild push recipes/ --remote file:///mnt/shared/aot-cache
      aotbuild push 3f1c9a0b --remote hf://datasets/my-org/aot-cache
    """

    from aotbuild.cache.signing import trusted_from_env
    from aotbuild.errors import UsageError
    from aotbuild.remote.sync import push as run_push

    if sign_key is not None:
        raise UsageError("push --sign-key was removed: a push never signs. `aotbuild sign KEYS... --sign-key "
                         "NAME.key` signs local entries you vouch for (docs/security.md), then push them")
    report = run_push(list(items), _remote(remote, required=True), cache=cache,
                      trusted=trusted_from_env(_keys(trusted_keys)),
                      progress=None if as_json else _transfer_progress("push"))
    _show(report, as_json)
    return EXIT_FAILED if report.damaged else EXIT_OK


@main.command()
@click.argument("recipes", nargs=-1, required=True)
@remote_option("Remote to pull from: file:///shared/folder, hf://owner/repo[@rev], hf://datasets/owner/repo, "
               "s3://bucket/prefix, gs://bucket/prefix, az://container/prefix.")
@cache_option
@json_option
@click.option("--fail-on-miss", is_flag=True, help="Exit 3 when a job is neither cached nor on the remote.")
@trusted_option
@command
def pull(recipes: tuple[str, ...], remote: str | None, cache: str | None, as_json: bool, fail_on_miss: bool,
         trusted_keys: str | None) -> int:
    """Fetch the entries RECIPES need in this environment from a remote, hash-verified.

    Only jobs the local cache lacks are fetched. Exit 1 when a fetched entry was refused
    (hash mismatch, malformed), 3 with --fail-on-miss when a job is on neither side.

    \b
    Example:
      aotbuild pull recipes/sdxl_neuron.yaml --remote hf://datasets/my-org/aot-cache
    """

    from aotbuild.remote.sync import pull as run_pull

    report = run_pull(list(recipes), _remote(remote, required=True), cache=cache, trusted_keys=_keys(trusted_keys),
                      progress=None if as_json else _transfer_progress("pull"))
    _show(report, as_json)
    if report.refused:
        return EXIT_FAILED
    return EXIT_MISS if (fail_on_miss and report.missing) else EXIT_OK


class _Line:
    """Progress on stderr, one way for builds and transfers: on a terminal (a tty) one line redrawn in
    place; in a log, a line when a thing starts and when it ends, and one every AOTBUILD_PROGRESS_INTERVAL
    seconds (60) in between, so a long compile or transfer shows life without filling the log."""

    def __init__(self) -> None:
        self.live = sys.stderr.isatty()
        self.interval = constants.progress_interval()
        self.next = 0.0

    def start(self, text: str) -> None:
        if not self.live:
            self.next = self.interval
            _echo(text, err=True)

    def tick(self, live: str, log: str, seconds: float) -> None:
        """``live`` redrawn on a terminal; ``log`` written once ``seconds`` have passed the next mark."""
        if self.live:
            click.echo("\r\033[K" + _clean(live), nl=False, err=True)
        elif seconds >= self.next:
            self.next = seconds + self.interval
            _echo(log, err=True)

    def end(self, text: str) -> None:
        click.echo(("\r\033[K" if self.live else "") + _clean(text), err=True)


def _progress() -> Callable[..., None]:
    """One line per job; on a terminal it updates in place with the phase and elapsed time."""
    line = _Line()

    def show(event: str, n: int, total: int, job: Any, result: Any) -> None:
        head = f"[{n}/{total}] {printable(job.label)} ({job.key[:12]})"
        if event == "start" and getattr(job, "status", "") == "failed":
            _echo(f"{head} retrying: it {printable(job.reason)}"[:400], err=True)
        if event == "start":
            line.start(f"{head} building ...")
        elif event == "tick":
            line.tick(f"{head} {result.status} {result.seconds:5.0f} s",
                      f"{head} {result.status} ({result.seconds:.0f} s so far)", result.seconds)
        elif event == "end":
            note = f": {printable(result.reason)}" if result.reason else ""  # a failure's reason: one line
            line.end(f"{head} {result.status} in {result.seconds:.1f} s{note}")

    return show


def _transfer_progress(verb: str, clock: Callable[[], float] | None = None) -> Callable[[str, Any], None]:
    """Each entry a push or pull moves (remote.base.Transfer), as builds show their jobs (:class:`_Line`):
    a bar of its bytes on a terminal, a line a minute in a log (issue 55: a multi-GB push said nothing
    for minutes). ``clock``: seconds, for the time each entry has taken (default ``time.monotonic``)."""
    import time

    line = _Line()
    now = clock or time.monotonic
    started: dict[str, float] = {}

    def show(event: str, t: Any) -> None:
        head = f"[{t.n}/{t.count}] {verb} {t.key[:12]}"
        if event == "start":
            started[t.key] = now()
            line.start(f"{head}: {format_size(t.size)} ...")
            return
        seconds = now() - started[t.key] if t.key in started else 0.0
        if event == "tick":
            share = t.done / t.size if t.size else 1.0
            bar = "#" * int(share * 20)
            line.tick(f"{head} [{bar:<20}] {format_size(t.done)} / {format_size(t.size)}",
                      f"{head}: {format_size(t.done)} of {format_size(t.size)} ({share:.0%}, {seconds:.0f} s so far)",
                      seconds)
        elif event == "end":
            line.end(f"{head}: {format_size(t.size)} in {seconds:.1f} s")

    return show


@main.command()
@click.argument("recipes", nargs=-1, required=True)
@cache_option
@json_option
@click.option("--fail-on-miss", is_flag=True,
              help="Exit 3 when any job is not cached (nor on --remote, when given): a CI gate.")
@remote_option("Also look for each job on this remote (status \"remote\"); nothing is downloaded.")
@shard_option
@trusted_option
@click.option("--explain-auto", "explain_auto", is_flag=True,
              help="For each job of a recipe without a strategy (strategy: auto): what auto would try, in order, "
                   "and why each other strategy is excluded.")
@command
def plan(recipes: tuple[str, ...], cache: str | None, as_json: bool, fail_on_miss: bool, remote: str | None,
         shard: str | None, trusted_keys: str | None, explain_auto: bool = False) -> int:
    """List every job of RECIPES: key, component, shape, hit or miss.

    \b
    Examples:
      aotbuild plan recipes/ --fail-on-miss
      aotbuild plan recipes/ --remote hf://datasets/my-org/aot-cache --fail-on-miss
      aotbuild plan recipes/ --explain-auto
    """

    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.errors import RecipeError
    from aotbuild.planner import JobStatus, mark_remote, shard_jobs, shard_summary
    from aotbuild.planner import plan as run_plan
    from aotbuild.recipe.rules import load_recipes
    from aotbuild.shards import resolve

    # a bad --shard (auto with no scheduler; empty: an unset CI variable) fails before planning
    picked = resolve(shard) if shard is not None else None
    target = _remote(remote)
    # A job whose key has a failure record on the remote reads "failed", as a local record does (and as
    # a build with --push would pull it); the remote's records are listed only if a job misses.
    failures = None
    if target is not None:
        from aotbuild.remote.sync import remote_failures

        failures = remote_failures(target)

    # Every bad recipe of a folder is reported, and the good ones planned: three bad recipes, one run.
    bad: list[RecipeError] = []
    good = load_recipes(list(recipes), errors=bad)
    jobs = []
    for recipe in good:
        try:
            jobs += run_plan([recipe], cache=cache, trusted_keys=_keys(trusted_keys), failures=failures)
        except RecipeError as exc:  # what plan checks against the model (warmup keys, adapters)
            bad.append(exc)
    jobs.sort(key=lambda j: (j.key is None, j.key or "", j.label))
    sharded = None
    if picked is not None:
        everything, jobs = jobs, shard_jobs(jobs, *picked)
        sharded = shard_summary(picked, len(jobs), everything)
    if target is not None:  # after sharding: the remote's keys listed once, manifests read for this shard only
        jobs = mark_remote(jobs, target, _keys(trusted_keys))
    if as_json:
        _emit_json({"cache": str(resolve_cache_root(cache)), "remote": target.url if target else None,
                    **({"shard": sharded} if sharded else {}), "jobs": [j.as_json() for j in jobs]})
    elif jobs or not bad:  # a recipe mistake alone is its one line, not an empty table (docs/quickstart.md)
        rows = [[j.recipe.name, j.component + _rank_text(j.factors), str(j.shape),
                 f"{j.recipe.strategy}: {j.chosen}" if j.chosen else j.recipe.strategy,
                 j.key[:12] if j.key else "-", j.status,
                 "" if j.status == JobStatus.HIT and not j.chosen else j.reason] for j in jobs]
        _echo(table(rows, ["recipe", "component", "shape", "strategy", "key", "status", "reason"]))
        if explain_auto:
            _echo(_explain_auto(jobs))
        hits = sum(j.status == JobStatus.HIT for j in jobs)
        there_text = f", {sum(j.status == JobStatus.REMOTE for j in jobs)} on {target.url}" if target else ""
        _echo(f"{hits}/{len(jobs)} jobs cached in {resolve_cache_root(cache)}{there_text}")
        cost = _estimate_text([j for j in jobs if j.status == JobStatus.MISS])
        if cost:
            _echo(cost)
        for j in jobs:  # the text length: how each job serves prompts of other lengths (issue 34)
            if j.text.get("warning"):
                _echo(f"warning: {j.label}: {j.text['warning']}")
        if fail_on_miss and any(j.status == JobStatus.MISS for j in jobs):  # a gate that fails says what fixes it
            _echo(advice.build_line(advice.Situation(recipes, resolve_cache_root(cache),
                                                     target.url if target is not None else "")))
    for exc in bad:
        _error(exc)
    if bad:
        return EXIT_BAD_INPUT
    missing = any(j.status not in (JobStatus.HIT, JobStatus.REMOTE) for j in jobs)
    return EXIT_MISS if (fail_on_miss and missing) else EXIT_OK


def _explain_auto(jobs: list) -> str:
    """Per auto job: the strategies tried in order (each with its concrete key, and whether it failed
    before) and the ones excluded, with why (aotbuild/strategies/order.py)."""
    from aotbuild.planner import JobStatus

    lines = []
    held: dict[tuple[int, str], set[str]] = {}  # what each component's stored shapes hold (the builder
    for j in jobs:  # starts a component's missing shapes there: one strategy serves a component)
        if j.choice is not None and j.status == JobStatus.HIT and j.chosen:
            held.setdefault((id(j.ctx), j.component), set()).add(j.chosen)
    for j in jobs:
        if j.choice is None:
            continue
        lines.append(f"{printable(j.label)} ({j.key[:12] if j.key else '-'}): auto tries, in this order:")
        stored = [n for n in j.choice.tries if n in held.get((id(j.ctx), j.component), ())]
        if j.status != JobStatus.HIT and stored and stored[0] != j.choice.tries[0]:
            lines.append(f"  starts at {stored[0]}: the component's other shapes hold it (one strategy serves "
                         f"every shape of a component); --retry-failed starts at {j.choice.tries[0]}")
        for n, name in enumerate(j.choice.tries, 1):
            known = f"; failed before, skipped until --retry-failed: {printable(j.failed_before[name])}" \
                if name in j.failed_before else ""
            lines.append(f"  {n}. {name} (key {j.attempt_keys.get(name, '-')[:12]}){known}"[:400])
        for name, why in j.choice.excluded:
            lines.append(f"  excluded: {name}: {printable(why)}"[:400])
        if j.chosen:
            lines.append(f"  built: {j.chosen} ({printable(j.reason)})"[:400])
    return "\n".join(lines) if lines else "no job of these recipes has strategy: auto"


def _estimate_text(misses: list) -> str:
    """The misses' estimated total build time and size, from the nearest cached entries."""
    from aotbuild.cache.layout import format_size

    known = [j for j in misses if j.estimated_build_s is not None]
    if not misses:
        return ""
    if not known:
        return f"to build {len(misses)} job(s): no estimate (no similar entry in the cache)"
    seconds = sum(j.estimated_build_s for j in known)
    size = sum(j.estimated_size or 0 for j in known)
    unknown = len(misses) - len(known)
    return (f"to build {len(misses)} job(s): about {_duration(seconds)} and {format_size(size)}"
            + (f" for {len(known)} of them ({unknown} without a similar entry to estimate from)" if unknown else "")
            + " (estimated from the nearest cached entries)")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


@main.command(name="ls")
@cache_option
@json_option
@command
def ls(cache: str | None, as_json: bool) -> int:
    """List what the cache holds: entries (one per job key) and built-in models.

    \b
    Example:
      aotbuild ls --cache /mnt/aot-cache
    """

    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.cache.manage import entries_size
    from aotbuild.strategies.registry import checked_store

    if _no_cache(resolve_cache_root(cache), as_json, {"models": [], "entries": [], "size": 0}):
        return EXIT_OK
    store = checked_store(resolve_cache_root(cache))
    manifests = list(store.iter_manifests())
    models = sorted(p.name for p in store.layout.models.iterdir()
                    if p.is_dir() and not p.name.startswith(".")) if store.layout.models.is_dir() else []
    if as_json:
        _emit_json({"cache": str(store.root), "models": models, "size": entries_size(manifests), "entries": [
            {"key": m.key, "recipe": m.recipe, "component": m.component, "model": _model_of(m),
             "shape": dict(m.shape), "target": m.target, "strategy": m.strategy, "scope": _scope_of(m),
             "size": m.size, "created": _created(m)} for m in manifests]})
        return EXIT_OK
    rows = [[m.key[:12], m.recipe, _model_of(m), m.component + _rank_text(m.factors), _shape_text(m.shape),
             m.target, m.strategy,
             _scope_of(m), format_size(m.size), _created(m) or "?"] for m in manifests]
    _echo(table(rows, ["key", "recipe", "model", "component", "shape", "target", "strategy", "scope", "size",
                        "created"]))
    _echo(f"{len(manifests)} entries, {format_size(entries_size(manifests))} in {store.root}")  # each blob once
    for name in models:
        _echo(f"model: {store.layout.models / name}")
    return EXIT_OK


def _model_of(manifest: Any) -> str:
    model = manifest.recipe_data.get("model") if isinstance(manifest.recipe_data, dict) else None
    return str(model.get("id")) if isinstance(model, dict) and model.get("id") else "?"


def _rank_text(factors: Any) -> str:
    """`` rank 0/2`` for one rank's entry of a tensor-parallel job, else ""."""
    sharded = factors.get("parallel") if isinstance(factors, Mapping) else None
    if not isinstance(sharded, Mapping):
        return ""
    return f" rank {printable(sharded.get('rank'))}/{printable(sharded.get('tensor'))}"


def _scope_of(manifest: Any) -> str:
    compile_ = manifest.factors.get("compile")
    return str(compile_.get("scope", "?")) if isinstance(compile_, dict) else "?"


def _shape_text(shape: Any) -> str:
    from aotbuild.recipe.schema import Shape

    return str(Shape(**shape))


def _created(manifest: Any) -> str | None:
    created = manifest.build.get("created")
    return created if isinstance(created, str) else None


@main.command()
@click.argument("key")
@cache_option
@json_option
@command
def show(key: str, cache: str | None, as_json: bool) -> int:
    """Show one cache entry in full: KEY is a hex prefix of at least 8 characters.

    \b
    Example:
      aotbuild show 3f1c9a0b
    """

    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.keys import flatten
    from aotbuild.strategies.registry import checked_store

    store = checked_store(resolve_cache_root(cache))
    full = store.resolve_prefix(key)
    try:
        manifest = store.load_manifest(full)
    except (OSError, ValueError) as exc:
        raise AotbuildError(f"entry {full[:12]} cannot be used: {str(exc).replace(str(store.root) + '/', '')}; "
                            f"run `aotbuild verify`") from None
    if manifest is None:
        raise AotbuildError(f"entry {full[:12]} was removed meanwhile")
    if as_json:
        _emit_json(manifest.as_json())
        return EXIT_OK
    _echo(f"key:        {full}")
    for field in ("recipe", "component", "target", "strategy"):
        _echo(f"{field + ':':<12}{printable(getattr(manifest, field))}")
    if manifest.auto is not None:  # strategy: auto: what the build tried before storing this strategy's entry
        from aotbuild.strategies.order import Attempt

        own = ", ".join(f"{k} {v}" for k, v in (manifest.auto.get("factors") or {}).items())
        _echo(f"{'auto:':<12}chose {printable(manifest.strategy)}" + (f" (its own factors, checked at load: "
                                                                  f"{printable(own)})" if own else ""))
        for attempt in manifest.auto.get("attempts") or []:
            _echo(f"{'':<12}{printable(Attempt.from_json(attempt).text())}"[:500])
    _echo(f"{'shape:':<12}{_shape_text(manifest.shape)}")
    if _rank_text(manifest.factors):
        _echo(f"{'parallel:':<12}tensor-parallel degree {printable(manifest.factors['parallel'].get('tensor'))}, "
              f"rank {printable(manifest.factors['parallel'].get('rank'))}")
    b = manifest.build
    seconds = b.get("seconds")
    if isinstance(seconds, dict):  # entries written before 0.1.0's fix held the phases here
        seconds = round(sum(v for v in seconds.values() if isinstance(v, int | float)), 1)
    phases = b.get("phases")
    split = (" (" + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in phases.items()
                              if isinstance(v, int | float)) + ")") if isinstance(phases, dict) else ""
    _echo(f"{'built:':<12}{printable(b.get('created'))} in {printable(seconds)} s{printable(split)} by aotbuild "
          f"{printable(b.get('aotbuild'))}")
    _echo(f"{'size:':<12}{format_size(manifest.size)} in {len(manifest.files)} files")
    proof = manifest.proof
    if proof is None:
        _echo(f"{'proof:':<12}none (built before aotbuild proved entries)")
    else:
        _echo(f"{'proof:':<12}served by a fresh process in {proof.load_s:.1f} s: {proof.compiles} compiles "
                   f"({proof.counter or 'compiler counters'}), {proof.instances} module instance(s), "
                   f"{proof.calls} call(s), {_difference_text(proof)}")
    _echo("factors:")
    for path, value in flatten(dict(manifest.factors)).items():
        _echo(f"  {printable(path)} = {json.dumps(value)}")
    _echo(f"signatures: {len(manifest.signatures)} call signature(s) built")
    dropped = sorted({k for r in manifest.packages for k in r.get("dropped_guards") or ()})
    if dropped:  # aot-compile: guard kinds its saved functions no longer check (docs/runtime.md)
        _echo(f"guards:     dropped at save: {printable(', '.join(dropped))}")
    _echo(f"signed by:  {_signed_text(manifest)}")
    return EXIT_OK


def _difference_text(proof: Any) -> str:
    """What the proof held the served outputs to: the absolute bound, or a relative one (int8static: against
    its quantized model run eagerly, with the package's and that model's distances from the float model).
    The figures come from a manifest, which may come from elsewhere: only finite numbers are printed."""
    def number(value: Any) -> float | None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return None
        try:
            value = float(value)
        except OverflowError:
            return None
        return value if math.isfinite(value) else None

    relative = proof.served.get("relative") if isinstance(proof.served, dict) else None
    relative = relative if isinstance(relative, dict) else {}
    gap, bound = number(relative.get("max_rel_diff")), number(relative.get("tolerance"))
    if gap is None or bound is None:
        return f"max |compiled - eager| {proof.max_abs_diff:.2e} (tolerance {proof.tolerance:.0e})"
    text = f"max |compiled - eager| / |eager| {gap:.2e} (bound {bound:.2g}"
    within = relative.get("over_bound_within_format")
    if isinstance(within, int) and not isinstance(within, bool) and 0 < within < 10**9:
        text += f"; {within} output(s) over it as far from the float model as the format itself"
    text += ")"
    served, quantized = number(relative.get("from_float")), number(relative.get("quantized_from_float"))
    if served is not None:
        text += f"; from the float model {served:.2e}"
        if quantized is not None:
            text += f" (the quantized model run eagerly {quantized:.2e})"
    return text


def _signed_text(manifest: Any) -> str:
    """Each key that signed, and (with trusted keys set) which trusted key's signature verifies."""
    from aotbuild.cache.signing import signer, trusted_from_env

    names = ", ".join(printable(s["key"]) for s in manifest.signed_by) or "nobody (unsigned)"
    trusted = trusted_from_env() if manifest.signed_by else None
    if trusted is None:
        return names
    who = signer(manifest, trusted)
    return f"{names} ({f'verified: trusted key {printable(who)}' if who else 'no trusted key signature verifies'})"


@main.command()
@click.argument("items", nargs=-1, required=True)
@click.option("--sign-key", "sign_key", metavar="NAME.key", type=click.Path(dir_okay=False), required=True,
              help="The private key to sign with.")
@cache_option
@json_option
@command
def sign(items: tuple[str, ...], sign_key: str, cache: str | None, as_json: bool) -> int:
    """Sign local entries you VOUCH for: KEYS (hex prefixes, 8+ characters) or RECIPES (their cached jobs).

    A signature tells every machine that trusts the key "load this": `build --sign-key` gives it only
    to what that build compiled and proved. This command gives it to entries found in a cache (pulled,
    restored, copied), so use it only for entries whose origin you know (docs/security.md). Each is
    hash-checked first; nothing is signed when one is damaged or missing.

    \b
    Example:
      aotbuild sign 3f1c9a0b 77d0e2aa --sign-key keys/ci.key
    """

    from aotbuild.remote.sync import sign as run_sign

    signed = run_sign(list(items), sign_key, cache)
    if as_json:
        _emit_json({"signed": signed})
    else:
        _echo(f"signed {len(signed)} entries" + "".join(f"\n  {k[:12]}" for k in signed))
    return EXIT_OK


@main.command()
@click.argument("name")
@click.option("--convert", is_flag=True, help="NAME is an old-format key file (NAME:base64): rewrite it in the "
                                              "new format, in place (.key private, .pub public).")
@command
def keygen(name: str, convert: bool) -> int:
    """Write an Ed25519 key pair: NAME.key (private, mode 0600) and NAME.pub, each one line
    `aotbuild-ed25519-private-v1 NAME BASE64` / `aotbuild-ed25519-public-v1 NAME BASE64`.

    Sign with `build --sign-key NAME.key`; serving machines trust the public key
    (`AOTBUILD_TRUSTED_KEYS=NAME.pub`). NAME may include a folder; existing files are never
    overwritten, except by --convert.

    \b
    Examples:
      aotbuild keygen keys/ci-2026
      aotbuild keygen --convert keys/ci.key
    """

    from aotbuild.cache.signing import convert as run_convert
    from aotbuild.cache.signing import keygen as run_keygen

    if convert:
        _echo(f"converted {run_convert(name)} to the new key format (signatures it made stay valid)")
        return EXIT_OK
    private, public = run_keygen(name)
    _echo(f"private key: {private} (keep it secret: a CI secret)\npublic key:  {public} (trust it where you serve)")
    return EXIT_OK


@main.command()
@cache_option
@json_option
@click.option("--fix", is_flag=True, help="Repair: drop damaged entries (the next build rebuilds them), orphans "
                                          "and leftovers of dead writers.")
@trusted_option
@command
def verify(cache: str | None, as_json: bool, fix: bool, trusted_keys: str | None) -> int:
    """Check every entry's blobs by hash; list every problem. Exit 1 when there is any.

    Problems: a blob whose content does not match its name, a missing blob, a malformed manifest, an
    orphan blob no manifest names, a temp file or build folder left by a writer that died.

    \b
    Examples:
      aotbuild verify
      aotbuild verify --fix
    """

    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.cache.manage import verify as run_verify
    from aotbuild.cache.signing import trusted_from_env
    from aotbuild.strategies.registry import checked_store

    if _no_cache(resolve_cache_root(cache), as_json, {"fixed": fix, "problems": []}):
        return EXIT_OK
    store = checked_store(resolve_cache_root(cache), trusted_from_env(_keys(trusted_keys)))
    problems = run_verify(store, fix=fix)
    remain = [p for p in problems if not fix or p.remains()]
    if as_json:
        from aotbuild.cache.journal import notes

        _emit_json({"cache": str(store.root), "fixed": fix, "problems": [p.as_json() for p in problems],
                    "remaining": [p.as_json() for p in remain], "notes": notes(store),
                    **({"signed_by": _signers(store)} if store.trusted is not None else {})})
    else:
        for p in problems:
            key = f" (entry {p.key[:12]})" if p.key else ""
            left = "  (remains)" if fix and p in remain else "  (left for its owner)" if not p.fixable else ""
            _echo(f"{p.kind:<9} {printable(p.path)}: {printable(p.detail)}{key}{left}")
        owners = [p for p in (remain if fix else problems) if not p.fixable]
        if fix:
            summary = [f"{len(problems) - len(remain)} problem(s) fixed in {store.root}"]
            summary += [f"{len(remain)} remain"] if remain else []
        else:
            repairs = sum(p.fixable for p in problems)
            summary = [f"{len(problems)} problem(s) found in {store.root}"]
            summary += ["run `aotbuild verify --fix` to repair" + (f" {repairs} of them" if owners else "")] \
                if repairs else []
        summary += [_left_for_owners(owners)] if owners else []
        _echo("; ".join(summary))
        if store.trusted is not None:  # rotation: which trusted key vouches for how many entries
            _echo(_signers_text(store))
    # A finding --fix never removes keeps the exit at 1 too: the store holds something aotbuild cannot
    # vouch for (a file it did not write, an entry nobody trusted signed, a manifest it cannot read).
    return EXIT_FAILED if remain else EXIT_OK


def _signers(store: Any) -> dict[str, str]:
    """key -> the trusted key whose signature on its entry verifies ("" for none)."""
    from aotbuild.cache.signing import signer

    return {m.key: signer(m, store.trusted) for m in store.iter_manifests()}


def _signers_text(store: Any) -> str:
    from collections import Counter

    counts = Counter(_signers(store).values())
    by = ", ".join(f"{printable(name)} {n}" for name, n in sorted(counts.items()) if name)
    return (f"{sum(n for name, n in counts.items() if name)} entries signed by a trusted key: {by or 'none'}"
            + (f"; {counts['']} by none" if counts[""] else ""))


def _left_for_owners(problems: list) -> str:
    """What ``verify --fix`` never removes, and what its owner does about each kind."""
    from aotbuild.cache.manage import OWNER_ACTION

    one = len(problems) == 1
    actions = "; ".join(f"{kind}: {OWNER_ACTION[kind]}" for kind in sorted({p.kind for p in problems}))
    return (f"{len(problems)} left for {'its owner' if one else 'their owners'} (--fix never removes "
            f"{'it' if one else 'them'}): {actions}")


@main.command()
@cache_option
@json_option
@click.option("--max-size", "max_size", metavar="SIZE",
              help="Remove least recently used entries until the cache fits: a size with its unit (20GB, "
                   "500MB, 1.5GiB, 4096B; a bare number is refused). Default: "
                   "AOTBUILD_MAX_SIZE (never pyproject.toml's max_size, which only builds use).")
@click.option("--stale", is_flag=True, help="Remove entries that can never match this environment again "
                                            "(another torch, Python, CPU ISA or GPU, or an older format).")
@click.option("--dry-run", is_flag=True, help="Say what would be removed; remove nothing.")
@command
def gc(cache: str | None, as_json: bool, max_size: str | None, stale: bool, dry_run: bool) -> int:
    """Shrink the cache: to a size limit (least recently used first) and/or drop stale entries.

    A load or a build that uses an entry makes it recent. Manifests go before their blobs, so an
    interrupted gc never leaves an entry pointing at nothing.

    \b
    Examples:
      aotbuild gc --max-size 50GB --dry-run
      aotbuild gc --stale
    """

    from aotbuild.cache.layout import resolve_cache_root, resolve_max_size
    from aotbuild.cache.manage import gc as run_gc
    from aotbuild.errors import UsageError
    from aotbuild.strategies.registry import checked_store

    limit = resolve_max_size(max_size)
    if limit is None and not stale:
        raise UsageError("say what to collect: --max-size SIZE (or AOTBUILD_MAX_SIZE), --stale, or both")
    if _no_cache(resolve_cache_root(cache), as_json, {"removed": [], "size_before": 0, "size_after": 0,
                                                      "dry_run": dry_run}):
        return EXIT_OK
    store = checked_store(resolve_cache_root(cache))
    report = run_gc(store, max_size=limit, stale=stale, dry_run=dry_run)
    if not report.removed and not as_json:
        _echo("nothing to remove" + (f" (under {format_size(limit)})" if limit is not None else ""))
    if as_json:
        _emit_json({"cache": str(store.root), **report.as_json()})
        return EXIT_OK
    _echo(report.text(str(store.root)))
    return EXIT_OK


@main.command()
@click.argument("items", nargs=-1, required=True)
@cache_option
@json_option
@command
def rm(items: tuple[str, ...], cache: str | None, as_json: bool) -> int:
    """Remove entries: KEYS (hex prefixes, 8+ characters) or every entry of RECIPES (any environment).

    A recipe's entries are those built under its name (the file name without .yaml), whatever
    their key: a copy of a recipe under another name removes nothing of the original's.

    \b
    Examples:
      aotbuild rm 3f1c9a0b
      aotbuild rm recipes/tiny_sd_cpu.yaml
    """

    from pathlib import Path

    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.cache.manage import rm as run_rm
    from aotbuild.errors import UsageError
    from aotbuild.recipe.rules import load_recipes
    from aotbuild.remote.sync import is_key_prefix
    from aotbuild.strategies.registry import checked_store

    for item in items:
        if not is_key_prefix(item) and not Path(item).exists():
            raise UsageError(f"{item}: not a key (a hex prefix of 8+ characters; `aotbuild ls` lists them) "
                             "nor a recipe file or folder")
    store = checked_store(resolve_cache_root(cache))
    keys = [store.resolve_prefix(i) for i in items if is_key_prefix(i)]
    names = {r.name for r in load_recipes([i for i in items if not is_key_prefix(i)])} \
        if any(not is_key_prefix(i) for i in items) else set()
    keys += [m.key for m in store.iter_manifests() if m.recipe in names]
    removed = run_rm(store, keys)
    if as_json:
        _emit_json({"cache": str(store.root), "removed": [{"key": k, "freed": n} for k, n in removed]})
    else:
        for key, freed in removed:
            _echo(f"removed {key[:12]} ({format_size(freed)} freed)")
        _echo(f"{len(removed)} {'entry' if len(removed) == 1 else 'entries'} removed from {store.root}")
    return EXIT_OK


@main.command()
@click.argument("recipe")
@cache_option
@json_option
@click.option("--shape", metavar="[Fx]HxW[bB]", help="The recipe's shape to measure, labelled as `aotbuild plan` "
              "prints it: 64x96, 64x96b2 (batch 2), 9x64x96 (9 frames); default: its first.")
@click.option("--repeats", type=click.IntRange(1, 50), default=3, show_default=True,
              help="Fresh processes for eager and warm; the table shows min / median / max.")
@click.option("--cold-repeats", type=click.IntRange(1, 50), default=1, show_default=True,
              help="Fresh processes for cold (each pays a full compile).")
@click.option("--calls", type=click.IntRange(1, 1000), default=3, show_default=True,
              help="Calls after the first, for the steady-state time.")
@click.option("--modes", default="eager,cold,warm", show_default=True,
              help="Which to measure, comma-separated (cold costs a full compile).")
@click.option("--plot", "plot_file", metavar="FILE.png", type=click.Path(dir_okay=False),
              help="Also draw the results (needs pip install 'aotbuild[plot]').")
@command
def bench(recipe: str, cache: str | None, as_json: bool, shape: str | None, repeats: int, cold_repeats: int,
          calls: int, modes: str, plot_file: str | None) -> int:
    """Measure RECIPE on this machine: eager vs cold compile vs aotbuild warm load.

    Each mode runs in a fresh process, timed from process start (imports included) to the first
    pipeline output, with the compiler caches pointed at empty folders: eager runs uncompiled, cold
    compiles as torch.compile would without any cache, warm loads from the aotbuild cache with
    load_compiled(on_miss="error"). Jobs the cache lacks for that shape are built first. Eager and
    warm run in 3 processes each (--repeats), cold in one (--cold-repeats); a busy machine (load
    average above half the cores) is warned about on stderr.

    \b
    Examples:
      aotbuild bench recipes/tiny_sd_cpu.yaml
      aotbuild bench recipes/tiny_sd_cpu.yaml --shape 64x96 --cold-repeats 3 --plot bench.png
    """

    from aotbuild.cli import bench as benchmod

    if plot_file:
        benchmod.require_matplotlib()  # before minutes of measuring, not after
    chosen = tuple(m.strip() for m in modes.split(",") if m.strip())
    report = benchmod.bench(recipe, cache, shape=shape, repeats=repeats, cold_repeats=cold_repeats, calls=calls,
                            modes=chosen, progress=lambda text: _echo(text, err=True),
                            build_progress=_progress(), warn=lambda text: _echo(text, err=True))
    if plot_file:
        benchmod.plot(report, plot_file)
    _show(report, as_json)
    if plot_file and not as_json:
        _echo(f"plot: {plot_file}")
    return EXIT_OK


@main.command()
@click.option("--target", "target", default="inductor", show_default=True,
              help="The target to check: inductor, neuron or tpu.")
@click.option("--device", default=None, help="The device to check (default: the target's).")
@cache_option
@remote_option("A remote to check (default: AOTBUILD_REMOTE; skipped when neither is set).")
@click.option("--deep", is_flag=True, help="Hash every blob of the store, as `aotbuild verify` does.")
@click.option("--no-roundtrip", "no_roundtrip", is_flag=True, help="Skip the tiny build (a minute or two).")
@json_option
@command
def doctor(target: str, device: str | None, cache: str | None, remote: str | None, deep: bool, no_roundtrip: bool,
           as_json: bool) -> int:
    """Check that this machine can build and serve a cache: toolchain, caches, disk, store, remote,
    and a roundtrip (the built-in tiny model built, proven by a fresh process serving it with 0
    compiles, in a temporary cache). Exit 0 when every check passes or is skipped, 1 otherwise.

    \b
    Examples:
      aotbuild doctor
      aotbuild doctor --device cuda --json
    """

    from aotbuild.cli.doctor import doctor as run_doctor
    from aotbuild.errors import UsageError
    from aotbuild.targets.registry import target_names

    if target not in target_names():
        raise UsageError(f"--target {target!r} is not a target (known: {', '.join(target_names())})")
    report = run_doctor(target, device, cache, remote, deep=deep, roundtrip=not no_roundtrip,
                        progress=None if as_json else _progress())
    _show(report, as_json)
    return EXIT_OK if report.ok else EXIT_FAILED


@main.command()
@json_option
@command
def targets(as_json: bool) -> int:
    """List every target and strategy: available here or not (and why), versions, default device and dtype.

    \b
    Example:
      aotbuild targets --json
    """

    from aotbuild.strategies.order import summary
    from aotbuild.strategies.registry import get_strategy, strategy_names
    from aotbuild.targets.registry import get_target, target_names

    rows = []
    for name in target_names():
        target = get_target(name)
        available = target.availability()
        device = target.default_device() if available.ok else "-"
        rows.append({"name": name, "available": available.ok, "reason": available.reason,
                     "versions": dict(available.versions), "default_device": device,
                     "default_dtype": target.default_dtype, "static_shapes": target.static_shapes,
                     "embeds_weights": target.embeds_weights})
    strategies = []
    for name in strategy_names():
        strategy = get_strategy(name)
        why = strategy.availability()
        strategies.append({"name": name, "targets": list(strategy.targets or target_names()),
                           "available": not why, "reason": why, "summary": summary(strategy)})
    if as_json:
        _emit_json({"targets": rows, "strategies": strategies})
        return EXIT_OK
    cells = [[r["name"], "yes" if r["available"] else "no", r["default_device"], r["default_dtype"],
              " ".join(f"{k}={v}" for k, v in r["versions"].items()) or "-", r["reason"]] for r in rows]
    _echo(table(cells, ["target", "available", "device", "dtype", "versions", "why not"]))
    _echo()
    cells = [[r["name"], ", ".join(r["targets"]), "yes" if r["available"] else "no", r["reason"] or r["summary"]]
             for r in strategies]
    _echo(table(cells, ["strategy", "targets", "available", "what it stores, or why not"]))
    return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    main()
