"""Gossip membership in virtual time: N agents (up to 1,000) on the in-memory network.

Every agent is a real :class:`region_agent.gossip.membership.Membership` exchanging real encoded messages
through :mod:`region_agent.gossip.simnet` (loss, latency); only time is simulated, so the figures are
protocol figures (seconds of simulated time, messages and bytes on the wire), not CPU figures.
Datagram sizes include the keyring's 29 bytes of encryption overhead; IP/UDP headers are not counted.

Scenarios, for each N of ``--sizes`` (a converged cluster that has run ``--warmup`` seconds):

* **load**: packets and bytes per agent per second at steady state (no loss), datagrams and
  push-pull streams separately;
* **broadcast**: one agent broadcasts a 100-byte user message (the stand-in for a store change);
  time until every other agent delivered it;
* **failure**: one agent is stopped without a leave (kill -9); time until the first agent suspects
  it, and until every survivor lists it dead; any other death is a false failure;

and separately:

* **false failures**: ``--ff-sizes`` agents under ``--loss`` packet loss for ``--ff-seconds``;
* **join**: ``--join-n`` agents, all running and unjoined; at t0 all but one join the first at once
  (Serf's "warm join"); time until every agent lists all as alive, ``--join-reps`` times.

Goals (issue 9): a change reaches all 1,000 in < 5 s; a killed agent is known dead by all in < 10 s
at 1,000 and in at most half Serf's time at 5/20/50; 0 false failures at 5 % loss over 10 minutes;
a 50-agent simultaneous join complete everywhere within 3 s in 10 of 10 runs. Serf's figures (from
``../shared/bench/anchors/serf/RESULTS.md``, measured on this machine) are printed beside ours.

    python bench/gossip_sim.py                       # N = 5, 20, 50, 1000; about 5 min
    python bench/gossip_sim.py --smoke               # a few seconds
    python bench/gossip_sim.py --sizes 50 --ff-sizes 50 --ff-seconds 60 --join-reps 3
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import Results, add_arguments

from region_agent.gossip.config import GossipConfig, lan, wan
from region_agent.gossip.messages import State
from region_agent.gossip.simnet import SimCluster

# Serf 0.9.4 on this machine (RESULTS.md, medians of 3): event with coalescing off reaching all
# handlers, and a kill -9 reported failed by all survivors.
SERF_EVENT_ALL_S = {5: 0.214, 20: 0.392, 50: 0.430}
SERF_FAILED_ALL_S = {5: 5.412, 20: 7.315, 50: 9.721}


def run_until(cluster: SimCluster, condition: Callable[[], bool], limit: float, step: float = 0.02) -> float | None:
    """Simulated seconds until ``condition`` holds (checked every ``step``), None past ``limit``."""
    start = cluster.scheduler.now()
    for _ in range(int(limit / step) + 1):
        if condition():
            return round(cluster.scheduler.now() - start, 3)
        cluster.run_for(step)
    return None


def everyone_converged(cluster: SimCluster) -> bool:
    names = {m.local.name for m in cluster.alive()}
    for node in cluster.alive():
        if node.live_count() < len(names):
            return False
        if any((v := node.member(name)) is None or v.state is not State.ALIVE for name in names):
            return False
    return True


def views_at_end(cluster: SimCluster) -> dict[str, int]:
    names = [m.local.name for m in cluster.alive()]
    suspect = missing = 0
    for node in cluster.alive():
        for name in names:
            view = node.member(name)
            if view is None or view.state in (State.DEAD, State.LEFT):
                missing += 1
            elif view.state is State.SUSPECT:
                suspect += 1
    return {"pairs_suspect_at_end": suspect, "pairs_dead_or_missing_at_end": missing}


def wire_totals(cluster: SimCluster) -> tuple[int, int, int, int]:
    s = cluster.network.stats
    return s.packets, s.packet_bytes, s.streams, s.stream_bytes


def scenario_size(n: int, config: GossipConfig, args: argparse.Namespace, seed: int) -> dict[str, Any]:
    started = time.monotonic()
    cluster = SimCluster(config, seed=seed, latency=args.latency)
    nodes = cluster.converged_start(n)
    cluster.run_for(args.warmup)

    # load: a steady-state window with nothing to gossip but probes and push-pulls
    before = wire_totals(cluster)
    cluster.run_for(args.window)
    after = wire_totals(cluster)
    per = n * args.window
    load: dict[str, float] = {"packets_per_agent_s": round((after[0] - before[0]) / per, 2),
            "udp_bytes_per_agent_s": round((after[1] - before[1]) / per, 1),
            "streams_per_agent_s": round((after[2] - before[2]) / per, 4),
            "stream_bytes_per_agent_s": round((after[3] - before[3]) / per, 1)}
    load["total_bytes_per_agent_s"] = round(load["udp_bytes_per_agent_s"] + load["stream_bytes_per_agent_s"], 1)

    # broadcast: one agent's change, until every other agent delivered it
    origin = nodes[0]
    key = "change-1"
    t0 = cluster.scheduler.now()
    origin.broadcast(key, bytes(100))
    receivers = [cluster.events[m.local.name] for m in nodes[1:]]
    reach_all = run_until(cluster, lambda: all(key in e.user for e in receivers), limit=60.0)
    delays = sorted(e.user[key] - t0 for e in receivers if key in e.user)
    broadcast = {"all_s": reach_all,
                 "median_s": round(statistics.median(delays), 3) if delays else None,
                 "reached": len(delays), "of": n - 1}

    # failure: kill -9 one agent
    cluster.run_for(2.0)
    victim = nodes[cluster.rng.randrange(1, n)]
    name = victim.local.name
    t0 = cluster.scheduler.now()
    cluster.kill(name)
    all_dead = run_until(cluster, lambda: cluster.everyone_sees(name, (State.DEAD,)), limit=120.0)
    survivors = [m.local.name for m in cluster.alive()]
    first_suspect = min((t for s in survivors for t, who, _, st in cluster.events[s].changes
                         if who == name and st is State.SUSPECT and t >= t0), default=None)
    first_dead = min((t for s in survivors for t, who, _, st in cluster.events[s].changes
                      if who == name and st is State.DEAD and t >= t0), default=None)
    false_deaths = sum(1 for s in survivors for _, who, _, st in cluster.events[s].changes
                       if who != name and st is State.DEAD)
    failure = {"first_suspect_s": None if first_suspect is None else round(first_suspect - t0, 3),
               "first_dead_s": None if first_dead is None else round(first_dead - t0, 3),
               "all_dead_s": all_dead, "false_failures": false_deaths}
    return {"n": n, "load": load, "broadcast": broadcast, "failure": failure,
            "real_seconds": round(time.monotonic() - started, 1)}


def summarize(n: int, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians (and worst) over the repetitions, with the goals this N must meet."""

    def pick(section: str, key: str) -> list[float | None]:
        return [run[section][key] for run in runs]

    def spread(values: list[float | None]) -> dict[str, Any]:
        done = sorted(v for v in values if v is not None)
        return {"median": round(statistics.median(done), 3) if done else None,
                "max": done[-1] if done else None, "missing": len(values) - len(done), "all": values}

    serf_failed = SERF_FAILED_ALL_S.get(n)
    dead_goal = serf_failed / 2 if serf_failed else 10.0
    broadcast_goal = SERF_EVENT_ALL_S.get(n, 5.0)
    broadcast, dead = spread(pick("broadcast", "all_s")), spread(pick("failure", "all_dead_s"))
    loads = [run["load"] for run in runs]
    load = {key: round(statistics.median(ld[key] for ld in loads), 2) for key in loads[0]}
    # What a packet capture would count: + 28 bytes of IPv4 and UDP header per datagram.
    load["udp_bytes_per_agent_s_with_ip_headers"] = round(
        load["udp_bytes_per_agent_s"] + 28 * load["packets_per_agent_s"], 1)
    first_suspect = spread(pick("failure", "first_suspect_s"))["median"]
    false_failures = sum(run["failure"]["false_failures"] for run in runs)
    return {
        "n": n, "reps": len(runs), "broadcast_all_s": broadcast, "dead_all_s": dead,
        "first_suspect_s": first_suspect, "false_failures": false_failures, "load": load,
        "serf": {"event_all_s": SERF_EVENT_ALL_S.get(n), "failed_all_s": serf_failed},
        "broadcast_goal_s": broadcast_goal, "dead_goal_s": dead_goal,
        "broadcast_ok": broadcast["missing"] == 0 and (broadcast["median"] or 0) <= broadcast_goal,
        "dead_ok": dead["missing"] == 0 and (dead["median"] or 0) <= dead_goal,
        "real_seconds": round(sum(run["real_seconds"] for run in runs), 1),
    }


def scenario_false_failures(n: int, config: GossipConfig, args: argparse.Namespace, seed: int) -> dict[str, object]:
    started = time.monotonic()
    cluster = SimCluster(config, seed=seed, latency=args.latency, loss=args.loss)
    nodes = cluster.converged_start(n)
    before = wire_totals(cluster)
    cluster.run_for(args.ff_seconds)
    after = wire_totals(cluster)
    deaths = sum(1 for m in nodes for _, _, _, st in cluster.events[m.local.name].changes if st is State.DEAD)
    per = n * args.ff_seconds
    return {"n": n, "loss": args.loss, "seconds": args.ff_seconds, "false_failures": deaths,
            "suspicions": sum(m.stats.suspicions for m in nodes),
            "refutations": sum(m.stats.refutations for m in nodes),
            "lost_packets": cluster.network.stats.lost,
            "max_health_score": max(m.health_score for m in nodes),
            "converged_at_end": everyone_converged(cluster),
            # (observer, member) pairs not seen alive at the end: suspicions in flight are normal
            # under loss; dead or missing ones would be failures.
            **views_at_end(cluster),
            "packets_per_agent_s": round((after[0] - before[0]) / per, 2),
            "bytes_per_agent_s": round((after[1] - before[1] + after[3] - before[3]) / per, 1),
            "real_seconds": round(time.monotonic() - started, 1)}


def scenario_join(n: int, config: GossipConfig, args: argparse.Namespace, seed: int) -> dict[str, object]:
    cluster = SimCluster(config, seed=seed, latency=args.latency)
    nodes = [cluster.add(i) for i in range(n)]
    cluster.run_for(1.0)  # all running, none joined
    for node in nodes[1:]:
        node.join([nodes[0].local.addr])
    took = run_until(cluster, lambda: everyone_converged(cluster), limit=120.0)
    return {"n": n, "seed": seed, "all_s": took,
            "push_pulls": sum(m.stats.push_pulls for m in nodes)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--sizes", default="5,20,50,1000", help="cluster sizes for load, broadcast and failure")
    parser.add_argument("--preset", choices=("lan", "wan"), default="lan")
    parser.add_argument("--latency-ms", default="0.5,5", help="one-way latency range, uniform (ms)")
    parser.add_argument("--warmup", type=float, default=5.0, help="simulated seconds before measuring")
    parser.add_argument("--window", type=float, default=30.0, help="simulated seconds of the load window")
    parser.add_argument("--loss", type=float, default=0.05)
    parser.add_argument("--ff-sizes", default="50", help="cluster sizes of the false-failure run")
    parser.add_argument("--ff-seconds", type=float, default=600.0)
    parser.add_argument("--join-n", type=int, default=50)
    parser.add_argument("--join-reps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per N (medians are reported)")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.ff_sizes, args.ff_seconds = "5,20", "8", 20.0
        args.join_n, args.join_reps, args.window, args.reps = 10, 2, 5.0, 1
    low, high = (float(v) / 1000 for v in args.latency_ms.split(","))
    args.latency = (low, high)
    config = lan() if args.preset == "lan" else wan()
    sizes = [int(v) for v in args.sizes.split(",") if v]
    ff_sizes = [int(v) for v in args.ff_sizes.split(",") if v]

    with Results("gossip_sim", args.out, smoke=args.smoke) as results:
        results.add("config", preset=args.preset, latency_ms=[low * 1000, high * 1000], **_fields(config))
        print(f"preset {args.preset}, one-way latency {args.latency_ms} ms, simulated time")
        print(f"{'N':>5} {'bcast all':>10} {'serf evt':>9} {'suspect':>8} {'dead all':>9} {'serf':>6} "
              f"{'goal':>6} {'pkt/s':>6} {'B/s':>7}  false   (medians of --reps)")
        for i, n in enumerate(sizes):
            runs = [scenario_size(n, config, args, args.seed + 10 * i + r) for r in range(args.reps)]
            for run in runs:
                results.add("size_run", **run)
            row = summarize(n, runs)
            results.add("size", **row)
            b, f, ld = row["broadcast_all_s"], row["dead_all_s"], row["load"]
            print(f"{n:>5} {_s(b['median']):>10} {_s(SERF_EVENT_ALL_S.get(n)):>9} {_s(row['first_suspect_s']):>8} "
                  f"{_s(f['median']):>9} {_s(SERF_FAILED_ALL_S.get(n)):>6} {row['dead_goal_s']:>6.2f} "
                  f"{ld['packets_per_agent_s']:>6} {ld['total_bytes_per_agent_s']:>7}  {row['false_failures']}"
                  f"   (max: bcast {_s(b['max'])}, dead {_s(f['max'])}; {row['real_seconds']} s real)")
        for i, n in enumerate(ff_sizes):
            ff = scenario_false_failures(n, config, args, args.seed + 100 + i)
            ff["goal_ok"] = ff["false_failures"] == 0
            results.add("false_failures", **ff)
            print(f"false failures: N={n}, {args.loss:.0%} loss, {args.ff_seconds:.0f} s: {ff['false_failures']} "
                  f"(suspicions {ff['suspicions']}, refutations {ff['refutations']}, "
                  f"{ff['bytes_per_agent_s']} B/s per agent, at the end {ff['pairs_suspect_at_end']} views suspect "
                  f"and {ff['pairs_dead_or_missing_at_end']} dead or missing, "
                  f"{ff['real_seconds']} s real)")
        joins = [scenario_join(args.join_n, config, args, args.seed + 200 + r) for r in range(args.join_reps)]
        times = [j["all_s"] for j in joins]
        complete = [t for t in times if isinstance(t, float) and t <= 3.0]
        for j in joins:
            results.add("join_run", **j)
        results.add("join", n=args.join_n, reps=args.join_reps, all_s=times,
                    max_s=max((t for t in times if isinstance(t, float)), default=None),
                    within_3s=len(complete), goal_ok=len(complete) == args.join_reps)
        print(f"join: {args.join_n} at once, all see all alive after {times} s; within 3 s: "
              f"{len(complete)} of {args.join_reps}")


def _fields(config: GossipConfig) -> dict[str, object]:
    return {f.name: (list(v) if isinstance(v := getattr(config, f.name), tuple) else v)
            for f in dataclasses.fields(config)}


def _s(value: object) -> str:
    return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)


if __name__ == "__main__":
    main()
