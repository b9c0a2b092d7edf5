"""``region-agent health``: the health listener as its own process, fed by the agent.

Run in a second container of the agent's pod (sharing an emptyDir for the feed socket),
it answers port 8086 on its own core, so a DNS flood that saturates the agent's event loop
can not slow or time out health answers. It knows only what the agent feeds it
(:class:`region_agent.health.feed.FeedSubscriber`) and answers 503 ``stale`` for every project once the
agent has not vouched for its view within ``stale_after_seconds``.

The lead's CLI calls :func:`run_sidecar`; ``python -m region_agent.health.sidecar`` (:func:`main`) is
the same with a few flags, for tests, benches and debugging.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from region_agent.base.clock import Clock
from region_agent.base.logs import setup_logging
from region_agent.base.names import region_name
from region_agent.base.tasks import cancel_and_wait, create_guarded_task
from region_agent.health.feed import FeedSubscriber
from region_agent.health.listener import HealthListener, Role
from region_agent.health.metrics import ListenerMetrics, ViewCollector
from region_agent.health.settings import HealthMode, HealthSettings

__all__ = ["main", "run_sidecar"]


async def run_sidecar(
    settings: HealthSettings,
    *,
    region: str,
    registry: CollectorRegistry | None = None,
    clock: Clock | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve health answers from the agent's feed until ``stop`` is set or the task is cancelled.

    Binds the public listener (``port``) and the sidecar's operator listener
    (``sidecar_operator_port``: its own /metrics) first, so a bad address fails at once with
    the setting named, then follows the feed. Until the first view arrives every project answers 503 ``stale``
    and ``/readyz`` is 503.
    """
    registry = registry if registry is not None else CollectorRegistry()
    subscriber = FeedSubscriber.from_settings(settings, region=region, registry=registry, clock=clock)
    metrics = ListenerMetrics(registry)
    registry.register(ViewCollector(subscriber.current))
    listener = HealthListener(
        region=region, source=subscriber, settings=settings, registry=registry, clock=clock, metrics=metrics
    )
    # The sidecar's own metrics (feed, requests) on its operator port; the agent has 8087.
    operator = HealthListener(
        region=region, source=subscriber, settings=settings, registry=registry, clock=clock, metrics=metrics,
        role=Role.OPERATOR, port=settings.sidecar_operator_port,
    )
    await listener.start()
    try:
        await operator.start()
    except BaseException:
        await listener.stop()
        raise
    gc.freeze()  # start-up objects live as long as the process: keep them out of GC pauses
    feed = create_guarded_task(subscriber.run(), name="health-feed-subscriber")
    try:
        await (stop.wait() if stop is not None else asyncio.Event().wait())
    finally:
        await cancel_and_wait([feed], budget=2.0)
        await operator.stop()
        await listener.stop()


def _parse(argv: Sequence[str] | None) -> tuple[HealthSettings, str, str]:
    defaults = HealthSettings()
    parser = argparse.ArgumentParser(prog="python -m region_agent.health.sidecar", description=__doc__.splitlines()[0])
    parser.add_argument("--region", required=True, help="this region's name, e.g. sfo1")
    parser.add_argument("--feed-socket", type=Path, default=defaults.feed_socket)
    parser.add_argument("--listen", action="append", help="listen address (repeatable)")
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--operator-port", type=int, default=defaults.sidecar_operator_port,
                        help="the sidecar's own /metrics (loopback unless --operator-listen)")
    parser.add_argument("--operator-listen", action="append", help="operator listen address (repeatable)")
    parser.add_argument("--stale-after", type=float, default=defaults.stale_after_seconds)
    parser.add_argument("--heartbeat-interval", type=float, default=defaults.heartbeat_interval_seconds,
                        help="only checked against --stale-after (the agent sends the heartbeats)")
    parser.add_argument("--reconnect-max", type=float, default=defaults.feed_reconnect_max_seconds)
    parser.add_argument("--request-log-per-second", type=float, default=defaults.request_log_per_second)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    settings = HealthSettings(
        mode=HealthMode.SIDECAR,
        feed_socket=args.feed_socket,
        listen_addresses=tuple(args.listen) if args.listen else defaults.listen_addresses,
        port=args.port,
        sidecar_operator_port=args.operator_port,
        operator_listen_addresses=(
            tuple(args.operator_listen) if args.operator_listen else defaults.operator_listen_addresses
        ),
        stale_after_seconds=args.stale_after,
        heartbeat_interval_seconds=args.heartbeat_interval,
        feed_reconnect_max_seconds=args.reconnect_max,
        request_log_per_second=args.request_log_per_second,
    )
    return settings, region_name(args.region), args.log_level


def main(argv: Sequence[str] | None = None) -> int:
    try:
        settings, region, log_level = _parse(argv)
    except ValueError as exc:  # pydantic's ValidationError names the field
        print(f"health sidecar: bad settings: {exc}", file=sys.stderr)
        return 2
    setup_logging(region=region, level=log_level)

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        await run_sidecar(settings, region=region, stop=stop)

    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(serve())
    else:
        uvloop.run(serve())
    return 0


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
