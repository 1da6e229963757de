"""Build jobs see no compiler side channel (issue 35 item 4): torch's and Triton's remote-cache
variables are removed from every child's environment (aotbuild/targets/side_channels.py, called by
child.environment), unless AOTBUILD_ALLOW_REMOTE_COMPILER_CACHE=1, which makes them a key factor.
The slow test points a real compile at a Redis API server on the loopback (fakeredis)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from aotbuild import constants
from aotbuild.builder import child

SIDE_CHANNELS = {"TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1", "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "1",
                 "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE": "1", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
                 "TORCHINDUCTOR_REDIS_URL": "redis://:hunter2-secret@127.0.0.1:1", "TORCHINDUCTOR_REDIS_HOST": "cache",
                 "TORCHINDUCTOR_REDIS_PORT": "6380", "TRITON_CACHE_MANAGER": "pkg.mod:Manager",
                 "TRITON_REMOTE_CACHE_BACKEND": "pkg.mod:Backend", "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_REMOTE_PGO": "1",
                 "TORCHINDUCTOR_REMOTE_SOMETHING_NEW": "1"}


def _child_env() -> dict[str, str]:
    """The environment a child process of a build actually has (it prints its own)."""
    proc = subprocess.run([sys.executable, "-c", "import json, os; print(json.dumps(dict(os.environ)))"],
                          env=child.environment({}), capture_output=True, text=True, check=True)
    return json.loads(proc.stdout)


def test_every_remote_compiler_cache_variable_is_gone_from_a_child(monkeypatch):
    for name, value in SIDE_CHANNELS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/tmp/local-is-fine")  # the local cache is the entry
    monkeypatch.delenv(constants.ENV_ALLOW_REMOTE_COMPILER_CACHE, raising=False)
    env = _child_env()
    assert not set(SIDE_CHANNELS) & set(env)
    assert not [n for n in constants.REMOTE_COMPILER_CACHE_VARIABLES if n in env]
    assert env["TORCHINDUCTOR_CACHE_DIR"] == "/tmp/local-is-fine"


def test_the_opt_in_keeps_them_and_makes_them_a_key_factor_without_their_values(monkeypatch):
    from aotbuild.context import environment_factors

    for name, value in SIDE_CHANNELS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(constants.ENV_ALLOW_REMOTE_COMPILER_CACHE, raising=False)
    plain = environment_factors()
    assert "remote_compiler_cache" not in plain  # keys unchanged unless opted in (tests/test_key_pins.py)
    monkeypatch.setenv(constants.ENV_ALLOW_REMOTE_COMPILER_CACHE, "1")
    assert {n: _child_env()[n] for n in SIDE_CHANNELS} == SIDE_CHANNELS
    factor = environment_factors()["remote_compiler_cache"]
    assert sorted(factor) == sorted(SIDE_CHANNELS)
    assert "hunter2" not in json.dumps(factor)  # a digest of each value, never the value (a password)
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", "redis://127.0.0.1:2")
    assert environment_factors()["remote_compiler_cache"] != factor  # another server, another key


@pytest.fixture
def redis_server():
    """A Redis API server on the loopback (fakeredis' TCP server), and a client of it."""
    redis = pytest.importorskip("redis")
    fakeredis = pytest.importorskip("fakeredis")
    server = fakeredis.TcpFakeServer(("127.0.0.1", 0))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], redis.Redis(host="127.0.0.1", port=server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


#: One tiny real compile, in a child process started as a build starts its children.
COMPILE = "import torch\nf = torch.compile(lambda x: torch.sin(x) * 2 + 1)\nprint(f(torch.randn(8)).shape)"


@pytest.mark.slow
def test_a_compile_writes_to_a_remote_cache_only_when_the_scrubbing_is_off(redis_server, monkeypatch, tmp_path):
    port, client = redis_server
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "1")
    monkeypatch.setenv("TORCHINDUCTOR_REDIS_URL", f"redis://127.0.0.1:{port}")
    # No vector ISA: Inductor skips its probes (a g++ compile and a Python process each, ~15 s of CPU per
    # fresh process on an AVX-512 host) and emits scalar C++; what reaches the server is the same FX graph.
    monkeypatch.setenv("TORCHINDUCTOR_VEC_ISA_OK", "0")
    for allow, inductor in (("0", "scrubbed"), ("1", "kept")):
        monkeypatch.setenv(constants.ENV_ALLOW_REMOTE_COMPILER_CACHE, allow)
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / inductor))  # empty: a real compile
        proc = subprocess.run([sys.executable, "-c", COMPILE], env=child.environment({}), capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        written = client.keys()
        if allow == "0":
            assert written == []  # scrubbed: the server heard nothing
    assert [k for k in written if k.startswith(b"pt2:fx-graph")]  # opted in: the compile's FX graph went there
