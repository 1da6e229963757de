"""``aotbuild doctor``: can this machine build and serve a cache? Named checks, one command.

Each check says ok, failed or skipped (it does not apply, or an earlier check failed), with a
one-line detail and, when it fails, the fix. The last one, ``roundtrip``, builds the built-in tiny
model's text encoder for the chosen target and device into a temporary cache (never the user's
store): the build's own proof is a fresh process serving the entry, so its figures are what a
replica on this machine would see (compiles at load, which must be 0, and the difference from eager).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

#: Free space below which the cache's disk fails the check (an SDXL entry is a few hundred MB).
MIN_FREE = 2 * 10**9


@dataclass
class Check:
    name: str
    ok: bool = True
    skipped: bool = False
    detail: str = ""
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)
    #: more of the detail, each printed on its own line below it (the store's other folders)
    lines: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("lines")
        out.update(out.pop("data"))
        return out


@dataclass
class Report:
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return all(c.ok or c.skipped for c in self.checks)

    def text(self) -> str:
        lines = []
        for c in self.checks:
            state = "skip" if c.skipped else "ok" if c.ok else "FAIL"
            fix = f"\n{'':16}fix: {c.fix}" if c.fix and not c.ok else ""
            lines.append(f"{state:<5} {c.name:<10} {c.detail}{fix}")
            lines += [f"{'':16}{line}" for line in c.lines]
        lines.append("this machine can build and serve caches" if self.ok else
                     "a check failed: fix it, then run aotbuild doctor again")
        return "\n".join(lines)

    def as_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "checks": [c.as_json() for c in self.checks]}


def _failed(name: str, detail: str, fix: str, **data: Any) -> Check:
    return Check(name, ok=False, detail=detail, fix=fix, data=data)


def _skipped(name: str, detail: str) -> Check:
    return Check(name, skipped=True, detail=detail)


def check_toolchain(target_name: str, device: str) -> Check:
    from aotbuild.targets.registry import get_target

    found = get_target(target_name).check_toolchain(device)
    return Check("toolchain", ok=found.ok, detail=found.detail, fix=found.fix, data=dict(found.data))


def check_caches(target_name: str, cache_root: Path) -> Check:
    """The target's own word on its compiler caches (``Target.check_caches``), then whether its cache
    folder and the aotbuild cache can be written."""
    from aotbuild.targets.registry import get_target

    found = get_target(target_name).check_caches()
    if not found.ok:
        return _failed("caches", found.detail, found.fix)
    compiler = Path(found.data["folder"])
    for label, folder in ((found.data["label"], compiler), ("aotbuild cache", cache_root)):
        problem = _writable(folder)
        if problem:
            return _failed("caches", f"the {label} {folder} is not writable: {problem}",
                           f"fix its permissions, or point it elsewhere ({found.data['variable']}; --cache or "
                           f"AOTBUILD_CACHE)")
    return Check("caches", detail=f"{found.detail}; {compiler} and {cache_root} writable")


def _writable(folder: Path) -> str:
    probe = folder
    while not probe.exists():
        probe = probe.parent
    try:
        with tempfile.NamedTemporaryFile(dir=probe, prefix=".aotbuild-doctor."):
            pass
    except OSError as exc:
        return exc.strerror or str(exc)
    return ""


def check_disk(cache_root: Path) -> Check:
    from aotbuild.cache.layout import format_size

    probe = cache_root
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < MIN_FREE:
        return _failed("disk", f"{format_size(free)} free under {probe}", f"free space: a build needs at least "
                                                                          f"{format_size(MIN_FREE)}", free=free)
    return Check("disk", detail=f"{format_size(free)} free under {probe}", data={"free": free})


def check_store(cache_root: Path, deep: bool) -> Check:
    from aotbuild.cache.layout import format_size
    from aotbuild.cache.manage import entries_size, other_folders
    from aotbuild.strategies.registry import checked_store

    store = checked_store(cache_root)
    # The folders beside the entries (built-in models, staging, locks, logs), each on its own line.
    folders = other_folders(store) if store.root.is_dir() else []
    lines = [f"{name + ':':<10}{format_size(size):>9}  {folder}" for name, folder, size in folders]
    sizes = {name: size for name, _, size in folders}
    if not store.layout.manifests.is_dir():
        return Check("store", detail=f"no entries yet in {cache_root}", lines=lines,
                     data={"entries": 0, "size": 0, "folders": sizes})
    entries = list(store.iter_manifests())
    size = entries_size(entries)  # each blob once, as gc and ls count (issue 55)
    if deep:
        from aotbuild.cache.manage import verify

        problems = verify(store)
        if problems:
            return _failed("store", f"{len(problems)} problem(s), e.g. {problems[0].kind} {problems[0].path}: "
                                    f"{problems[0].detail}", _store_fix(problems), entries=len(entries))
    broken = [m.key for m in entries if not store.check_entry(m.key)[0]]
    if broken:
        return _failed("store", f"{len(broken)} of {len(entries)} entries have missing or resized blobs",
                       "aotbuild verify --fix (the next build rebuilds them)", entries=len(entries))
    how = "every blob hashed" if deep else "sizes checked; --deep hashes every blob"
    return Check("store", detail=f"{len(entries)} entries, {format_size(size)} ({how})", lines=lines,
                 data={"entries": len(entries), "size": size, "folders": sizes})


def _store_fix(problems: list) -> str:
    """``verify --fix`` only where it repairs something; what it never removes is left for its owner."""
    from aotbuild.cache.manage import OWNER_ACTION

    repairs = sum(p.fixable for p in problems)
    fixes = [f"aotbuild verify --fix{f' repairs {repairs} of them' if repairs < len(problems) else ''}"] \
        if repairs else []
    fixes += [f"{kind} (left for its owner, --fix never removes it): {OWNER_ACTION[kind]}"
              for kind in sorted({p.kind for p in problems if not p.fixable})]
    return "; ".join(fixes)


def check_remote(url: str | None) -> Check:
    if not url:
        return _skipped("remote", "no --remote and no AOTBUILD_REMOTE")
    from aotbuild.errors import AotbuildError
    from aotbuild.remote.schemes import parse_remote

    try:
        keys = parse_remote(url).keys()
    except AotbuildError as exc:
        return _failed("remote", str(exc), "check the URL, the network and HF_TOKEN (docs/ci.md)")
    return Check("remote", detail=f"{url} answers: {len(keys)} entries")


#: What the roundtrip compiles: builtin:tiny-sd's CLIP text encoder, not its UNet. The roundtrip checks
#: the toolchain end to end (Inductor's code generation, the C++ compiler or Triton, the entry's files
#: captured and stored, a fresh process serving them with 0 compiles, equal to eager), which any
#: compiled module shows; the text encoder is 12 kernels where the UNet is 42 (~1.3 s of the C++
#: compiler each on CPU): the whole roundtrip (build, its processes and the proof) took 59 s of CPU here
#: (2 cores, one compile thread), where the UNet's compile alone takes 76 s.
ROUNDTRIP_COMPONENT = "text_encoder"

ROUNDTRIP = textwrap.dedent("""\
    # aotbuild doctor's roundtrip: the built-in tiny model's text encoder, one small shape
    model: {{id: builtin:tiny-sd, dtype: float32}}
    target: {target}
    device: {device}
    strategy: jit-cache  # the quickest build to prove; strategy auto is its own check (tests/test_auto.py)
    compile: {{components: [{component}], scope: full}}
    shapes: [{{height: 64, width: 64}}]
    warmup: {{num_inference_steps: 1, guidance_scale: 0.0}}
""")


def check_roundtrip(target: str, device: str, progress: Any = None) -> Check:
    """Build and prove the tiny model's text encoder in a temporary cache; the proof is a fresh process
    serving it."""
    from aotbuild.builder.build import ResultStatus, build

    folder = Path(tempfile.mkdtemp(prefix="aotbuild-doctor-"))
    try:
        recipe = folder / "doctor.yaml"
        recipe.write_text(ROUNDTRIP.format(target=target, device=device, component=ROUNDTRIP_COMPONENT))
        # The job and its proof each get empty compiler caches of their own (target.capture_env).
        report = build([str(recipe)], cache=folder / "cache", progress=progress)
        result = report.results[0]
        if result.status != ResultStatus.BUILT:
            return _failed("roundtrip", f"the tiny build {result.status}: {result.reason}",
                           "fix the check that failed above; the log named in the detail has the rest")
        from aotbuild.cache.store import Store

        manifest = Store(folder / "cache").read_manifest(result.job.key or "")
        proof = manifest.proof if manifest else None
        if proof is None:
            return _failed("roundtrip", "the entry has no proof", "report this: a built entry is always proven")
        return Check("roundtrip", detail=f"built builtin:tiny-sd's {ROUNDTRIP_COMPONENT} in {result.seconds:.0f} s, "
                                         f"then a fresh process served it: "
                                         f"compiled_at_load {proof.compiles} ({proof.counter}), max |compiled - "
                                         f"eager| {proof.max_abs_diff:.1e}, load {proof.load_s:.1f} s",
                     data={"component": ROUNDTRIP_COMPONENT, "compiled_at_load": proof.compiles,
                           "max_abs_diff": proof.max_abs_diff,
                           "build_s": round(result.seconds, 1), "load_s": proof.load_s})
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(folder, ignore_errors=True)


def doctor(target: str = "inductor", device: str | None = None, cache: str | Path | None = None,
           remote: str | None = None, deep: bool = False, roundtrip: bool = True, progress: Any = None) -> Report:
    from aotbuild import constants
    from aotbuild.cache.layout import resolve_cache_root
    from aotbuild.targets.registry import get_target

    t = get_target(target)
    device = device or (t.default_device() if t.availability().ok else "cpu")
    root = resolve_cache_root(cache)
    checks = [check_toolchain(target, device), check_caches(target, root), check_disk(root), check_store(root, deep),
              check_remote(remote or os.environ.get(constants.ENV_REMOTE))]
    if not roundtrip:
        checks.append(_skipped("roundtrip", "--no-roundtrip"))
    elif not checks[0].ok:
        checks.append(_skipped("roundtrip", "the toolchain check failed"))
    else:
        checks.append(check_roundtrip(target, device, progress))
    return Report(checks)
