"""Failover and recovery time of region-agent's standalone health checks, measured like the PowerDNS anchor.

    python bench/failover.py                         # agent at interval 2 s and 5 s, PowerDNS at 5 s; ~6 min
    python bench/failover.py --intervals 2 --repeats 3 --no-pdns --no-extras
    python bench/failover.py --smoke                 # agent at 0.5 s with extras, PowerDNS at 1 s: does it run?

Method (``bench/anchors/pdns/RESULTS.md`` section B, ``bench/anchors/gdnsd/RESULTS.md`` section B):
each server under test gets its own pair of fake copies (``region_agent/demo/fake_copy.py`` on
127.0.0.11 = primary and 127.0.0.12 = backup, one free port per server, so every check an
endpoint logs is from that server). For each of ``--repeats`` phases, the bench waits for a
check to land at the primary's endpoint, waits a phase of (i - 0.5)/repeats of the observed
check period, flips the primary (503 ``down``; back to ``ok`` for recovery) and polls
``dig +short`` every 100 ms until the answer changes.

* **total**: flip -> the dig that returned the new answer;
* **to_check**: flip -> arrival of the first check that saw the new state;
* **confirm** (agent): flip -> arrival of the check that decided it (the quick re-check);
* **dns_lag**: that first check -> the new answer (re-check delay + check time + poll step).

Polls run on a 100 ms grid that starts at a random offset after each flip (a grid anchored
at the flip would be phase-locked to the check cycle and hide the poll lag); each poll is one
``dig +short`` process, and "the new answer" is timed when that dig returns.

Model: total ~= (period - phase) + recheck_delay (0.1 s, agent only) + check time + poll lag
(0-100 ms + one dig), so over evenly spread phases the median is ~ interval/2 + 0.1 s + ~0.07 s
and the worst case (a flip just after a check) ~ interval + 0.1 s + 0.12 s.

Extras: a primary that accepts the connection and answers only after the check timeout + 0.5 s,
flipped at phase period/2; and **one lost check**: exactly one check fails (503, a dropped
connection, or a timeout) and the answer is polled every 100 ms from before the failure until
three more check periods have passed (one in ``--smoke``); the agent's answer must never change (PowerDNS 4.7, which
flips on one failure, is run through the same test for comparison).

Goals (issue 2): interval 2 s: median <= 1.5 s, worst <= 2.5 s; interval 5 s: median <= 2.5 s,
worst <= 5.6 s; no flip on one lost check. Results: ``bench/README.md``; every run writes its raw
results (each flip, each lost check, each summary) to the JSON lines file it names at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Results, add_arguments, start_agent
from dns_rig import (
    AGENT_ZONE,
    BACKUP,
    HA_NAME,
    PRIMARY,
    Endpoint,
    Procs,
    Server,
    dig,
    free_port,
    need_tools,
    now,
    start_endpoint,
    start_pdns,
    wait_answer,
)

POLL = 0.1
# The poll grid starts at a random offset after each flip: flips sit at fixed phases of the check
# cycle, so a grid anchored at the flip would be phase-locked to the checks and hide the poll lag.
RNG = random.Random(20261129)
GOALS = {2.0: (1.5, 2.5), 5.0: (2.5, 5.6)}  # interval -> (median, worst)


@dataclass
class Rig:
    name: str
    server: Server
    primary: Endpoint
    backup: Endpoint
    interval: float
    recheck: float  # 0 for PowerDNS
    timeout: float  # of one check
    results: Results
    lost_periods: int = 3  # check periods a lost-check run polls for
    period: float = 0.0
    fails: list[float] = field(default_factory=list)
    recs: list[float] = field(default_factory=list)
    lost_check: list[str] = field(default_factory=list)


@dataclass
class Flip:
    phase: float
    total: float | None
    to_check: float | None
    confirm: float | None
    dns_lag: float | None
    answer: str


def sleep_until(t: float) -> None:
    delay = t - now()
    if delay > 0:
        time.sleep(delay)


def observed_period(rig: Rig) -> float:
    """Median gap between regular checks at the primary (re-checks, < interval/2 apart, left out)."""
    deadline = time.monotonic() + 4 * rig.interval + 5
    while True:
        arrivals = [r.arrived for r in rig.primary.checks()]
        gaps = [b - a for a, b in itertools.pairwise(arrivals) if b - a > rig.interval / 2]
        if len(gaps) >= 2 or time.monotonic() > deadline:
            return statistics.median(gaps[-10:]) if gaps else rig.interval
        time.sleep(0.1)


def flip_measure(rig: Rig, label: str, state: str, phase: float, away: bool, timeout: float = 30.0) -> Flip:
    """Sync to a check landing at the primary, wait ``phase``, flip it, poll dig until the answer changes."""
    synced = rig.primary.wait_check(now(), timeout=3 * rig.interval + 5)
    if synced is None:
        raise RuntimeError(f"{rig.name}: no health check seen at the primary")
    sleep_until(synced.arrived + phase)
    t0 = rig.primary.set(state)
    offset = RNG.uniform(0, POLL)
    t1: float | None = None
    answer = ""
    k = 0
    while now() - t0 < timeout:
        sleep_until(t0 + offset + k * POLL)
        answer = dig(rig.server.port, HA_NAME)
        if (away and answer and PRIMARY not in answer) or (not away and PRIMARY in answer.split()):
            t1 = now()
            break
        k += 1
    first = rig.primary.wait_check(t0, timeout=rig.interval + 6)
    decider = rig.primary.wait_check(t0, timeout=rig.interval + 6, count=2) if rig.recheck else first
    flip = Flip(
        phase=t0 - synced.arrived,
        total=None if t1 is None else t1 - t0,
        to_check=None if first is None else first.arrived - t0,
        confirm=None if decider is None else decider.arrived - t0,
        dns_lag=None if t1 is None or first is None else t1 - first.arrived,
        answer=answer,
    )
    model = (rig.period - flip.phase) % rig.period + rig.recheck
    if state.startswith("hang"):
        model += rig.timeout * (2 if rig.recheck else 1)  # each failing check waits out the timeout
    print(f"  {label:<16} phase={flip.phase:.3f}s total={fmt(flip.total)} to_check={fmt(flip.to_check)} "
          f"confirm={fmt(flip.confirm)} dns_lag={fmt(flip.dns_lag)} model~{model:.2f}s+poll "
          f"(grid offset {offset * 1000:.0f} ms) answer='{answer}'", flush=True)
    rig.results.add("flip", server=rig.name, interval=rig.interval, label=label, state=state, model=round(model, 3),
                    **asdict(flip))
    return flip


def fmt(value: float | None) -> str:
    return "TIMEOUT" if value is None else f"{value:.3f}s"


def lost_check(rig: Rig, failure: tuple[str, ...]) -> str:
    """The next request(s) fail as given, then ``ok``; poll the answer until two more regular checks passed."""
    synced = rig.primary.wait_check(now(), timeout=3 * rig.interval + 5)
    if synced is None:
        raise RuntimeError(f"{rig.name}: no health check seen at the primary")
    sleep_until(synced.arrived + 0.2)
    answers: dict[str, int] = {}
    t0 = rig.primary.set("ok", once=failure)
    end = t0 + rig.lost_periods * rig.period + (rig.timeout + 0.5 if failure[0].startswith("hang") else 0.5)
    k = 0
    first_change: float | None = None
    while now() < end:
        answer = dig(rig.server.port, HA_NAME)
        answers[answer] = answers.get(answer, 0) + 1
        if answer != PRIMARY and first_change is None:
            first_change = now() - t0
        k += 1
        sleep_until(t0 + k * POLL)
    seen = sorted((r for r in rig.primary.checks() if r.arrived > t0), key=lambda r: r.arrived)

    def bad(status: int, took: float) -> bool:
        return status != 200 or took >= rig.timeout

    def note(i: int) -> str:
        r = seen[i]
        if r.finished - r.arrived > 1:
            return f"(after {r.finished - r.arrived:.1f}s)"
        if i and seen[i - 1].status == 0 and r.arrived - seen[i - 1].arrived < 0.05:
            return "(client's immediate retry)"
        return ""

    trail = ", ".join(f"+{r.arrived - t0:.3f}s:{r.status or 'dropped'}{note(i)}" for i, r in enumerate(seen))
    failed = sum(bad(r.status, r.finished - r.arrived) for r in seen)
    changed = set(answers) != {PRIMARY}
    verdict = "CHANGED" if changed else "never changed"
    what = " + ".join(failure)
    result = (f"one lost check ({what}): {sum(answers.values())} polls over {end - t0:.1f} s, answers "
              f"{answers} -> {verdict}" + (f" (first at +{first_change:.2f} s)" if first_change else "")
              + f"; requests after the failure was armed: {trail} ({failed} failed)")
    print("  " + result, flush=True)
    rig.results.add("lost_check", server=rig.name, interval=rig.interval, failure=list(failure),
                    polls=sum(answers.values()), seconds=round(end - t0, 3), answers=answers, changed=changed,
                    first_change=first_change, failed_requests=failed, requests=len(seen))
    # settle back to the primary before the next measurement
    wait_answer(rig.server, PRIMARY, 3 * rig.interval + 10)
    return ("FLIPPED" if changed else "held") + f" on {what} ({failed} failed request(s))"


def run_rig(rig: Rig, repeats: int, extras: bool, failures: tuple[tuple[str, ...], ...]) -> None:
    print(f"\n==================== {rig.name}: {rig.server.notes} ====================")
    rig.primary.set("ok")
    rig.backup.set("ok")
    print(f"precondition: answer '{PRIMARY}' after {wait_answer(rig.server, PRIMARY, 30):.2f} s")
    rig.period = observed_period(rig)
    rig.results.add("period", server=rig.name, interval=rig.interval, observed=round(rig.period, 4))
    print(f"observed check period at the primary: {rig.period:.3f} s (configured {rig.interval:g} s)")
    for i in range(1, repeats + 1):
        phase = rig.period * (i - 0.5) / repeats
        f = flip_measure(rig, f"[{i}] failover", "down", phase, away=True)
        if f.total is not None:
            rig.fails.append(f.total)
        r = flip_measure(rig, f"[{i}] recovery", "ok", phase, away=False)
        if r.total is not None:
            rig.recs.append(r.total)
    if extras:
        hang = f"hang {rig.timeout + 0.5:g}"  # answers, but only after the check has timed out
        flip_measure(rig, "[hang] failover", hang, rig.period * 0.5, away=True)
        flip_measure(rig, "[hang] recovery", "ok", rig.period * 0.5, away=False)
        for failure in failures:
            rig.lost_check.append(lost_check(rig, tuple(hang if f == "hang" else f for f in failure)))
    summary(rig)
    rig.results.add("summary", server=rig.name, interval=rig.interval, period=round(rig.period, 4),
                    recheck=rig.recheck, timeout=rig.timeout, failover=rig.fails, recovery=rig.recs,
                    failover_median=statistics.median(rig.fails) if rig.fails else None,
                    failover_worst=max(rig.fails, default=None),
                    recovery_median=statistics.median(rig.recs) if rig.recs else None,
                    recovery_worst=max(rig.recs, default=None), lost_check=rig.lost_check)


def stats(values: list[float]) -> str:
    if not values:
        return "n/a"
    each = ", ".join(f"{v:.3f}" for v in values)
    return f"median {statistics.median(values):.3f} s, worst {max(values):.3f} s ({each})"


def summary(rig: Rig) -> None:
    print(f"{rig.name} failover: {stats(rig.fails)}")
    print(f"{rig.name} recovery: {stats(rig.recs)}")
    if rig.period:
        print(f"  model: median ~ {rig.period / 2 + rig.recheck + 0.07:.2f} s (period/2 + re-check + poll), worst "
              f"possible (flip just after a check) ~ {rig.period + rig.recheck + 0.12:.2f} s")
    goal = GOALS.get(rig.interval) if rig.recheck else None
    if goal and rig.fails and rig.recs:
        for what, values in (("failover", rig.fails), ("recovery", rig.recs)):
            med, worst = statistics.median(values), max(values)
            print(f"  goal at interval {rig.interval:g} s ({what}): median <= {goal[0]} s "
                  f"{'met' if med <= goal[0] else 'MISSED'} ({med:.3f}), worst <= {goal[1]} s "
                  f"{'met' if worst <= goal[1] else 'MISSED'} ({worst:.3f})")


# 'drop' twice: aiohttp (the agent's client) silently retries a GET whose connection was closed without
# an answer, so one failed agent check is two dropped connections; one drop alone is shown too (for the
# agent it is no failed check at all; for PowerDNS it is). 'hang': longer than the check timeout.
FAILURES: tuple[tuple[str, ...], ...] = (("down",), ("drop",), ("drop", "drop"), ("hang",))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--intervals", type=float, nargs="+", default=[2.0, 5.0], help="agent check intervals")
    parser.add_argument("--repeats", type=int, default=5, help="phases per interval")
    parser.add_argument("--pdns-interval", type=int, default=5, help="PowerDNS lua-health-checks-interval")
    parser.add_argument("--no-pdns", action="store_true", help="skip PowerDNS 4.7 side by side")
    parser.add_argument("--no-extras", action="store_true", help="skip the hang and one-lost-check runs")
    parser.add_argument("--keep-tmp", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    if not 1 <= args.repeats <= 20 or any(not 0.5 <= i <= 60 for i in args.intervals) or args.pdns_interval < 1:
        parser.error("--repeats 1..20, --intervals 0.5..60, --pdns-interval >= 1")
    # smoke: one phase of everything; the extras (hang, one lost check polled for one period) on the
    # agent only, whose checks can run every 0.5 s; PowerDNS at its shortest interval, 1 s
    intervals = [0.5] if args.smoke else args.intervals
    repeats, lost_periods = (1, 1) if args.smoke else (args.repeats, 3)
    failures = (("down",),) if args.smoke else FAILURES
    pdns_interval = 1 if args.smoke else args.pdns_interval
    need_tools("dig", *(() if args.no_pdns else ("pdns_server",)))
    tmp = Path(tempfile.mkdtemp(prefix="dns-failover."))
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}  cores: {len(os.sched_getaffinity(0))}",
          flush=True)
    rigs: list[Rig] = []
    tools = ("dig",) if args.no_pdns else ("dig", "pdns_server")
    try:
        with Results("failover", args.out, smoke=args.smoke, tools=tools) as results, Procs(tmp) as procs:
            def pair(name: str) -> tuple[Endpoint, Endpoint]:
                port = free_port((PRIMARY, BACKUP), udp=False)
                return (start_endpoint(procs, f"{name}-primary", PRIMARY, port),
                        start_endpoint(procs, f"{name}-backup", BACKUP, port))

            for interval in intervals:
                name = f"agent-interval-{interval:g}"
                primary, backup = pair(name)
                timeout = min(2.0, interval)
                server = start_agent(procs, name, AGENT_ZONE,
                                     checks={"port": primary.port, "interval": interval, "timeout": timeout})
                server.notes.update({"checks.interval": f"{interval:g}", "checks.timeout": f"{timeout:g}",
                                     "recheck_delay": "0.1", "fall": "2", "rise": "2"})
                rigs.append(Rig(name, server, primary, backup, interval, 0.1, timeout, results, lost_periods))
            if not args.no_pdns:
                primary, backup = pair("pdns")
                name = f"pdns-interval-{pdns_interval}"
                server = start_pdns(procs, name, primary.port, lua="shared", interval=pdns_interval)
                # timeout=2 is in the ifurlup record (dns_rig.ifurlup_record)
                rigs.append(Rig(name, server, primary, backup, pdns_interval, 0.0, 2.0, results, lost_periods))
            for rig in rigs:
                run_rig(rig, repeats, not args.no_extras and (rig.recheck > 0 or not args.smoke), failures)
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n==================== SUMMARY ====================")
    for rig in rigs:
        summary(rig)
        for line in rig.lost_check:
            print(f"  one lost check: {line}")
    agents = [r for r in rigs if r.recheck and r.interval == pdns_interval and r.fails and r.recs]
    pdns = [r for r in rigs if not r.recheck and r.fails and r.recs]
    if agents and pdns:
        a, p = agents[0], pdns[0]
        print(f"agent/pdns at interval {pdns_interval}, median failover: {statistics.median(a.fails):.3f} / "
              f"{statistics.median(p.fails):.3f} = {statistics.median(a.fails) / statistics.median(p.fails):.2f}; "
              f"recovery {statistics.median(a.recs) / statistics.median(p.recs):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
