"""A CPU load answers Inductor's vector-ISA probes from the entry's record when this CPU's facts are
the build's (aotbuild/targets/inductor_isa.py): no probe compiles, and Inductor picks the build's ISA
with the build's kernel flags. Otherwise Inductor probes as always.

The CPU is faked (torch.cpu's flag reads, ``platform.machine``, ``_init_amx``) and so are the probes
(``VecISA.check_build`` records each probe and answers without g++), so every ISA Inductor can pick
on x86 is checked on any host. Inductor makes its ISA list once per process: one fresh interpreter
imports torch, and each step of each case runs in a process forked from it before any list is made
(a build, a load, and a plain process for comparison)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from tests.conftest import VECTOR_ISA, run_python

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="Inductor probes x86 ISAs on Linux and Windows"),
              pytest.mark.xdist_group("isa-probes"),  # one worker runs the probe subprocess (outcomes)
              pytest.mark.slow,  # that subprocess runs g++ for every ISA case (20-25 s): the full suite runs it
              pytest.mark.usefixtures("vector_isa")]  # Inductor's own ISA choice (the suite's is scalar)

DRIVER = textwrap.dedent("""
    import json, os, platform, sys, traceback
    import torch
    import torch._inductor.config as config
    from torch._inductor import cpu_vec_isa as v
    from torch._inductor.cpp_builder import _get_build_args_of_chosen_isa
    from aotbuild.targets.inductor import InductorTarget
    import aotbuild.targets.inductor_isa  # noqa: F401 (imported once, before the forks)

    PROBES = {v.VecISA._avx_code: "base", v.VecAVX512._avx512_bf16_code: "avx512_bf16",
              v.VecAVX512VNNI._avx512_vnni_code: "avx512_vnni", v.VecAMX._amx_code: "amx_tile",
              v.VecAMX._amx_fp16_code: "amx_fp16"}

    def fake(cpu, compiles, env):
        # This process's CPU and compiler, as the case says.
        os.environ["ATEN_CPU_CAPABILITY"] = env
        platform.machine = lambda: "x86_64"
        flags = cpu["flags"]
        torch.cpu._is_avx2_supported = lambda: "avx2" in flags
        torch.cpu._is_avx512_supported = lambda: "avx512" in flags
        torch.cpu._is_vnni_supported = lambda: "avx512_vnni" in flags
        torch.cpu._is_amx_tile_supported = lambda: "amx_tile" in flags
        torch.cpu._is_avx512_bf16_supported = lambda: cpu["avx512_bf16"]
        torch.cpu._is_amx_fp16_supported = lambda: cpu["amx_fp16"]
        torch.cpu._init_amx = lambda: cpu["amx_permission"]
        probes = []
        def check_build(self, code):
            probes.append(str(self) + ": " + PROBES[code])
            return compiles.get(PROBES[code], True)
        v.VecISA.check_build = check_build
        return probes

    def picked():
        isa = v.pick_vec_isa()
        macros, arch_flags = _get_build_args_of_chosen_isa(isa)  # what the ISA puts on the compile command
        return {"isa": str(isa), "macros": macros, "arch_flags": arch_flags, "bits": isa.bit_width()}

    def build(case):
        probes = fake(case["cpu"], case.get("compiles", {}), case.get("env", ""))
        v.pick_vec_isa()  # the compile picks its ISA
        facts = InductorTarget().build_facts("cpu")
        return {"facts": facts, "picked": picked(), "probes": probes}

    def load(case, builds):
        load = case.get("load", {})
        probes = fake({**case["cpu"], **load.get("cpu", {})}, case.get("compiles", {}), load.get("env", ""))
        if builds is not None:
            InductorTarget().before_install(builds, load.get("device", "cpu"))
        return {"picked": picked(), "probes": probes, "vec_isa_ok": config.cpp.vec_isa_ok}

    def next_build(case):
        # Another job built on this host afterwards, on the load's CPU: its probes are answered from the
        # host's record (the build above kept it) only where that CPU vouches for it.
        load = case.get("load", {})
        probes = fake({**case["cpu"], **load.get("cpu", {})}, case.get("compiles", {}), load.get("env", ""))
        InductorTarget().prepare_build("cpu")
        return {"picked": picked(), "probes": probes}

    def forked(fn, *args):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            try:
                out = json.dumps(fn(*args))
            except BaseException:
                out = json.dumps({"error": traceback.format_exc()})
            with os.fdopen(write, "w") as pipe:
                pipe.write(out)
            os._exit(0)
        os.close(write)
        with os.fdopen(read) as pipe:
            out = pipe.read()
        os.waitpid(pid, 0)
        return json.loads(out)

    results = {}
    for name, case in json.loads(sys.stdin.read()).items():
        built = forked(build, case)
        if "error" in built:
            results[name] = built
            continue
        facts = built["facts"]
        for edit in case.get("edit", []):  # a record edited after the build: [path..., value or None]
            at = facts
            for part in edit[:-2]:
                at = at.get(part, {})
            if edit[-1] is None:
                at.pop(edit[-2], None)
            else:
                at[edit[-2]] = edit[-1]
        builds = case.get("builds", [facts, facts])
        builds = [facts if b == "built" else b for b in builds]
        results[name] = {"build": built, "load": forked(load, case, builds), "plain": forked(load, case, None),
                         "next_build": forked(next_build, case)}
    print("RESULT " + json.dumps(results))
""")

AMX = {"flags": ["avx2", "avx512", "avx512_vnni", "amx_tile"], "avx512_bf16": True, "amx_fp16": True,
       "amx_permission": True}
VNNI = {"flags": ["avx2", "avx512", "avx512_vnni"], "avx512_bf16": True, "amx_fp16": False, "amx_permission": False}
AVX512 = {"flags": ["avx2", "avx512"], "avx512_bf16": False, "amx_fp16": False, "amx_permission": False}
AVX2 = {"flags": ["avx2"], "avx512_bf16": False, "amx_fp16": False, "amx_permission": False}
NONE = {"flags": [], "avx512_bf16": False, "amx_fp16": False, "amx_permission": False}

#: Loads on the build's CPU: each answered from the record, no probe; the picked ISA is `isa`.
REPLAYED = {
    "amx": ({"cpu": AMX}, "avx512 avx512_vnni amx_tile"),
    "amx, its fp16 probe failing": ({"cpu": AMX, "compiles": {"amx_fp16": False}}, "avx512 avx512_vnni amx_tile"),
    "amx, its tile probe failing": ({"cpu": AMX, "compiles": {"amx_tile": False}}, "avx512 avx512_vnni"),
    "avx512 vnni with bf16": ({"cpu": VNNI}, "avx512 avx512_vnni"),
    "avx512 vnni, its bf16 probe failing": ({"cpu": VNNI, "compiles": {"avx512_bf16": False}}, "avx512 avx512_vnni"),
    "avx512 vnni without bf16": ({"cpu": {**VNNI, "avx512_bf16": False}}, "avx512 avx512_vnni"),
    "avx512 with bf16": ({"cpu": {**AVX512, "avx512_bf16": True}}, "avx512"),
    "avx512": ({"cpu": AVX512}, "avx512"),
    "avx512 by ATEN_CPU_CAPABILITY": ({"cpu": AMX, "env": "avx512", "load": {"env": "avx512"}},
                                      "avx512 avx512_vnni amx_tile"),
    "avx2 by ATEN_CPU_CAPABILITY": ({"cpu": VNNI, "env": "avx2", "load": {"env": "avx2"}}, "avx2"),
    "avx2": ({"cpu": AVX2}, "avx2"),
    "none": ({"cpu": NONE}, "INVALID_VEC_ISA"),
    "none, the avx2 probe failing": ({"cpu": AVX2, "compiles": {"base": False}}, "INVALID_VEC_ISA"),
}

#: Loads whose CPU, settings or record cannot vouch for the build's probes: Inductor probes itself.
PROBED = {
    "a CPU with VNNI the build's lacked": {"cpu": AVX512, "load": {"cpu": {"flags": VNNI["flags"]}}},
    "a CPU without the build's VNNI": {"cpu": VNNI, "load": {"cpu": {"flags": AVX512["flags"]}}},
    "a CPU with bf16 the build's lacked": {"cpu": AVX512, "load": {"cpu": {"avx512_bf16": True}}},
    "a CPU with amx_fp16 the build's lacked": {"cpu": {**AMX, "amx_fp16": False}, "load": {"cpu": {"amx_fp16": True}}},
    "no AMX tile permission here": {"cpu": AMX, "load": {"cpu": {"amx_permission": False}}},
    "ATEN_CPU_CAPABILITY at the load only": {"cpu": VNNI, "load": {"env": "avx2"}},
    "an entry from before the record": {"cpu": VNNI, "edit": [["vec_isa_probes", None]]},
    "a record of another pick": {"cpu": VNNI, "edit": [["vec_isa", "avx512"]]},
    "a record missing a sub-probe": {"cpu": VNNI, "edit": [["vec_isa_probes", "isas", "avx512", "avx512_bf16", None]]},
    "a record's flags this Inductor does not give": {"cpu": VNNI,
                                                     "edit": [["vec_isa_probes", "arch_flags", ["-mavx2"]]]},
    "a record claiming a failed probe passed": {"cpu": VNNI, "compiles": {"avx512_vnni": False}, "edit": [
        ["vec_isa_probes", "isas", "avx512 avx512_vnni", "ok", True],
        ["vec_isa_probes", "isas", "avx512 avx512_vnni", "avx512_bf16", True]]},
    "a record claiming a failed sub-probe passed": {"cpu": {**AVX512, "avx512_bf16": True}, "compiles": {
        "avx512_bf16": False}, "edit": [["vec_isa_probes", "isas", "avx512", "avx512_bf16", True]]},
    "entries that disagree": {"cpu": VNNI, "builds": ["built", {"vec_isa": "avx2"}]},
    "a CUDA load": {"cpu": VNNI, "load": {"device": "cuda"}},
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    cases = {**{name: case for name, (case, _) in REPLAYED.items()}, **PROBED}
    folder = tmp_path_factory.mktemp("isa")
    (folder / "tmp").mkdir()  # the host's record of each case's build (inductor_isa.HOST_FOLDER) goes here
    (folder / "driver.py").write_text(DRIVER)
    (folder / "cases.json").write_text(json.dumps(cases))
    proc = run_python(f"import runpy, sys; sys.stdin = open({str(folder / 'cases.json')!r}); "
                      f"runpy.run_path({str(folder / 'driver.py')!r}, run_name='__main__')",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"), "TMPDIR": str(folder / "tmp"),
                           **VECTOR_ISA})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def _outcome(outcomes, name: str) -> dict:
    outcome = outcomes[name]
    assert "error" not in outcome, outcome.get("error")
    for step in ("build", "load", "plain", "next_build"):
        assert "error" not in outcome[step], outcome[step]["error"]
    return outcome


@pytest.mark.parametrize("name", list(REPLAYED))
def test_a_load_on_the_build_s_cpu_runs_no_probe_and_picks_the_build_s_isa_and_flags(outcomes, name):
    outcome, isa = _outcome(outcomes, name), REPLAYED[name][1]
    build, load, plain = outcome["build"], outcome["load"], outcome["plain"]
    assert build["picked"]["isa"] == build["facts"]["vec_isa"] == isa
    assert "vec_isa_probes" in build["facts"]
    assert load["probes"] == []
    assert load["picked"] == build["picked"] == plain["picked"]  # Inductor's own pick, without its probes
    assert load["vec_isa_ok"] is None  # Inductor's setting as it was: the FX graph cache key holds it
    # and the next job built on this host probes nothing either: the build kept the host's record
    assert outcome["next_build"] == {"picked": build["picked"], "probes": []}


def test_the_sub_probes_change_the_kernel_flags_the_load_replays(outcomes):
    """The cases above would pass with the sub-probes ignored if they changed nothing: they do."""
    flags = {name: " ".join(_outcome(outcomes, name)["load"]["picked"]["arch_flags"]).split() for name in REPLAYED}
    assert "-mavx512bf16" in flags["avx512 with bf16"] and "-mavx512bf16" not in flags["avx512"]
    assert "-mamx-fp16" in flags["amx"] and "-mamx-fp16" not in flags["amx, its fp16 probe failing"]
    assert "-mavx512bf16" in flags["amx"]


@pytest.mark.parametrize("name", list(PROBED))
def test_a_load_its_cpu_or_record_cannot_vouch_for_leaves_inductor_to_probe(outcomes, name):
    outcome = _outcome(outcomes, name)
    load, plain = outcome["load"], outcome["plain"]
    assert load["probes"], "Inductor should have probed its ISAs itself"
    assert load == plain  # the same probes, pick and flags as a process that installed nothing


#: The cases whose load CPU (or ATEN_CPU_CAPABILITY) is not the build's: a job built there is on another host.
ANOTHER_HOST = [name for name, case in PROBED.items() if case.get("load", {}).keys() & {"cpu", "env"}]


@pytest.mark.parametrize("name", ANOTHER_HOST)
def test_a_build_on_a_cpu_the_host_record_cannot_vouch_for_probes_for_itself(outcomes, name):
    """The host's record (aotbuild/targets/inductor_isa.py, keep_host_record) is replayed by a later
    build job only through the checks a load makes: another CPU probes, and picks as a plain process."""
    outcome = _outcome(outcomes, name)
    assert outcome["next_build"]["probes"], "Inductor should have probed its ISAs itself"
    assert outcome["next_build"] == {"picked": outcome["plain"]["picked"], "probes": outcome["plain"]["probes"]}


def test_the_host_record_lives_beside_inductor_s_headers_named_by_torch_and_compiler(tmp_path, monkeypatch):
    import tempfile

    from aotbuild.targets import inductor_isa

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    path = inductor_isa.host_record_path()
    if path is None:
        pytest.skip("Inductor does not probe x86 ISAs here")
    assert path.startswith(str(tmp_path / "torchinductor_")) and f"/{inductor_isa.HOST_FOLDER}/" in path
    from torch._inductor import cpp_builder

    monkeypatch.setattr(cpp_builder, "get_compiler_version_info", lambda compiler: "another g++ 99")
    assert inductor_isa.host_record_path() != path  # another compiler: another record, probed afresh
    assert inductor_isa.reuse_host_record() is False  # none there yet: Inductor probes
