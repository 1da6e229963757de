"""Progress for push and pull (issue 55): each entry's bytes, done of its size, shown as builds show their
jobs: a bar redrawn on a terminal, a line every AOTBUILD_PROGRESS_INTERVAL seconds (a minute) in a log.
Before, a push printed one line per entry once it was there and a pull nothing, so a multi-GB entry
went to the Hub or S3 with the console silent for minutes."""

from __future__ import annotations

import re
import shutil
import sys

from tests.conftest import TINY_RECIPE, invoke_cli


def test_push_and_pull_show_each_entry_s_bytes_in_a_log(tmp_path, cache, fake_compiles):
    """Through the CLI (not a terminal), with AOTBUILD_PROGRESS_INTERVAL=0: a line for every update. Each
    entry is three stand-in blobs of 2,976 bytes (tests/standins.py), read and counted one by one."""
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE.read_text())
    local, other, remote = cache, tmp_path / "other", f"file://{tmp_path / 'remote'}"  # cache: the built-in model
    shutil.copytree(cache / "models", other / "models")
    assert invoke_cli("build", "--cache", str(local), str(recipe)).returncode == 0
    assert len(fake_compiles) == 2
    often = {"AOTBUILD_PROGRESS_INTERVAL": "0"}
    pushed = invoke_cli("push", "--remote", remote, "--cache", str(local), env=often)
    assert pushed.returncode == 0, pushed.stderr
    pulled = invoke_cli("pull", str(recipe), "--remote", remote, "--cache", str(other), env=often)
    assert pulled.returncode == 0 and pulled.stdout.count("pulled") == 2, pulled.stdout + pulled.stderr
    for verb, proc in (("push", pushed), ("pull", pulled)):
        lines = proc.stderr.splitlines()
        for n, key in enumerate(sorted(fake_compiles) if verb == "pull" else _order(lines, verb), 1):
            mine = [line for line in lines if line.startswith(f"[{n}/2] {verb} {key[:12]}")]
            assert mine[0] == f"[{n}/2] {verb} {key[:12]}: 8.9 KB ...", lines
            ticks = [re.sub(r"\d+ s so far", "T s so far", line) for line in mine[1:-1]]
            assert ticks == [f"[{n}/2] {verb} {key[:12]}: {done} of 8.9 KB ({share}, T s so far)"
                             for done, share in (("3.0 KB", "33%"), ("6.0 KB", "67%"), ("8.9 KB", "100%"))], lines
            assert re.fullmatch(rf"\[{n}/2\] {verb} {key[:12]}: 8\.9 KB in \d+\.\d s", mine[-1]), lines
    assert sorted(_order(pushed.stderr.splitlines(), "push")) == sorted(k[:12] for k in fake_compiles)


def _order(lines: list[str], verb: str) -> list[str]:
    """The key prefixes of the entries, in the order their first lines came."""
    return list(dict.fromkeys(m[1] for line in lines if (m := re.match(rf"\[\d+/\d+\] {verb} ([0-9a-f]{{12}})", line))))


def test_a_terminal_gets_a_bar_and_a_log_a_line_a_minute(capsys, monkeypatch):
    """The renderer alone, on a clock of its own: a log gets the start, a line once a minute has passed
    since the last, and the end; a terminal gets a bar redrawn in place."""
    from aotbuild.cli.commands import _transfer_progress
    from aotbuild.remote.base import Transfer

    def run(times: list[float]) -> str:
        clock = iter(times)
        show = _transfer_progress("pull", clock=lambda: next(clock))
        show("start", Transfer("ab" * 32, 0, 4 * 10 ** 9, 2, 3))
        for done in (10 ** 9, 2 * 10 ** 9, 3 * 10 ** 9):
            show("tick", Transfer("ab" * 32, done, 4 * 10 ** 9, 2, 3))
        show("end", Transfer("ab" * 32, 4 * 10 ** 9, 4 * 10 ** 9, 2, 3))
        return capsys.readouterr().err

    assert run([0.0, 30.0, 61.0, 90.0, 125.5]).splitlines() == [
        "[2/3] pull abababababab: 4.0 GB ...",
        "[2/3] pull abababababab: 2.0 GB of 4.0 GB (50%, 61 s so far)",
        "[2/3] pull abababababab: 4.0 GB in 125.5 s"]
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    drawn = run([0.0, 1.0, 2.0, 3.0, 4.0])
    assert drawn.split("\r\x1b[K") == ["", "[2/3] pull abababababab [#####               ] 1.0 GB / 4.0 GB",
                                       "[2/3] pull abababababab [##########          ] 2.0 GB / 4.0 GB",
                                       "[2/3] pull abababababab [###############     ] 3.0 GB / 4.0 GB",
                                       "[2/3] pull abababababab: 4.0 GB in 4.0 s\n"]
