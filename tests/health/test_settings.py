from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from region_agent.health.settings import HealthMode, HealthSettings


def test_defaults() -> None:
    settings = HealthSettings()
    assert settings.mode is HealthMode.IN_PROCESS
    assert settings.port == 8086
    assert settings.listen_addresses == ("0.0.0.0", "::")
    assert settings.stale_after_seconds == 15.0
    assert (settings.operator_listen_addresses, settings.operator_port) == (("127.0.0.1",), 8087)
    assert settings.operator_token_file is None


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


def test_an_operator_token_file_must_be_readable_and_not_empty(tmp_path: Path) -> None:
    good = tmp_path / "token"
    good.write_text("s3cret\n")
    assert HealthSettings(operator_token_file=good).operator_token_file == good
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for bad, words in ((tmp_path / "missing", "No such file"), (empty, "is empty")):
        with pytest.raises(ValidationError, match="operator_token_file") as failure:
            HealthSettings(operator_token_file=bad)
        assert words in str(failure.value)
