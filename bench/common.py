"""What every bench shares: the results file, the tool versions and background load it records,
and starting PowerDNS on any zone, the agent on any zone file, groups of fake copies and ``wrk``
(the benches and ``tests/globaldns/test_pdns_differential.py``).

Processes are started through :class:`dns_rig.Procs` (stopped by PID when the bench ends, also on
SIGTERM) and fake copies through :func:`dns_rig.start_endpoint`; this module builds on them and
on nothing beyond 127.0.0.0/8. (``dns_rig.start_pdns`` and ``dns_rig.start_agent``, the anchor's
zone only, still write their own copy of the same configuration.)

**Results file** (JSON lines), written by :class:`Results` and named at the end of every run::

    {"type": "run", "bench": ..., "command": ..., "argv": [...], "smoke": false, "started": ...,
     "commit": ..., "versions": {...}, "load": {...}}
    {"type": "result", "name": ..., <figures>}          (one line per measurement)
    {"type": "end", "finished": ..., "seconds": ..., "load": {...}}

``load`` is the background: ``os.getloadavg()`` and the share of all cores busy over a short
sample of ``/proc/stat`` (taken before the bench starts anything, and again after it stopped).
Figures are JSON numbers, strings, booleans, null, lists or objects of those; never NaN.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _path in (str(REPO), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

# Only the standard library at import time: a bench that measures its own process's memory
# (kube_list, usage_churn) imports this module too. The rest is imported where it is used.
if TYPE_CHECKING:
    from dns_rig import Endpoint, Procs, Server

ZONE = "g.example.com"  # the zone every DNS bench serves (as in dns_rig)
CHECK_HOST = f"runr-health.{ZONE}"
RESULTS_DIR = BENCH / "results"
PACKAGES = ("aiohttp", "uvloop", "dnspython", "prometheus-client", "kubernetes-asyncio", "maxminddb")
# argv that prints a tool's version, and a pattern for the version in its output
TOOLS: Mapping[str, tuple[list[str], str]] = {
    "wrk": (["wrk", "-v"], r"wrk\s+(\S+)"),
    "pdns_server": (["pdns_server", "--version"], r"Authoritative Server\s+(\S+)"),
    "dnsperf": (["dnsperf", "-h"], r"[Vv]ersion\s+(\S+)"),
    "dig": (["dig", "-v"], r"DiG\s+(\S+)"),
}


# ---------------------------------------------------------------- results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--smoke`` and ``--out``, the same in every bench."""
    parser.add_argument("--smoke", action="store_true",
                        help="a second or two per scenario at tiny sizes: proves the bench runs, measures nothing")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON lines results file (default: bench/results/<bench>-<UTC time>.jsonl; "
                             "smoke runs: under the temp directory)")


def tool_versions(tools: Sequence[str] = ()) -> dict[str, str]:
    """Python, the project's runtime packages, and each named external tool ('missing' if absent)."""
    versions = {"python": platform.python_version(), "platform": platform.platform()}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "missing"
    for tool in tools:
        argv, pattern = TOOLS.get(tool, ([tool, "--version"], r"(\S+)"))
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            versions[tool] = "missing"
            continue
        found = re.search(pattern, done.stdout + done.stderr)
        versions[tool] = found.group(1) if found else "unknown"
    return versions


def background_load(sample_seconds: float = 1.0) -> dict[str, Any]:
    """Load of the machine right now: load averages and % of all cores busy over a short sample."""
    from dns_rig import proc_stat

    busy0, total0 = proc_stat()
    time.sleep(sample_seconds)
    busy1, total1 = proc_stat()
    busy = 100.0 * (busy1 - busy0) / (total1 - total0) if total1 > total0 else 0.0
    return {"loadavg": [round(v, 2) for v in os.getloadavg()], "busy_percent": round(busy, 1),
            "sample_seconds": sample_seconds, "cores": len(os.sched_getaffinity(0))}


class Foreign:
    """% of all cores busy with other people's work while it is open: /proc/stat busy time minus the
    CPU of ``pids``, of this process and of its waited-for children (e.g. ``wrk``) over the same time."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = list(pids)
        self.percent = 0.0

    def _ours(self) -> float:
        from dns_rig import cpu_seconds

        children = resource.getrusage(resource.RUSAGE_CHILDREN)
        return (sum(cpu_seconds(pid) for pid in self.pids) + time.process_time() + children.ru_utime
                + children.ru_stime)

    def __enter__(self) -> Foreign:
        from dns_rig import proc_stat

        self._busy, self._total = proc_stat()
        self._ours0 = self._ours()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        from dns_rig import proc_stat

        busy, total = proc_stat()
        foreign = busy - self._busy - (self._ours() - self._ours0)
        self.percent = round(max(0.0, 100.0 * foreign / (total - self._total)), 1) if total > self._total else 0.0


def _commit() -> str:
    done = subprocess.run(["git", "-C", str(REPO), "describe", "--always", "--dirty"], capture_output=True,
                          text=True, timeout=10, check=False)
    return done.stdout.strip() or "unknown"


def _finite(value: object, where: str) -> None:
    """Raise ValueError unless ``value`` is plain JSON without NaN or infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {value} is not a finite number")
    if isinstance(value, Mapping):
        for key, item in value.items():
            _finite(item, f"{where}.{key}")
    elif isinstance(value, list | tuple):
        for i, item in enumerate(value):
            _finite(item, f"{where}[{i}]")
    elif not isinstance(value, str | int | float | bool | type(None)):
        raise ValueError(f"{where}: {type(value).__name__} is not JSON")


class Results:
    """The results file of one run: ``with Results(...) as results: results.add(name, **figures)``."""

    def __init__(self, bench: str, out: Path | None, *, smoke: bool, tools: Sequence[str] = ()) -> None:
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
        if out is None:
            where = Path(tempfile.gettempdir()) / "region-agent-bench" if smoke else RESULTS_DIR
            out = where / f"{bench}{'-smoke' if smoke else ''}-{stamp}.jsonl"
        self.path = out
        self.bench = bench
        self.smoke = smoke
        self.tools = tools
        self._started = time.monotonic()
        self._file: Any = None

    def __enter__(self) -> Results:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", encoding="utf-8")
        self._write({
            "type": "run", "bench": self.bench, "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "argv": sys.argv, "smoke": self.smoke,
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "commit": _commit(), "versions": tool_versions(self.tools),
            "load": background_load(0.2 if self.smoke else 2.0),
        })
        return self

    def add(self, name: str, **figures: object) -> None:
        """One measurement; written (and flushed) at once, so a crash later keeps it."""
        if "type" in figures:
            raise ValueError("'type' is the line's kind, not a figure")
        self._write({"type": "result", "name": name, **figures})

    def _write(self, line: Mapping[str, object]) -> None:
        _finite(line, str(line.get("name", line["type"])))
        self._file.write(json.dumps(line, sort_keys=False) + "\n")
        self._file.flush()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if kind is None:
                self._write({
                    "type": "end", "finished": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "seconds": round(time.monotonic() - self._started, 1),
                    "load": background_load(0.2 if self.smoke else 2.0),
                })
        finally:
            self._file.close()
            print(f"results: {self.path}", flush=True)


def read_results(path: Path, *, strict: bool = True) -> list[dict[str, Any]]:
    """The lines of a results file, checked: a run line, result lines, an end line; raises ValueError.

    ``strict``: the run line also names the command and the versions (as :class:`Results` writes it).
    """
    lines = [json.loads(text) for text in path.read_text(encoding="utf-8").splitlines()]
    if not lines or not all(isinstance(line, dict) for line in lines):
        raise ValueError(f"{path}: expected one JSON object per line")
    if lines[0].get("type") != "run" or lines[-1].get("type") != "end":
        raise ValueError(f"{path}: not a complete run (first line 'run', last 'end')")
    for key in ("command", "versions", "load", "started", "smoke") if strict else ("load", "started", "smoke"):
        if key not in lines[0]:
            raise ValueError(f"{path}: the run line has no {key!r}")
    results = lines[1:-1]
    if not results or any(line.get("type") != "result" or not line.get("name") for line in results):
        raise ValueError(f"{path}: expected result lines with a name between 'run' and 'end'")
    for line in lines:
        _finite(line, str(line.get("name", line.get("type"))))
    return lines


# ---------------------------------------------------------------- readiness


def wait_http(port: int, path: str, watch: Sequence[tuple[subprocess.Popen[bytes], Path]], timeout: float = 30.0,
              host: str = "127.0.0.1") -> None:
    """Poll ``GET path`` until it answers 200; fail early (with its log) if a watched process exits."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        exited = [(proc, log) for proc, log in watch if proc.poll() is not None]
        if exited or time.monotonic() > deadline:
            proc, log = (exited or list(watch))[0]
            state = f"{proc.args!r} exited with {proc.returncode}" if exited else f"not ready in {timeout} s"
            tail = log.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"{host}:{port}{path}: {state}\n{tail}")
        time.sleep(0.05)  # polling a child process for readiness


def wait_dns(server: Server, timeout: float = 60.0, zone: str = ZONE) -> None:
    """Poll the zone's SOA over UDP until the server answers NOERROR; fail early if it exits."""
    import dns.exception
    import dns.message
    import dns.query
    import dns.rcode

    deadline = time.monotonic() + timeout
    query = dns.message.make_query(zone, "SOA")
    while True:
        try:
            if dns.query.udp(query, "127.0.0.1", port=server.port, timeout=0.5).rcode() == dns.rcode.NOERROR:
                return
        except (dns.exception.DNSException, OSError):
            pass
        if server.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{server.name} did not answer SOA: {server.log.read_text()[-2000:]}")
        time.sleep(0.05)


# ---------------------------------------------------------------- servers


def start_pdns(procs: Procs, name: str, zone_text: str, *, lua: str = "shared", interval: int = 5,
               loglevel: int = 4) -> Server:
    """PowerDNS 4.7 with the bind backend serving ``zone_text`` for :data:`ZONE`; returns once it answers."""
    from dns_rig import Server, free_port

    conf = procs.tmp / name
    conf.mkdir()
    port = free_port()
    (conf / "zone").write_text(zone_text, encoding="utf-8")
    (conf / "named.conf").write_text(f'zone "{ZONE}" {{ type master; file "{conf / "zone"}"; }};\n',
                                     encoding="utf-8")
    (conf / "pdns.conf").write_text("\n".join([
        "launch=bind", f"bind-config={conf / 'named.conf'}", "local-address=127.0.0.1", f"local-port={port}",
        f"enable-lua-records={lua}", f"lua-health-checks-interval={interval}", "daemon=no", "guardian=no",
        f"socket-dir={conf}", "webserver=no", "api=no", "disable-syslog=yes", "security-poll-suffix=",
        f"loglevel={loglevel}",
    ]) + "\n", encoding="utf-8")
    proc, log = procs.start(name, ["pdns_server", f"--config-dir={conf}"])
    server = Server(name, port, proc, log, notes={"enable-lua-records": lua,
                                                  "lua-health-checks-interval": str(interval)})
    wait_dns(server)
    return server


def start_agent(procs: Procs, name: str, zone_yaml: str, *, checks: Mapping[str, object],
                env: Mapping[str, str] | None = None, wait: str = "ready", log_level: str = "warning") -> Server:
    """``python -m agent run`` (standalone zone file, region sfo1) on free loopback ports.

    ``checks``: the ``checks`` settings (host defaults to :data:`CHECK_HOST`). ``wait``: ``ready``
    returns once ``/readyz`` is 200 (its first check round is done), ``dns`` once it answers SOA.
    """
    from dns_rig import Server, free_port

    conf = procs.tmp / name
    conf.mkdir()
    (conf / "zone.yaml").write_text(zone_yaml, encoding="utf-8")
    port, public_port, operator_port = free_port(), free_port(udp=False), free_port(udp=False)
    checks_yaml = ", ".join(f"{k}: {v}" for k, v in {"host": CHECK_HOST, **checks}.items())
    (conf / "agent.yaml").write_text(f"""\
region: sfo1
zone_file: zone.yaml
log_level: {log_level}
shutdown_drain_seconds: 0
dns: {{zone: {ZONE}, listen_addresses: [127.0.0.1], port: {port}}}
checks: {{{checks_yaml}}}
health: {{listen_addresses: [127.0.0.1], port: {public_port}, operator_port: {operator_port}}}
""", encoding="utf-8")
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("REGION_AGENT_")}
    full_env.update(env or {})
    proc, log = procs.start(name, [sys.executable, "-m", "region_agent", "run", "--config", str(conf / "agent.yaml")],
                            env=full_env, cwd=REPO)
    # metrics_port: the operator listener (/metrics, /zone, /readyz)
    server = Server(name, port, proc, log, operator_port, notes=dict(env or {}))
    if wait == "ready":
        wait_http(operator_port, "/readyz", [(proc, log)])
    else:
        wait_dns(server)
    return server


def start_endpoints(procs: Procs, prefix: str, hosts: Sequence[str], state: str = "ok") -> dict[str, Endpoint]:
    """Fake copies (one process each) on every host at one port: a check URL names one port."""
    from dns_rig import free_port, start_endpoint

    for _ in range(5):
        port = free_port(hosts, udp=False)
        started: dict[str, Endpoint] = {}
        try:
            for host in hosts:
                started[host] = start_endpoint(procs, f"{prefix}-{host}", host, port, state)
        except RuntimeError:  # the port was taken meanwhile on one host: stop these, pick another
            for endpoint in started.values():
                procs.stop(endpoint.proc)
            continue
        return started
    raise RuntimeError(f"no port free on all of {hosts}")


# ---------------------------------------------------------------- wrk


def parse_wrk(text: str) -> dict[str, Any]:
    """requests/s, latency percentiles (ms), non-2xx and socket errors from ``wrk --latency`` output."""
    rps = re.search(r"Requests/sec:\s+([\d.]+)", text)
    total = re.search(r"(\d+) requests in ([\d.]+)(us|ms|s|m)", text)
    if rps is None or total is None:
        raise ValueError(f"not wrk output: {text[-500:]!r}")
    unit_ms = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0}
    latency = {f"p{pct}": round(float(value) * unit_ms[unit], 3)
               for pct, value, unit in re.findall(r"^\s+(\d+)%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M)}
    non_2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    errors = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    return {
        "requests_per_second": float(rps.group(1)),
        "requests": int(total.group(1)),
        "latency_ms": latency,
        "non_2xx": int(non_2xx.group(1)) if non_2xx else 0,
        "socket_errors": sum(int(n) for n in errors.groups()) if errors else 0,
    }


def run_wrk(url: str, *, duration: int, connections: int, threads: int = 1, cpu: int | None = None) -> dict[str, Any]:
    """``wrk --latency`` against a loopback ``url`` (bounded by ``duration``); parsed, with the command."""
    if not url.startswith("http://127."):
        raise ValueError(f"loopback only: {url}")
    command = ["wrk", f"-t{threads}", f"-c{connections}", f"-d{duration}s", "--latency", url]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    if cpu is not None and len(os.sched_getaffinity(0)) > cpu:
        os.sched_setaffinity(proc.pid, {cpu})
    try:
        out, _ = proc.communicate(timeout=duration + 30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
    return {"command": shlex.join(command), **parse_wrk(out)}
