"""The container image: built with podman from container/Dockerfile, run, queried, stopped with SIGTERM.

Slow (about a minute). Needs root, podman, runc and the cache that `container/prepare-base.sh`
makes once (a debootstrap bookworm base and the dependency wheels): the test itself uses no
network but loopback. Everything it creates — images, the container, podman's storage — lives
under the test's own directory and is removed at the end.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import wait_for
from tests.fakes.dns_client import answers
from tests.fakes.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("REGION_AGENT_IMAGE_CACHE", "/var/cache/region-agent-image"))
DRAIN = 2.0
BUDGET = 15.0
GRACE = DRAIN + BUDGET + 5  # what the chart gives the pod (terminationGracePeriodSeconds)
ZONE = """regions:
  sfo1: {ipv4: [127.0.0.41], ns_ipv4: [127.0.0.1]}
projects:
  shop: {regions: [sfo1], primary: sfo1}
"""
CONTAINERS_CONF = """[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""

pytestmark = [
    pytest.mark.external,
    pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("podman") and shutil.which("runc")),
                       reason="needs root, podman and runc (scripts/system-packages.sh)"),
    pytest.mark.skipif(not (CACHE / "base.tar").is_file() or not (CACHE / "context" / "wheels").is_dir(),
                       reason=f"no image cache in {CACHE}: run container/prepare-base.sh"),
]


class Podman:
    """podman with its own storage, configuration and names, all under one directory."""

    def __init__(self, home: Path) -> None:
        self.home = home
        home.mkdir()
        (home / "containers.conf").write_text(CONTAINERS_CONF)
        self.env = {**os.environ, "CONTAINERS_CONF": str(home / "containers.conf")}
        self.global_args = ["--root", str(home / "storage"), "--runroot", str(home / "run"),
                            "--tmpdir", str(home / "tmp"), "--cgroup-manager", "cgroupfs", "--runtime", "runc"]
        (home / "tmp").mkdir()

    def __call__(self, *args: str, timeout: float = 300, stdin: Path | None = None,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        with open(stdin, "rb") if stdin else open(os.devnull, "rb") as source:
            result = subprocess.run(["podman", *self.global_args, *args], stdin=source, capture_output=True,
                                    timeout=timeout, env=self.env, check=False, text=True)
        if check and result.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)}: {result.returncode}\n{result.stdout}\n{result.stderr}")
        return result

    def clean(self) -> None:
        self("rm", "--all", "--force", "--time", "0", check=False, timeout=60)
        self("rmi", "--all", "--force", check=False, timeout=120)
        self("system", "reset", "--force", check=False, timeout=120)
        shutil.rmtree(self.home.parent, ignore_errors=True)


@pytest.fixture
def podman() -> Iterator[Podman]:
    # podman refuses a run root longer than 50 characters: a short directory of the test's own
    runner = Podman(Path(tempfile.mkdtemp(prefix="ra-image-test-", dir="/tmp")) / "p")
    try:
        yield runner
    finally:
        runner.clean()


def _context(tmp_path: Path) -> Path:
    """The build context: the cached dependency wheels and tini, and this checkout's own wheel."""
    context = tmp_path / "context"
    shutil.copytree(CACHE / "context", context, ignore=shutil.ignore_patterns("region_agent-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-index", "--find-links",
                    str(CACHE / "context" / "wheels"), "--wheel-dir", str(context / "wheels"), str(ROOT)],
                   check=True, timeout=300, capture_output=True)
    return context


async def _readyz(port: int) -> tuple[int, str]:
    try:
        async with aiohttp.ClientSession() as http, \
                http.get(f"http://127.0.0.1:{port}/readyz", timeout=aiohttp.ClientTimeout(total=2)) as r:
            return r.status, await r.text()
    except aiohttp.ClientError:
        return 0, ""


async def _answers(port: int) -> set[str]:
    return await answers(port, "shop.g.example.com", timeout=0.5) or set()


async def test_the_image_builds_answers_and_drains_on_sigterm(podman: Podman, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:12]
    base, image, name = f"localhost/ra-test-base:{tag}", f"localhost/ra-test:{tag}", f"ra-test-{tag}"
    podman("import", "-", base, stdin=CACHE / "base.tar")
    podman("build", "--network=host", "--build-arg", f"BASE={base}", "-f", str(ROOT / "container" / "Dockerfile"),
           "-t", image, str(_context(tmp_path)), timeout=600)
    inspect = podman("image", "inspect", "--format", "{{.Config.User}} {{.Config.Entrypoint}} {{.Config.Healthcheck}}",
                     image).stdout.strip()
    assert inspect.startswith("10001:10001 [/usr/local/bin/tini -- /opt/region-agent/bin/region-agent]"), inspect
    assert inspect.endswith("<nil>"), inspect  # no HEALTHCHECK

    conf = tmp_path / "conf"
    conf.mkdir()
    dns_port, http_port, operator_port = free_port(), free_port(), free_port()
    (conf / "zone.yaml").write_text(ZONE)
    (conf / "agent.yaml").write_text(f"""
region: sfo1
zone_file: zone.yaml
shutdown_drain_seconds: {DRAIN}
shutdown_budget: {BUDGET}
dns: {{zone: g.example.com, listen_addresses: [127.0.0.1], port: {dns_port}}}
checks: {{host: runr-health.g.example.com, port: {free_port()}, interval: 0.5, timeout: 0.4}}
health: {{listen_addresses: [127.0.0.1], port: {http_port}, operator_port: {operator_port}}}
""")
    for path in conf.iterdir():
        path.chmod(0o644)
    conf.chmod(0o755)
    podman("run", "--detach", "--name", name, "--network=host", "--read-only", "--cap-drop=ALL",
           "--volume", f"{conf}:/etc/region-agent:ro", image, "run", "--config", "/etc/region-agent/agent.yaml")

    async def ready() -> bool:
        return (await _readyz(http_port))[0] == 200
    try:
        await wait_for(ready, timeout=30, message="/readyz 200 from the container")
    except AssertionError:
        raise AssertionError(podman("logs", name, check=False).stderr) from None
    assert await _answers(dns_port) == {"127.0.0.41"}
    top = podman("top", name, "user", "pid", "args").stdout
    assert "10001       1           /usr/local/bin/tini" in top, top

    podman("kill", "--signal", "TERM", name)
    signalled = time.monotonic()

    async def draining() -> tuple[int, str] | None:
        answer = await _readyz(http_port)
        return answer if answer[0] == 503 else None
    assert await wait_for(draining, timeout=DRAIN, message="/readyz draining") == (503, "not ready: draining")
    assert await _answers(dns_port) == {"127.0.0.41"}  # DNS still answers while the load balancer drops it
    exit_code = podman("wait", name, timeout=GRACE + 10).stdout.strip()
    elapsed = time.monotonic() - signalled
    assert exit_code == "0", podman("logs", name, check=False).stderr
    assert DRAIN * 0.9 <= elapsed < GRACE, elapsed
    assert '"msg": "stopping"' in podman("logs", name).stderr
