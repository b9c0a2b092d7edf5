"""The one way tests and benches pick a port: free for TCP and UDP together on every host asked."""

from __future__ import annotations

import socket
from collections.abc import Sequence


def free_port(hosts: Sequence[str] = ("127.0.0.1",), *, udp: bool = True) -> int:
    """A port free for TCP (and UDP) on every host right now.

    A DNS server binds both; a port the kernel picked for one protocol may be held for the
    other by another process, so both are tried before the port is handed out.
    """
    for _ in range(100):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as first:
            first.bind((hosts[0], 0))
            port = int(first.getsockname()[1])
            ok = True
            for host in hosts:
                for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM) if udp else (socket.SOCK_STREAM,):
                    if host == hosts[0] and kind == socket.SOCK_STREAM:
                        continue
                    with socket.socket(socket.AF_INET, kind) as probe:
                        try:
                            probe.bind((host, port))
                        except OSError:
                            ok = False
            if ok:
                return port
    raise RuntimeError("no free port")
