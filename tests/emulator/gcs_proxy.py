"""An HTTP proxy in front of the GCS emulator that refuses the reads of one object, by
default with the 403 GCS gives an identity lacking `storage.objects.get`.

For processes a test cannot patch: `tpupipe shard` run as a user runs it, and the
forkserver worker processes it reads sources in. They reach it through
`STORAGE_EMULATOR_HOST`; the emulator's own URL in its answers (an object's `mediaLink`)
is rewritten to the proxy's, so downloads come through it too.
"""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

# GCS's own answer to a download the caller may not make.
DENIED_MESSAGE = (
    "reader@test-project.iam.gserviceaccount.com does not have storage.objects.get access "
    "to the Google Cloud Storage object. Permission 'storage.objects.get' denied on "
    "resource (or it may not exist)."
)
_HOP_BY_HOP = {"connection", "content-length", "keep-alive", "transfer-encoding"}


class DenyingProxy:
    """Forwards every request to `upstream`, but answers the downloads (`alt=media`) of
    the object named `deny` with an error of `status`, `reason` and `message`; with
    `metadata`, also the requests for its metadata (`blob.reload`).

    With `hold_others`, any other download waits (up to 30 s) until a refusal was sent:
    the process reading the other objects cannot finish its work before another process
    has met the refusal, and `refused_while_held` says that one did.
    """

    def __init__(
        self,
        upstream: str,
        deny: str,
        status: int = 403,
        reason: str = "forbidden",
        message: str = DENIED_MESSAGE,
        metadata: bool = False,
        hold_others: bool = False,
    ) -> None:
        self.upstream, self.deny, self.hold_others = upstream.rstrip("/"), deny, hold_others
        self.status, self.reason, self.message = status, reason, message
        self.metadata = metadata
        self.refused: list[str] = []  # the path of each request refused
        self.refused_while_held = False
        self._held = 0
        self._lock = threading.Lock()
        self._refusal = threading.Event()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def _forward(self) -> None:
                proxy._handle(self)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

            def log_message(self, *args: object) -> None:
                pass  # the test's output is the CLI's

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> DenyingProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        download = req.command == "GET" and "alt=media" in req.path
        names_it = unquote(urlsplit(req.path).path).endswith(f"/o/{self.deny}")
        if req.command == "GET" and names_it and (download or self.metadata):
            with self._lock:
                self.refused.append(req.path)
                self.refused_while_held |= self._held > 0
            error = {"code": self.status, "message": self.message}
            error["errors"] = [{"reason": self.reason, "message": self.message}]
            self._reply(req, self.status, {"Content-Type": "application/json"}, error)
            self._refusal.set()
            return
        if download and self.hold_others:
            with self._lock:
                self._held += 1
            self._refusal.wait(timeout=30)
            with self._lock:
                self._held -= 1
        length = int(req.headers.get("Content-Length") or 0)
        body = req.rfile.read(length) if length else None
        target = urlsplit(self.upstream)
        conn = http.client.HTTPConnection(target.hostname, target.port, timeout=60)
        try:
            # A download's bytes pass as they are; metadata comes uncompressed, so that
            # the emulator's URL in it can be rewritten.
            dropped = {"host"} if download else {"host", "accept-encoding"}
            headers = {k: v for k, v in req.headers.items() if k.lower() not in dropped}
            conn.request(req.command, req.path, body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            if not download:
                data = data.replace(self.upstream.encode(), self.url.encode())
            self._reply(req, resp.status, dict(resp.getheaders()), data)
        finally:
            conn.close()

    @staticmethod
    def _reply(req: BaseHTTPRequestHandler, status: int, headers: dict, body: object) -> None:
        data = body if isinstance(body, bytes) else json.dumps({"error": body}).encode()
        req.send_response(status)
        for key, value in headers.items():
            if key.lower() not in _HOP_BY_HOP:
                req.send_header(key, value)
        req.send_header("Content-Length", str(len(data)))
        req.end_headers()
        req.wfile.write(data)
