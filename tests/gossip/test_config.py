"""The timing formulas and the presets derived from one base."""

from __future__ import annotations

import math

import pytest

from region_agent.gossip.config import GossipConfig, base, lan, suspicion_timeout, wan


def test_presets_derive_from_base() -> None:
    assert lan() == base()
    w = wan()
    assert w.probe_interval == 5 * base().probe_interval
    assert w.probe_interval >= 2 * w.probe_timeout
    assert w.suspicion_mult == base().suspicion_mult + 1
    assert w.gossip_nodes == base().gossip_nodes + 1
    assert w.indirect_checks == base().indirect_checks


@pytest.mark.parametrize(("members", "minimum"), [(1, 1.2), (5, 1.2), (10, 1.2), (100, 2.4), (1000, 3.6)])
def test_suspicion_min_scales_with_log_n(members: int, minimum: float) -> None:
    config = GossipConfig()
    assert config.suspicion_min(members) == pytest.approx(minimum)
    assert config.suspicion_max(members) == pytest.approx(6 * minimum)


@pytest.mark.parametrize(("members", "limit"), [(1, 4), (9, 4), (10, 8), (99, 8), (100, 12), (1000, 16)])
def test_retransmit_limit(members: int, limit: int) -> None:
    assert GossipConfig().retransmit_limit(members) == limit


def test_expected_confirmations_drop_to_zero_in_tiny_clusters() -> None:
    config = GossipConfig(suspicion_mult=4)
    assert config.expected_confirmations(10) == 2
    assert config.expected_confirmations(3) == 0


@pytest.mark.parametrize(("confirmations", "expected_timeout"), [
    (0, 60.0), (1, 60.0 - 50.0 * math.log(2) / math.log(4)), (3, 10.0), (7, 10.0)])
def test_lifeguard_timeout(confirmations: int, expected_timeout: float) -> None:
    assert suspicion_timeout(10.0, 60.0, confirmations, 3) == pytest.approx(expected_timeout)


def test_no_expected_confirmations_means_minimum() -> None:
    assert suspicion_timeout(10.0, 60.0, 0, 0) == 10.0


def test_push_pull_interval_grows_for_big_clusters() -> None:
    config = GossipConfig(push_pull_interval=30.0)
    assert config.push_pull_every(32) == 30.0
    assert config.push_pull_every(64) == 60.0
    assert config.push_pull_every(1000) == 30.0 * 6
    assert config.reconnect_every(1000) == config.reconnect_interval * 6


@pytest.mark.parametrize("change", [{"probe_timeout": 0.6}, {"probe_timeout": 0.3}, {"probe_interval": 0.0},
                                    {"indirect_checks": 0}, {"packet_bytes": 100}])
def test_invalid_config_refused(change: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GossipConfig(**change)  # type: ignore[arg-type]
