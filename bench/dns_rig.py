"""Shared by the DNS benches: start PowerDNS 4.7, region-agent and fake copies on loopback; stop them by PID.

Nothing here talks beyond 127.0.0.0/8. Every process a bench starts is registered in a
:class:`Procs` and stopped by its PID (SIGTERM, then SIGKILL after a grace period) when the
bench ends, however it ends (``with Procs(...)``; SIGTERM and SIGINT unwind through it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, TracebackType

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from region_agent.demo.fake_copy import CheckRecord, read_log, write_state  # noqa: E402
from tests.fakes.ports import free_port  # noqa: E402 - the one free_port, for every bench

__all__ = ["free_port"]  # the benches take it from here

ZONE = "g.example.com"
CHECK_HOST = f"runr-health.{ZONE}"
PRIMARY, BACKUP = "127.0.0.11", "127.0.0.12"
HA_NAME = f"shop.{ZONE}"
STATIC_NAME = f"static.{ZONE}"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def now() -> float:
    return time.time()


def need_tools(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing {', '.join(missing)}: apt-get install -y pdns-server pdns-backend-bind dnsperf "
                 "bind9-dnsutils")


# ---------------------------------------------------------------- processes


class Procs:
    """Processes this bench started; ``stop_all`` ends them by PID, newest first."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []
        self._old: dict[int, object] = {}

    def __enter__(self) -> Procs:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            self._old[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop_all()
        for sig, handler in self._old.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    @staticmethod
    def _on_signal(signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def start(self, name: str, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
              cwd: Path | None = None) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.tmp / f"{name}.out"
        with open(log, "wb") as out:
            proc = subprocess.Popen(list(argv), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(env) if env is not None else None, cwd=cwd)
        self.started.append((name, proc))
        return proc, log

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.terminate()  # by PID
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self.started = [(n, p) for n, p in self.started if p is not proc]

    def stop_all(self) -> None:
        for _name, proc in reversed(list(self.started)):
            self.stop(proc)


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_stat() -> tuple[float, float]:
    """(busy, total) seconds of all cores since boot, from /proc/stat."""
    with open("/proc/stat", encoding="ascii") as handle:
        values = [int(v) for v in handle.readline().split()[1:9]]
    total = sum(values)
    idle = values[3] + values[4]
    return (total - idle) / CLK_TCK, total / CLK_TCK


def busy_percent(seconds: float) -> float:
    """% of all cores busy over the next ``seconds`` (whatever runs on the machine)."""
    b0, t0 = proc_stat()
    time.sleep(seconds)
    b1, t1 = proc_stat()
    return 100.0 * (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0


# ---------------------------------------------------------------- fake copies


@dataclass
class Endpoint:
    host: str
    port: int
    state_file: Path
    log_file: Path
    proc: subprocess.Popen[bytes]

    def set(self, steady: str, once: str | Sequence[str] = ()) -> float:
        """Write the state file; returns the time after which a check sees it."""
        write_state(self.state_file, steady, once)
        return now()

    def checks(self) -> list[CheckRecord]:
        return read_log(self.log_file)

    def wait_check(self, since: float, timeout: float, ua: str | None = None, count: int = 1) -> CheckRecord | None:
        """The ``count``-th check that arrived after ``since`` (polling the log every 10 ms), or None."""
        deadline = time.monotonic() + timeout
        while True:
            seen = [r for r in self.checks() if r.arrived > since and (ua is None or r.user_agent.startswith(ua))]
            if len(seen) >= count:
                return seen[count - 1]
            if time.monotonic() > deadline:
                return None
            time.sleep(0.01)


def start_endpoint(procs: Procs, name: str, host: str, port: int, state: str = "ok") -> Endpoint:
    state_file = procs.tmp / f"{name}.state"
    log_file = procs.tmp / f"{name}.log"
    write_state(state_file, state)
    proc, out = procs.start(name, [sys.executable, "-m", "region_agent.demo.fake_copy", "--bind", host, "--port",
                                   str(port), "--state-file", str(state_file), "--log", str(log_file)], cwd=REPO)
    deadline = time.monotonic() + 15
    while "health endpoint on" not in out.read_text(encoding="utf-8", errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"fake copy {name} on {host}:{port} did not start: {out.read_text()[-500:]}")
        time.sleep(0.02)
    return Endpoint(host, port, state_file, log_file, proc)


# ---------------------------------------------------------------- DNS servers


@dataclass
class Server:
    name: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_port: int | None = None
    notes: dict[str, str] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def threads(self) -> int:
        try:
            return len(os.listdir(f"/proc/{self.proc.pid}/task"))
        except OSError:
            return 0


def dig(port: int, name: str, rdtype: str = "A", *extra: str) -> str:
    """``dig +short``: the answer's records sorted and space separated ('' on timeout or empty)."""
    result = subprocess.run(["dig", "@127.0.0.1", "-p", str(port), name, rdtype, "+short", "+time=1", "+tries=1",
                             *extra], capture_output=True, text=True, timeout=5, check=False)
    lines = [ln for ln in result.stdout.splitlines() if ln and not ln.startswith(";")]
    return " ".join(sorted(lines))


def wait_answer(server: Server, want: str, timeout: float, name: str = HA_NAME) -> float:
    t0 = time.monotonic()
    last = ""
    while time.monotonic() - t0 < timeout:
        last = dig(server.port, name)
        if last == want:
            return time.monotonic() - t0
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited: {server.log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"{server.name}: {name} never answered {want!r} within {timeout} s (last {last!r})")


def ifurlup_record(health_port: int, name: str = HA_NAME) -> str:
    return (f"{name}. 30 IN LUA A \"ifurlup('http://{CHECK_HOST}:{health_port}/global-health/shop', "
            f"{{{{'{PRIMARY}'}}, {{'{BACKUP}'}}}}, {{selector='all', backupSelector='all', timeout=2, "
            "minimumFailures=2, stringmatch='ok'})\"")


def start_pdns(procs: Procs, name: str, health_port: int, *, lua: str = "shared", interval: int = 5) -> Server:
    """PowerDNS 4.7 as the anchor runs it (bench/anchors/pdns/run.sh): bind backend, default threads."""
    conf = procs.tmp / name
    conf.mkdir()
    port = free_port()
    (conf / "zone").write_text("\n".join([
        f"$ORIGIN {ZONE}.",
        "$TTL 300",
        f"@ IN SOA ns1.{ZONE}. hostmaster.{ZONE}. 1 3600 600 604800 60",
        f"@ IN NS ns1.{ZONE}.",
        "ns1 IN A 192.0.2.53",
        "static IN A 192.0.2.1",
        ifurlup_record(health_port),
    ]) + "\n", encoding="utf-8")
    (conf / "named.conf").write_text(f'zone "{ZONE}" {{ type master; file "{conf / "zone"}"; }};\n',
                                     encoding="utf-8")
    (conf / "pdns.conf").write_text("\n".join([
        "launch=bind", f"bind-config={conf / 'named.conf'}", "local-address=127.0.0.1", f"local-port={port}",
        f"enable-lua-records={lua}", f"lua-health-checks-interval={interval}", "daemon=no", "guardian=no",
        f"socket-dir={conf}", "webserver=no", "api=no", "disable-syslog=yes", "security-poll-suffix=",
        "loglevel=4",
    ]) + "\n", encoding="utf-8")
    proc, log = procs.start(name, ["pdns_server", f"--config-dir={conf}"])
    server = Server(name, port, proc, log, notes={"enable-lua-records": lua, "lua-health-checks-interval":
                                                   str(interval)})
    deadline = time.monotonic() + 20
    while dig(port, ZONE, "SOA") == "":
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return server


AGENT_ZONE = f"""\
regions:
  sfo1: {{ipv4: [{PRIMARY}], ns_ipv4: [127.0.0.1]}}
  ams1: {{ipv4: [{BACKUP}], ns_ipv4: [127.0.0.2]}}
projects:
  shop: {{regions: [sfo1, ams1], primary: sfo1, mode: ha, all_down: all}}
"""


def start_agent(procs: Procs, name: str, health_port: int, *, interval: float = 5.0, timeout: float = 2.0,
                env: Mapping[str, str] | None = None) -> Server:
    """``python -m agent run`` (uvloop, one process) on the zone equivalent to the PowerDNS record."""
    conf = procs.tmp / name
    conf.mkdir()
    (conf / "zone.yaml").write_text(AGENT_ZONE, encoding="utf-8")
    port, metrics_port = free_port(), free_port(udp=False)
    (conf / "agent.yaml").write_text(f"""\
region: sfo1
zone_file: zone.yaml
log_level: warning
dns: {{zone: {ZONE}, listen_addresses: [127.0.0.1], port: {port}}}
checks: {{host: {CHECK_HOST}, port: {health_port}, interval: {interval}, timeout: {timeout}}}
health: {{listen_addresses: [127.0.0.1], port: {metrics_port}, operator_port: 0}}
""", encoding="utf-8")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}
    full_env.update(env or {})
    proc, log = procs.start(name, [sys.executable, "-m", "region_agent", "run", "--config", str(conf / "agent.yaml")],
                            env=full_env, cwd=REPO)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/readyz", timeout=1) as response:
                if response.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not become ready: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    server = Server(name, port, proc, log, metrics_port)
    try:
        maps = Path(f"/proc/{proc.pid}/maps").read_text(encoding="utf-8", errors="replace")
        server.notes["uvloop"] = "loaded" if "uvloop" in maps else "NOT loaded"
    except OSError:
        server.notes["uvloop"] = "?"
    for key, value in (env or {}).items():
        server.notes[key] = value
    return server
