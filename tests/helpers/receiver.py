"""An HTTP server on 127.0.0.1 that keeps every JSON body posted to it (any path), for the
webhooks and events the product and the local job post."""

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """``note``, if given, is called as each body arrives; what it returns is kept beside the
    body (what a file said at that moment, say)."""

    def __init__(self, note: Callable[[], object] | None = None):
        self.bodies: list = []
        self.notes: list = []
        self.arrived = threading.Condition()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                seen = note() if note else None
                with outer.arrived:
                    outer.bodies.append(body)
                    outer.notes.append(seen)
                    outer.arrived.notify_all()
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait(self, count: int, timeout: float = 60) -> list:
        """The bodies once ``count`` have arrived (a sender may post them later)."""
        with self.arrived:
            self.arrived.wait_for(lambda: len(self.bodies) >= count, timeout)
        return list(self.bodies)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
