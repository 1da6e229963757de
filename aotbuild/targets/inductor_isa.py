"""Inductor's CPU vector-ISA probes: what a build found, recorded in the entry, and replayed by a load
on a CPU whose flags vouch for it, so a fresh replica compiles no probe.

Every fresh process that touches Inductor's C++ code makes its list of usable vector ISAs once
(``torch._inductor.cpu_vec_isa.valid_vec_isa_list``): for each ISA this CPU's flags name
(``x86_isa_checker``: avx2, avx512, avx512_vnni, amx_tile) it compiles a probe with that ISA's flags
and ``dlopen``-s it in a new Python process (``VecISA.check_build``), and the AVX-512 family runs
sub-probes whose results change the kernels' compile flags: ``avx512_bf16`` (where the CPU has it;
adds ``-mavx512bf16``), VNNI, AMX tiles (then ``torch.cpu._init_amx()``, which asks the kernel for
the tile permission) and ``amx_fp16`` (adds ``-mamx-fp16``). The kernels' cache keys hold those
flags, so an installed kernel is found only where the picked ISA and its flags are the build's.

A build records (:func:`probe_record`) the CPU facts that decide which probes Inductor runs, each
named ISA's outcome with its sub-probe results, and the picked ISA's macros and flags. A load
(:func:`replay_probes`) answers Inductor's probes from that record only where this CPU's facts are
the build's (so Inductor asks exactly the probes the build host answered), the ISA it would pick
from them is the build's, and AMX's tile permission is granted here; then it checks that the
picked ISA's macros and flags are the recorded ones. Otherwise Inductor probes as always. No
Inductor setting changes (the FX graph cache key reads ``cpp.vec_isa_ok``)."""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping
from typing import Any

#: The probes' names in the record, by the class attribute holding the code Inductor compiles.
_PROBES = (("VecISA", "_avx_code", "base"), ("VecAVX512", "_avx512_bf16_code", "avx512_bf16"),
           ("VecAVX512VNNI", "_avx512_vnni_code", "avx512_vnni"), ("VecAMX", "_amx_code", "amx_tile"),
           ("VecAMX", "_amx_fp16_code", "amx_fp16"))
#: Probes whose failure makes the ISA unusable (its record's "ok"); the others only change its flags.
_GATING = {"base", "avx512_vnni", "amx_tile"}


def _inductor() -> Any:
    """Inductor's ISA module where this process may probe x86 ISAs, or None."""
    if platform.machine() not in ("x86_64", "AMD64") or sys.platform not in ("linux", "win32"):
        return None
    import torch._inductor.config as inductor_config
    from torch._inductor import cpu_vec_isa

    if inductor_config.is_fbcode() or inductor_config.cpp.simdlen is not None \
            or inductor_config.cpp.vec_isa_ok is not None:
        return None  # no probes, a pick by width, or the user's answer to every probe
    if not all(hasattr(getattr(cpu_vec_isa, cls, None), attr) for cls, attr, _ in _PROBES):
        return None  # another Inductor than the one this module was written against
    return cpu_vec_isa


def _cpu_facts(cpu_vec_isa: Any) -> dict[str, Any]:
    """What decides which probes Inductor runs on this CPU: the flags, and the sub-probes' CPU checks."""
    import torch

    return {"flags": sorted(cpu_vec_isa.x86_isa_checker()),
            "avx512_bf16": bool(torch.cpu._is_avx512_bf16_supported()),
            "amx_fp16": bool(torch.cpu._is_amx_fp16_supported())}


def _named(cpu_vec_isa: Any, flags: list[str]) -> list[Any]:
    """Inductor's ISAs these flags name, in its order of preference (the ones it probes)."""
    return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]


def _kernel_flags(isa: Any) -> dict[str, Any]:
    """What the ISA puts on Inductor's compile command (cpp_builder._get_build_args_of_chosen_isa)."""
    from torch._inductor.cpp_builder import _get_build_args_of_chosen_isa

    macros, arch_flags = _get_build_args_of_chosen_isa(isa)
    return {"macros": list(macros), "arch_flags": list(arch_flags)}


def probe_record() -> dict[str, Any] | None:
    """What Inductor's probes found in this (build) process, or None where it did not probe (another
    machine, ``cpp.simdlen`` or ``cpp.vec_isa_ok`` set, or no ISA list made yet)."""
    cpu_vec_isa = _inductor()
    if cpu_vec_isa is None or not cpu_vec_isa.valid_vec_isa_list.cache_info().currsize:
        return None
    facts = _cpu_facts(cpu_vec_isa)
    valid = cpu_vec_isa.valid_vec_isa_list()
    isas: dict[str, dict[str, bool]] = {}
    for isa in _named(cpu_vec_isa, facts["flags"]):
        found = {"ok": any(v is isa for v in valid)}
        if found["ok"] and isinstance(isa, cpu_vec_isa.VecAVX512):
            found["avx512_bf16"] = bool(isa._is_avx512_bf16_supported)
        if found["ok"] and isinstance(isa, cpu_vec_isa.VecAMX):
            found["amx_fp16"] = bool(isa._is_amx_fp16_supported)
        isas[str(isa)] = found
    return {"cpu": facts, "isas": isas, **_kernel_flags(cpu_vec_isa.pick_vec_isa())}


def _answers(cpu_vec_isa: Any, named: list[Any], record: Mapping[str, Any]) -> dict[str, dict[str, bool]] | None:
    """Each named ISA's recorded probe results, where the record has them all and well formed."""
    isas = record.get("isas")
    if not isinstance(isas, Mapping) or set(isas) != {str(isa) for isa in named}:
        return None
    answers = {}
    for isa in named:
        found = isas[str(isa)]
        if not isinstance(found, Mapping) or not all(isinstance(v, bool) for v in found.values()) \
                or not isinstance(found.get("ok"), bool):
            return None
        needed = {"ok"}
        if found["ok"] and isinstance(isa, cpu_vec_isa.VecAVX512):
            needed.add("avx512_bf16")
        if found["ok"] and isinstance(isa, cpu_vec_isa.VecAMX):
            needed.add("amx_fp16")
        if set(found) != needed:
            return None
        answers[str(isa)] = {**{kind: found["ok"] for kind in _GATING}, **found}
    return answers


def replay_probes(built_for: object, record: object) -> bool:
    """Make Inductor's ISA list from the build's probe results, compiling no probe, when this CPU
    vouches for them: True if so, and then Inductor picks ``built_for`` with the recorded kernel flags.

    Nothing is done (Inductor probes as always) off x86, with ``cpp.simdlen`` or ``cpp.vec_isa_ok``
    set, when the list is made already, for a record from before aotbuild recorded the results, and
    when this CPU's facts (its ISA flags, avx512_bf16, amx_fp16) are not the build's: a sub-probe
    result the flags cannot vouch for is never assumed."""
    cpu_vec_isa = _inductor()
    if (cpu_vec_isa is None or not isinstance(built_for, str) or not isinstance(record, Mapping)
            or cpu_vec_isa.valid_vec_isa_list.cache_info().currsize):
        return False
    facts = _cpu_facts(cpu_vec_isa)
    if record.get("cpu") != facts:
        return False  # another CPU: Inductor would ask other probes, or with other flags
    named = _named(cpu_vec_isa, facts["flags"])
    answers = _answers(cpu_vec_isa, named, record)
    if answers is None:
        return False
    usable = [isa for isa in named if answers[str(isa)]["ok"]]
    picks = (cpu_vec_isa.get_isa_from_cpu_capability(os.getenv("ATEN_CPU_CAPABILITY"), usable,
                                                     cpu_vec_isa.invalid_vec_isa)
             if usable else cpu_vec_isa.invalid_vec_isa)
    if str(picks) != built_for:
        return False  # ATEN_CPU_CAPABILITY, or a record of another pick
    if any(isinstance(isa, cpu_vec_isa.VecAMX) for isa in usable):
        import torch

        if not torch.cpu._init_amx():  # the tile permission, which Inductor asks after its AMX probe
            return False
    kinds = {getattr(getattr(cpu_vec_isa, cls), attr): kind for cls, attr, kind in _PROBES}

    def replay(isa: Any) -> Any:
        real, found = isa.check_build, answers[str(isa)]

        def check_build(code: str) -> bool:
            kind = kinds.get(code)
            return found[kind] if kind in found else real(code)  # a probe the record lacks: Inductor's own

        return check_build

    try:
        for isa in named:
            isa.check_build = replay(isa)  # on these instances only, while the list is made
        cpu_vec_isa.valid_vec_isa_list()
    finally:
        for isa in named:
            vars(isa).pop("check_build", None)
    picked = cpu_vec_isa.pick_vec_isa()
    if str(picked) == built_for and _kernel_flags(picked) == {k: record.get(k) for k in ("macros", "arch_flags")}:
        return True
    _forget(cpu_vec_isa, named)  # a record this Inductor does not reproduce: let it probe for itself
    return False


def _forget(cpu_vec_isa: Any, named: list[Any]) -> None:
    """Drop every answer Inductor cached from a replay: its ISA list, each ISA's cached ``__bool__``
    and the sub-probe results kept on the ISAs."""
    cpu_vec_isa.valid_vec_isa_list.cache_clear()
    for cls in vars(cpu_vec_isa).values():
        if isinstance(cls, type) and issubclass(cls, cpu_vec_isa.VecISA):
            for member in vars(cls).values():
                if hasattr(member, "cache_clear"):
                    member.cache_clear()
    for isa in named:
        for attr in ("_is_avx512_bf16_supported", "_is_amx_fp16_supported", "_arch_flags"):
            vars(isa).pop(attr, None)


# -- the build host's own record: every job of every build on this host probes once -----------------
# A job compiles in a fresh process with an empty Inductor folder (aotbuild/targets/inductor.py), so
# without this each job ran all of Inductor's probes again: a g++ compile and a fresh Python process per
# probe, 15 s of CPU per job on an AVX-512 host, often a fifth of a small job's build. The first job
# on a host records what its probes found (the record an entry holds); later jobs answer the probes from
# it through replay_probes, which checks this CPU's facts, the pick and the kernel flags, as a load does.

#: The most a host record may hold (one is about 1 KiB).
RECORD_BYTES = 64 * 1024
#: The folder under Inductor's default cache folder (``$TMPDIR/torchinductor_<user>``, beside its
#: precompiled headers): a fresh container or machine starts without it, and probes once.
HOST_FOLDER = "aotbuild-isa-probes"


def host_record_path() -> str | None:
    """This host's record file, named by what besides the CPU decides the probes' outcomes (the torch
    installed, the C++ compiler and its version, this Python); None where Inductor does not probe."""
    import hashlib
    import json
    import shutil

    if _inductor() is None:
        return None
    import torch
    from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    compiler = get_cpp_compiler()
    ident = [torch.__version__, os.path.dirname(torch.__file__), shutil.which(compiler) or compiler,
             get_compiler_version_info(compiler), sys.executable, sys.version]
    name = hashlib.sha256(json.dumps(ident).encode()).hexdigest()[:32]
    return os.path.join(default_cache_dir(), HOST_FOLDER, f"{name}.json")


def reuse_host_record() -> bool:
    """Before a build job's first compile: answer Inductor's probes from this host's record where one
    exists and this CPU vouches for it (replay_probes); True if so. Never raises: a record that cannot
    be read or does not replay leaves Inductor to probe."""
    from aotbuild.utils import safeio

    try:
        path = host_record_path()
        if path is None or not os.path.isfile(path):
            return False
        record = safeio.read_json(path, max_bytes=RECORD_BYTES, max_depth=8)
        return isinstance(record, Mapping) and replay_probes(record.get("vec_isa"), record.get("vec_isa_probes"))
    except Exception:  # noqa: BLE001 - an unreadable record only costs the probes it would have saved
        return False


def keep_host_record(vec_isa: str, record: Mapping[str, Any] | None) -> None:
    """After a build job's compile: keep what its probes found (or replayed) as this host's record,
    written whole by rename, unless the record there says the same. Never raises."""
    import json

    from aotbuild.utils import safeio

    if record is None:
        return
    try:
        path = host_record_path()
        if path is None:
            return
        data = json.dumps({"vec_isa": vec_isa, "vec_isa_probes": record}, sort_keys=True).encode()
        if os.path.isfile(path) and safeio.read_bytes(path, RECORD_BYTES) == data:
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with safeio.atomic_write(path) as out:
            out.file.write(data)
    except Exception:  # noqa: BLE001 - the next job probes for itself
        return
