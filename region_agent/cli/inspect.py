"""``region-agent members`` and ``region-agent zone --digest [--all]``: the cluster as one agent sees it.

Both read the control API of a running agent's operator listener (``/v1/members``, ``/v1/digests``)
with the operator bearer token, like ``serf members`` asks its agent over RPC.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from region_agent.cli.operator_client import CliError, add_operator_arguments, fetch_json, operator_target


def format_members(data: dict[str, Any], now: float | None = None) -> str:
    now = time.time() if now is None else now
    rows = [("NAME", "ADDRESS", "REGION", "ROLE", "STATE", "FOR", "RTT", "DNS-REACHABLE")]
    for m in data.get("members", []):
        since = m.get("since")
        age = "-" if not isinstance(since, (int, float)) else f"{max(0.0, now - since):.0f}s"
        rtt = m.get("rtt_ms")
        reachable = (m.get("meta") or {}).get("dns-reachable", "-")
        rows.append((m["name"], m.get("address", "-"), m["region"], m["role"], m["state"], age,
                     "-" if rtt is None else f"{rtt:.1f}ms", reachable))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    regions = data.get("regions", {})
    summary = ", ".join(f"{name} {state}" for name, state in sorted(regions.items()))
    lines.append(f"# seen from {data.get('region')}: majority {'yes' if data.get('majority') else 'NO'}; {summary}")
    return "\n".join(lines)


def format_digests(data: dict[str, Any], *, all_members: bool) -> str:
    lines = [f"{data.get('region')}/{data.get('node')}  {data.get('digest')}  (this agent)"]
    if all_members:
        for row in data.get("agents", []):
            digest = row.get("digest") or "not heard yet"
            lines.append(f"{row['member']}  {digest}  {'same' if row.get('same') else 'DIFFERENT'}")
        if not data.get("agents"):
            lines.append("# no live peer to compare with: this agent is alone or cut off from the others")
        else:
            lines.append("# converged" if data.get("converged") else "# not converged: anti-entropy is repairing")
    return "\n".join(lines)


def cmd_members(args: argparse.Namespace) -> int:
    url, token_file = operator_target(args)
    try:
        data = fetch_json(url + "/v1/members", token_file)
    except CliError as exc:
        print(f"region-agent members: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2) if args.json else format_members(data))
    return 0


def cmd_digest(args: argparse.Namespace) -> int:
    """``zone --digest``: this agent's store digest, and with ``--all`` every member's; exit 3 when they differ,
    4 when there is no live peer to compare with (an isolated agent is not "converged")."""
    url, token_file = operator_target(args)
    try:
        data = fetch_json(url + "/v1/digests", token_file)
    except CliError as exc:
        print(f"region-agent zone: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(data, indent=2))
    else:
        print(format_digests(data, all_members=args.all))
    if not args.all:
        return 0
    if not data.get("agents"):
        return 4
    return 0 if data.get("converged") else 3


def add_members_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    members = sub.add_parser("members", help="list the gossip members a running agent sees (name, address, "
                             "region, state, RTT)")
    add_operator_arguments(members)
    members.add_argument("--json", action="store_true", help="raw JSON")
    members.set_defaults(func=cmd_members)
