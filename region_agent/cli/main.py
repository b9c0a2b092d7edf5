"""``region-agent``: run the agent, its health sidecar, the demo, or inspect a running agent.

Exit codes: 0 done, 1 runtime failure, 2 bad settings or arguments (a port in use included: one line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from region_agent.app.preflight import check_files
from region_agent.app.settings import AgentSettings, SettingsError, load_settings, unknown_env_variables
from region_agent.base.logs import setup_logging
from region_agent.cli.operator_client import CliError, add_operator_arguments, fetch_json, operator_target
from region_agent.globaldns.acme.tsig import TsigConfigError
from region_agent.globaldns.server import BindError
from region_agent.health.listener import ListenError
from region_agent.zonefile.watcher import ZoneFileError

DEMO_CONFIG = Path(__file__).resolve().parent.parent / "demo" / "agent.yaml"
logger = logging.getLogger("region_agent.cli")


def _run(coro: Coroutine[Any, Any, int]) -> int:
    try:
        import uvloop
    except ImportError:  # uvloop is optional off Linux/macOS
        return asyncio.run(coro)
    return int(uvloop.run(coro))


def _settings(args: argparse.Namespace, **overrides: Any) -> AgentSettings:
    if getattr(args, "zone_file", None):
        overrides["zone_file"] = Path(args.zone_file)
    return load_settings(Path(args.config) if args.config else None, **overrides)


def _warn_unknown_env() -> None:
    """One warning per ``REGION_AGENT_*`` variable that is no setting (a typo is otherwise ignored)."""
    for line in unknown_env_variables():
        logger.warning("%s", line)


async def _run_agent(settings: AgentSettings) -> int:
    from region_agent.app.supervisor import Agent

    await Agent(settings).run()
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    settings = _settings(args)
    check_files(settings)  # what check-config checks, before anything binds
    setup_logging(region=settings.region, level=settings.log_level)
    _warn_unknown_env()
    return _run(_run_agent(settings))


def cmd_demo(args: argparse.Namespace) -> int:
    from region_agent.demo.run import run_demo

    if not args.config:
        args.config = str(DEMO_CONFIG)
    settings = _settings(args)
    setup_logging(region=settings.region, level="error" if not args.verbose else "info")
    rounds = args.rounds if args.rounds > 0 else sys.maxsize
    try:
        return _run(run_demo(settings, step_seconds=args.step, rounds=rounds,
                             config=None if args.config == str(DEMO_CONFIG) else args.config))
    except KeyboardInterrupt:
        return 0


def cmd_health(args: argparse.Namespace) -> int:
    from region_agent.health.sidecar import run_sidecar

    settings = _settings(args)
    setup_logging(region=settings.region, level=settings.log_level)
    _warn_unknown_env()

    async def sidecar() -> int:
        await run_sidecar(settings.health, region=settings.region)
        return 0

    return _run(sidecar())


def cmd_zone(args: argparse.Namespace) -> int:
    if args.digest or args.all:
        from region_agent.cli.inspect import cmd_digest

        return cmd_digest(args)
    base, token_file = operator_target(args)
    url = base + "/zone"
    try:
        data = fetch_json(url, token_file)
    except CliError as exc:
        print(f"region-agent zone: {exc}", file=sys.stderr)
        return 1
    if args.delegation:
        from region_agent.globaldns.delegation import delegation_lines, name_servers_from_zone_document

        try:
            zone, servers = name_servers_from_zone_document(data)
        except (ValueError, KeyError, TypeError) as exc:
            print(f"region-agent zone: {url} is not a zone document: {exc}", file=sys.stderr)
            return 1
        if not servers:
            print(f"region-agent zone: no region of {zone} has a name-server address (ns_ipv4, ns_ipv6)",
                  file=sys.stderr)
            return 1
        print(f"; the delegation of {zone}: records to create in its parent zone")
        print("\n".join(delegation_lines(zone, servers, args.ttl)))
        return 0
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(format_zone(data))
    return 0


def format_zone(data: dict[str, Any]) -> str:
    lines = [f"; zone {data.get('zone')}  serial {data.get('serial')}  ready {data.get('ready')}  "
             f"digest {data.get('digest')}"]
    for record in data.get("records", []):
        if record.get("type") == "project":
            lines.append(f"{record['name']}  {record['mode']}  primary={record.get('primary')}  "
                         f"all_down={record['all_down']}  ttl={record['ttl']}")
            for qtype, answer in sorted(record.get("answers", {}).items()):
                if "addresses" in answer:
                    shown = " ".join(answer["addresses"]) or "-"
                    lines.append(f"    {qtype:<5} {answer['outcome']:<8} {shown}   ({answer['why']})")
                else:
                    lines.append(f"    {qtype:<5} proximity among {' '.join(answer['proximity'])}")
            for target in record.get("targets", []):
                failed = target.get("failed_addresses") or []
                note = f"  failed: {' '.join(failed)}" if failed and target["health"] == "healthy" else ""
                reason = f"  ({target['reason']})" if target.get("reason") not in ("", "ok") else ""
                lines.append(f"    target {target['region']:<6} {' '.join(target['addresses']):<30} "
                             f"{target['health']}{reason}{note}")
        elif record.get("type") == "SOA":
            lines.append(f"{record['name']}  SOA  serial={record['serial']} mname={record['mname']}")
        else:
            lines.append(f"{record['name']}  {record['type']}  {' '.join(record.get('addresses', []))}")
    return "\n".join(lines)


def cmd_geoip(args: argparse.Namespace) -> int:
    """The GeoIP database and the reachability self-check of a running agent (its /health/region)."""
    base, token_file = operator_target(args)
    url = base + "/health/region"
    try:
        data = fetch_json(url, token_file)
    except CliError as exc:
        print(f"region-agent geoip: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"geoip": data.get("geoip"), "reachable": data.get("reachable")}, indent=2))
        return 0
    print(format_geoip(data.get("geoip"), data.get("reachable")))
    return 0


def format_geoip(geoip: dict[str, Any] | None, reachable: dict[str, Any] | None) -> str:
    def when(seconds: float | None) -> str:
        return "-" if seconds is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))

    lines = []
    if not geoip:
        lines.append("geoip: not reported by this agent")
    else:
        where = f" {geoip['location']}" if geoip.get("location") else ""
        lines.append(f"geoip: {geoip['state']}  source {geoip['source']}{where}")
        if geoip["state"] == "loaded":
            cached = ", the cached copy" if geoip.get("from_cache") else ""
            lines.append(f"    {geoip.get('database_type')}  {geoip.get('size_bytes')} bytes  built "
                         f"{geoip.get('build_date')}  loaded {when(geoip.get('loaded_at'))}{cached}")
        error = geoip.get("error")
        if error:
            lines.append(f"    error ({error.get('code')}): {error.get('message', '')}")
        failed = geoip.get("refresh_error")
        if failed:
            lines.append(f"    last refresh failed {when(failed.get('at'))} ({failed.get('code')}): "
                         f"{failed.get('message', '')}")
        if geoip.get("next_refresh_at") is not None:
            lines.append(f"    next refresh {when(geoip['next_refresh_at'])}")
    if not reachable or reachable.get("reachable") is None:
        lines.append("reachable: unknown (not checked)")
    else:
        failed_transports = reachable.get("failed_transports") or []
        verdict = "yes" if reachable["reachable"] else f"no, failed over {' and '.join(failed_transports)}"
        addresses = " ".join(reachable.get("addresses") or [])
        lines.append(f"reachable: {verdict}  ({addresses} port {reachable.get('port')}, checked "
                     f"{when(reachable.get('checked_at'))})")
        lines.extend(f"    {line}" for line in reachable.get("errors") or [])
    return "\n".join(lines)


def cmd_check_config(args: argparse.Namespace) -> int:
    """The checks ``run`` makes short of binding and the network; the settings printed, secrets hidden."""
    settings = _settings(args)
    check_files(settings)
    for line in unknown_env_variables():
        print(f"region-agent: warning: {line}", file=sys.stderr)
    if settings.zone_file is not None:
        from region_agent.zonefile.watcher import read_zone_file

        data = read_zone_file(settings.zone_file, settings.zone_file_max_bytes)
        print(f"zone file {settings.zone_file}: {len(data.regions)} regions, {len(data.projects)} projects")
    print(json.dumps(redacted(settings.model_dump(mode="json")), indent=2, default=str))
    return 0


SECRET_KEYS = frozenset(("secret", "token", "password"))  # setting names whose values are secrets
HIDDEN = "**********"  # as pydantic shows a SecretStr


def redacted(data: Any) -> Any:
    """``data`` with the value of every secret-named key hidden (inline TSIG secrets, inline tokens)."""
    if isinstance(data, dict):
        return {k: HIDDEN if k in SECRET_KEYS and v is not None else redacted(v) for k, v in data.items()}
    if isinstance(data, list):
        return [redacted(v) for v in data]
    return data


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="region-agent", description=__doc__.splitlines()[0] if __doc__ else "")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", help="YAML settings file (also REGION_AGENT_CONFIG)")
        p.add_argument("--zone-file", help="standalone mode: YAML file of regions and projects")
        return p

    run = with_config(sub.add_parser("run", help="run the agent"))
    run.set_defaults(func=cmd_run)
    demo = with_config(sub.add_parser("demo", help="run the agent on the demo zone with failing fake copies"))
    demo.add_argument("--step", type=float, default=6.0, help="seconds between failure steps")
    demo.add_argument("--rounds", type=int, default=0, help="times to play the script (0: until Ctrl-C)")
    demo.add_argument("--verbose", action="store_true", help="show the agent's logs")
    demo.set_defaults(func=cmd_demo)
    health = with_config(sub.add_parser("health", help="run the health listener as a sidecar process"))
    health.set_defaults(func=cmd_health)
    zone = sub.add_parser("zone", help="print the zone a running agent answers, with each target's health")
    add_operator_arguments(zone)
    zone.add_argument("--json", action="store_true", help="raw JSON")
    zone.add_argument("--delegation", action="store_true",
                      help="print the NS and glue records the parent zone needs (zone-file lines)")
    zone.add_argument("--ttl", type=int, default=3600, help="TTL of the --delegation records (default 3600)")
    zone.add_argument("--digest", action="store_true", help="this agent's store digest (the control API)")
    zone.add_argument("--all", action="store_true",
                      help="with --digest: every member's digest as last heard; exit 3 while they differ")
    zone.set_defaults(func=cmd_zone)
    from region_agent.cli.zone_import import add_zone_import_parser

    add_zone_import_parser(zone)  # region-agent zone import FILE
    geoip = sub.add_parser("geoip", help="show a running agent's GeoIP database and whether its name server is "
                           "reachable")
    add_operator_arguments(geoip)
    geoip.add_argument("--json", action="store_true", help="raw JSON")
    geoip.set_defaults(func=cmd_geoip)
    check = with_config(sub.add_parser("check-config", help="validate settings and zone file, print them"))
    check.set_defaults(func=cmd_check_config)
    from region_agent.demo import fake_copy

    fake = sub.add_parser("fake-copy", help="a fake copy's health endpoint (/global-health/<slug>) that answers as "
                          "told, for trying failover by hand (the one the demo, tests and benches use)",
                          description="A fake copy: GET /global-health/<slug> answers as told (with --log each "
                          "request is logged). Point a region's ingress address in the zone file at it.",
                          epilog=fake_copy.BEHAVIOURS)
    fake_copy.add_arguments(fake)
    fake.set_defaults(func=fake_copy.run)
    from region_agent.cli.inspect import add_members_parser
    from region_agent.cli.keys import add_keys_parser

    add_keys_parser(sub)
    add_members_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    # BindError, ListenError: a DNS or health port in use, an address not ours; TsigConfigError: an unusable TSIG key
    except (SettingsError, ZoneFileError, BindError, ListenError, TsigConfigError) as exc:
        print(f"region-agent: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
