"""Every metric the agent exposes is named region_agent_* and explains itself."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.exposition import generate_latest

from region_agent.app.settings import AgentSettings
from region_agent.app.supervisor import Agent


async def test_metric_names_and_help(tmp_path: Path) -> None:
    zone = tmp_path / "zone.yaml"
    zone.write_text("regions: {sfo1: {ipv4: [127.0.0.51]}}\nprojects: {shop: {regions: [sfo1]}}\n")
    agent = Agent(AgentSettings(region="sfo1", zone_file=zone,
                                dns={"listen_addresses": ["127.0.0.1"], "port": 0},
                                health={"listen_addresses": ["127.0.0.1"], "port": 0, "operator_port": 0}))
    await agent.start()
    try:
        families = list(agent.registry.collect())
        text = generate_latest(agent.registry).decode()
    finally:
        await agent.stop()
    names = {family.name for family in families}
    assert {"region_agent_dns_responses", "region_agent_dns_answer_seconds", "region_agent_dns_zone_serial",
            "region_agent_check_targets_by_state", "region_agent_zone_file_reloads"} <= names
    for family in families:
        assert family.name.startswith("region_agent_"), family.name
        assert family.documentation.strip(), f"{family.name} has no help text"
    assert "region_agent_dns_zone_serial " in text
