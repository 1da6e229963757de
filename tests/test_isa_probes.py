"""A CPU load skips Inductor's vector-ISA probes when the entry's build picked the ISA this CPU's
flags give (aotbuild/targets/inductor.py, skip_isa_probes); otherwise Inductor probes as always.

Each case runs in a fresh interpreter: Inductor caches its ISA list for the process."""

from __future__ import annotations

import json
import platform
import textwrap

import pytest

from tests.conftest import run_python

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 ISA probes")

CASE = textwrap.dedent("""
    import json, sys
    import torch._inductor.config as config
    from torch._inductor import cpu_vec_isa
    from aotbuild.targets.inductor import InductorTarget

    probes = []
    cpu_vec_isa.VecISA.check_build = lambda self, code: probes.append(str(self)) or True  # no g++ here
    flags = cpu_vec_isa.x86_isa_checker()
    named = [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    built_for = sys.argv[1] if sys.argv[1] != "-" else str(cpu_vec_isa.get_isa_from_cpu_capability(
        None, named, cpu_vec_isa.invalid_vec_isa))
    InductorTarget().before_install([{"vec_isa": built_for}, {"vec_isa": built_for}], sys.argv[2])
    picked = str(cpu_vec_isa.pick_vec_isa())
    print("RESULT " + json.dumps({"picked": picked, "built_for": built_for, "probes": probes,
                                  "vec_isa_ok": config.cpp.vec_isa_ok}))
""")


def _case(tmp_path, built_for: str, device: str = "cpu") -> dict:
    script = tmp_path / "case.py"
    script.write_text(CASE)
    proc = run_python(f"import runpy, sys; sys.argv = ['case', {built_for!r}, {device!r}]; "
                      f"runpy.run_path({str(script)!r}, run_name='__main__')",
                      env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "ATEN_CPU_CAPABILITY": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))[len("RESULT "):])


def test_an_entry_built_for_this_cpu_s_isa_skips_the_probes_and_changes_no_setting(tmp_path):
    result = _case(tmp_path, "-")
    assert result["probes"] == [] and result["picked"] == result["built_for"]
    assert result["vec_isa_ok"] is None  # Inductor's setting as it was: the FX graph cache key holds it


def test_an_entry_built_for_another_isa_leaves_inductor_to_probe(tmp_path):
    result = _case(tmp_path, "vsx")  # a POWER build: this CPU's flags cannot vouch for it
    assert result["probes"], "Inductor should have probed its ISAs itself"


def test_a_cuda_load_leaves_the_cpu_probes_alone(tmp_path):
    assert _case(tmp_path, "-", device="cuda")["probes"]
