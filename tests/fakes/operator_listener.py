"""A stand-in for an agent's operator listener: JSON answers by path, in a thread, for the CLI's tests
(the inspection commands talk to it with urllib, synchronously)."""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextlib.contextmanager
def operator_listener(answers: Mapping[str, Any], token: str | None = None) -> Iterator[tuple[int, list[str]]]:
    """Serve ``answers[path]`` as JSON on 127.0.0.1 (read at each request: the caller may change it); with
    ``token``, 401 without ``Authorization: Bearer <token>``. Yields (port, the paths asked)."""
    asked: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            if token is not None and self.headers.get("Authorization") != f"Bearer {token}":
                self.send_response(401)
                self.end_headers()
                return
            body = json.dumps(answers[self.path]).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1]), asked
    finally:
        server.shutdown()
        server.server_close()
