"""The ``cluster`` settings group: this agent's role and how regions are judged together."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["agent", "witness"] = Field(
        default="agent",
        description="agent: serves DNS and reports its region's copies. witness: serves no copies and no DNS; it "
        "only adds a vantage point, so two regions can out-vote a partition (run it anywhere, in a third place).")
    two_region_policy: Literal["hold", "failover"] = Field(
        default="hold",
        description="With two regions and no witness no majority exists. hold: keep answering a region that went "
        "silent or whose ingress the other region sees down (a partition never empties an answer); failover: drop "
        "it (a dead region leaves the answers, but a partition makes each region drop the other).")
    observe_interval: float = Field(
        default=2.0, gt=0,
        description="Seconds between two looks at the cluster: this region's observations are gossiped when they "
        "change, and at least every observation_max_age / 3.")
    observation_max_age: float = Field(
        default=60.0, gt=0,
        description="Seconds another region's observation counts in a quorum. Unchanged observations are "
        "re-sent every third of it, so it sets the idle gossip of observations (one publisher per region).")
    ingress_interval: float = Field(
        default=5.0, gt=0,
        description="Seconds between two probes of each other region's ingress (one per region and address, never "
        "per project).")
    ingress_timeout: float = Field(default=2.0, gt=0, description="Seconds one ingress probe may take.")
    max_clock_offset: float = Field(
        default=1.0, gt=0, le=300,
        description="Seconds this agent's wall clock may be off the median of its peers (measured on every probe's "
        "ack) before it is the outlier: degraded, refusing control-API writes and ACME UPDATEs. Entries stamped "
        "more than 3x this (+1 s) ahead of the receiver's clock are refused. Run NTP everywhere.")
    ingress_path: str = Field(
        default="/livez", pattern=r"^/[\x21-\x7e]*$",
        description="Path asked on each region's ingress addresses (port and Host header: the checks settings), "
        "answered by that region's agent health listener behind its ingress.")

    @model_validator(mode="after")
    def _bounds(self) -> ClusterSettings:
        if self.ingress_timeout > self.ingress_interval:
            raise ValueError("ingress_timeout must not exceed ingress_interval")
        if self.observation_max_age < 3 * self.observe_interval:
            raise ValueError("observation_max_age must be at least 3 observe intervals (refreshes must land)")
        return self
