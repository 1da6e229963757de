"""A loopback stand-in for the part of the Hugging Face Hub HTTP API that ``huggingface_hub`` uses to
list, download and commit files (tests only; standard library only).

It serves what huggingface_hub 2.4's public functions really request for those operations:

==========  ==============================================================  =================================
method      path                                                            called by
==========  ==============================================================  =================================
HEAD, GET   ``/{repo_id}/resolve/{rev}/{path}`` (``/datasets/...``,          hf_hub_download, file_exists,
            ``/spaces/...`` for the other repo types)                       get_hf_file_metadata
GET         ``/api/{type}s/{repo_id}``                                      repo_info / model_info / ...
GET         ``/api/{type}s/{repo_id}/revision/{rev}``                       repo_info(revision=...),
                                                                            snapshot_download, no-op commits
GET         ``/api/{type}s/{repo_id}/tree/{rev}[/{path}]``                  list_repo_tree (``path`` arrives
                                                                            with its slashes as ``%2F``)
GET         ``/api/{type}s/{repo_id}/commits/{rev}``                        list_repo_commits
GET         ``/api/{type}s/{repo_id}/refs``                                 list_repo_refs
POST        ``/api/{type}s/{repo_id}/preupload/{rev}``                      create_commit (upload modes)
POST        ``/api/{type}s/{repo_id}/commit/{rev}``                         create_commit (NDJSON payload)
POST        ``/api/repos/create``                                           create_repo
POST        ``/{repo_id}.git/info/lfs/objects/batch`` (``/datasets/...``,    create_commit,
            ``/spaces/...``)                                                preupload_lfs_files (LFS only)
PUT         ``/{repo_id}.git/info/lfs/objects/{sha256}?size=&signature=``   the batch's upload action href
POST        ``/{repo_id}.git/info/lfs/objects/verify``                      the batch's verify action href
==========  ==============================================================  =================================

Behaviour worth knowing:

* By default every file is a plain git blob: preupload answers ``uploadMode: "regular"``, so uploads go
  inline (base64 in the commit payload). ``ETag`` is the file's git blob sha1 (what ``huggingface_hub``
  computes locally for regular files, so re-committing an unchanged file is a no-op). Downloads are always
  plain HTTP GETs on the resolve URL: no response ever carries an ``X-Xet-*`` header or redirects.
* LFS is opt-in: with ``lfs_threshold=N`` (constructor, settable attribute, ``--lfs-threshold``, or ``POST
  /_standin/lfs_threshold`` ``{"threshold": N}``), preupload answers ``"lfs"`` for non-empty files of at least
  ``N`` bytes, and huggingface_hub then posts the git-lfs batch request, PUTs each object the batch asks for
  (``transfer: "basic"``, one PUT, never multipart or Xet), posts the verify action, and commits an ``lfsFile``
  line (path, sha256 oid, size). Objects are kept per repo by sha256 (as on the Hub, LFS objects are not
  shared between repos); a stored one gets no upload action, so it is not uploaded again. The PUT is
  refused unless the bytes hash to the oid and match the size (400). An ``lfsFile`` line naming an object
  this repo does not hold fails the whole commit with 400 (nothing applied); so does an inline ``file`` of
  ``N`` bytes or more. An LFS file reads back with its real content; its resolve response adds
  ``X-Linked-Etag: "<sha256>"`` and ``X-Linked-Size`` (huggingface_hub prefers them to ``ETag``, which is the
  pointer file's blob sha1, and names the cached blob by the sha256); tree listings and ``blobs=True`` repo
  info carry the Hub's ``lfs`` object (sha256, size, pointer size).
* Xet is never offered. huggingface_hub 2.4 picks Xet over LFS on its own, whenever the ``hf_xet`` package
  is installed (``utils._runtime.is_xet_available()``; no server field or header is consulted), unless
  ``HF_HUB_DISABLE_XET=1`` is set (read at import: also patch ``huggingface_hub.constants.HF_HUB_DISABLE_XET``
  in-process). So an LFS test must set it; otherwise the client asks ``GET /api/{type}s/{repo_id}/
  xet-write-token/{rev}``, which answers 400 saying so, and the commit fails before any upload or commit request.
* Errors carry the ``X-Error-Code`` header the real Hub sends: ``RepoNotFound`` (401 without a token, 404
  with one), ``RevisionNotFound`` (404), ``EntryNotFound`` (404, for a missing file *and* for a tree
  listing of a missing folder, as on the Hub). huggingface_hub maps them to ``RepositoryNotFoundError``,
  ``RevisionNotFoundError`` and ``RemoteEntryNotFoundError``.
* Reads need no token (every repo is public; any ``Authorization`` header is ignored). Writes (preupload,
  commit, create repo, LFS batch and verify) need ``Authorization: Bearer <write_token>``; otherwise 401 with
  ``X-Error-Message: Invalid credentials in Authorization header`` (huggingface_hub raises a plain
  ``HfHubHTTPError``). huggingface_hub sends no ``Authorization`` header with the LFS PUT (on the Hub it goes to
  a presigned storage URL), so the upload href carries the credential instead: an HMAC of the object keyed
  by the write token, which only an authorized batch request hands out (403 without it).
* Revisions: branch ``main`` (also ``refs/heads/main``) and any full 40-hex commit sha. Each commit keeps
  its whole file table in memory, so reads at an old sha see that commit's files. A new repo has one
  empty "initial commit", as on the Hub (but without a ``.gitattributes`` file).
* Commits are applied atomically, under a lock, on top of the branch head at that moment. A
  ``parentCommit`` that is not the head gets 412, as on the Hub. Supported NDJSON lines: ``header``,
  ``file`` (base64), ``lfsFile`` (see above), ``deletedFile``, ``deletedFolder``. ``create_pr`` is refused (400).
* ``fail_commits = n`` makes the next ``n`` commit requests answer 500 after their payload is read
  (nothing applied). ``create_commit`` does not retry a commit POST, so it raises at once.
* ``requests`` records ``(method, path)`` for every Hub request, path unquoted and without the query.
* ``tree_page_size`` (default 1000, as on the Hub) paginates tree listings with a ``Link: <...>;
  rel="next"`` header; the cursor pins the commit, so a listing stays consistent across pages.

Run it as a separate process with ``python -m tests.fakes.hub_server --port-file F --repo owner/name:dataset``:
it writes the endpoint URL to ``F`` (atomically) once it serves, and serves until SIGTERM/SIGINT. Such a
process can be inspected or driven over HTTP: ``GET /_standin/state`` returns the repos, commits, LFS objects
and requests as JSON; ``POST /_standin/fail_commits`` with ``{"n": 2}`` sets the fault knob.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import hmac
import itertools
import json
import os
import signal
import socket
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, quote, unquote, urlsplit

DEFAULT_WRITE_TOKEN = "hf_test_write"
REPO_TYPES = ("model", "dataset", "space")
PLURALS = {f"{t}s": t for t in REPO_TYPES}
URL_PREFIXES = {"model": "", "dataset": "datasets/", "space": "spaces/"}
# Path segments that follow a repo id in /api/{type}s/{repo_id}/... URLs.
API_ACTIONS = {"tree", "revision", "preupload", "commit", "commits", "refs", "paths-info", "resolve",
               "xet-read-token", "xet-write-token"}
INVALID_CREDENTIALS = "Invalid credentials in Authorization header"
LFS_CONTENT_TYPE = "application/vnd.git-lfs+json"
LFS_POINTER = "version https://git-lfs.github.com/spec/v1\noid sha256:{oid}\nsize {size}\n"
MISSING_LFS_OBJECT = ("Your push was rejected because an LFS pointer pointed to a file that does not exist. "
                      "Offending file(s): {paths}")


def git_blob_oid(data: bytes) -> str:
    """The git sha1 of a blob: what the Hub reports as a regular file's oid and ETag."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(data: bytes) -> bytes:
    """The git-lfs pointer file git stores in place of an LFS file's content."""
    return LFS_POINTER.format(oid=hashlib.sha256(data).hexdigest(), size=len(data)).encode()


def _is_sha256(oid: object) -> bool:
    return isinstance(oid, str) and len(oid) == 64 and all(c in "0123456789abcdef" for c in oid)


def _now() -> str:
    now = datetime.now(timezone.utc)
    return now.strftime("%Y-%m-%dT%H:%M:%S.") + f"{now.microsecond // 1000:03d}Z"


def _is_sha(rev: str) -> bool:
    return len(rev) == 40 and all(c in "0123456789abcdef" for c in rev)


class HubError(Exception):
    """An error response, with the headers the real Hub sends for it."""

    def __init__(self, status: int, message: str, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.headers = dict(headers or {})


@dataclass
class _Commit:
    oid: str
    message: str
    description: str
    parent: str | None
    paths: list[str]
    files: dict[str, bytes]
    date: str
    lfs: dict[str, str] = field(default_factory=dict)  # path -> sha256, for the files stored as LFS

    def blob_oid(self, path: str) -> str:
        """The git oid of ``path``'s blob: of its content, or of its LFS pointer for an LFS file."""
        data = self.files[path]
        return git_blob_oid(lfs_pointer(data) if path in self.lfs else data)


@dataclass
class _Repo:
    repo_id: str
    repo_type: str
    created_at: str
    commits: dict[str, _Commit] = field(default_factory=dict)  # oid -> commit, oldest first
    branches: dict[str, str] = field(default_factory=dict)  # name -> head oid
    lfs_objects: dict[str, bytes] = field(default_factory=dict)  # sha256 -> content, uploaded to this repo


class HubStandIn:
    """In-memory Hub serving on 127.0.0.1 (random port by default) from a daemon thread.

    >>> with HubStandIn() as hub:
    ...     hub.create_repo("owner/name", repo_type="dataset")
    ...     HfApi(endpoint=hub.endpoint, token=hub.write_token).create_commit(...)
    """

    def __init__(self, write_token: str = DEFAULT_WRITE_TOKEN, host: str = "127.0.0.1", port: int = 0,
                 lfs_threshold: int | None = None):
        self.write_token = write_token
        self.lfs_threshold = lfs_threshold  # None: every file is regular; else files of >= this many bytes are LFS
        self.fail_commits = 0
        self.requests: list[tuple[str, str]] = []
        self.tree_page_size = 1000
        self._host, self._port = host, port
        self._lock = threading.RLock()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._counter = itertools.count()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._sockets: set[socket.socket] = set()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> HubStandIn:
        if self._server is not None:
            return self
        server = ThreadingHTTPServer((self._host, self._port), _Handler)
        server.daemon_threads = True
        server.hub = self  # type: ignore[attr-defined]
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,), name="hub-standin", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        with self._lock:
            sockets, self._sockets = list(self._sockets), set()
        for sock in sockets:  # end kept-alive connections, so their handler threads finish
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> HubStandIn:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        if self._server is None:
            raise RuntimeError("HubStandIn is not started (use it as a context manager or call start())")
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- test-side helpers (no HTTP) -------------------------------------------------------------

    def create_repo(self, repo_id: str, repo_type: str = "model") -> None:
        """Create a public repo with an empty initial commit on ``main`` (no-op if it exists)."""
        self._check_type(repo_type)
        with self._lock:
            if (repo_type, repo_id) in self._repos:
                return
            repo = _Repo(repo_id=repo_id, repo_type=repo_type, created_at=_now())
            self._repos[(repo_type, repo_id)] = repo
            commit = self._new_commit(repo, None, "initial commit", "", [], {})
            repo.branches["main"] = commit.oid

    def files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, bytes]:
        """The file table (path -> content) of ``revision`` (a branch or a commit sha)."""
        with self._lock:
            return dict(self._resolve(self._repo(repo_type, repo_id), revision).files)

    def commits(self, repo_id: str, repo_type: str = "model") -> list[dict]:
        """Every commit of the repo, oldest first (the first is the empty "initial commit"):
        ``{"oid", "message", "paths"}`` where ``paths`` are the paths the commit added, changed or deleted."""
        with self._lock:
            repo = self._repo(repo_type, repo_id)
            return [{"oid": c.oid, "message": c.message, "paths": list(c.paths)} for c in repo.commits.values()]

    def head(self, repo_id: str, repo_type: str = "model", branch: str = "main") -> str:
        with self._lock:
            return self._resolve(self._repo(repo_type, repo_id), branch).oid

    def commit_files(self, repo_id: str, files: dict[str, bytes], repo_type: str = "model",
                     message: str = "seed", delete: tuple[str, ...] = (), branch: str = "main") -> str:
        """Commit directly (no HTTP, no auth): seeds a repo for a test. Returns the new commit's oid.
        Files that ``lfs_threshold`` makes LFS are stored as LFS objects, as an LFS upload would."""
        ops: list[tuple[str, str, object]] = []
        with self._lock:
            repo = self._repo(repo_type, repo_id, authed=True)
            for path, data in files.items():
                if self.is_lfs_size(len(data)):
                    oid = hashlib.sha256(data).hexdigest()
                    repo.lfs_objects[oid] = bytes(data)
                    ops.append(("lfsFile", path, (oid, len(data))))
                else:
                    ops.append(("file", path, bytes(data)))
            ops += [("deletedFile", p, b"") for p in delete]
            return self._apply(repo_type, repo_id, branch, message, "", None, ops).oid

    def is_lfs_size(self, size: int) -> bool:
        """Whether preupload answers ``uploadMode: "lfs"`` for a file of ``size`` bytes (never for empty files,
        which huggingface_hub always commits inline)."""
        threshold = self.lfs_threshold
        return threshold is not None and size > 0 and size >= threshold

    def lfs_files(self, repo_id: str, repo_type: str = "model", revision: str = "main") -> dict[str, str]:
        """The files of ``revision`` stored as LFS: path -> sha256 (the rest are regular git blobs)."""
        with self._lock:
            return dict(self._resolve(self._repo(repo_type, repo_id), revision).lfs)

    def lfs_objects(self, repo_id: str, repo_type: str = "model") -> dict[str, bytes]:
        """The LFS objects uploaded to the repo (sha256 -> content), referenced by a commit or not."""
        with self._lock:
            return dict(self._repo(repo_type, repo_id).lfs_objects)

    # -- state -----------------------------------------------------------------------------------

    @staticmethod
    def _check_type(repo_type: str) -> None:
        if repo_type not in REPO_TYPES:
            raise ValueError(f"repo_type must be one of {REPO_TYPES}, not {repo_type!r}")

    def _repo(self, repo_type: str, repo_id: str, authed: bool = False) -> _Repo:
        repo = self._repos.get((repo_type, repo_id))
        if repo is None:
            # The Hub answers 401 to anonymous requests (it cannot tell missing from private) and 404 otherwise.
            raise HubError(404 if authed else 401, "Repository not found", "RepoNotFound")
        return repo

    @staticmethod
    def _resolve(repo: _Repo, revision: str) -> _Commit:
        rev = revision.removeprefix("refs/heads/")
        if rev in repo.branches:
            return repo.commits[repo.branches[rev]]
        if rev in repo.commits:
            return repo.commits[rev]
        raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def _new_commit(self, repo: _Repo, parent: str | None, message: str, description: str,
                    paths: list[str], files: dict[str, bytes], lfs: dict[str, str] | None = None) -> _Commit:
        seed = json.dumps([repo.repo_type, repo.repo_id, parent, message, next(self._counter),
                           sorted((p, git_blob_oid(d), (lfs or {}).get(p)) for p, d in files.items())])
        oid = hashlib.sha1(seed.encode()).hexdigest()
        commit = _Commit(oid, message, description, parent, paths, files, _now(), dict(lfs or {}))
        repo.commits[oid] = commit
        return commit

    def _apply(self, repo_type: str, repo_id: str, revision: str, message: str, description: str,
               parent_commit: str | None, ops: list[tuple[str, str, object]]) -> _Commit:
        """Apply ``ops`` [(kind, path, data)] as one new commit on branch ``revision``, atomically. ``data`` is the
        content for ``file``, ``(sha256, size or None)`` for ``lfsFile`` (an object uploaded to this repo)."""
        with self._lock:
            repo = self._repo(repo_type, repo_id, authed=True)
            branch = revision.removeprefix("refs/heads/")
            if branch not in repo.branches:
                if branch in repo.commits:
                    raise HubError(400, f"Invalid rev id: {revision} is not a branch")
                raise HubError(404, f"Invalid rev id: {revision}", "RevisionNotFound")
            head = repo.commits[repo.branches[branch]]
            if parent_commit is not None and parent_commit != head.oid:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            missing = [path for kind, path, data in ops if kind == "lfsFile" and not self._has_object(repo, data)]
            if missing:  # checked first: nothing is applied
                raise HubError(400, MISSING_LFS_OBJECT.format(paths=", ".join(missing)))
            files, lfs = dict(head.files), dict(head.lfs)
            touched: list[str] = []
            for kind, path, data in ops:
                if kind == "file":
                    files[path] = data  # type: ignore[assignment]
                    lfs.pop(path, None)
                    touched.append(path)
                elif kind == "lfsFile":
                    oid = data[0]  # type: ignore[index]
                    files[path], lfs[path] = repo.lfs_objects[oid], oid
                    touched.append(path)
                elif kind == "deletedFile":
                    if path not in files:
                        raise HubError(404, "A file with this name doesn't exist", "EntryNotFound")
                    del files[path]
                    lfs.pop(path, None)
                    touched.append(path)
                else:  # deletedFolder
                    prefix = path.rstrip("/") + "/"
                    gone = [p for p in files if p.startswith(prefix)]
                    if not gone:
                        raise HubError(404, "A folder with this name doesn't exist", "EntryNotFound")
                    for p in gone:
                        del files[p]
                        lfs.pop(p, None)
                    touched.extend(gone)
            commit = self._new_commit(repo, head.oid, message, description, list(dict.fromkeys(touched)), files, lfs)
            repo.branches[branch] = commit.oid
            return commit

    @staticmethod
    def _has_object(repo: _Repo, ref: object) -> bool:
        oid, size = ref  # type: ignore[misc]
        return oid in repo.lfs_objects and size in (None, len(repo.lfs_objects[oid]))

    def _sign(self, repo: _Repo, oid: str, size: int) -> str:
        """What an upload href carries instead of the token (huggingface_hub sends no Authorization header on the
        PUT, which goes to a presigned storage URL on the real Hub)."""
        message = f"{repo.repo_type}:{repo.repo_id}:{oid}:{size}".encode()
        return hmac.new(self.write_token.encode(), message, hashlib.sha256).hexdigest()

    def _state(self) -> dict:
        with self._lock:
            return {
                "repos": {
                    f"{t}:{rid}": {
                        "branches": dict(repo.branches),
                        "commits": [{"oid": c.oid, "message": c.message, "paths": list(c.paths)}
                                    for c in repo.commits.values()],
                        "files": {p: {"oid": head.blob_oid(p), "size": len(d), "lfs": head.lfs.get(p)}
                                  for p, d in sorted(head.files.items())},
                        "lfs_objects": sorted(repo.lfs_objects),
                    }
                    for (t, rid), repo in self._repos.items()
                    for head in [repo.commits[repo.branches["main"]]]
                },
                "fail_commits": self.fail_commits,
                "lfs_threshold": self.lfs_threshold,
                "requests": [list(r) for r in self.requests],
            }

    def _repo_url(self, repo: _Repo) -> str:
        return f"{self.endpoint}/{URL_PREFIXES[repo.repo_type]}{repo.repo_id}"


def _tree_entries(commit: _Commit, path: str, recursive: bool) -> list[dict]:
    """What GET /api/{type}s/{repo_id}/tree/{rev}/{path} lists, sorted by path."""
    files = commit.files
    prefix = path.strip("/")
    if prefix:
        base = prefix + "/"
        under = [p for p in files if p.startswith(base)]
        if not under:  # a missing folder, or a file: the Hub answers 404 EntryNotFound to both
            raise HubError(404, f"Entry not found: {prefix!r} is not a folder at {commit.oid}", "EntryNotFound")
    else:
        base, under = "", list(files)
    entries: dict[str, dict] = {}
    for p in under:
        parts = p[len(base):].split("/")
        for depth in range(1, len(parts) if recursive else min(2, len(parts))):
            folder = base + "/".join(parts[:depth])
            if folder not in entries:
                inside = sorted(q for q in files if q.startswith(folder + "/"))
                listing = "".join(f"{q[len(folder) + 1:]}\0{commit.blob_oid(q)}\n" for q in inside)
                entries[folder] = {"type": "directory", "oid": hashlib.sha1(listing.encode()).hexdigest(),
                                   "path": folder}
        if recursive or len(parts) == 1:
            entries[p] = {"type": "file", "oid": commit.blob_oid(p), "size": len(files[p]), "path": p}
            if p in commit.lfs:  # as on the Hub: size is the content's, oid the pointer's blob
                entries[p]["lfs"] = {"oid": commit.lfs[p], "size": len(files[p]),
                                     "pointerSize": len(lfs_pointer(files[p]))}
    return [entries[k] for k in sorted(entries)]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, like the Hub (every response carries a Content-Length)
    server_version = "HubStandIn/1.0"
    timeout = 60

    @property
    def hub(self) -> HubStandIn:
        return self.server.hub  # type: ignore[attr-defined]

    def setup(self) -> None:
        super().setup()
        with self.hub._lock:
            self.hub._sockets.add(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            with self.hub._lock:
                self.hub._sockets.discard(self.connection)

    def log_message(self, format, *args) -> None:  # quiet
        pass

    # -- plumbing --------------------------------------------------------------------------------

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None,
              content_type: str = "application/json; charset=utf-8") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD" and body:
            self.wfile.write(body)

    def _json(self, status: int, payload, headers: dict | None = None) -> None:
        self._send(status, json.dumps(payload).encode(), headers)

    def _dispatch(self, method: str) -> None:
        split = urlsplit(self.path)
        self._query = parse_qs(split.query)
        self._body = self._read_body()  # always drain the body, so a kept-alive connection stays in sync
        raw_segments = split.path.split("/")[1:]
        segments = [unquote(s) for s in raw_segments]
        if segments[:1] != ["_standin"]:
            with self.hub._lock:
                self.hub.requests.append((method, unquote(split.path)))
        try:
            self._route(method, segments)
        except HubError as err:
            headers = {"X-Error-Message": err.message, **err.headers}
            if err.code:
                headers["X-Error-Code"] = err.code
            self._json(err.status, {"error": err.message}, headers)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception as err:  # a bug in the stand-in: say so loudly, once (400 is never retried)
            self._json(400, {"error": f"hub stand-in bug: {err!r}"}, {"X-Error-Message": f"stand-in bug: {err!r}"})

    def _route(self, method: str, seg: list[str]) -> None:
        if seg[:1] == ["_standin"]:
            return self._control(method, seg[1:])
        start = 1 if seg[0] in ("datasets", "spaces") else 0
        for at in (start, start + 1):  # {prefix}{repo_id}.git/info/lfs/objects/...: the git-lfs API
            if len(seg) > at + 4 and seg[at].endswith(".git") and seg[at + 1:at + 4] == ["info", "lfs", "objects"]:
                repo_type = PLURALS[seg[0]] if start else "model"
                return self._lfs(method, repo_type, "/".join(seg[start:at] + [seg[at][:-4]]), seg[at + 4:])
        if seg[:1] == ["api"]:
            if seg[1:3] == ["repos", "create"] and method == "POST":
                return self._create_repo()
            if len(seg) >= 3 and seg[1] in PLURALS:
                repo_type = PLURALS[seg[1]]
                repo_id, tail = self._split_repo(repo_type, seg[2:])
                return self._api(method, repo_type, repo_id, tail)
        elif "resolve" in seg[1:4] and method in ("GET", "HEAD"):
            at = seg.index("resolve", 1)
            if at - start in (1, 2) and len(seg) > at + 2:
                repo_type = PLURALS[seg[0]] if start else "model"
                return self._resolve_file(repo_type, "/".join(seg[start:at]), seg[at + 1], "/".join(seg[at + 2:]))
        raise HubError(404, "Not Found")

    def _split_repo(self, repo_type: str, rest: list[str]) -> tuple[str, list[str]]:
        with self.hub._lock:
            known = {rid for (t, rid) in self.hub._repos if t == repo_type}
        if len(rest) >= 2 and (f"{rest[0]}/{rest[1]}" in known or rest[0] not in known and rest[1] not in API_ACTIONS):
            return f"{rest[0]}/{rest[1]}", rest[2:]
        return rest[0], rest[1:]

    def _authed(self) -> bool:
        return self.headers.get("Authorization") is not None

    def _require_write(self) -> None:
        if self.headers.get("Authorization") != f"Bearer {self.hub.write_token}":
            raise HubError(401, INVALID_CREDENTIALS)

    # -- endpoints -------------------------------------------------------------------------------

    def _api(self, method: str, repo_type: str, repo_id: str, tail: list[str]) -> None:
        hub = self.hub
        action = tail[0] if tail else None
        if method == "GET" and action is None:
            return self._repo_info(repo_type, repo_id, "main")
        if method == "GET" and action == "revision" and len(tail) == 2:
            return self._repo_info(repo_type, repo_id, tail[1])
        if method == "GET" and action == "tree" and len(tail) >= 2:
            return self._tree(repo_type, repo_id, tail[1], "/".join(tail[2:]))
        if method == "GET" and action == "commits" and len(tail) == 2:
            with hub._lock:
                commit = hub._resolve(hub._repo(repo_type, repo_id, self._authed()), tail[1])
                repo = hub._repos[(repo_type, repo_id)]
                history = []
                while commit is not None:
                    history.append({"id": commit.oid, "title": commit.message, "message": commit.description,
                                    "authors": [{"user": "standin"}], "date": commit.date})
                    commit = repo.commits.get(commit.parent) if commit.parent else None
            return self._json(200, history)
        if method == "GET" and action == "refs" and len(tail) == 1:
            with hub._lock:
                repo = hub._repo(repo_type, repo_id, self._authed())
                branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": oid}
                            for b, oid in repo.branches.items()]
            return self._json(200, {"branches": branches, "converts": [], "tags": [], "pullRequests": []})
        if method == "POST" and action == "preupload" and len(tail) == 2:
            return self._preupload(repo_type, repo_id, tail[1])
        if method == "POST" and action == "commit" and len(tail) == 2:
            return self._commit(repo_type, repo_id, tail[1])
        if method == "GET" and action in ("xet-read-token", "xet-write-token"):
            # Only reached by a client that took the Xet path on its own (hf_xet installed, HF_HUB_DISABLE_XET
            # unset): nothing here advertises Xet. Say why, instead of a bare 404.
            raise HubError(400, "The hub stand-in does not serve Xet storage: set HF_HUB_DISABLE_XET=1 so that "
                                "huggingface_hub uploads LFS files with the LFS basic transfer")
        raise HubError(404, "Not Found")

    def _repo_info(self, repo_type: str, repo_id: str, revision: str) -> None:
        hub = self.hub
        blobs = self._query.get("blobs", [""])[0].lower() in ("1", "true")
        with hub._lock:
            repo = hub._repo(repo_type, repo_id, self._authed())
            commit = hub._resolve(repo, revision)
            siblings = []
            for path in sorted(commit.files):
                sibling: dict = {"rfilename": path}
                if blobs:
                    sibling.update(size=len(commit.files[path]), blobId=commit.blob_oid(path))
                    if path in commit.lfs:
                        sibling["lfs"] = {"sha256": commit.lfs[path], "size": len(commit.files[path]),
                                          "pointerSize": len(lfs_pointer(commit.files[path]))}
                siblings.append(sibling)
        info = {"_id": hashlib.sha1(f"{repo_type}:{repo_id}".encode()).hexdigest()[:24], "id": repo_id,
                "author": repo_id.split("/")[0] if "/" in repo_id else None, "sha": commit.oid,
                "lastModified": commit.date, "createdAt": repo.created_at, "private": False, "gated": False,
                "disabled": False, "downloads": 0, "likes": 0, "tags": [], "siblings": siblings}
        if repo_type == "model":
            info["modelId"] = repo_id
        self._json(200, info)

    def _tree(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        hub = self.hub
        recursive = self._query.get("recursive", [""])[0].lower() in ("1", "true")
        cursor = self._query.get("cursor", [""])[0]
        with hub._lock:
            repo = hub._repo(repo_type, repo_id, self._authed())
            if cursor:  # "<commit oid>:<offset>": later pages list the commit the first page listed
                oid, _, offset_text = cursor.partition(":")
                commit, offset = hub._resolve(repo, oid), int(offset_text)
            else:
                commit, offset = hub._resolve(repo, revision), 0
            entries = _tree_entries(commit, path, recursive)
        size = max(1, int(hub.tree_page_size))
        page, headers = entries[offset:offset + size], {}
        if offset + size < len(entries):
            query = f"recursive={str(recursive).lower()}&cursor={commit.oid}:{offset + size}"
            url = f"{hub.endpoint}{quote(urlsplit(self.path).path, safe='/%')}?{query}"
            headers["Link"] = f'<{url}>; rel="next"'
        self._json(200, page, headers)

    def _resolve_file(self, repo_type: str, repo_id: str, revision: str, path: str) -> None:
        hub = self.hub
        with hub._lock:
            commit = hub._resolve(hub._repo(repo_type, repo_id, self._authed()), revision)
            data = commit.files.get(path)
            sha256 = commit.lfs.get(path)
        if data is None:
            # The Hub sends the commit along, so huggingface_hub can cache the file's absence.
            raise HubError(404, "Entry not found", "EntryNotFound", {"X-Repo-Commit": commit.oid})
        headers = {"X-Repo-Commit": commit.oid, "ETag": f'"{commit.blob_oid(path)}"', "Accept-Ranges": "bytes"}
        if sha256 is not None:
            # An LFS file: the Hub names the content with X-Linked-Etag (its sha256, which huggingface_hub prefers
            # to ETag and uses as the cached blob's name) and X-Linked-Size. The content itself is served right
            # here, not through a redirect to a CDN or Xet storage.
            headers.update({"X-Linked-Etag": f'"{sha256}"', "X-Linked-Size": str(len(data))})
        status, body = 200, data
        ranges = self.headers.get("Range")
        if ranges:
            start, end = self._parse_range(ranges, len(data))
            if start is None:
                headers["Content-Range"] = f"bytes */{len(data)}"
                return self._send(416, b"", headers)
            status, body = 206, data[start:end + 1]
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self._send(status, body, headers, content_type="application/octet-stream")

    @staticmethod
    def _parse_range(value: str, total: int) -> tuple[int | None, int]:
        unit, _, spec = value.partition("=")
        first, _, last = spec.split(",")[0].strip().partition("-")
        try:
            if unit.strip() != "bytes":
                return None, 0
            if first == "":  # suffix range: the last N bytes
                start, end = max(0, total - int(last)), total - 1
            else:
                start, end = int(first), min(int(last), total - 1) if last else total - 1
        except ValueError:
            return None, 0
        return (start, end) if start <= end and start < total else (None, 0)

    def _preupload(self, repo_type: str, repo_id: str, revision: str) -> None:
        hub = self.hub
        self._require_write()
        if self._query.get("create_pr"):
            raise HubError(400, "The hub stand-in does not support pull requests (create_pr)")
        try:
            files = json.loads(self._body or b"{}")["files"]
        except (ValueError, KeyError, TypeError) as err:
            raise HubError(400, f"Invalid preupload payload: {err}") from err
        with hub._lock:
            commit = hub._resolve(hub._repo(repo_type, repo_id, authed=True), revision)
            answer = []
            for item in files:
                size = item.get("size")
                lfs = isinstance(size, int) and hub.is_lfs_size(size)
                entry = {"path": item["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False}
                if item["path"] in commit.files:  # what huggingface_hub compares to skip unchanged files
                    entry["oid"] = commit.lfs.get(item["path"]) or commit.blob_oid(item["path"])
                answer.append(entry)
        self._json(200, {"files": answer, "commitOid": commit.oid})

    def _commit(self, repo_type: str, repo_id: str, revision: str) -> None:
        hub = self.hub
        self._require_write()
        if self._query.get("create_pr"):
            raise HubError(400, "The hub stand-in does not support pull requests (create_pr)")
        header, ops = self._parse_commit_payload(self._body)
        too_big = [path for kind, path, data in ops if kind == "file" and hub.is_lfs_size(len(data))]  # type: ignore[arg-type]
        if too_big:  # a client that ignored preupload's "lfs" (the Hub has its own size limit on inline files)
            raise HubError(400, f"Your push was rejected because it contains files that must be stored with LFS "
                                f"(lfs_threshold={hub.lfs_threshold} bytes): {', '.join(too_big)}")
        with hub._lock:
            failing = hub.fail_commits > 0
            if failing:
                hub.fail_commits -= 1
        if failing:
            raise HubError(500, "Internal Error - injected by HubStandIn.fail_commits")
        commit = hub._apply(repo_type, repo_id, revision, header["summary"], header.get("description") or "",
                            header.get("parentCommit"), ops)
        url = f"{hub.endpoint}/{URL_PREFIXES[repo_type]}{repo_id}/commit/{commit.oid}"
        self._json(200, {"success": True, "commitOid": commit.oid, "commitUrl": url,
                         "commitMessage": commit.message, "hookOutput": "", "pullRequestUrl": None})

    @staticmethod
    def _parse_commit_payload(body: bytes) -> tuple[dict, list[tuple[str, str, object]]]:
        header: dict | None = None
        ops: list[tuple[str, str, object]] = []
        try:
            for line in body.splitlines():
                if not line.strip():
                    continue
                item = json.loads(line)
                key, value = item["key"], item["value"]
                if key == "header":
                    header = value
                elif key == "file":
                    encoding = value.get("encoding", "utf-8")
                    content = value["content"]
                    data = base64.b64decode(content, validate=True) if encoding == "base64" else content.encode()
                    ops.append(("file", value["path"], data))
                elif key in ("deletedFile", "deletedFolder"):
                    ops.append((key, value["path"], b""))
                elif key == "lfsFile":  # the content is an LFS object uploaded beforehand (batch + PUT)
                    oid, size = value["oid"], value.get("size")
                    if value.get("algo", "sha256") != "sha256" or not _is_sha256(oid):
                        raise HubError(400, f"lfsFile {value['path']!r}: expected algo sha256 and a sha256 oid")
                    if size is not None and (not isinstance(size, int) or size < 0):
                        raise HubError(400, f"lfsFile {value['path']!r}: invalid size {size!r}")
                    ops.append(("lfsFile", value["path"], (oid, size)))
                else:
                    raise HubError(400, f"Unknown commit operation {key!r}")
        except (ValueError, KeyError, TypeError, binascii.Error) as err:
            raise HubError(400, f"Invalid commit payload: {err!r}") from err
        if not header or not header.get("summary"):
            raise HubError(400, "Commit summary is required")
        return header, ops

    # -- git-lfs API (opt-in: reached only once preupload answers uploadMode "lfs") ----------------

    def _lfs(self, method: str, repo_type: str, repo_id: str, tail: list[str]) -> None:
        if method == "POST" and tail == ["batch"]:
            return self._lfs_batch(repo_type, repo_id)
        if method == "POST" and tail == ["verify"]:
            return self._lfs_verify(repo_type, repo_id)
        if method == "PUT" and len(tail) == 1 and _is_sha256(tail[0]):
            return self._lfs_put(repo_type, repo_id, tail[0])
        raise HubError(404, "Not Found")

    def _lfs_json(self, payload) -> None:
        self._send(200, json.dumps(payload).encode(), content_type=LFS_CONTENT_TYPE)

    def _lfs_batch(self, repo_type: str, repo_id: str) -> None:
        """POST {prefix}{repo_id}.git/info/lfs/objects/batch: upload actions for the objects not stored yet."""
        hub = self.hub
        self._require_write()
        try:
            payload = json.loads(self._body or b"{}")
            operation, objects = payload["operation"], payload["objects"]
            transfers = payload.get("transfers") or ["basic"]  # the git-lfs default
            ref = (payload.get("ref") or {}).get("name")
            if not isinstance(objects, list):
                raise TypeError("objects must be a list")
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise HubError(400, f"Invalid LFS batch payload: {err!r}") from err
        if operation != "upload":
            raise HubError(422, f"The hub stand-in's LFS batch API only uploads, not {operation!r}")
        if "basic" not in transfers:  # never "xet" or "multipart": one PUT of the whole object
            raise HubError(422, f"No supported transfer in {transfers!r}: the hub stand-in only offers 'basic'")
        if payload.get("hash_algo", "sha256") != "sha256":
            raise HubError(409, f"Unsupported hash algorithm {payload['hash_algo']!r}")
        base = f"{hub.endpoint}/{URL_PREFIXES[repo_type]}{quote(repo_id)}.git/info/lfs/objects"
        answer = []
        with hub._lock:
            repo = hub._repo(repo_type, repo_id, authed=True)
            if ref is not None:
                hub._resolve(repo, ref)
            for obj in objects:
                oid, size = (obj.get("oid"), obj.get("size")) if isinstance(obj, dict) else (None, None)
                item = {"oid": oid if isinstance(oid, str) else "", "size": size if isinstance(size, int) else 0}
                if not _is_sha256(oid) or not isinstance(size, int) or size < 0:
                    item["error"] = {"code": 422, "message": "Invalid object: expected a sha256 oid and a size"}
                elif oid in repo.lfs_objects:  # already stored: no actions, huggingface_hub skips the upload
                    if len(repo.lfs_objects[oid]) != size:
                        item["error"] = {"code": 422, "message": f"Size mismatch for object {oid}"}
                else:
                    query = f"size={size}&signature={hub._sign(repo, oid, size)}"
                    item.update(authenticated=True, actions={
                        "upload": {"href": f"{base}/{oid}?{query}", "expires_in": 3600},
                        "verify": {"href": f"{base}/verify", "header": {}}})
                answer.append(item)
        self._lfs_json({"transfer": "basic", "objects": answer, "hash_algo": "sha256"})

    def _lfs_put(self, repo_type: str, repo_id: str, oid: str) -> None:
        """PUT of an upload href: the object's bytes, checked against its sha256 (and size) before storing."""
        hub = self.hub
        size_text = self._query.get("size", [""])[0]
        signature = self._query.get("signature", [""])[0]
        with hub._lock:
            repo = hub._repo(repo_type, repo_id, authed=True)
            expected = hub._sign(repo, oid, int(size_text)) if size_text.isdigit() else ""
        signed = bool(expected) and hmac.compare_digest(signature, expected)
        if not signed and self.headers.get("Authorization") != f"Bearer {hub.write_token}":
            raise HubError(403, "Invalid or missing upload signature (use the href of a batch upload action)")
        data = self._body
        if size_text.isdigit() and len(data) != int(size_text):
            raise HubError(400, f"Size mismatch: got {len(data)} bytes, the batch request said {size_text}")
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, f"sha256 mismatch: the uploaded bytes do not hash to {oid}")
        with hub._lock:
            repo.lfs_objects[oid] = data
        self._send(200, b"", {"ETag": f'"{hashlib.md5(data).hexdigest()}"'})

    def _lfs_verify(self, repo_type: str, repo_id: str) -> None:
        """POST {prefix}{repo_id}.git/info/lfs/objects/verify (called after the PUT): is the object stored?"""
        hub = self.hub
        self._require_write()
        try:
            payload = json.loads(self._body or b"{}")
            oid, size = payload["oid"], payload["size"]
        except (ValueError, KeyError, TypeError) as err:
            raise HubError(400, f"Invalid LFS verify payload: {err!r}") from err
        with hub._lock:
            data = hub._repo(repo_type, repo_id, authed=True).lfs_objects.get(oid)
        if data is None:
            raise HubError(404, f"Object {oid} not found")
        if len(data) != size:
            raise HubError(422, f"Size mismatch for object {oid}: stored {len(data)} bytes, not {size}")
        self._lfs_json({"oid": oid, "size": size})

    def _create_repo(self) -> None:
        hub = self.hub
        self._require_write()
        try:
            payload = json.loads(self._body or b"{}")
            name, organization = payload["name"], payload.get("organization")
        except (ValueError, KeyError, TypeError) as err:
            raise HubError(400, f"Invalid payload: {err}") from err
        repo_type = payload.get("type") or "model"
        if repo_type not in REPO_TYPES:
            raise HubError(400, f"Invalid repo type {repo_type!r}")
        repo_id = f"{organization}/{name}" if organization else name
        with hub._lock:
            if (repo_type, repo_id) in hub._repos:
                message = f"You already created this {repo_type} repo"
                return self._json(409, {"error": message, "url": hub._repo_url(hub._repos[(repo_type, repo_id)])},
                                  {"X-Error-Message": message})
            hub.create_repo(repo_id, repo_type)
            url = hub._repo_url(hub._repos[(repo_type, repo_id)])
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _control(self, method: str, seg: list[str]) -> None:
        hub = self.hub
        if method == "GET" and seg == ["state"]:
            return self._json(200, hub._state())
        if method == "POST" and seg == ["fail_commits"]:
            with hub._lock:
                hub.fail_commits = int(json.loads(self._body or b"{}").get("n", 1))
            return self._json(200, {"fail_commits": hub.fail_commits})
        if method == "POST" and seg == ["lfs_threshold"]:
            threshold = json.loads(self._body or b"{}").get("threshold")
            hub.lfs_threshold = None if threshold is None else int(threshold)
            return self._json(200, {"lfs_threshold": hub.lfs_threshold})
        raise HubError(404, "Not Found")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fakes.hub_server", description=__doc__.split("\n")[0])
    parser.add_argument("--port-file", required=True, help="where to write the endpoint URL once serving")
    parser.add_argument("--repo", action="append", default=[], metavar="OWNER/NAME[:TYPE]",
                        help="repo to create (TYPE: model, dataset or space; default model); repeatable")
    parser.add_argument("--write-token", default=DEFAULT_WRITE_TOKEN)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--fail-commits", type=int, default=0)
    parser.add_argument("--lfs-threshold", type=int, default=None, metavar="BYTES",
                        help="files of at least BYTES bytes go through LFS (default: every file is regular)")
    args = parser.parse_args(argv)

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    hub = HubStandIn(write_token=args.write_token, host=args.host, port=args.port, lfs_threshold=args.lfs_threshold)
    for spec in args.repo:
        repo_id, _, repo_type = spec.partition(":")
        hub.create_repo(repo_id, repo_type or "model")
    hub.fail_commits = args.fail_commits
    with hub:
        tmp = f"{args.port_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(hub.endpoint + "\n")
        os.replace(tmp, args.port_file)
        print(hub.endpoint, flush=True)
        while not stop.wait(0.5):
            pass
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
