"""``aotbuild doctor``: named checks, exit 1 naming the one that failed, a real roundtrip."""

from __future__ import annotations

import json

import pytest

from tests.conftest import invoke_cli, run_cli


def checks(proc) -> dict[str, dict]:
    return {c["name"]: c for c in json.loads(proc.stdout)["checks"]}


@pytest.mark.slow  # seconds of subprocesses or server traffic: the full suite runs it
def test_a_missing_compiler_fails_the_toolchain_check_and_skips_the_roundtrip(tmp_path):
    proc = run_cli("doctor", "--json", "--cache", str(tmp_path / "c"), env={"CXX": str(tmp_path / "no-such-g++")})
    assert proc.returncode == 1, proc.stderr
    found = checks(proc)
    assert json.loads(proc.stdout)["ok"] is False
    assert not found["toolchain"]["ok"] and "no working C++ compiler (CXX=" in found["toolchain"]["detail"]
    assert "point CXX at a working compiler" in found["toolchain"]["fix"]
    assert found["roundtrip"]["skipped"] and "toolchain" in found["roundtrip"]["detail"]
    text = run_cli("doctor", "--cache", str(tmp_path / "c"), env={"CXX": str(tmp_path / "no-such-g++")})
    assert text.returncode == 1 and "FAIL  toolchain" in text.stdout and "a check failed" in text.stdout


def test_every_check_is_named_and_a_missing_remote_fails(tmp_path):
    (tmp_path / "c").mkdir()
    proc = invoke_cli("doctor", "--json", "--no-roundtrip", "--cache", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = checks(proc)
    assert list(found) == ["toolchain", "caches", "disk", "store", "remote", "roundtrip"]
    assert found["toolchain"]["ok"] and found["remote"]["skipped"] and found["roundtrip"]["skipped"]
    assert found["disk"]["free"] > 0 and found["store"]["entries"] == 0
    bad = invoke_cli("doctor", "--json", "--no-roundtrip", "--cache", str(tmp_path / "c"),
                  "--remote", f"file://{tmp_path}/nowhere/cache")
    assert bad.returncode == 1 and not checks(bad)["remote"]["ok"]
    off = run_cli("doctor", "--json", "--no-roundtrip", "--cache", str(tmp_path / "c"),
                  env={"TORCHINDUCTOR_FX_GRAPH_CACHE": "0"})
    assert off.returncode == 1 and "FX graph cache" in checks(off)["caches"]["detail"]


@pytest.mark.slow  # one tiny build (the text encoder: 12 kernels) and its proof, about a minute of CPU
def test_the_roundtrip_builds_and_a_fresh_process_serves_with_0_compiles(tmp_path, vector_isa):
    # in this process: the build's worker and its proof are fresh processes already (the CLI's own
    # process is tested above, exit codes included). With Inductor's own vector ISA (the suite's other
    # builds emit scalar kernels, tests/conftest.py): the doctor checks what a user's build does.
    proc = invoke_cli("doctor", "--json", "--cache", str(tmp_path / "c"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    roundtrip = checks(proc)["roundtrip"]
    assert roundtrip["ok"] and roundtrip["compiled_at_load"] == 0 and roundtrip["max_abs_diff"] <= 1e-4
    assert roundtrip["component"] == "text_encoder" and "text_encoder in " in roundtrip["detail"]
    assert not (tmp_path / "c").exists()  # never the user's store: a temporary cache


def test_the_store_check_suggests_verify_fix_only_for_what_it_repairs(tmp_path):
    from aotbuild.cache.store import Store
    from aotbuild.cli.doctor import check_store
    from tests.standins import add_entry

    store = Store(tmp_path / "c")
    add_entry(store, tmp_path, "a", {"x.so": b"kernel-a"})
    store.layout.tmp.mkdir(parents=True, exist_ok=True)
    (store.layout.tmp / "notes.txt").write_text("not aotbuild's")
    alone = check_store(store.root, deep=True)
    assert not alone.ok and "verify --fix" not in alone.fix
    assert alone.fix.startswith("foreign (left for its owner, --fix never removes it): aotbuild did not write it")
    orphan = tmp_path / "orphan"
    orphan.write_bytes(b"no manifest names it")
    store.put_blob(orphan)
    both = check_store(store.root, deep=True)
    assert both.fix.startswith("aotbuild verify --fix repairs 1 of them; foreign (left for its owner")
