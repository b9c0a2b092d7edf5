"""Settings validation and building an ApiClient from a kubeconfig."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from region_agent.kube.client import KubeConfigError, api_client_for, build_api_client, load_configuration
from region_agent.kube.resources import KNATIVE_SERVICES
from region_agent.kube.settings import KubeSettings, WatchSettings
from tests.fakes.kube_api import FakeKubeApi
from tests.fakes.kube_api import write_kubeconfig as fake_kubeconfig
from tests.fakes.kube_objects import knative_service


def test_every_field_is_described() -> None:
    for model in (KubeSettings, WatchSettings):
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"watch": {"server_timeout_min": 600, "server_timeout_max": 300}}, "server_timeout_max"),
        ({"watch": {"page_size": 0}}, "page_size"),
        ({"lag_threshold": 0}, "lag_threshold"),
        ({"config": "magic"}, "config"),
        ({"cnpg": {"status_port": 70000}}, "status_port"),
        ({"unknown": 1}, "unknown"),
    ],
)
def test_bad_settings_name_the_field(values: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationError) as raised:
        KubeSettings.model_validate(values)
    assert field in str(raised.value)


def write_kubeconfig(path: Path, server: str) -> Path:
    return fake_kubeconfig(path, server, token="secret-token")


async def test_kubeconfig_client_talks_to_the_api(fake: FakeKubeApi, tmp_path: Path) -> None:
    fake.put(KNATIVE_SERVICES, knative_service("shop"))
    settings = KubeSettings(config="kubeconfig", kubeconfig=str(write_kubeconfig(tmp_path / "config", fake.url)))
    client = await build_api_client(settings)
    try:
        response = await client.call_api(
            KNATIVE_SERVICES.path, "GET", auth_settings=["BearerToken"], _preload_content=False
        )
        assert response.status == 200
        response.release()
    finally:
        await client.close()
    assert fake.list_requests(KNATIVE_SERVICES)


async def test_auto_mode_without_a_pod_reads_the_kubeconfig(fake: FakeKubeApi, tmp_path: Path) -> None:
    path = write_kubeconfig(tmp_path / "config", fake.url)
    configuration = await load_configuration(KubeSettings(kubeconfig=str(path)), environ={})
    assert configuration.host == fake.url
    assert configuration.api_key["BearerToken"] == "Bearer secret-token"


async def test_missing_configuration_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(KubeConfigError, match="kubeconfig"):
        await load_configuration(KubeSettings(kubeconfig=str(tmp_path / "absent")), environ={})
    with pytest.raises(KubeConfigError, match="in-cluster"):
        await load_configuration(KubeSettings(config="in-cluster"), environ={})


async def test_api_client_for_a_plain_url() -> None:
    client = api_client_for("http://127.0.0.1:1")
    assert client.configuration.host == "http://127.0.0.1:1"
    await client.close()
