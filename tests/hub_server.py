"""A small Hub-compatible HTTP server for tests: the endpoints that ``huggingface_hub`` uses to create
a repo, commit files and download them, served from memory on 127.0.0.1.

Protocol (see huggingface_hub's ``hf_api.py``, ``_commit_api.py``, ``file_download.py``):

* ``POST /api/repos/create``: ``{"name", "organization"}`` -> ``{"url"}``, 409 if it exists.
* ``POST /api/models/{repo}/preupload/{rev}``: every file gets ``uploadMode: "regular"``, so the
  client puts the contents base64-inline into the commit: no LFS or Xet endpoint is needed.
* ``POST /api/models/{repo}/commit/{rev}``: NDJSON (header, file, deletedFile) -> a new commit.
* ``HEAD``/``GET /{repo}/resolve/{rev}/{path}``: with ``X-Repo-Commit`` and ``ETag``; missing
  files and repos answer 404 with ``X-Error-Code: EntryNotFound`` / ``RepoNotFound``.
* ``POST /api/validate-yaml``: the README's YAML header must parse.
* ``GET /api/models/{repo}[/revision/{rev}]`` and ``/api/models/{repo}/tree/{rev}``: repo info.

Writes need ``Authorization: Bearer <token>`` (the token given to :class:`HubServer`, if any).
Run ``python tests/hub_server.py`` to serve on a free port until interrupted.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

import yaml

REPO = r"(?P<repo>[^/]+/[^/]+)"
REV = r"(?P<rev>[^/]+)"


class _Repo:
    def __init__(self):
        self.commits: list[tuple[str, dict[str, bytes]]] = [(hashlib.sha1(b"init").hexdigest(), {})]

    @property
    def head(self) -> tuple[str, dict[str, bytes]]:
        return self.commits[-1]

    def snapshot(self, rev: str) -> tuple[str, dict[str, bytes]] | None:
        if rev == "main":
            return self.head
        return next((c for c in self.commits if c[0] == rev), None)


class HubServer:
    """An in-memory Hub on ``127.0.0.1``: ``url`` to put in ``HF_ENDPOINT``, ``repos`` to inspect.

    Args:
        token: the only token accepted for writes (any bearer token when ``None``).
    """

    def __init__(self, token: str | None = None):
        self.token = token
        self.repos: dict[str, _Repo] = {}
        self.requests: list[str] = []
        self.lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(self))
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def files(self, repo_id: str) -> dict[str, bytes]:
        """The files at the head of ``repo_id``."""
        return dict(self.repos[repo_id].head[1])


def _make_handler(server: HubServer):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        # -- helpers -------------------------------------------------------------------------
        def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False):
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _json(self, status: int, obj, headers: dict | None = None):
            self._send(status, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})})

        def _error(self, status: int, code: str | None, message: str, head: bool = False):
            headers = {"X-Error-Message": message, "Content-Type": "application/json"}
            if code:
                headers["X-Error-Code"] = code
            self._send(status, json.dumps({"error": message}).encode(), headers, head=head)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _authorised(self) -> bool:
            auth = self.headers.get("Authorization", "")
            ok = auth.startswith("Bearer ") and (server.token is None or auth[7:] == server.token)
            if not ok:
                self._body()
                self._error(401, None, "Invalid credentials in Authorization header")
            return ok

        def _route(self, method: str):
            path = unquote(urlparse(self.path).path)
            with server.lock:
                server.requests.append(f"{method} {path}")
            return path

        # -- GET / HEAD ---------------------------------------------------------------------
        def do_HEAD(self):
            self._get(head=True)

        def do_GET(self):
            self._get(head=False)

        def _get(self, head: bool):
            path = self._route("HEAD" if head else "GET")
            if m := re.fullmatch(rf"/{REPO}/resolve/{REV}/(?P<file>.+)", path):
                return self._resolve(m["repo"], m["rev"], m["file"], head)
            if m := re.fullmatch(rf"/api/models/{REPO}(?:/revision/{REV})?", path):
                return self._info(m["repo"], m["rev"] or "main", head)
            if m := re.fullmatch(rf"/api/models/{REPO}/tree/{REV}(?:/(?P<sub>.*))?", path):
                return self._tree(m["repo"], m["rev"], m["sub"] or "", head)
            self._error(404, None, f"No route for {path}", head=head)

        def _snapshot(self, repo_id: str, rev: str, head: bool):
            repo = server.repos.get(repo_id)
            if repo is None:
                self._error(404, "RepoNotFound", f"Repository {repo_id} not found", head=head)
                return None
            snap = repo.snapshot(rev)
            if snap is None:
                self._error(404, "RevisionNotFound", f"Revision {rev} not found", head=head)
            return snap

        def _resolve(self, repo_id: str, rev: str, file: str, head: bool):
            if (snap := self._snapshot(repo_id, rev, head)) is None:
                return
            sha, files = snap
            if file not in files:
                return self._error(404, "EntryNotFound", f"{file} not found in {repo_id}", head=head)
            data = files[file]
            etag = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            self._send(200, data, {"X-Repo-Commit": sha, "ETag": f'"{etag}"',
                                   "Content-Type": "application/octet-stream"}, head=head)

        def _info(self, repo_id: str, rev: str, head: bool):
            if (snap := self._snapshot(repo_id, rev, head)) is None:
                return
            sha, files = snap
            self._json(200, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": False,
                             "siblings": [{"rfilename": f} for f in sorted(files)], "tags": []})

        def _tree(self, repo_id: str, rev: str, sub: str, head: bool):
            if (snap := self._snapshot(repo_id, rev, head)) is None:
                return
            _, files = snap
            items = [{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                     for f, d in sorted(files.items()) if f.startswith(sub)]
            self._json(200, items)

        # -- POST ---------------------------------------------------------------------------
        def do_POST(self):
            path = self._route("POST")
            if path == "/api/repos/create":
                return self._create()
            if path == "/api/validate-yaml":
                return self._validate_yaml()
            if m := re.fullmatch(rf"/api/models/{REPO}/preupload/{REV}", path):
                return self._preupload(m["repo"])
            if m := re.fullmatch(rf"/api/models/{REPO}/commit/{REV}", path):
                return self._commit(m["repo"], m["rev"])
            self._body()
            self._error(404, None, f"No route for {path}")

        def _create(self):
            if not self._authorised():
                return
            payload = json.loads(self._body() or b"{}")
            if payload.get("type", "model") != "model":
                return self._error(400, None, "This test server only holds model repos")
            repo_id = f"{payload.get('organization') or 'user'}/{payload['name']}"
            url = f"{server.url}/{repo_id}"
            with server.lock:
                if repo_id in server.repos:
                    return self._json(409, {"error": "You already created this model repo", "url": url})
                server.repos[repo_id] = _Repo()
            self._json(200, {"url": url, "name": repo_id})

        def _validate_yaml(self):
            """The README's YAML header must parse to a mapping (the real Hub checks much more)."""
            content = json.loads(self._body() or b"{}").get("content", "")
            match = re.match(r"^---\n(.*?)\n---", content, re.S)
            try:
                meta = yaml.safe_load(match[1]) if match else {}
            except yaml.YAMLError as e:
                return self._json(400, {"errors": [{"message": f"invalid YAML: {e}"}]})
            if not isinstance(meta, dict):
                return self._json(400, {"errors": [{"message": "the YAML header is not a mapping"}]})
            self._json(200, {"errors": [], "warnings": []})

        def _preupload(self, repo_id: str):
            if not self._authorised():
                return
            payload = json.loads(self._body() or b"{}")
            if repo_id not in server.repos:
                return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            files = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None}
                     for f in payload.get("files", [])]
            self._json(200, {"files": files, "commitOid": server.repos[repo_id].head[0]})

        def _commit(self, repo_id: str, rev: str):
            if not self._authorised():
                return
            lines = [json.loads(line) for line in self._body().splitlines() if line.strip()]
            repo = server.repos.get(repo_id)
            if repo is None:
                return self._error(404, "RepoNotFound", f"Repository {repo_id} not found")
            if rev != "main":
                return self._error(400, None, "This test server only commits to main")
            with server.lock:
                files = dict(repo.head[1])
                summary = ""
                for item in lines:
                    key, value = item["key"], item["value"]
                    if key == "header":
                        summary = value.get("summary", "")
                    elif key == "file":
                        files[value["path"]] = base64.b64decode(value["content"])
                    elif key == "deletedFile":
                        files.pop(value["path"], None)
                    elif key == "deletedFolder":
                        files = {p: d for p, d in files.items() if not p.startswith(value["path"].rstrip("/") + "/")}
                    else:
                        return self._error(400, None, f"Unsupported commit operation {key!r} (only regular files)")
                sha = hashlib.sha1(f"{repo.head[0]}{summary}{sorted(files)}{len(repo.commits)}".encode()).hexdigest()
                repo.commits.append((sha, files))
            self._json(200, {"commitUrl": f"{server.url}/{repo_id}/commit/{sha}", "commitOid": sha, "success": True})

    return Handler


if __name__ == "__main__":
    import time

    with HubServer() as hub:
        print(f"Serving a test Hub at {hub.url} (HF_ENDPOINT={hub.url})", flush=True)
        while True:
            time.sleep(3600)
