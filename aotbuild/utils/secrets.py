"""Secrets never printed (issue 53): one scrubber that knows every source of a secret aotbuild can meet,
applied wherever text leaves aotbuild.

Sources (:func:`known`): the object stores' and the Hub's credential variables, and every environment
variable whose name looks secret (``*_TOKEN``, ``*_SECRET*``, ``*PASSWORD*``, ...; values of 8 characters
or more); the secret-named values of ``AOTBUILD_REMOTE_OPTIONS``; the user info of ``AOTBUILD_REMOTE``,
``AWS_ENDPOINT_URL`` and the other endpoint variables; the profile files the clients read (AWS's shared
credentials and config files, ``GOOGLE_APPLICATION_CREDENTIALS``'s JSON, the Hub's token file); and what
aotbuild registers while it runs (the signing key given to ``--sign-key``: :func:`register`). Each is
also matched URL-encoded and JSON-escaped. Patterns (:func:`scrub`): a URL's user info whatever it
holds (an AWS secret key holds ``/``), query values of any secret-looking name, a URL's fragment, Azure
connection-string keys.

Where it is applied: the CLI's stdout and stderr (every line, ``--json`` included: :func:`install_streams`),
every exception the public API raises with its chained causes (:func:`scrubbed`), and, once either is
in use, every log record of the process (the clients' DEBUG logging too) and every warning's text
(:func:`install`). What it cannot know: a secret held only inside a client's memory that no file or
variable names (an instance role's temporary keys, fetched over the network), should a store echo it.
"""

from __future__ import annotations

import functools
import io
import json
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote, quote_plus

from aotbuild import constants

__all__ = ["scrub", "known", "register", "scrubbed", "scrub_exception", "install", "install_streams"]

MASK = "***"
#: A name (variable, option, query parameter, profile key) whose value is a secret.
SECRET_NAME = re.compile(r"secret|token|passw|pwd|credential|private|api.?key|access.?key|account.?key|"
                         r"storage.?key|auth|signature|^sig$|_sig$|^sas|sas_|session|connection.?string|"
                         r"^key$|_key$", re.IGNORECASE)
#: An environment variable whose value is a secret, by the words of its name (``CI_DEPLOY_PASSWORD``,
#: ``GITHUB_TOKEN``, ``OPENAI_API_KEY``; not ``PWD``, ``SSH_AUTH_SOCK`` or ``AOTBUILD_TRUSTED_KEYS``).
SECRET_ENV_NAME = re.compile(r"(^|_)(SECRETS?|TOKEN|PASSWORD|PASSWD|PASSPHRASE|CREDENTIALS?|APIKEY|API_KEY|"
                             r"ACCESS_KEY|ACCOUNT_KEY|PRIVATE_KEY|STORAGE_KEY|SAS|SAS_TOKEN|AUTH_TOKEN|"
                             r"CONNECTION_STRING|KEY)(_|$)", re.IGNORECASE)
#: Names of that shape whose values are paths or modes, not secrets.
_NOT_SECRET_NAMES = frozenset({"AWS_SHARED_CREDENTIALS_FILE", "GOOGLE_APPLICATION_CREDENTIALS", "HF_TOKEN_PATH",
                               "HF_HUB_DISABLE_IMPLICIT_TOKEN", "GIT_ASKPASS", "SSH_ASKPASS"})
#: gcsfs's ``token`` modes: names of a credential chain, not secrets (scrubbed, "anon" garbled every
#: "anonymous" in a store's message to "***ymous").
_NOT_SECRETS = frozenset({"anon", "google_default", "cloud", "cache", "browser", "true", "false", "none"})
#: Variables holding credentials, whatever their length (their names do not all look secret).
SECRET_ENV = (*constants.SECRET_ENV, "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "AWS_SECURITY_TOKEN",
              "AZURE_STORAGE_ACCOUNT_NAME_KEY", "GCS_OAUTH_TOKEN", "AWS_BEARER_TOKEN_BEDROCK")
#: Variables holding URLs whose user info is a secret.
URL_ENV = (constants.ENV_REMOTE, "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "STORAGE_EMULATOR_HOST", "HF_ENDPOINT",
           "AZURE_STORAGE_BLOB_ENDPOINT", "HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY")
#: Bytes read of any one credentials file.
_FILE_BYTES = 256 * 1024

# A URL's user info, whatever it holds up to the last "@" of the token; hf:// uses "@" for a revision
# and file:// has none.
_USERINFO = re.compile(r"\b(?!hf://|file://)([a-zA-Z][a-zA-Z0-9+.-]*://)[^\s'\"<>]*@")
_QUERY = re.compile(r"([?&;]([^=&#;\s'\"]*)=)([^&#;\s'\"]*)")
_FRAGMENT = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s#'\"]*)#[^\s'\"]+")
_AZURE = re.compile(r"((?:AccountKey|SharedAccessSignature|SharedAccessKey|sig)=)[^;&\s'\"]+", re.IGNORECASE)
_PEM = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----.*?-----END [A-Z ]*PRIVATE KEY-----", re.DOTALL)

_registered: set[str] = set()
_lock = threading.Lock()
_cache: tuple[Any, list[str]] | None = None


def register(value: str | None) -> None:
    """A secret aotbuild met while running (a signing key's text): scrubbed from then on."""
    if value and len(value.strip()) >= 4:
        with _lock:
            _registered.add(value.strip())
            global _cache
            _cache = None


def _read(path: str | os.PathLike | None) -> str:
    if not path:
        return ""
    try:
        from aotbuild.utils import safeio

        return safeio.read_text(path, _FILE_BYTES)
    except (OSError, ValueError):
        return ""


def _secret_values(value: Any, name: str = "") -> Iterable[str]:
    """The string values under secret-looking names in a parsed JSON/INI structure."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _secret_values(v, str(k))
    elif isinstance(value, list):
        for v in value:
            yield from _secret_values(v, name)
    elif isinstance(value, str) and SECRET_NAME.search(name) and value.lower() not in _NOT_SECRETS:
        yield value


def _userinfo(url: str) -> list[str]:
    """The user and password of ``url``'s user info (whatever they hold)."""
    match = re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://([^\s]*)@", url.strip())
    if not match or url.startswith(("hf://", "file://")):
        return []
    info = match.group(1)
    return [info, *info.split(":", 1)]


def _profile_files(env: dict[str, str]) -> list[str]:
    home = Path(env.get("HOME") or os.path.expanduser("~"))
    hf_home = env.get("HF_HOME") or str(home / ".cache" / "huggingface")
    return [env.get("AWS_SHARED_CREDENTIALS_FILE") or str(home / ".aws" / "credentials"),
            env.get("AWS_CONFIG_FILE") or str(home / ".aws" / "config"),
            env.get("GOOGLE_APPLICATION_CREDENTIALS", ""),
            env.get("HF_TOKEN_PATH") or str(Path(hf_home) / "token"),
            env.get("AZURE_CONFIG_DIR", "") and str(Path(env["AZURE_CONFIG_DIR"]) / "config")]


def _fingerprint(env: dict[str, str], files: list[str]) -> Any:
    stats = []
    for f in files:
        try:
            st = os.stat(f) if f else None
            stats.append((f, st.st_mtime_ns, st.st_size) if st else None)
        except OSError:
            stats.append(None)
    return hash(frozenset(env.items())), tuple(stats), frozenset(_registered)


def known() -> list[str]:
    """Every secret value this process can name now, longest first (each at least 4 characters)."""
    global _cache
    env = dict(os.environ)
    files = _profile_files(env)
    stamp = _fingerprint(env, files)
    with _lock:
        if _cache is not None and _cache[0] == stamp:
            return _cache[1]
    found: list[str] = list(_registered)
    for name, value in env.items():
        if name in SECRET_ENV:
            found.append(value)
        elif SECRET_ENV_NAME.search(name) and name.upper() not in _NOT_SECRET_NAMES and len(value) >= 8:
            found.append(value)
        if name in URL_ENV:
            found += _userinfo(value)
        if name in SECRET_ENV and "=" in value and ";" in value:  # a connection string: its parts too
            found += [part.split("=", 1)[1] for part in value.split(";") if "=" in part
                      and SECRET_NAME.search(part.split("=", 1)[0])]
    try:
        from aotbuild.utils import safeio

        options = safeio.loads_json(constants.env_remote_options() or "{}", max_bytes=64 * 1024, max_depth=8)
        found += _secret_values(options)
    except ValueError:
        pass
    aws_credentials, aws_config, google, hf_token, azure = files
    for path in (aws_credentials, aws_config, azure):
        found += _ini_secrets(_read(path))
    text = _read(google)
    if text:
        try:
            from aotbuild.utils import safeio

            found += _secret_values(safeio.loads_json(text, max_bytes=_FILE_BYTES, max_depth=16))
        except ValueError:
            pass
    found.append(_read(hf_token).strip())
    values = set()
    for s in found:
        s = s.strip() if isinstance(s, str) else ""
        if len(s) < 4 or s.lower() in _NOT_SECRETS:
            continue
        values |= {s, quote(s, safe=""), quote_plus(s), json.dumps(s)[1:-1]}
        if "\n" in s:  # a PEM key: each of its lines too (a message may show one)
            values |= {line.strip() for line in s.splitlines() if len(line.strip()) >= 16}
    out = sorted(values, key=len, reverse=True)
    with _lock:
        _cache = (stamp, out)
    return out


def _ini_secrets(text: str) -> list[str]:
    if not text:
        return []
    import configparser

    parser = configparser.ConfigParser(interpolation=None, strict=False)
    try:
        parser.read_string(text)
    except configparser.Error:
        return []
    return [value for section in parser.sections() for name, value in parser.items(section, raw=True)
            if SECRET_NAME.search(name) and value]


def scrub(text: str) -> str:
    """``text`` with every secret :func:`known` names and every credential-shaped part masked."""
    if not isinstance(text, str) or not text:
        return text
    for secret in known():
        if secret in text:
            text = text.replace(secret, MASK)
    text = _PEM.sub(MASK, text)
    text = _USERINFO.sub(rf"\1{MASK}@", text)
    text = _AZURE.sub(rf"\1{MASK}", text)
    text = _QUERY.sub(lambda m: f"{m.group(1)}{MASK}" if SECRET_NAME.search(m.group(2)) or m.group(2).lower() in (
        "x-amz-signature", "x-amz-credential", "x-amz-security-token", "x-goog-signature", "x-goog-credential",
        "sv", "se", "sp", "sig") else m.group(0), text)
    text = _FRAGMENT.sub(rf"\1#{MASK}", text)
    return text


def scrub_exception(exc: BaseException) -> BaseException:
    """``exc``, and every exception chained to it, with their arguments scrubbed in place. A chained
    exception whose own ``str()`` still shows a secret (a class that formats itself) is cut off the
    chain; the outermost one, if so, is replaced by a RuntimeError of its scrubbed text."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        _scrub_args(current)
        for link in ("__cause__", "__context__"):
            nxt = getattr(current, link)
            if nxt is not None:
                _scrub_args(nxt)
                if _leaks(nxt):
                    setattr(current, link, None)
        current = current.__cause__ or current.__context__
    if _leaks(exc):
        clean = RuntimeError(scrub(f"{type(exc).__name__}: {exc}"))
        clean.__suppress_context__ = True
        return clean
    return exc


def _scrub_args(exc: BaseException) -> None:
    try:
        exc.args = tuple(scrub(a) if isinstance(a, str) else a for a in exc.args)
        for name in ("strerror", "filename", "filename2", "msg", "message", "reason"):
            value = getattr(exc, name, None)
            if isinstance(value, str) and scrub(value) != value:
                setattr(exc, name, scrub(value))
    except (AttributeError, TypeError):
        pass
    notes = getattr(exc, "__notes__", None)
    if isinstance(notes, list):
        notes[:] = [scrub(n) if isinstance(n, str) else n for n in notes]


def _leaks(exc: BaseException) -> bool:
    try:
        text = str(exc)
    except Exception:  # a broken __str__ shows nothing
        return False
    return scrub(text) != text


F = TypeVar("F", bound=Callable[..., Any])


def scrubbed(fn: F) -> F:
    """A public API function whose exceptions leave it scrubbed (with their chained causes), and which
    installs the process-wide scrubbing of log records and warnings (:func:`install`) when called."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        install()
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            clean = scrub_exception(exc)
            if clean is exc:
                raise
            raise clean from None

    return call  # type: ignore[return-value]


_installed = False


def install() -> None:
    """Scrub every log record made in this process (aotbuild's and the clients', DEBUG included) and
    every warning's text. Idempotent; only text that names a secret changes."""
    global _installed
    if _installed:
        return
    import logging
    import warnings

    with _lock:
        if _installed:
            return
        make = logging.getLogRecordFactory()

        def record(*args: Any, **kwargs: Any) -> logging.LogRecord:
            rec = make(*args, **kwargs)
            try:
                message = rec.getMessage()
            except Exception:  # a record whose arguments do not format: logging reports it itself
                return rec
            clean = scrub(message)
            if clean != message:
                rec.msg, rec.args = clean, None
            if rec.exc_info and rec.exc_info[1] is not None:
                scrub_exception(rec.exc_info[1])
            return rec

        logging.setLogRecordFactory(record)
        formatwarning = warnings.formatwarning

        def format_warning(message: Any, category: Any, filename: str, lineno: int, line: str | None = None) -> str:
            return scrub(formatwarning(message, category, filename, lineno, line))

        warnings.formatwarning = format_warning
        _installed = True


class _ScrubbedStream(io.TextIOBase):
    """A text stream that writes whole lines, each scrubbed, to the stream under it."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.pending = ""

    def write(self, text: str) -> int:
        self.pending += text
        end = max(self.pending.rfind("\n"), self.pending.rfind("\r"))  # a line, or a progress bar's redraw
        if end >= 0:
            self.inner.write(scrub(self.pending[:end + 1]))
            self.pending = self.pending[end + 1:]
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.inner.write(scrub(self.pending))
            self.pending = ""
        self.inner.flush()

    def isatty(self) -> bool:
        return bool(getattr(self.inner, "isatty", lambda: False)())

    def writable(self) -> bool:
        return True

    @property
    def closed(self) -> bool:  # type: ignore[override]
        return bool(getattr(self.inner, "closed", False))

    def fileno(self) -> int:
        return self.inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.inner, "encoding", "utf-8")

    @property
    def buffer(self) -> Any:  # click writes bytes here for binary output; aotbuild writes none
        return self.inner.buffer


def install_streams() -> None:
    """The CLI: stdout and stderr scrubbed line by line (tracebacks and ``--json`` too), and :func:`install`."""
    install()
    if not isinstance(sys.stdout, _ScrubbedStream):
        sys.stdout = _ScrubbedStream(sys.stdout)  # type: ignore[assignment]
    if not isinstance(sys.stderr, _ScrubbedStream):
        sys.stderr = _ScrubbedStream(sys.stderr)  # type: ignore[assignment]
    import atexit

    atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush()))
