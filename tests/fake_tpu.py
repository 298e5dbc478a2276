"""A small fake of the Cloud TPU v2 REST API, for the real `TpuClient` to talk to.

It keeps nodes, queued resources and long-running operations in memory and is scripted
by the test: creates that fail with quota or capacity errors, nodes that take a few polls
to become READY, spot requests that stay WAITING_FOR_RESOURCES, preemption on demand.
It also serves each fake VM's instance metadata under `/vm/{zone}/{node}/{worker}/`, so
the launcher can run unchanged on this machine (`GCE_METADATA_HOST` points there).

Only loopback, on a free port chosen at start.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

_STATUS = {
    403: "PERMISSION_DENIED",
    404: "NOT_FOUND",
    409: "ALREADY_EXISTS",
    429: "RESOURCE_EXHAUSTED",
    400: "FAILED_PRECONDITION",
    500: "INTERNAL",
    503: "UNAVAILABLE",
}
RESET = 0  # a fault "code": the connection is closed without an answer
_NODE_TYPE = "type.googleapis.com/google.cloud.tpu.v2.Node"
_QR_TYPE = "type.googleapis.com/google.cloud.tpu.v2.QueuedResource"
_EMPTY_TYPE = "type.googleapis.com/google.protobuf.Empty"
_ROUTE = re.compile(
    r"^/v2/projects/(?P<project>[^/]+)/locations/(?P<zone>[^/]+)"
    r"(?:/(?P<kind>nodes|queuedResources|operations)(?:/(?P<id>[^/:]+))?)?$"
)
_METADATA = re.compile(
    r"^/vm/(?P<zone>[^/]+)/(?P<node>[^/]+)/(?P<worker>\d+)"
    r"/computeMetadata/v1/instance/attributes/(?P<key>[^/]+)$"
)


# What the real API accepts (RFC 1035 names; GCP's label rules): the fake refuses the rest
# with INVALID_ARGUMENT, so a name or label the pipeline builds wrongly fails here as it
# would in the cloud, instead of after sharding and upload there.
_RESOURCE_ID = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_KEY = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
_LABEL_VALUE = re.compile(r"^[a-z0-9_-]{0,63}$")


class ApiError(Exception):
    def __init__(self, code: int, message: str, status: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.status = code, message, status


def check_create(kind: str, resource_id: str, node: dict) -> None:
    """Refuse an id or a node's labels that the real API would (400 INVALID_ARGUMENT)."""
    for what, value in ((kind, resource_id), ("node", node.get("_node_id", resource_id))):
        if not isinstance(value, str) or not _RESOURCE_ID.match(value):
            raise ApiError(400, f"invalid {what} id {value!r}", "INVALID_ARGUMENT")
    labels = node.get("labels", {})
    if len(labels) > 64:
        raise ApiError(400, f"{len(labels)} labels: at most 64", "INVALID_ARGUMENT")
    for key, value in labels.items():
        if not _LABEL_KEY.match(key) or not _LABEL_VALUE.match(str(value)):
            raise ApiError(400, f"invalid label {key}={value!r}", "INVALID_ARGUMENT")


class FakeTpuApi:
    """In-memory TPU API. Script it through the attributes documented below.

    Attributes:
        create_errors: per zone, errors the next creates fail with, in order; each is
            (http_code, message) for the create call itself, or ("op", grpc_code, message)
            for the long-running operation (8 = RESOURCE_EXHAUSTED, as for capacity), or
            ("lost",): the node is created but the client gets a 503 (a lost response).
        deny: every TPU call answers 403 PERMISSION_DENIED.
        creating_polls: GETs a new node answers CREATING before it turns READY.
        op_polls: polls an operation answers `done: false` before it is done.
        spot_waits: queued resources stay WAITING_FOR_RESOURCES.
        on_ready / on_gone: hooks called with (zone, node_id, node) when a node becomes
            READY / is deleted or preempted (the pipeline test starts and stops "VMs").
        faults: (method, path suffix, http_code) answered once each, in order, by the
            first request that matches, before anything else happens (a transient 503 on
            a GET of an operation, a 429 on a delete, …); code RESET (0) hangs up instead.
        hold_creates: when set to an Event, a create request waits for it before it is
            carried out (a request still in flight); `create_arrived` is set on its arrival.
        calls: (method, path) of every request; creates: node ids created, in order.
    """

    def __init__(self) -> None:
        self.nodes: dict[tuple[str, str], dict[str, Any]] = {}
        self.queued: dict[tuple[str, str], dict[str, Any]] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.create_errors: dict[str, list[tuple]] = {}
        self.deny = False
        self.faults: list[tuple[str, str, int]] = []
        self.creating_polls = 1
        self.op_polls = 1
        self.spot_waits = False
        self.on_ready: Callable[[str, str, dict], None] | None = None
        self.on_gone: Callable[[str, str, dict], None] | None = None
        self.calls: list[tuple[str, str]] = []
        self.hold_creates: threading.Event | None = None
        self.create_arrived = threading.Event()
        self.creates: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None

    # -- control -----------------------------------------------------------------------

    def start(self) -> str:
        """Serve on 127.0.0.1 at a free port; returns `host:port`."""
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _serve(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"{}") if length else {}
                code, payload = api.handle(method, self.path, body)
                if code == RESET:  # hang up without an answer, as a reset connection does
                    self.close_connection = True
                    return
                data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up waiting (interrupted): the work is done anyway

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

            def do_DELETE(self) -> None:
                self._serve("DELETE")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        return f"127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def preempt(self, zone: str, node_id: str) -> None:
        """The node is PREEMPTED, as a spot VM reclaimed by Google: its VMs stop."""
        with self._lock:
            node = self.nodes[(zone, node_id)]
            node["state"] = "PREEMPTED"
        if self.on_gone:
            self.on_gone(zone, node_id, node)

    def reclaim(self, zone: str, qr_id: str, state: str = "SUSPENDED") -> None:
        """Spot capacity taken back through its queued resource: the request turns
        SUSPENDING or SUSPENDED ("the resources ... have been deleted") and its node goes."""
        with self._lock:
            self.queued[(zone, qr_id)]["state"] = {"state": state}
            node = self.nodes.pop((zone, qr_id), None)
        if node is not None and self.on_gone:
            self.on_gone(zone, qr_id, node)

    # -- request handling --------------------------------------------------------------

    def handle(self, method: str, raw_path: str, body: dict) -> tuple[int, Any]:
        url = urlsplit(raw_path)
        query = {k: v[0] for k, v in parse_qs(url.query).items()}
        with self._lock:
            self.calls.append((method, url.path))
        meta = _METADATA.match(url.path)
        if meta:
            return self._metadata(**meta.groupdict())
        route = _ROUTE.match(url.path)
        try:
            if route is None:
                raise ApiError(404, f"no route {url.path}")
            self._inject_fault(method, url.path)
            if self.deny:
                raise ApiError(403, "Permission 'tpu.nodes.create' denied on resource")
            if method == "POST" and self.hold_creates is not None:
                self.create_arrived.set()
                self.hold_creates.wait(60)  # outside the lock: reads go on meanwhile
            with self._lock:
                return 200, self._dispatch(method, route.groupdict(), query, body)
        except ApiError as e:
            status = e.status or _STATUS.get(e.code, "UNKNOWN")
            return e.code, {"error": {"code": e.code, "message": e.message, "status": status}}

    def _inject_fault(self, method: str, path: str) -> None:
        with self._lock:
            for i, (m, suffix, code) in enumerate(self.faults):
                if m == method and path.endswith(suffix):
                    del self.faults[i]
                    raise ApiError(code, f"injected {code} on {method} {path}")

    def _dispatch(self, method: str, r: dict, query: dict, body: dict) -> Any:
        zone, kind, rid = r["zone"], r["kind"], r["id"]
        parent = f"projects/{r['project']}/locations/{zone}"
        if kind == "operations" and method == "GET":
            return self._poll_op(f"{parent}/operations/{rid}")
        if kind == "nodes":
            if method == "POST":
                check_create("node", query["nodeId"], body)
                return self._create_node(parent, zone, query["nodeId"], body)
            if method == "GET" and rid is None:
                return {"nodes": [self._node_view(z, n) for (z, n) in self.nodes if z == zone]}
            if (zone, rid) not in self.nodes:
                raise ApiError(404, f"node {rid} not found")
            if method == "GET":
                return self._node_view(zone, rid)
            return self._delete_node(parent, zone, rid)
        if kind == "queuedResources":
            if method == "POST":
                spec = body.get("tpu", {}).get("nodeSpec", [{}])[0]
                node = {**spec.get("node", {}), "_node_id": spec.get("nodeId")}
                check_create("queued resource", query["queuedResourceId"], node)
                return self._create_qr(parent, zone, query["queuedResourceId"], body)
            if method == "GET" and rid is None:
                return {
                    "queuedResources": [self._qr_view(z, q) for (z, q) in self.queued if z == zone]
                }
            if (zone, rid) not in self.queued:
                raise ApiError(404, f"queued resource {rid} not found")
            if method == "GET":
                return self._qr_view(zone, rid)
            if (zone, rid) in self.nodes and query.get("force") != "true":
                raise ApiError(400, "queued resource has a node; use force")
            del self.queued[(zone, rid)]
            if (zone, rid) in self.nodes:
                self._delete_node(parent, zone, rid)
            return self._new_op(parent, {"@type": _EMPTY_TYPE})
        raise ApiError(404, "unsupported")

    def _next_error(self, zone: str) -> tuple | None:
        errors = self.create_errors.get(zone)
        return errors.pop(0) if errors else None

    def _create_node(self, parent: str, zone: str, node_id: str, body: dict) -> dict:
        error = self._next_error(zone)
        if error and error[0] == "lost":  # the node is created, but the answer is lost
            self._add_node(parent, zone, node_id, body)
            raise ApiError(503, "backend unavailable")
        if error and error[0] != "op":
            raise ApiError(error[0], error[1])
        if (zone, node_id) in self.nodes:
            raise ApiError(409, f"node {node_id} already exists")
        if error:  # the operation fails: no node is left behind, as with the real API
            return self._new_op(parent, None, error={"code": error[1], "message": error[2]})
        self._add_node(parent, zone, node_id, body)
        return self._new_op(parent, {"@type": _NODE_TYPE, **self._node_view(zone, node_id)})

    def _add_node(self, parent: str, zone: str, node_id: str, body: dict) -> None:
        self.creates[node_id] += 1
        self.nodes[(zone, node_id)] = {
            **body,
            "name": f"{parent}/nodes/{node_id}",
            "state": "CREATING",
            "_polls": 0,
            "networkEndpoints": [
                {"ipAddress": "127.0.0.1"}
                for _ in range(int(body.get("metadata", {}).get("tpupipe-hosts", "1")))
            ],
        }

    def _delete_node(self, parent: str, zone: str, node_id: str) -> dict:
        node = self.nodes.pop((zone, node_id))
        if self.on_gone and node["state"] != "PREEMPTED":
            self.on_gone(zone, node_id, node)
        return self._new_op(parent, {"@type": _EMPTY_TYPE})

    def _node_view(self, zone: str, node_id: str) -> dict:
        node = self.nodes[(zone, node_id)]
        if node["state"] == "CREATING":
            node["_polls"] += 1
            if node["_polls"] > self.creating_polls:
                node["state"] = "READY"
                if self.on_ready:
                    self.on_ready(zone, node_id, node)
        return {k: v for k, v in node.items() if not k.startswith("_")}

    def _create_qr(self, parent: str, zone: str, qr_id: str, body: dict) -> dict:
        error = self._next_error(zone)
        if error and error[0] != "op":
            raise ApiError(error[0], error[1])
        if (zone, qr_id) in self.queued:
            raise ApiError(409, f"queued resource {qr_id} already exists")
        if error:  # the operation fails (a stockout): no request is left behind
            return self._new_op(parent, None, error={"code": error[1], "message": error[2]})
        valid = float(body.get("queueingPolicy", {}).get("validUntilDuration", "0s")[:-1] or 0)
        self.queued[(zone, qr_id)] = {
            **body,
            "name": f"{parent}/queuedResources/{qr_id}",
            "state": {"state": "ACCEPTED"},
            "_deadline": time.monotonic() + valid if valid else None,
        }
        return self._new_op(parent, {"@type": _QR_TYPE, **self._qr_view(zone, qr_id)})

    def _qr_view(self, zone: str, qr_id: str) -> dict:
        qr = self.queued[(zone, qr_id)]
        state = qr["state"]["state"]
        if state in ("ACCEPTED", "WAITING_FOR_RESOURCES"):
            deadline = qr["_deadline"]
            if deadline is not None and time.monotonic() > deadline:
                qr["state"] = {
                    "state": "FAILED",
                    "failedData": {
                        "error": {"code": 8, "message": "valid_until passed with no capacity"}
                    },
                }
            elif self.spot_waits:
                qr["state"] = {"state": "WAITING_FOR_RESOURCES"}
            else:
                spec = qr["tpu"]["nodeSpec"][0]
                self._add_node(spec["parent"], zone, spec["nodeId"], spec["node"])
                qr["state"] = {"state": "ACTIVE"}
        return {k: v for k, v in qr.items() if not k.startswith("_")}

    def _new_op(self, parent: str, response: dict | None, error: dict | None = None) -> dict:
        name = f"{parent}/operations/op-{next(self._ids)}"
        self.operations[name] = {"polls": 0, "response": response, "error": error}
        return self._op_view(name)

    def _poll_op(self, name: str) -> dict:
        if name not in self.operations:
            raise ApiError(404, f"operation {name} not found")
        self.operations[name]["polls"] += 1
        return self._op_view(name)

    def _op_view(self, name: str) -> dict:
        op = self.operations[name]
        view: dict[str, Any] = {"name": name, "done": op["polls"] >= self.op_polls}
        if view["done"]:
            view.update({"error": op["error"]} if op["error"] else {"response": op["response"]})
        return view

    def _metadata(self, zone: str, node: str, worker: str, key: str) -> tuple[int, Any]:
        with self._lock:
            found = self.nodes.get((zone, node))
            if found is None:
                return 404, b"no such node"
            values = {**found.get("metadata", {}), "agent-worker-number": worker}
        if key not in values:
            return 404, b"no such attribute"
        return 200, values[key].encode()
