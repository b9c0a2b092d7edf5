"""HealthService: what the supervisor runs, in both modes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from prometheus_client import CollectorRegistry

from region_agent.base.tasks import cancel_and_wait
from region_agent.health.feed import FeedSubscriber
from region_agent.health.operator import Document
from region_agent.health.service import HealthService
from region_agent.health.settings import HealthMode, HealthSettings
from tests.health.helpers import copy, view, wait_until


async def test_in_process_serves_what_is_published() -> None:
    settings = HealthSettings(listen_addresses=("127.0.0.1",), port=0, operator_port=0)
    service = HealthService(settings, region="sfo1", registry=CollectorRegistry())
    assert service.publisher is None
    await service.start()
    try:
        listener = service.listener
        assert listener is not None
        await wait_until(lambda: listener.addresses, message="listening")
        host, port = listener.addresses[0]
        service.publish(view([copy("shop")]))
        async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/global-health/shop") as response:
            assert (response.status, await response.text()) == (200, "ok")
    finally:
        await service.stop()
    assert listener.addresses == []


async def test_sidecar_mode_publishes_and_keeps_its_own_port(tmp_path: Path) -> None:
    socket_path = tmp_path / "feed.sock"
    settings = HealthSettings(mode=HealthMode.SIDECAR, feed_socket=socket_path, heartbeat_interval_seconds=0.05,
                              listen_addresses=("127.0.0.1",), port=8086, operator_port=0)
    service = HealthService(settings, region="sfo1", registry=CollectorRegistry(),
                            documents={"/zone": Document(lambda: {"serial": 7}, lambda: 7)})
    assert service.listener is None  # the sidecar answers publicly
    assert service.publisher is not None
    published = view([copy("shop")])
    service.publish(published)
    await service.start()
    subscriber = FeedSubscriber(socket_path=socket_path, region="sfo1", stale_after=5.0, registry=CollectorRegistry())
    follow = asyncio.get_running_loop().create_task(subscriber.run())
    try:
        await wait_until(lambda: subscriber.current()[0] == published, message="the view through the socket")
        (host, port), = service.operator.addresses  # the agent's operator port, not the sidecar's 8086
        assert port != 8086 and host == "127.0.0.1"
        async with aiohttp.ClientSession() as http, http.get(f"http://{host}:{port}/zone") as response:
            assert (response.status, await response.json()) == (200, {"serial": 7})
    finally:
        await cancel_and_wait([follow])
        await service.stop()
