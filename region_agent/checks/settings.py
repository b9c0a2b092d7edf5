"""Settings of the standalone HTTP health checks (env ``REGION_AGENT_CHECKS__<FIELD>``)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from region_agent.checks.checker import CheckConfig
from region_agent.checks.rule import CheckRule


class ChecksSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(
        default="runr-health.g.example.com",
        description="Host of the check URL http://<host>/global-health/<slug>: sent as the Host header to each "
        "region's ingress address, never resolved.",
    )
    port: int = Field(default=80, ge=1, le=65535, description="Port the checks connect to (the URL has none).")
    path: str = Field(default="/global-health/{slug}", description="Check path; {slug} is the project slug.")
    expect: str = Field(default="ok", description="Substring the 200 body must contain (case-sensitive).")
    timeout: float = Field(default=2.0, gt=0, description="A check not answered within this many seconds fails.")
    interval: float = Field(
        default=5.0, gt=0,
        description="Seconds between regular checks of one target. Failover takes about interval/2 + "
        "recheck_delay on average; a shorter interval costs more requests to every copy.",
    )
    recheck_delay: float = Field(
        default=0.1, ge=0,
        description="A result that disagrees with the target's state is confirmed this much later instead of "
        "an interval later. Longer rides out longer blips before flipping; shorter fails over sooner.",
    )
    fall: int = Field(default=2, ge=1, description="Consecutive failures that take a target down.")
    rise: int = Field(default=2, ge=1, description="Consecutive successes that bring a target back up.")
    max_concurrent: int = Field(
        default=128, ge=1,
        description="Checks in flight at once (each holds a connection and a descriptor); the rest wait their "
        "turn. Thousands of targets starting together would otherwise stall the event loop and time out.",
    )

    @model_validator(mode="after")
    def _timeout_fits(self) -> ChecksSettings:
        if self.timeout > self.interval:
            raise ValueError("timeout must not exceed interval")
        return self

    def config(self, user_agent: str) -> CheckConfig:
        return CheckConfig(
            port=self.port, host=self.host, path=self.path, expect=self.expect, timeout=self.timeout,
            rule=CheckRule(self.interval, self.recheck_delay, self.fall, self.rise), user_agent=user_agent,
            max_concurrent=self.max_concurrent,
        )
