"""How many HTTP requests the agents send to the regions' copies per interval, as projects grow
(issue 10: cluster probe traffic grows with regions², not projects).

Five regions (``sfo1 ams1 fra1 nrt1 syd1``), one ingress address each: fake copies
(:class:`region_agent.demo.fake_copy.HealthEndpoint`, in this process, recording every request) on
127.0.0.41-45 sharing one port. N projects (``p00000`` ...), each in all five regions. Every
request that arrives at a fake is counted, by path: ``/global-health/<slug>`` is a copy check,
``/livez`` an ingress probe.

b. **cluster** (run first: its figure is the one the issue asks for): five agents, one per region,
   joined by gossip on 127.0.0.1-5 (the harness of ``tests/e2e/cluster.py``; agent 0 imports the
   zone file as the control role, the others learn it by gossip). Each agent checks only its own
   region's copies (N per agent: still per project) and probes each *other* region's ingress
   addresses once per ``cluster.ingress_interval`` (1 s here). The check interval (1 h) outlasts the
   run, so each agent makes exactly one round of own-region checks, which is one check interval's
   worth: counted at each region's fake (only its own agent checks it) from launch until every fake
   has seen its N slugs (or ``--first-round-wait``: then ``first_round_complete`` is false). Then,
   in the quiet after the round, ``--ingress-window`` seconds of ingress probes: per ingress interval
   = probes arriving at the five fakes × ingress interval / window, and per agent from its own
   ``region_agent_cluster_ingress_probes_total`` (what it sent, answered or not) read at both ends.
   Expected: per agent (regions − 1) × addresses = 4 probes; all agents 5 × 4 = 20, whatever N.
   (The issue's "20 probes per agent per interval" is this cluster-wide 20 at one address per
   region; one agent sends 4, and would send 20 only with 5 addresses per region.)
a. **standalone**: one ``region-agent run`` with the zone file (region sfo1; a standalone agent
   HTTP-checks every project's copy in every region, like PowerDNS ``ifurlup``). Counted: the first
   round (from launch until ``/readyz``, which waits for it: every target once), and, when the check
   interval is at most ``--max-window``, the requests in one window of exactly one check interval
   after it (every target is checked once per interval, so the window holds one check of each).
   Expected: regions × addresses × N = 5N per interval.

The check interval grows with N so that the copies get at most ``--rate`` check requests per second
(two shared cores: 10,000 projects × 5 regions every 5 s would be 10,000 requests/s); the count per
interval does not depend on the interval's length. ``--budget`` bounds the whole run (default
250 s of measuring, then up to ~40 s to stop the agents): what does not fit is written as
``skipped`` or ``incomplete``.

    python bench/probe_count.py                                   # N = 100 1000 10000, at most ~5 min
    python bench/probe_count.py --only standalone --sizes 10000   # the 10,000 standalone case alone
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _path in (str(REPO), str(BENCH)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

import aiohttp  # noqa: E402
from common import Results, add_arguments  # noqa: E402

from region_agent.demo.fake_copy import INGRESS_PATH, PATH_PREFIX, HealthEndpoint  # noqa: E402
from region_agent.gossip.keyring import generate_key  # noqa: E402
from tests.e2e.cluster import APEX, REGIONS, Agent, Cluster, env_without_drain, write_keyring, zone_text  # noqa: E402
from tests.fakes.ports import free_port  # noqa: E402

HOSTS = tuple(f"127.0.0.{41 + i}" for i in range(len(REGIONS)))
PROBES_METRIC = "region_agent_cluster_ingress_probes_total"


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, ...]
    rate: float  # at most this many check requests per second at the copies
    min_interval: float
    ingress_interval: float
    only: str | None
    deadline: float  # monotonic: the whole run ends by then
    start_timeout: float
    max_window: float  # a steady window longer than this is not waited for
    first_round_wait: float  # cluster: how long to wait for every copy's first check round
    ingress_window: float  # cluster: seconds of ingress probes counted
    cluster_check_interval: float  # cluster: longer than the run (one round per agent)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def check_interval(self, n: int) -> float:
        return round(max(self.min_interval, len(REGIONS) * n / self.rate), 1)


def project_zone(n: int) -> str:
    return zone_text(REGIONS, {f"p{i:05d}": REGIONS for i in range(n)})


def count(copies: Sequence[HealthEndpoint], start: float, end: float) -> dict[str, dict[str, int]]:
    """Per fake: copy checks and ingress probes that arrived in [start, end)."""
    out: dict[str, dict[str, int]] = {}
    for copy in copies:
        checks = ingress = other = 0
        for record in copy.records:
            if not start <= record.arrived < end:
                continue
            if record.path == INGRESS_PATH:
                ingress += 1
            elif record.path.startswith(PATH_PREFIX):
                checks += 1
            else:
                other += 1
        out[copy.host] = {"checks": checks, "ingress": ingress, "other": other}
    return out


def checked_slugs(copy: HealthEndpoint, since: float, until: float = float("inf")) -> int:
    """How many distinct projects' checks arrived at ``copy`` in [since, until)."""
    return len({r.path for r in copy.records if since <= r.arrived < until and r.path.startswith(PATH_PREFIX)})


async def get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        async with aiohttp.ClientSession() as http, http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            return r.status, await r.text()
    except (aiohttp.ClientError, TimeoutError, OSError):
        return 0, ""


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            if head.split("{")[0] == name:
                total += float(value)
    return total


async def wait_until(what: str, check: Any, timeout: float, procs: Sequence[subprocess.Popen[bytes]] = (),
                     logs: Sequence[Path] = ()) -> None:
    """Poll ``check()`` (async) every 0.1 s until true; fail after ``timeout`` or when a process exited."""
    deadline = time.monotonic() + timeout
    while not await check():
        dead = [p for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            tail = "\n".join(log.read_text(errors="replace")[-1500:] for log in logs if log.exists())
            state = f"{dead[0].args!r} exited {dead[0].returncode}" if dead else f"not within {timeout:.0f} s"
            raise RuntimeError(f"{what}: {state}\n{tail}")
        await asyncio.sleep(0.1)  # polling processes this bench started, with a deadline


def launch(config: Path, log: Path) -> subprocess.Popen[bytes]:
    """``region-agent run --config`` as a child process (stopped by PID in :func:`stop`)."""
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "region_agent", "run", "--config", str(config)], stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO, env=env_without_drain())


def stop(process: subprocess.Popen[bytes] | None) -> None:
    if process is not None and process.poll() is None:
        process.terminate()  # by PID: only what this bench started
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


# ---------------------------------------------------------------- a. standalone


async def standalone(n: int, plan: Plan, copies: list[HealthEndpoint], port: int, tmp: Path,
                     results: Results) -> None:
    interval = plan.check_interval(n)
    folder = tmp / f"standalone-{n}"
    folder.mkdir()
    (folder / "zone.yaml").write_text(project_zone(n))
    http_port, operator_port, dns_port = free_port(udp=False), free_port(udp=False), free_port()
    config = folder / "agent.yaml"
    config.write_text(f"""\
region: sfo1
node: n0
zone_file: {folder / "zone.yaml"}
log_level: warning
dns: {{zone: {APEX}, listen_addresses: [127.0.0.1], port: {dns_port}}}
checks: {{host: runr-health.{APEX}, port: {port}, interval: {interval}, timeout: {min(2.0, interval)}}}
health: {{listen_addresses: [127.0.0.1], port: {http_port}, operator_listen_addresses: [127.0.0.1],
          operator_port: {operator_port}}}
""")
    log = folder / "agent.log"
    for copy in copies:
        copy.records.clear()
    launched = time.time()
    process = launch(config, log)
    try:
        async def ready() -> bool:
            return (await get(f"http://127.0.0.1:{http_port}/readyz"))[0] == 200

        # the first round of 5N checks may take minutes: the whole budget, and the partial count if not
        try:
            await wait_until(f"standalone agent, {n} projects, ready", ready, max(0.0, plan.left() - 10),
                             [process], [log])
        except RuntimeError:
            if process.poll() is not None:
                raise
            partial = count(copies, launched, time.time())
            results.add("standalone_not_ready", projects=n, check_interval_s=interval,
                        seconds_since_launch=round(time.time() - launched, 1),
                        checks_so_far=sum(c["checks"] for c in partial.values()),
                        targets_so_far=sum(checked_slugs(copy, launched) for copy in copies),
                        expected_per_interval=len(REGIONS) * n)
            raise
        start = time.time()
        first_round_s = start - launched
        steady = interval <= plan.max_window and interval + 5 < plan.left()
        if steady:
            await asyncio.sleep(interval)  # the measurement window: one check interval
        end = time.time()
        await asyncio.sleep(min(2.0, interval))  # checks that arrived in the window are recorded when answered
        alive = process.poll() is None
    finally:
        stop(process)
    first = count(copies, launched, start)
    first_checks = sum(c["checks"] for c in first.values())  # the first round, and more when it was quick
    first_targets = sum(checked_slugs(copy, launched, start) for copy in copies)
    counts = count(copies, start, end)
    checks = sum(c["checks"] for c in counts.values()) if steady else None
    expected = len(REGIONS) * 1 * n
    results.add("standalone", projects=n, regions=len(REGIONS), addresses_per_region=1, agents=1,
                check_interval_s=interval, window_s=round(end - start, 3) if steady else None,
                copy_checks_per_check_interval=checks, expected=expected,
                targets_checked_until_ready=first_targets, checks_until_ready=first_checks,
                launch_to_ready_s=round(first_round_s, 1),
                ingress_probes_per_interval=sum(c["ingress"] for c in counts.values()),
                per_copy_checks={host: c["checks"] for host, c in (counts if steady else first).items()},
                agent_alive_at_end=alive)
    window = f"{checks} copy checks per {interval:g} s check interval" if steady else "no steady window"
    print(f"standalone  N={n:>6}: {window} (expected {expected}); ready {first_round_s:.1f} s after launch, "
          f"{first_targets} targets checked by then ({first_checks} checks)", flush=True)


# ---------------------------------------------------------------- b. cluster


async def cluster(n: int, plan: Plan, copies: list[HealthEndpoint], port: int, tmp: Path, results: Results) -> None:
    # One own-region round per agent in the whole run: the check interval outlasts the run, so
    # the round is one check interval's worth of checks, and the ingress window after it is quiet.
    interval = plan.cluster_check_interval
    folder = tmp / f"cluster-{n}"
    folder.mkdir()
    zone = folder / "zone.yaml"
    zone.write_text(project_zone(n))
    key = generate_key()
    ring = folder / "keyring.json"
    write_keyring(ring, [key], key)
    c = Cluster(folder, copies=[], check_port=port)  # the shared fakes stay out of c.stop()
    ingress = plan.ingress_interval
    extra = f"cluster: {{ingress_interval: {ingress}, ingress_timeout: {ingress}}}\n"
    first = c.add(0, zone_file=zone, keyring=ring, seeds=[], extra=extra, check_interval=interval,
                  check_timeout=2.0)
    seeds = [f"{first.host}:{first.gossip_port}"]
    for i in range(1, len(REGIONS)):
        c.add(i, zone_file=None, keyring=ring, seeds=seeds, extra=extra, check_interval=interval, check_timeout=2.0)
    for copy in copies:
        copy.records.clear()
    launched = time.time()
    for agent in c.agents:
        agent.start()
    procs = [a.process for a in c.agents if a.process is not None]
    logs = [a.log for a in c.agents]
    try:
        targets: dict[str, float] = {}

        async def all_check_n() -> bool:
            values = await asyncio.gather(*(a.metric("region_agent_check_targets") for a in c.agents))
            targets.update({a.region: v for a, v in zip(c.agents, values, strict=True) if v})
            return all(v == n for v in values)

        # Under load (10,000 projects gossiped to four agents, each starting 10,000 checks on two
        # shared cores) this may not finish in the budget: the ingress window is measured anyway.
        try:
            await wait_until(f"cluster, {n} projects: every agent checks its {n} copies", all_check_n,
                             min(plan.start_timeout, max(0.0, plan.left() - plan.ingress_window - 15)), procs, logs)
            all_known = True
        except RuntimeError:
            if any(p.poll() is not None for p in procs):
                raise
            all_known = False
        known = time.time()

        async def first_round() -> bool:
            return all(checked_slugs(copy, launched) >= n for copy in copies)

        try:
            await wait_until(f"cluster, {n} projects: a first round at every copy", first_round,
                             min(plan.first_round_wait, max(0.0, plan.left() - plan.ingress_window - 5)), procs, logs)
            complete = True
        except RuntimeError:
            if any(p.poll() is not None for p in procs):
                raise
            complete = False
        round_done = time.time()
        await asyncio.sleep(min(2.0, ingress))  # the round's last answers are recorded
        start, before = time.time(), await asyncio.gather(*(probes(a) for a in c.agents))
        await asyncio.sleep(max(10 * ingress, min(plan.ingress_window, plan.left() - 5)))
        end, after = time.time(), await asyncio.gather(*(probes(a) for a in c.agents))
        await asyncio.sleep(min(2.0, ingress))
        alive = all(p.poll() is None for p in procs)
    finally:
        await c.stop()
    own = {REGIONS[i]: sum(1 for r in copies[i].records if launched <= r.arrived < round_done
                           and r.path.startswith(PATH_PREFIX)) for i in range(len(REGIONS))}
    own_targets = {REGIONS[i]: checked_slugs(copies[i], launched, round_done) for i in range(len(REGIONS))}
    counts = count(copies, start, end)
    span = end - start
    ingress_total = sum(cnt["ingress"] for cnt in counts.values())
    per_ingress_interval = round(ingress_total * ingress / span, 2)
    by_agent = {a.region: None if b is None or e is None else round((e[1] - b[1]) * ingress / (e[0] - b[0]), 2)
                for a, b, e in zip(c.agents, before, after, strict=True)}
    expected_agent = (len(REGIONS) - 1) * 1
    results.add("cluster", projects=n, regions=len(REGIONS), addresses_per_region=1, agents=len(c.agents),
                ingress_interval_s=ingress, window_s=round(span, 3),
                ingress_probes_in_window=ingress_total,
                ingress_probes_per_ingress_interval=per_ingress_interval,
                ingress_probes_per_agent_per_ingress_interval=by_agent,
                expected_ingress_per_agent=expected_agent,
                expected_ingress_total=len(REGIONS) * expected_agent,
                ingress_probes_at_each_copy={h: cnt["ingress"] for h, cnt in counts.items()},
                copy_checks_in_window=sum(cnt["checks"] for cnt in counts.values()),
                own_region_checks_first_round=own, own_region_targets_first_round=own_targets,
                expected_own_region_checks_per_agent=n, first_round_complete=complete,
                check_interval_s=interval,
                launch_to_all_checking_s=round(known - launched, 1) if all_known else None,
                check_targets_per_agent=targets,
                launch_to_first_round_done_s=round(round_done - launched, 1) if complete else None,
                agents_alive_at_end=alive)
    print(f"cluster     N={n:>6}: {per_ingress_interval:g} ingress probes per {ingress:g} s ingress interval at the "
          f"copies (expected {len(REGIONS) * expected_agent}; sent per agent "
          f"{sorted({v for v in by_agent.values() if v is not None})}); own-region copy checks in one round per "
          f"agent {sorted(set(own.values()))} (expected {n}; round {'complete' if complete else 'INCOMPLETE'} "
          f"{round_done - launched:.0f} s after launch)", flush=True)


async def probes(agent: Agent) -> tuple[float, float] | None:
    """(wall time, the agent's ingress probes sent so far), or None when its metrics did not answer."""
    for _ in range(2):
        status, body = await get(f"http://{agent.host}:{agent.operator_port}/metrics", timeout=3.0)
        if status == 200:
            return time.time(), metric(body, PROBES_METRIC)
    return None


# ---------------------------------------------------------------- run


async def run(plan: Plan, results: Results) -> None:
    copies = [HealthEndpoint(HOSTS[0])]
    port = await copies[0].start()
    for host in HOSTS[1:]:
        copy = HealthEndpoint(host, port)
        await copy.start()
        copies.append(copy)
    try:
        with tempfile.TemporaryDirectory(prefix="probe-count-") as tmp:
            # The cluster first: its figure (probes independent of N) is the one the issue asks for.
            for scenario in (cluster, standalone):
                for n in plan.sizes:
                    if plan.only not in (None, scenario.__name__):
                        continue
                    name = scenario.__name__
                    if plan.left() < 10:
                        results.add("skipped", scenario=name, projects=n, why="the run's budget is spent (--budget)")
                        print(f"{name:<11} N={n:>6}: skipped, the run's budget is spent", flush=True)
                        continue
                    try:
                        async with asyncio.timeout(plan.left()):
                            await scenario(n, plan, copies, port, Path(tmp), results)
                    except (TimeoutError, RuntimeError) as exc:
                        why = "the run's budget ran out (--budget)" if isinstance(exc, TimeoutError) else str(exc)
                        results.add("incomplete", scenario=name, projects=n, why=why[:2000])
                        print(f"{name:<11} N={n:>6}: incomplete: {why[:300]}", flush=True)
    finally:
        for copy in copies:
            await copy.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="projects (default 100 1000 10000)")
    parser.add_argument("--rate", type=float, default=500.0,
                        help="at most this many check requests per second at the copies: sets the check interval "
                             "(default 500)")
    parser.add_argument("--ingress-interval", type=float, default=1.0, help="cluster.ingress_interval (default 1 s)")
    parser.add_argument("--only", choices=("standalone", "cluster"), default=None)
    parser.add_argument("--budget", type=float, default=250.0,
                        help="seconds for measuring; stopping the agents comes after it (default 250)")
    parser.add_argument("--max-window", type=float, default=60.0,
                        help="longest measurement window; a standalone check interval longer than this is reported "
                             "by its first round only (default 60 s)")
    parser.add_argument("--first-round-wait", type=float, default=60.0,
                        help="cluster: longest wait for every copy's first round of checks (default 60 s)")
    parser.add_argument("--ingress-window", type=float, default=20.0,
                        help="cluster: seconds of ingress probes counted after the first round (default 20)")
    args = parser.parse_args(argv)
    sizes = tuple(args.sizes or ((5,) if args.smoke else (100, 1000, 10000)))
    plan = Plan(sizes=sizes, rate=args.rate, min_interval=1.0 if args.smoke else 2.0,
                ingress_interval=0.25 if args.smoke else args.ingress_interval, only=args.only,
                deadline=time.monotonic() + (75.0 if args.smoke else args.budget),
                start_timeout=40.0 if args.smoke else 90.0, max_window=args.max_window,
                first_round_wait=20.0 if args.smoke else args.first_round_wait,
                ingress_window=3.0 if args.smoke else args.ingress_window, cluster_check_interval=3600.0)
    with Results("probe_count", args.out, smoke=args.smoke) as results:
        try:
            import uvloop
        except ImportError:  # pragma: no cover
            asyncio.run(run(plan, results))
        else:
            uvloop.run(run(plan, results))
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
    sys.exit(130)
