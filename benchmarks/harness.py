"""Shared by the benchmark scripts (arch_matrix.py, cold_vs_warm.py); not a benchmark itself.

- ``derive_recipe``: a one-shape copy of a recipe with another strategy / scope / block list;
- ``child_env``: the environment of a fresh process whose compiler caches are empty folders, with
  this checkout first on PYTHONPATH (so a worktree measures its own code);
- ``build``: ``aotbuild build --json`` of one recipe into a cache, in its own process with an empty
  Inductor cache, and what the entry's manifest says about it (``aotbuild show --json KEY``): the
  build's phases (load, compile_and_warmup, proof seconds) and the proof's figures.

Runs as a plain module next to the scripts (``python benchmarks/X.py`` puts benchmarks/ first on
sys.path).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
#: The built-in tiny models and the recipe each benchmark derives its cells from.
ARCHS = {"tiny-sd": RECIPES / "tiny_sd_cpu.yaml", "tiny-sdxl": RECIPES / "tiny_sdxl_cpu.yaml",
         "tiny-sd3": RECIPES / "tiny_sd3_cpu.yaml", "tiny-flux": RECIPES / "tiny_flux_cpu.yaml",
         "tiny-pixart-sigma": RECIPES / "tiny_pixart_cpu.yaml", "tiny-wan": RECIPES / "tiny_wan_cpu.yaml",
         "tiny-wan22": RECIPES / "tiny_wan22_cpu.yaml"}

#: Regional scope for a denoiser that declares no ``_repeated_blocks``: the block classes to compile.
REGIONAL_BLOCKS = {"tiny-sd3": ["JointTransformerBlock"], "tiny-pixart-sigma": ["BasicTransformerBlock"]}

#: Guidance on, where the recipe turns it off (SD-style pipelines batch both halves when it is on);
#: the other recipes have it on already (Flux: an input; PixArt: batched; Wan: two calls).
GUIDED = {"tiny-sd": {"guidance_scale": 7.5}, "tiny-sdxl": {"guidance_scale": 5.0},
          "tiny-sd3": {"guidance_scale": 5.0}}


def derive_recipe(base: Path, dest: Path, *, strategy: str, scope: str = "full",
                  blocks: list[str] | None = None, warmup: dict[str, Any] | None = None) -> Path:
    """Write ``base`` with its first shape only (each cold compile costs minutes on a small CPU),
    ``strategy`` and ``compile.scope``, ``compile.blocks`` and warmup arguments when given, to ``dest``.
    ``strategy="auto"``: no ``strategy`` line at all, the recipe a user writes without one."""
    import yaml

    data = yaml.safe_load(base.read_text())
    data["shapes"] = data["shapes"][:1]
    data.pop("strategy", None)
    if strategy != "auto":
        data["strategy"] = strategy
    data["compile"]["scope"] = scope
    if blocks:
        data["compile"]["blocks"] = list(blocks)
    if warmup:
        data["warmup"] = {**data.get("warmup", {}), **warmup}
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(f"# {base.name}, one shape, strategy {strategy}, scope {scope} (derived by benchmarks/)\n"
                    + yaml.safe_dump(data, sort_keys=False))
    return dest


def child_env(workdir: Path, target: str = "inductor") -> dict[str, str]:
    """os.environ with every compiler cache of ``target`` pointed at an empty folder under
    ``workdir``, a temp folder of its own (``TMPDIR``: Inductor keeps its precompiled C++ headers
    there, outside its cache, and a fresh machine has none), no AOTBUILD_CACHE, and this checkout
    first on PYTHONPATH."""
    from aotbuild.constants import ENV_CACHE
    from aotbuild.targets.registry import get_target

    env = dict(os.environ)
    env.pop(ENV_CACHE, None)
    for name, value in get_target(target).capture_env(workdir).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    temp = workdir / "tmp"
    temp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(temp)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


@dataclass
class Build:
    """One ``aotbuild build --json`` of a one-job recipe, and its entry's manifest figures."""

    status: str  # built | cached | failed | skipped | error (the command itself failed)
    seconds: float = 0.0  # the job's seconds (the manifest's build.seconds), proof included
    wall_s: float = 0.0  # the whole command: Python start, imports, the built-in model's creation
    reason: str = ""
    key: str | None = None
    phases: dict[str, float] = field(default_factory=dict)  # load, compile_and_warmup, proof seconds
    proof: dict[str, Any] | None = None  # the manifest's proof: load_s, compiles, max_abs_diff, ...
    log_tail: str = ""  # a failed job's log (<cache>/logs/), its last lines

    @property
    def ok(self) -> bool:
        return self.status in ("built", "cached")

    @property
    def proof_s(self) -> float | None:
        return self.phases.get("proof")

    @property
    def proof_share(self) -> float | None:
        """The proof's seconds as a share of the job's."""
        return self.proof_s / self.seconds if self.proof_s is not None and self.seconds else None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "proof_share": self.proof_share}


def _cli(args: list[str], env: dict[str, str]) -> tuple[int, dict[str, Any] | None, str]:
    """``python -m aotbuild.cli ARGS``: exit code, its JSON (None if it printed none), stderr's tail."""
    proc = subprocess.run([sys.executable, "-m", "aotbuild.cli", *args], env=env, capture_output=True, text=True,
                          errors="replace", cwd=REPO)
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        data = None
    tail = " | ".join(x.strip() for x in proc.stderr.strip().splitlines()[-4:] if x.strip())
    return proc.returncode, data if isinstance(data, dict) else None, tail


def build(recipe: Path, cache: Path, workdir: Path) -> Build:
    """Build ``recipe`` (one component, one shape) into ``cache`` with an empty Inductor cache under
    ``workdir``; never raises for a failed build: the result's status and reason say why."""
    import time

    env = child_env(workdir / "build-caches")
    started = time.perf_counter()
    code, data, tail = _cli(["build", "--json", "--cache", str(cache), str(recipe)], env)
    wall = time.perf_counter() - started
    if data is None or not data.get("jobs"):
        return Build("error", wall_s=wall, reason=f"aotbuild build exited with {code}: {tail or 'no output'}")
    jobs = data["jobs"]
    bad = [j for j in jobs if j["status"] not in ("built", "cached")]
    job = bad[0] if bad else jobs[0]
    result = Build(job["status"], float(job.get("seconds", 0.0)), wall, job.get("reason", ""), job.get("key"))
    log = re.search(r"\(log: ([^)]+)\)", result.reason)
    if log:
        result.log_tail = _tail(Path(log.group(1)))
    if len(jobs) > 1:
        result.reason = (result.reason + f" ({len(jobs)} jobs; the figures are the first's)").strip()
    if result.ok and result.key:
        code, manifest, tail = _cli(["show", "--json", "--cache", str(cache), result.key], env)
        if manifest is None:
            result.status, result.reason = "error", f"aotbuild show exited with {code}: {tail}"
            return result
        result.seconds = float(manifest["build"].get("seconds") or result.seconds)
        result.phases = dict(manifest["build"].get("phases") or {})
        result.proof = manifest.get("proof")
    return result


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").rstrip().splitlines()[-lines:])
    except OSError:
        return ""


def run_child(script: str, args: list[str], env: dict[str, str], cwd: Path | None = None,
              marker: str = "RESULT ") -> dict[str, Any]:
    """``python SCRIPT --child ARGS``; the JSON it printed after ``marker``, or {"error": why}."""
    proc = subprocess.run([sys.executable, script, "--child", *args], env=env, capture_output=True, text=True,
                          errors="replace", cwd=cwd)
    line = next((x for x in proc.stdout.splitlines() if x.startswith(marker)), None)
    if line is not None:
        return json.loads(line[len(marker):])
    last = [x.strip() for x in proc.stderr.strip().splitlines() if x.strip()][-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(last) or 'no output'}"}


def fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def table(header: list[str], rows: list[list[str]], text_columns: int = 1) -> str:
    """The first ``text_columns`` columns left-aligned, the figures right-aligned."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = []
    for row in [header, *rows]:
        cells = [c.ljust(w) if i < text_columns else c.rjust(w)
                 for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
