"""An in-memory Hugging Face Hub on 127.0.0.1 for tests: enough of the HTTP API for `push_to_hub` and
`from_pretrained` with the real `huggingface_hub` client.

Point the client at it with the environment of `FakeHub.client_env(...)` (HF_ENDPOINT, HF_HUB_DISABLE_XET=1, a
private HF_HOME / cache, a dummy token) in a fresh interpreter: huggingface_hub reads those variables at import.

Endpoints (the ones huggingface_hub 1.x/2.x calls for create_repo / create_commit / hf_hub_download):
    POST /api/repos/create                             {"name", "organization"} -> {"url"}; 409 if it exists
    POST /api/validate-yaml                            README.md front matter must be a YAML mapping
    GET  /api/models/{repo}[/revision/{rev}]           model_info / repo_info (sha, siblings)
    GET  /api/models/{repo}/tree/{rev}[/{path}]        list_repo_tree (the tokenizer looks for chat templates)
    POST /api/models/{repo}/preupload/{rev}            upload mode per file ("lfs" by .gitattributes or size)
    POST /{repo}.git/info/lfs/objects/batch            LFS batch API, "basic" transfer
    PUT  /lfs-upload/{sha256}                          the LFS object (its sha256 is checked)
    POST /api/models/{repo}/commit/{rev}               NDJSON commit: header, file (base64), lfsFile
    HEAD/GET /{repo}/resolve/{rev}/{path}              ETag, X-Repo-Commit, Content-Length (+ X-Linked-* for LFS)
Writes need an `Authorization: Bearer ...` header, as on the Hub. Errors carry the X-Error-Code header the
client maps to RepositoryNotFoundError / RevisionNotFoundError / EntryNotFoundError. Every request is logged in
`FakeHub.requests`; a request no route handles is also logged in `FakeHub.unhandled` and answered 404.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, unquote, urlsplit

import yaml

NAMESPACE = "hf-tiny-tester"  # the user the token belongs to: the namespace of a repo id given without one
# What a new Hub repo starts with: the LFS patterns decide the upload mode of each file.
GITATTRIBUTES = (
    "*.safetensors filter=lfs diff=lfs merge=lfs -text\n"
    "*.bin filter=lfs diff=lfs merge=lfs -text\n"
    "*.pt filter=lfs diff=lfs merge=lfs -text\n"
    "*.gguf filter=lfs diff=lfs merge=lfs -text\n"
    "*.model filter=lfs diff=lfs merge=lfs -text\n"
)
LFS_SIZE_THRESHOLD = 10 * 1024 * 1024  # the Hub stores any file above 10 MB in LFS


def git_blob_oid(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


@dataclass(frozen=True)
class StoredFile:
    size: int
    content: bytes | None = None  # regular (git) file
    lfs_sha256: str | None = None  # LFS file: content lives in FakeHub.lfs_objects

    @property
    def oid(self) -> str:
        """The git blob id (of the pointer, for LFS files), as the Hub reports it."""
        if self.lfs_sha256 is not None:
            return git_blob_oid(lfs_pointer(self.lfs_sha256, self.size))
        return git_blob_oid(self.content)


@dataclass
class Repo:
    repo_id: str
    commits: dict[str, dict[str, StoredFile]] = field(default_factory=dict)
    branches: dict[str, str] = field(default_factory=dict)
    commit_messages: dict[str, str] = field(default_factory=dict)

    def resolve(self, revision: str) -> str | None:
        if revision in self.branches:
            return self.branches[revision]
        return revision if revision in self.commits else None


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit


class FakeHub:
    """The Hub state (repos, commits, LFS objects) plus the HTTP server that serves it from a thread."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, bytes] = {}
        self.requests: list[tuple[str, str]] = []
        self.unhandled: list[tuple[str, str]] = []
        self.lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> str:
        hub = self

        class Handler(_HubRequestHandler):
            fake_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)  # port 0: a free port, loopback only
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-hub", daemon=True)
        self._thread.start()
        return self.url

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=10)
            self._server = None

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def client_env(self, home: str) -> dict[str, str]:
        """Environment variables that point huggingface_hub / transformers at this server, with caches in `home`."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HUB_DISABLE_XET": "1",  # no xet against a non-HF server: plain LFS uploads
            "HF_HOME": f"{home}/hf_home",
            "HF_HUB_CACHE": f"{home}/hf_home/hub",
            "HF_MODULES_CACHE": f"{home}/hf_home/modules",
            "HF_TOKEN": "hf_dummy_token_for_the_fake_hub",
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }

    # ------------------------------------------------------------------ inspection helpers for tests
    def files(self, repo_id: str, revision: str = "main") -> dict[str, StoredFile]:
        repo = self.repos[repo_id]
        return dict(repo.commits[repo.resolve(revision)])

    def read(self, repo_id: str, path: str, revision: str = "main") -> bytes:
        stored = self.files(repo_id, revision)[path]
        return self.lfs_objects[stored.lfs_sha256] if stored.lfs_sha256 is not None else stored.content

    # ------------------------------------------------------------------ repo operations
    def create_repo(self, repo_id: str) -> Repo:
        with self.lock:
            if repo_id in self.repos:
                raise HubError(409, f"You already created this model repo: {repo_id}")
            repo = Repo(repo_id)
            files = {".gitattributes": StoredFile(size=len(GITATTRIBUTES), content=GITATTRIBUTES.encode())}
            oid = self._new_commit_oid(repo_id, None, files, "initial commit")
            repo.commits[oid], repo.branches["main"], repo.commit_messages[oid] = files, oid, "initial commit"
            self.repos[repo_id] = repo
            return repo

    def repo(self, repo_id: str) -> Repo:
        if repo_id not in self.repos:
            raise HubError(404, f"Repository {repo_id} not found", code="RepoNotFound")
        return self.repos[repo_id]

    def snapshot(self, repo_id: str, revision: str) -> tuple[str, dict[str, StoredFile]]:
        repo = self.repo(repo_id)
        oid = repo.resolve(revision)
        if oid is None:
            raise HubError(404, f"Invalid rev id: {revision}", code="RevisionNotFound")
        return oid, repo.commits[oid]

    def commit(self, repo_id: str, revision: str, lines: list[dict]) -> str:
        with self.lock:
            repo = self.repo(repo_id)
            if revision not in repo.branches:
                raise HubError(404, f"Invalid rev id: {revision} is not a branch", code="RevisionNotFound")
            if not lines or lines[0].get("key") != "header":
                raise HubError(400, "commit payload must start with a 'header' line")
            header = lines[0]["value"]
            if not header.get("summary"):
                raise HubError(400, "commit header needs a non-empty 'summary'")
            parent = repo.branches[revision]
            if header.get("parentCommit") not in (None, parent):
                raise HubError(412, f"parentCommit {header['parentCommit']} is not the head of {revision}")
            files = dict(repo.commits[parent])
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                path = value.get("path", "")
                if not path or path.startswith("/") or ".." in path.split("/"):
                    raise HubError(400, f"invalid path in commit: {path!r}")
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise HubError(400, f"{path}: only base64 file content is supported")
                    data = base64.b64decode(value["content"])
                    files[path] = StoredFile(size=len(data), content=data)
                elif key == "lfsFile":
                    sha = value.get("oid")
                    if sha not in self.lfs_objects:
                        raise HubError(422, f"{path}: LFS object {sha} was never uploaded")
                    files[path] = StoredFile(size=len(self.lfs_objects[sha]), lfs_sha256=sha)
                else:
                    raise HubError(400, f"unsupported commit operation {key!r}")
            oid = self._new_commit_oid(repo_id, parent, files, header["summary"])
            repo.commits[oid], repo.branches[revision], repo.commit_messages[oid] = files, oid, header["summary"]
            return oid

    @staticmethod
    def _new_commit_oid(repo_id: str, parent: str | None, files: dict[str, StoredFile], message: str) -> str:
        digest = hashlib.sha1(f"{repo_id}\n{parent}\n{message}\n".encode())
        for path in sorted(files):
            digest.update(f"{path} {files[path].oid}\n".encode())
        return digest.hexdigest()

    def upload_mode(self, files: dict[str, StoredFile], path: str, size: int) -> str:
        attributes = files.get(".gitattributes")
        patterns = []
        if attributes is not None and attributes.content is not None:
            patterns = [line.split()[0] for line in attributes.content.decode().splitlines() if "filter=lfs" in line]
        name = path.rsplit("/", 1)[-1]
        if size > LFS_SIZE_THRESHOLD or any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
            return "lfs"
        return "regular"


def _validate_card_yaml(content: str) -> list[str]:
    """The Hub rejects a README.md whose front matter is not a YAML mapping."""
    if not content.startswith("---"):
        return []
    match = re.match(r"^---\s*\n(.*?)\n---\s*(\n|$)", content, re.DOTALL)
    if match is None:
        return ["README.md front matter is not closed by a '---' line"]
    try:
        data = yaml.safe_load(match.group(1))
    except yaml.YAMLError as error:
        return [f"README.md front matter is not valid YAML: {error}"]
    if data is not None and not isinstance(data, dict):
        return ["README.md front matter must be a YAML mapping"]
    return []


_REPO = r"(?P<repo>[^/]+/[^/]+)"
_REV = r"(?P<rev>[^/]+)"


class _HubRequestHandler(BaseHTTPRequestHandler):
    fake_hub: FakeHub
    protocol_version = "HTTP/1.1"

    # The route table: (method, regex, handler name); HEAD is served by the GET handlers without a body.
    ROUTES: ClassVar[list[tuple[str, str, str]]] = [
        ("POST", r"/api/repos/create", "create_repo"),
        ("POST", r"/api/validate-yaml", "validate_yaml"),
        ("GET", rf"/api/models/{_REPO}", "model_info"),
        ("GET", rf"/api/models/{_REPO}/revision/{_REV}", "model_info"),
        ("GET", rf"/api/models/{_REPO}/tree/{_REV}(?:/(?P<path>.*))?", "tree"),
        ("POST", rf"/api/models/{_REPO}/preupload/{_REV}", "preupload"),
        ("POST", rf"/{_REPO}\.git/info/lfs/objects/batch", "lfs_batch"),
        ("PUT", r"/lfs-upload/(?P<sha>[0-9a-f]{64})", "lfs_upload"),
        ("POST", rf"/api/models/{_REPO}/commit/{_REV}", "commit"),
        ("GET", rf"/{_REPO}/resolve/{_REV}/(?P<path>.+)", "resolve"),
    ]

    def log_message(self, format, *args):  # keep pytest output clean
        pass

    # ------------------------------------------------------------------ dispatch
    def do_GET(self):
        self._dispatch("GET")

    def do_HEAD(self):
        self._dispatch("HEAD")

    def do_POST(self):
        self._dispatch("POST")

    def do_PUT(self):
        self._dispatch("PUT")

    def _dispatch(self, method: str) -> None:
        hub = self.fake_hub
        split = urlsplit(self.path)
        path, self.query = split.path, parse_qs(split.query)
        hub.requests.append((method, self.path))
        body = self._read_body()
        route_method = "GET" if method == "HEAD" else method
        for candidate_method, pattern, name in self.ROUTES:
            match = re.fullmatch(pattern, path)
            if candidate_method == route_method and match:
                params = {k: unquote(v) if v is not None else None for k, v in match.groupdict().items()}
                try:
                    getattr(self, f"handle_{name}")(body=body, head=method == "HEAD", **params)
                except HubError as error:
                    self._send_error(error, head=method == "HEAD")
                return
        hub.unhandled.append((method, self.path))
        self._send_error(HubError(404, f"fake hub: no route for {method} {path}"), head=method == "HEAD")

    def _read_body(self) -> bytes:
        # huggingface_hub sends every body (JSON, NDJSON, LFS objects) with a Content-Length
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _require_token(self) -> None:
        if not self.headers.get("Authorization", "").startswith("Bearer "):
            raise HubError(401, "Invalid credentials in Authorization header")

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, head: bool = False) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, str(value))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head and body:
            self.wfile.write(body)

    def _send_json(self, payload, status: int = 200, head: bool = False) -> None:
        self._send(status, json.dumps(payload).encode(), {"Content-Type": "application/json"}, head=head)

    def _send_error(self, error: HubError, head: bool = False) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": error.message}
        if error.code:
            headers["X-Error-Code"] = error.code
        if error.commit:
            headers["X-Repo-Commit"] = error.commit
        self._send(error.status, json.dumps({"error": error.message}).encode(), headers, head=head)

    def _json_body(self, body: bytes):
        try:
            return json.loads(body or b"{}")
        except json.JSONDecodeError as error:
            raise HubError(400, f"request body is not JSON: {error}") from error

    # ------------------------------------------------------------------ handlers
    def handle_create_repo(self, body, head):
        self._require_token()
        payload = self._json_body(body)
        if payload.get("type", "model") != "model":
            raise HubError(400, f"fake hub: only model repos, got type={payload.get('type')!r}")
        name = payload.get("name") or ""
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise HubError(400, f"Invalid repo name: {name!r}")
        repo_id = f"{payload.get('organization') or NAMESPACE}/{name}"
        try:
            self.fake_hub.create_repo(repo_id)
        except HubError as error:
            self._send_json({"error": error.message, "url": f"{self.fake_hub.url}/{repo_id}"}, status=409)
            return
        self._send_json({"url": f"{self.fake_hub.url}/{repo_id}", "name": repo_id, "id": repo_id}, head=head)

    def handle_validate_yaml(self, body, head):
        errors = _validate_card_yaml(self._json_body(body).get("content", ""))
        payload = {"errors": [{"message": e} for e in errors], "warnings": []}
        self._send_json(payload, status=400 if errors else 200, head=head)

    def handle_model_info(self, body, head, repo, rev=None):
        oid, files = self.fake_hub.snapshot(repo, rev or "main")
        self._send_json(
            {
                "id": repo,
                "modelId": repo,
                "author": repo.split("/")[0],
                "sha": oid,
                "private": False,
                "disabled": False,
                "gated": False,
                "tags": [],
                "library_name": "transformers",
                "siblings": [{"rfilename": path} for path in sorted(files)],
            },
            head=head,
        )

    def _entry(self, path: str, stored: StoredFile) -> dict:
        entry = {"type": "file", "path": path, "size": stored.size, "oid": stored.oid}
        if stored.lfs_sha256 is not None:
            pointer_size = len(lfs_pointer(stored.lfs_sha256, stored.size))
            entry["lfs"] = {"oid": stored.lfs_sha256, "size": stored.size, "pointerSize": pointer_size}
        return entry

    def handle_tree(self, body, head, repo, rev, path=None):
        _, files = self.fake_hub.snapshot(repo, rev)
        prefix = (path or "").strip("/")
        recursive = self.query.get("recursive", ["false"])[0].lower() in ("1", "true")
        entries, folders = [], set()
        for file_path in sorted(files):
            if prefix and not file_path.startswith(prefix + "/"):
                continue
            rest = file_path[len(prefix) + 1 :] if prefix else file_path
            if "/" in rest and not recursive:
                folder = (prefix + "/" if prefix else "") + rest.split("/")[0]
                if folder not in folders:
                    folders.add(folder)
                    oid = hashlib.sha1(folder.encode()).hexdigest()
                    entries.append({"type": "directory", "path": folder, "oid": oid, "size": 0})
                continue
            entries.append(self._entry(file_path, files[file_path]))
        if prefix and not entries and prefix not in files:
            raise HubError(404, f"{prefix} does not exist on {rev}", code="EntryNotFound")
        self._send_json(entries, head=head)

    def handle_preupload(self, body, head, repo, rev):
        self._require_token()
        _, files = self.fake_hub.snapshot(repo, rev)
        answer = []
        for item in self._json_body(body).get("files", []):
            mode = self.fake_hub.upload_mode(files, item["path"], int(item["size"]))
            stored = files.get(item["path"])
            remote_oid = None
            if stored is not None:  # the oid the client compares with its local one to skip unchanged files
                remote_oid = stored.lfs_sha256 if stored.lfs_sha256 is not None else stored.oid
            answer.append({"path": item["path"], "uploadMode": mode, "shouldIgnore": False, "oid": remote_oid})
        self._send_json({"files": answer, "commitOid": self.fake_hub.repos[repo].resolve(rev)}, head=head)

    def handle_lfs_batch(self, body, head, repo):
        self._require_token()
        self.fake_hub.repo(repo)
        payload = self._json_body(body)
        if payload.get("operation") != "upload":
            raise HubError(400, f"fake hub: LFS batch supports only 'upload', got {payload.get('operation')!r}")
        objects = []
        for obj in payload.get("objects", []):
            entry = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in self.fake_hub.lfs_objects:
                entry["actions"] = {"upload": {"href": f"{self.fake_hub.url}/lfs-upload/{obj['oid']}"}}
            objects.append(entry)
        body = json.dumps({"transfer": "basic", "objects": objects}).encode()
        self._send(200, body, {"Content-Type": "application/vnd.git-lfs+json"}, head=head)

    def handle_lfs_upload(self, body, head, sha):
        actual = hashlib.sha256(body).hexdigest()
        if actual != sha:
            raise HubError(400, f"LFS object content has sha256 {actual}, expected {sha}")
        with self.fake_hub.lock:
            self.fake_hub.lfs_objects[sha] = body
        self._send(200, head=head)

    def handle_commit(self, body, head, repo, rev):
        self._require_token()
        try:
            lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
        except json.JSONDecodeError as error:
            raise HubError(400, f"commit body is not NDJSON: {error}") from error
        oid = self.fake_hub.commit(repo, rev, lines)
        self._send_json(
            {
                "success": True,
                "commitOid": oid,
                "commitUrl": f"{self.fake_hub.url}/{repo}/commit/{oid}",
                "pullRequestUrl": None,
            },
            head=head,
        )

    def handle_resolve(self, body, head, repo, rev, path):
        oid, files = self.fake_hub.snapshot(repo, rev)
        if path not in files:
            raise HubError(404, f"Entry not found: {path}", code="EntryNotFound", commit=oid)
        stored = files[path]
        headers = {"X-Repo-Commit": oid, "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}
        if stored.lfs_sha256 is not None:
            data = self.fake_hub.lfs_objects[stored.lfs_sha256]
            headers["ETag"] = f'"{stored.oid}"'  # git id of the LFS pointer; the client keys its cache on X-Linked-Etag
            headers.update({"X-Linked-Etag": f'"{stored.lfs_sha256}"', "X-Linked-Size": stored.size})
        else:
            data = stored.content
            headers["ETag"] = f'"{stored.oid}"'
        self._send(200, data, headers, head=head)

