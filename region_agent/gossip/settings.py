"""The ``gossip`` settings group: where this agent listens, whom it joins, and its secrets."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from region_agent.gossip.config import GossipConfig, lan, wan


def parse_seed(text: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port`` or a bare IPv6 address → (host, port)."""
    text = text.strip()
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"bad seed {text!r}: use [v6]:port")
        port = int(rest[1:]) if rest else default_port
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = int(port_text)
    else:
        host, port = text, default_port
    if not host or not 0 < port < 65536:
        raise ValueError(f"bad seed {text!r}")
    return host, port


class GossipSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(
        default=False,
        description="Join the other agents by gossip (cluster mode): this region's copy health and the ACME "
        "records spread to every agent, and theirs come here. Off: a standalone agent.")
    bind_address: str = Field(default="0.0.0.0", description="Address the gossip UDP and TCP listeners bind.")
    port: int = Field(default=7946, ge=1, le=65535, description="Gossip port, UDP and TCP.")
    advertise_address: str | None = Field(
        default=None,
        description="The address other agents reach this one at. Unset: bind_address, which must then not be a "
        "wildcard (in Kubernetes set it to the pod or node IP from the downward API).")
    seeds: list[str] = Field(
        default_factory=list,
        description="Agents to join at start: host, host:port or [v6]:port (port: gossip.port).")
    seeds_dns: str | None = Field(
        default=None,
        description="A DNS name whose A/AAAA records are seeds (a headless Service), resolved at every join "
        "attempt.")
    preset: Literal["lan", "wan"] = Field(
        default="wan",
        description="Timings: wan for agents across regions (the usual cluster), lan when all agents share one "
        "network. See region_agent/gossip/config.py for every field and its formula.")
    keyring_file: Path | None = Field(
        default=None,
        description="JSON keyring of the AES-GCM keys that seal every datagram and stream (region-agent keys "
        "init). Required when gossip is enabled; re-read when it changes, so keys rotate without a restart.")
    tls_ca_file: Path | None = Field(default=None, description="Cluster CA (PEM) that signs every agent's "
                                     "identity certificate; with tls_cert_file and tls_key_file, streams use mutual "
                                     "TLS and every write, member record and observation is signed. Required in "
                                     "cluster mode (unless allow_unsigned).")
    tls_cert_file: Path | None = Field(default=None, description="This agent's identity certificate (PEM), naming "
                                       "its region (region-agent keys cert --region).")
    tls_key_file: Path | None = Field(default=None, description="This agent's private key (PEM).")
    revoked_file: Path | None = Field(
        default=None,
        description="Revoked identity certificates: a text file of SHA-256 fingerprints, one per line (# comments). "
        "What they signed is refused and dropped, and they are refused as peers; re-read when it changes.")
    allow_unsigned: bool = Field(
        default=False,
        description="LAB ONLY: run a cluster without identity certificates. Any holder of the gossip keyring can "
        "then forge any write, member or vote. Logged loudly at start and shown as a problem.")
    sync_interval: float = Field(
        default=10.0, gt=0,
        description="Mean seconds between anti-entropy rounds (digest exchange with one random peer).")
    join_retry_max: float = Field(
        default=30.0, gt=0, description="Longest wait between two join attempts while no other agent is known.")
    ready_sync_timeout: float = Field(
        default=10.0, ge=0,
        description="At start, seconds to wait for a first sync with a peer before reporting ready anyway "
        "(a lone first agent must come up).")
    stream_max_connections: int = Field(
        default=256, ge=1,
        description="Gossip TCP connections held at once; when all are taken the longest idle is closed for the "
        "newcomer.")
    stream_max_connections_per_source: int = Field(
        default=32, ge=1,
        description="Gossip TCP connections one IPv4 address (or IPv6 /64) may hold; beyond it a new one is refused. "
        "An agent sends at most 4 streams at once to one peer.")
    stream_timeout: float = Field(
        default=10.0, gt=0, description="Seconds a gossip TCP connection has, after its TLS handshake, to send its "
        "whole frame.")
    stream_idle_timeout: float = Field(
        default=3.0, gt=0, description="Seconds within which a gossip TCP connection must deliver its frame's "
        "length and then each 64 KiB of it, or be closed: a trickle counts as idle.")
    stream_buffer_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024 * 1024,
        description="Bytes of incoming gossip frames held at once, all connections together: a frame's length is "
        "read first, and one that does not fit is refused before it is read (without TLS anyone can announce one).")
    stream_source_buffer_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024 * 1024,
        description="The same bound for the frames of one IPv4 address (or IPv6 /64); keep it above the largest "
        "anti-entropy message (8 MiB), or a big exchange is refused.")

    @field_validator("bind_address", "advertise_address")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        return None if value is None else str(ipaddress.ip_address(value))

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, value: list[str]) -> list[str]:
        for seed in value:
            parse_seed(seed, 1)
        return value

    @model_validator(mode="after")
    def _complete(self) -> GossipSettings:
        tls = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(tls) and not all(tls):
            raise ValueError("tls_ca_file, tls_cert_file and tls_key_file go together")
        if self.enabled:
            if self.keyring_file is None:
                raise ValueError("keyring_file is required when gossip is enabled (region-agent keys init)")
            if self.advertise_address is None and ipaddress.ip_address(self.bind_address).is_unspecified:
                raise ValueError("advertise_address is required when bind_address is a wildcard")
            if not all(tls) and not self.allow_unsigned:
                raise ValueError("identity certificates are required in cluster mode: set tls_ca_file, tls_cert_file "
                                 "and tls_key_file (region-agent keys init, keys cert --region); allow_unsigned: true "
                                 "runs a lab cluster that any keyring holder can forge")
        return self

    @property
    def advertised(self) -> str:
        return self.advertise_address or self.bind_address

    def seed_list(self) -> list[tuple[str, int]]:
        return [parse_seed(seed, self.port) for seed in self.seeds]

    def timings(self) -> GossipConfig:
        return lan() if self.preset == "lan" else wan()
