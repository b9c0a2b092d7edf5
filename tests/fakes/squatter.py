"""A squatter: another process, under another uid, that binds a UDP port beside the agent.

Forked, not exec'd: the test's interpreter lives where ``nobody`` may not execute it. The child
only switches uid, binds and reports, then leaves with ``os._exit``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

NOBODY = 65534


@dataclass(frozen=True)
class Squat:
    uid: int      # the child's effective uid when it tried
    errno: int    # 0: it bound the port beside the agent

    @property
    def bound(self) -> bool:
        return self.errno == 0


def _attempt(host: str, port: int, uid: int) -> str:
    if uid != os.geteuid():
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM)
    # Everything a squatter can ask for: REUSEADDR (any uid, on UDP) and REUSEPORT (same uid).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        return f"{os.geteuid()} {exc.errno or -1}"
    finally:
        sock.close()
    return f"{os.geteuid()} 0"


def squat(host: str, port: int, *, uid: int = NOBODY) -> Squat:
    """Try to bind ``host:port`` (UDP) from a child process running as ``uid``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into the test
        try:
            os.close(read_end)
            os.write(write_end, _attempt(host, port, uid).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        report = os.read(read_end, 64).decode()
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)
    uid_text, _, errno_text = report.partition(" ")
    assert errno_text, f"the squatter reported nothing ({report!r})"
    return Squat(int(uid_text), int(errno_text))
