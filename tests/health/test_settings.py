from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from health.settings import HealthMode, HealthSettings


def test_defaults() -> None:
    settings = HealthSettings()
    assert settings.mode is HealthMode.IN_PROCESS
    assert settings.port == 8086
    assert settings.listen_addresses == ("0.0.0.0", "::")
    assert settings.stale_after_seconds == 15.0


def test_every_field_documents_its_trade_off() -> None:
    for name, info in HealthSettings.model_fields.items():
        assert info.description and len(info.description) > 30, name


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"listen_addresses": ("localhost",)}, "listen_addresses"),
        ({"listen_addresses": ()}, "listen_addresses"),
        ({"port": 70000}, "port"),
        ({"stale_after_seconds": 0}, "stale_after_seconds"),
        ({"heartbeat_interval_seconds": 6.0}, "heartbeat_interval_seconds"),
        ({"feed_reconnect_max_seconds": 10.0}, "feed_reconnect_max_seconds"),
        ({"feed_socket": Path("/" + "x" * 200)}, "feed_socket"),
        ({"mode": "elsewhere"}, "mode"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_settings_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError, match=field):
        HealthSettings.model_validate(changes)


def test_addresses_are_normalized() -> None:
    settings = HealthSettings(listen_addresses=("127.0.0.1", "::0001", "127.0.0.1"))
    assert settings.listen_addresses == ("127.0.0.1", "::1")
