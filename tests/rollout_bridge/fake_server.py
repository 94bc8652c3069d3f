"""`FakeServer`: a stand-in rollout server for the failure paths a real one cannot show on demand
(an aborted request, a 503, a hang, a dropped connection, malformed JSON).

A stdlib `ThreadingHTTPServer` on 127.0.0.1 (an ephemeral port) in a daemon thread. Every request
is logged, then answered by `answer(route, body)`, which subclasses override; the default answers
as a healthy server does: /v1/models, /weight_info (the version /finish_weight_update set) and
an empty JSON object for everything else (the other weight-push routes, /health).
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

# (status, body): a JSON-able body, or bytes sent as they are. None: no answer, the connection
# is closed unanswered.
Answer = tuple[int, Any] | None


class FakeServer:
    """`url`; `log` of (method, path with query, headers, JSON body) per request; `version`."""

    def __init__(self, version: str = "base", model: dict[str, Any] | None = None) -> None:
        self.version = version
        self.model = model or {"id": "fake"}
        self.log: list[tuple[str, str, dict[str, str], Any]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._stopped = False
        threading.Thread(  # a short poll: `stop` returns at once
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()

    @property
    def hits(self) -> Counter[str]:
        """Requests per route (the path without its query)."""
        return Counter(path.split("?")[0] for _, path, _, _ in self.log)

    def answer(self, route: str, body: Any) -> Answer:
        """The answer to a request on `route` (the path without its query)."""
        if route == "/v1/models":
            return 200, {"data": [self.model]}
        if route == "/weight_info":
            return 200, {"weight_version": self.version}
        if route == "/finish_weight_update":
            self.version = body["weight_version"]
        return 200, {}

    def stop(self) -> None:
        """Stops serving and closes the listening socket (a later connect is refused)."""
        if not self._stopped:
            self._stopped = True
            self.server.shutdown()
            self.server.server_close()

    def close(self) -> None:
        self.stop()


def _handler(fake: FakeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _answer(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else None
            fake.log.append((self.command, self.path, dict(self.headers), body))
            out = fake.answer(self.path.split("?")[0], body)
            if out is None:
                self.close_connection = True
                return
            status, payload = out
            raw = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        do_GET = do_POST = _answer

    return Handler
