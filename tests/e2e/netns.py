"""Network namespaces for partition tests: one namespace per region on one switch, links cut with nft.

Topology (every name carries the test process's PID, so concurrent runs never collide)::

    host ── veth ──┐
                   switch namespace: bridge br0
    ra<pid>-sfo1 ──┤  (one veth per region namespace, its far end on the bridge)
    ra<pid>-ams1 ──┤
    ra<pid>-fra1 ──┘

Each region namespace has one address ``10.A.B.(i+1)/24`` (A, B from the PID; the host side of
its veth is ``.254``, so the test process reaches every agent and copy directly). A *link* between
two regions is cut by dropping each one's address in the other's namespace: every namespace
holds an nft table ``ra_cut`` with a set ``blocked`` of peer addresses whose packets it drops
in both directions (input and output hooks, established connections included). The host's
address is never blocked, so an isolated region stays observable.

:meth:`Namespace.listen` opens a listening socket *inside* a namespace from the test process
(``setns`` in a throwaway thread), so a fake copy served by the test's own event loop lives in
the region's namespace. Agents run as ``ip netns exec <ns> <python> -m agent ...``; ``ip netns
exec`` execs the command, so the PID that :class:`subprocess.Popen` returns is the agent's.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
TABLE = "ra_cut"


def unavailable() -> str | None:
    """Why namespaces can not be made here (None when they can): root, ``ip`` and ``nft`` are needed."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "nft") if shutil.which(tool) is None]
    if missing:
        return f"missing {' and '.join(missing)} (iproute2, nftables)"
    return None


def run(*argv: str, stdin: str | None = None) -> str:
    done = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _subnet(pid: int) -> ipaddress.IPv4Network:
    """A /24 from 10.200.0.0/13 chosen by the PID, skipping any the host already routes."""
    routes = run("ip", "-4", "route", "show", "table", "all")
    used = [ipaddress.ip_network(word, strict=False) for line in routes.splitlines()
            for word in line.split()[:1] if word[0].isdigit()]
    for step in range(2048):
        n = (pid + step * 7919) % 2048
        candidate = ipaddress.IPv4Network(f"10.{200 + n // 256}.{n % 256}.0/24")
        if not any(candidate.overlaps(u) for u in used):
            return candidate
    raise RuntimeError("no free 10.200.0.0/13 subnet for the test network")


@dataclass
class Namespace:
    name: str       # the ip netns name
    label: str      # e.g. the region
    address: str
    blocked: set[str] = field(default_factory=set)

    def argv(self, *command: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *command]

    def inside(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` in a fresh thread that has entered this namespace (sockets it makes stay there)."""
        result: list[T] = []
        error: list[BaseException] = []

        def target() -> None:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                with open(f"/run/netns/{self.name}", "rb") as handle:
                    if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
                        errno = ctypes.get_errno()
                        raise OSError(errno, f"setns {self.name}: {os.strerror(errno)}")
                result.append(fn())
            except BaseException as exc:
                error.append(exc)

        thread = threading.Thread(target=target, name=f"netns-{self.name}")
        thread.start()
        thread.join()
        if error:
            raise error[0]
        return result[0]

    def listen(self, port: int) -> socket.socket:
        """A TCP socket listening on this namespace's address (for asyncio.start_server(sock=...))."""
        def make() -> socket.socket:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.address, port))
            sock.listen(128)
            sock.setblocking(False)
            return sock
        return self.inside(make)

    def nft(self, script: str) -> None:
        run(*self.argv("nft", "-f", "-"), stdin=script)


class Network:
    """A switch namespace with a bridge, a host veth on it, and region namespaces added one by one."""

    def __init__(self, pid: int | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.tag = f"ra{self.pid}"
        self.switch = f"{self.tag}-sw"
        self.host_link = f"{self.tag}h"       # at most 15 characters: ra + 7 digits + h
        self.subnet: ipaddress.IPv4Network | None = None
        self.namespaces: dict[str, Namespace] = {}
        self._made: list[str] = []            # namespaces to delete, in creation order

    @property
    def host_address(self) -> str:
        assert self.subnet is not None
        return str(self.subnet.network_address + 254)

    def create(self) -> None:
        self.subnet = _subnet(self.pid)
        run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        sw = ["ip", "netns", "exec", self.switch]
        run(*sw, "ip", "link", "add", "br0", "type", "bridge")
        run(*sw, "ip", "link", "set", "br0", "up")
        run("ip", "link", "add", self.host_link, "type", "veth", "peer", "name", "host", "netns", self.switch)
        run(*sw, "ip", "link", "set", "host", "master", "br0", "up")
        run("ip", "addr", "add", f"{self.host_address}/24", "dev", self.host_link)
        run("ip", "link", "set", self.host_link, "up")

    def add(self, label: str) -> Namespace:
        """A namespace for ``label`` (a region) with the next address, on the bridge, with an empty cut table."""
        assert self.subnet is not None, "create() first"
        index = len(self.namespaces)
        ns = Namespace(f"{self.tag}-{label}", label, str(self.subnet.network_address + index + 1))
        run("ip", "netns", "add", ns.name)
        self._made.append(ns.name)
        port = f"p{index}"
        run("ip", "link", "add", "eth0", "netns", ns.name, "type", "veth", "peer", "name", port, "netns", self.switch)
        run("ip", "netns", "exec", self.switch, "ip", "link", "set", port, "master", "br0", "up")
        run(*ns.argv("ip", "addr", "add", f"{ns.address}/24", "dev", "eth0"))
        run(*ns.argv("ip", "link", "set", "eth0", "up"))
        run(*ns.argv("ip", "link", "set", "lo", "up"))
        ns.nft(f"""
table inet {TABLE} {{
  set blocked {{ type ipv4_addr; }}
  chain input {{ type filter hook input priority 0; policy accept; ip saddr @blocked drop; }}
  chain output {{ type filter hook output priority 0; policy accept; ip daddr @blocked drop; }}
}}
""")
        self.namespaces[label] = ns
        return ns

    # --- cutting links ------------------------------------------------------------------------

    def _block(self, ns: Namespace, addresses: set[str]) -> None:
        new = addresses - ns.blocked
        if new:
            ns.nft(f"add element inet {TABLE} blocked {{ {', '.join(sorted(new))} }}\n")
            ns.blocked |= new

    def _unblock(self, ns: Namespace, addresses: set[str]) -> None:
        gone = addresses & ns.blocked
        if gone:
            ns.nft(f"delete element inet {TABLE} blocked {{ {', '.join(sorted(gone))} }}\n")
            ns.blocked -= gone

    def cut(self, a: str, b: str) -> None:
        """Cut the link between ``a`` and ``b`` both ways; every other link stays."""
        na, nb = self.namespaces[a], self.namespaces[b]
        self._block(na, {nb.address})
        self._block(nb, {na.address})

    def heal(self, a: str, b: str) -> None:
        na, nb = self.namespaces[a], self.namespaces[b]
        self._unblock(na, {nb.address})
        self._unblock(nb, {na.address})

    def isolate(self, label: str) -> None:
        """Cut every link of ``label`` (the host still reaches it)."""
        for other in self.namespaces:
            if other != label:
                self.cut(label, other)

    def heal_all(self) -> None:
        for ns in self.namespaces.values():
            self._unblock(ns, set(ns.blocked))

    def blocked(self, label: str) -> set[str]:
        """The addresses ``label``'s namespace drops, as nft lists them (what the kernel enforces)."""
        text = run(*self.namespaces[label].argv("nft", "list", "set", "inet", TABLE, "blocked"))
        elements = text.partition("elements = {")[2].partition("}")[0]
        return {word.strip() for word in elements.split(",") if word.strip()}

    # --- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Delete the host veth and every namespace made (veths in them go too). Processes still in
        a namespace keep it alive: stop them first."""
        errors: list[str] = []
        if self.subnet is not None:
            try:
                run("ip", "link", "del", self.host_link)
            except RuntimeError as exc:
                if "Cannot find device" not in str(exc):
                    errors.append(str(exc))
        for name in reversed(self._made):
            try:
                run("ip", "netns", "del", name)
            except RuntimeError as exc:
                errors.append(str(exc))
        self._made.clear()
        self.namespaces.clear()
        if errors:
            raise RuntimeError("; ".join(errors))
