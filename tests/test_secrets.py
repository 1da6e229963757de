"""Secrets never printed (issue 53): one scrubber (aotbuild/utils/secrets.py) that knows every source a
secret comes from, applied to every line a command prints, every ``--json`` value, every exception the
API raises with its chained causes, every log record and every warning. The end-to-end test plants a
distinct secret in each source, runs every command that touches a remote with its failures forced (a
closed port), and greps all output for every secret."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from aotbuild.utils import secrets
from tests.conftest import MAIN_RECIPE, REPO, run_cli, run_python


@pytest.fixture(autouse=True)
def no_ambient_secrets(monkeypatch, tmp_path):
    """Profile files and the Hub's token file from this test's own home, none of the developer's."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for name in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "GOOGLE_APPLICATION_CREDENTIALS", "HF_TOKEN_PATH",
                 "HF_HOME", "AOTBUILD_REMOTE_OPTIONS", "AOTBUILD_REMOTE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("text", "shown"), [
    # an AWS secret key holds "/": the whole user info goes, whatever it holds
    ("remote 's3://AKIAX:ab/cd/efSECRET@bkt/p' is bad", "remote 's3://***@bkt/p' is bad"),
    ("gs://u:p/q+r=@bkt/x and az://k:v@c/p", "gs://***@bkt/x and az://***@c/p"),
    ("http://user:pa%2Fss@127.0.0.1:9/", "http://***@127.0.0.1:9/"),
    # query values of any secret-looking name, signed URLs' signatures, and a URL's fragment
    ("s3://b/p?secret=S1&region=eu&password=S2&X-Amz-Signature=S3", "s3://b/p?secret=***&region=eu&password=***&"
                                                                    "X-Amz-Signature=***"),
    ("https://a.blob.core.windows.net/c?sv=2024&sig=S4&st=1", "https://a.blob.core.windows.net/c?sv=***&sig=***&st=1"),
    ("s3://b/p#S5", "s3://b/p#***"),
    ("DefaultEndpointsProtocol=https;AccountName=a;AccountKey=S6==;", "DefaultEndpointsProtocol=https;AccountName=a;"
                                                                     "AccountKey=***;"),
    # not secrets: a Hub revision, a folder remote, a plain URL
    ("hf://owner/repo@main", "hf://owner/repo@main"),
    ("file:///srv/cache", "file:///srv/cache"),
    ("https://huggingface.co/owner/repo", "https://huggingface.co/owner/repo"),
])
def test_credential_shaped_text_is_masked(text, shown):
    assert secrets.scrub(text) == shown


def test_every_source_of_a_secret_is_known_and_masked_in_every_form(tmp_path, monkeypatch):
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text("[default]\naws_access_key_id = PLANTKEYID1\n"
                                               "aws_secret_access_key = plant/secret+2\n[ci]\naws_session_token = "
                                               "PLANTTOKEN3\nregion = eu-west-1\n")
    (home / ".aws" / "config").write_text("[profile x]\naws_secret_access_key = PLANTCONFIG4\n")
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_PLANTTOKENFILE5\n")
    google = tmp_path / "sa.json"
    google.write_text(json.dumps({"type": "service_account", "project_id": "visible-project",
                                  "private_key_id": "PLANTKEYID6", "private_key": "-----BEGIN PRIVATE KEY-----\n"
                                  "PLANTPEMLINE7PLANTPEMLINE7\n-----END PRIVATE KEY-----\n"}))
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(google))
    monkeypatch.setenv("AOTBUILD_REMOTE_OPTIONS", json.dumps({"key": "PLANTOPTION8", "token": "anon",
                                                              "client_kwargs": {"aws_secret": "PLANTOPTION9"}}))
    monkeypatch.setenv("HF_TOKEN", "hf_PLANTENV10")
    monkeypatch.setenv("CI_DEPLOY_PASSWORD", "PLANTGENERIC11")  # any variable whose name looks secret
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://minio:PLANTENDPOINT12@127.0.0.1:9")
    secrets.register("PLANTSIGNKEY13")
    planted = ["PLANTKEYID1", "plant/secret+2", "PLANTTOKEN3", "PLANTCONFIG4", "hf_PLANTTOKENFILE5", "PLANTKEYID6",
               "PLANTPEMLINE7PLANTPEMLINE7", "PLANTOPTION8", "PLANTOPTION9", "hf_PLANTENV10", "PLANTGENERIC11",
               "PLANTENDPOINT12", "PLANTSIGNKEY13"]
    from urllib.parse import quote

    for secret in planted:
        for form in (secret, quote(secret, safe=""), json.dumps(secret)[1:-1]):
            assert "PLANT" not in secrets.scrub(f"an error echoing {form} back").replace("plant", ""), (secret, form)
    # names of credential modes, regions and projects are not secrets
    assert secrets.scrub("anon eu-west-1 visible-project") == "anon eu-west-1 visible-project"


def test_an_exception_and_its_chained_causes_leave_the_api_scrubbed(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "abc/DEF+secret9")

    class Echoing(Exception):  # formats itself: its text cannot be scrubbed in place
        def __str__(self) -> str:
            return "denied for abc/DEF+secret9"

    @secrets.scrubbed
    def pull() -> None:
        try:
            try:
                raise Echoing()
            except Echoing as inner:
                raise OSError(f"s3://AKIA:abc/DEF+secret9@b/p: {inner}") from inner
        except OSError as exc:
            raise ValueError(f"pull failed: {exc}") from exc

    with pytest.raises(ValueError) as caught:
        pull()
    chain, exc = [], caught.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert chain and not any("secret9" in text for text in chain), chain
    assert "s3://***@b/p" in chain[0]


def test_log_records_and_warnings_are_scrubbed_once_installed(tmp_path):
    code = textwrap.dedent("""
        import logging, warnings
        logging.basicConfig(level=logging.DEBUG)
        from aotbuild.utils import secrets
        secrets.install()
        logging.getLogger("botocore.auth").debug("signing with %s", "PLANTLOG1")
        logging.getLogger("aotbuild").info("remote s3://k:%s@b/p", "PLANT/LOG2")
        warnings.warn("token PLANTLOG1 in a warning")
    """)
    proc = run_python(code, env={"AWS_SECRET_ACCESS_KEY": "PLANTLOG1"})
    assert proc.returncode == 0, proc.stderr
    assert "PLANT" not in proc.stdout + proc.stderr and proc.stderr.count("***") == 3, proc.stderr


#: Runs each (extra environment, argv) of argv[1] (JSON) as the ``aotbuild`` console script would, its
#: stdout and stderr scrubbed as the console script's are (secrets.install_streams), then prints its exit code.
CLI_DRIVER = textwrap.dedent("""
    import json, os, sys
    from aotbuild.utils.secrets import install_streams
    install_streams()
    from aotbuild.cli.commands import main
    for extra, args in json.loads(sys.argv[1]):
        before = dict(os.environ)
        os.environ.update(extra)
        try:
            main(args, prog_name="aotbuild")
        except SystemExit as exc:
            print(f"exit {exc.code}")
        finally:
            os.environ.clear()
            os.environ.update(before)
        sys.stdout.flush()
        sys.stderr.flush()
""")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # 18 commands in one process and one API process against closed ports (~15 s)
def test_no_secret_in_any_output_of_a_command_that_touches_a_remote(tmp_path, cache):
    """A distinct secret in each source; every command that touches a remote, with its failures forced
    (the endpoints are closed ports): no planted secret in any stdout, stderr or ``--json``."""
    port = _closed_port()
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text("[default]\naws_access_key_id = AKIAPLANTPROFILE1\n"
                                               "aws_secret_access_key = plant/PROFILE+2\n")
    (home / ".cache" / "huggingface").mkdir(parents=True)
    (home / ".cache" / "huggingface" / "token").write_text("hf_PLANTHFFILE3")
    google = tmp_path / "sa.json"
    google.write_text(json.dumps({"type": "service_account", "private_key": "PLANTGOOGLE4", "client_email": "x@y"}))
    key = tmp_path / "ci.key"
    proc = run_cli("keygen", str(tmp_path / "ci"))
    assert proc.returncode == 0, proc.stderr
    seed = key.read_text().split()[2]
    planted = {
        "url user info (s3)": "ab/cd/PLANTURL5",
        "url user info (gs)": "PLANT/GS6",
        "url user info (az)": "PLANTAZ7",
        "AOTBUILD_REMOTE": "PLANT/REMOTE8",
        "AWS_ENDPOINT_URL": "PLANT/ENDPOINT9",
        "query secret": "PLANTQUERY10",
        "fragment": "PLANTFRAGMENT11",
        "AWS_SECRET_ACCESS_KEY": "env/PLANTAWS+12",
        "AZURE_STORAGE_CONNECTION_STRING": "PLANTAZKEY13==",
        "HF_TOKEN": "hf_PLANTHFENV14",
        "AOTBUILD_REMOTE_OPTIONS": "PLANTOPTIONS15",
        "generic": "PLANTGENERIC16",
        "profile secret": "plant/PROFILE+2",
        "profile key id": "AKIAPLANTPROFILE1",
        "hf token file": "hf_PLANTHFFILE3",
        "google private key": "PLANTGOOGLE4",
        "--sign-key": seed,
    }
    env = {"HOME": str(home), "AWS_SHARED_CREDENTIALS_FILE": str(home / ".aws" / "credentials"),
           "GOOGLE_APPLICATION_CREDENTIALS": str(google), "HF_HOME": str(home / ".cache" / "huggingface"),
           "AWS_ENDPOINT_URL": f"http://minio:{planted['AWS_ENDPOINT_URL']}@127.0.0.1:{port}",
           "AWS_SECRET_ACCESS_KEY": planted["AWS_SECRET_ACCESS_KEY"], "AWS_ACCESS_KEY_ID": "AKIAEXAMPLE",
           "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
           "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=http;AccountName=dev;AccountKey="
                                              f"{planted['AZURE_STORAGE_CONNECTION_STRING']};BlobEndpoint="
                                              f"http://127.0.0.1:{port}/dev;",
           "HF_TOKEN": planted["HF_TOKEN"], "HF_ENDPOINT": f"http://127.0.0.1:{port}",
           "AOTBUILD_REMOTE_OPTIONS": json.dumps({"secret": planted["AOTBUILD_REMOTE_OPTIONS"]}),
           "MY_REGISTRY_PASSWORD": planted["generic"], "AOTBUILD_REMOTE_RETRIES": "1", "AOTBUILD_REMOTE_BACKOFF": "0"}
    # A cache whose path holds every secret that only a file or a variable knows: every command prints its
    # cache root, so each of them reaches the output and must come out masked.
    echoed = "-".join(planted[k] for k in ("profile secret", "profile key id", "hf token file", "google private key",
                                          "--sign-key", "generic", "HF_TOKEN", "AWS_SECRET_ACCESS_KEY"))
    root = tmp_path / echoed / "cache"
    shutil.copytree(cache, root)
    recipe = str(MAIN_RECIPE)
    remotes = [f"s3://AKIAX:{planted['url user info (s3)']}@bkt/p", f"gs://u:{planted['url user info (gs)']}@bkt/p",
               f"az://dev:{planted['url user info (az)']}@c/p", f"s3://bkt/p?secret={planted['query secret']}",
               f"s3://bkt/p#{planted['fragment']}", "s3://bkt/p", "gs://bkt/p", "az://c/p", "hf://owner/repo"]
    commands = [({}, ["plan", recipe, "--remote", remote, "--json"]) for remote in remotes]
    commands += [({}, ["pull", recipe, "--remote", remote])
                 for remote in (remotes[0], remotes[3], "s3://bkt/p", "gs://bkt/p", "az://c/p", "hf://owner/repo")]
    commands += [({}, ["push", recipe, "--remote", "s3://bkt/p"]), ({}, ["sign", recipe, "--sign-key", str(key)]),
                 ({"AOTBUILD_REMOTE": f"s3://k:{planted['AOTBUILD_REMOTE']}@bkt/p"}, ["plan", recipe])]
    commands = [(extra, [*args, "--cache", str(root)]) for extra, args in commands]
    # the console script's streams, one command after another in one process (a process each: +30 s)
    outputs = [subprocess.run([sys.executable, "-c", CLI_DRIVER, json.dumps(commands)], capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=REPO)]
    assert outputs[0].stdout.count("exit ") == len(commands), outputs[0].stderr[-2000:]
    api = textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.DEBUG)
        import aotbuild
        recipe, root = sys.argv[1:3]
        for remote in sys.argv[3:]:
            for call in (lambda: aotbuild.pull([recipe], remote, cache=root),
                         lambda: aotbuild.load_compiled(recipe, cache=root, remote=remote, on_miss="error")):
                try:
                    call()
                except Exception as exc:
                    import traceback
                    traceback.print_exc()
    """)
    outputs.append(subprocess.run([sys.executable, "-c", api, recipe, str(root), *remotes[:5]], capture_output=True,
                                  text=True, env={**os.environ, "PYTHONPATH": str(REPO), **env}, cwd=REPO))
    everything = "\n".join(p.stdout + p.stderr for p in outputs)
    assert "***" in everything
    leaked = {name: value for name, value in planted.items() if value in everything}
    lines = [line for line in everything.splitlines() if any(v in line for v in leaked.values())]
    assert not leaked, (leaked, lines[:5])
