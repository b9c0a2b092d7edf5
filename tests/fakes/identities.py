"""A cluster CA and agent identities for tests: real certificates, real keys, made in memory."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from region_agent.base.identity import CertBook, Identity, Signer, identity_of
from region_agent.cli.keys import cert_pem, issue_cert, key_pem, make_ca


@dataclass
class Agent:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    identity: Identity

    @property
    def signer(self) -> Signer:
        return Signer(self.key, self.identity)

    @property
    def der(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.DER)


@dataclass
class ClusterCA:
    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey
    issued: list[Agent] = field(default_factory=list)

    @classmethod
    def make(cls, name: str = "test cluster CA") -> ClusterCA:
        cert, key = make_ca(name)
        return cls(cert, key)

    def agent(self, region: str, node: str | None = None, *, days: int = 30,
              not_before: datetime | None = None) -> Agent:
        cert, key = issue_cert(self.cert, self.key, f"{region}-{node or 'any'}", region=region, node=node,
                               days=days, not_before=not_before)
        start = (not_before or datetime.now(UTC)).timestamp() + 60
        agent = Agent(cert, key, identity_of(cert, [self.cert], max(time.time(), start)))
        self.issued.append(agent)
        return agent

    def expired_agent(self, region: str, node: str | None = None) -> Agent:
        """A certificate valid for a day that ended a week ago (its identity is made as of then)."""
        start = datetime.now(UTC) - timedelta(days=8)
        cert, key = issue_cert(self.cert, self.key, f"{region}-old", region=region, node=node, days=1,
                               not_before=start)
        return Agent(cert, key, identity_of(cert, [self.cert], start.timestamp() + 3600))

    def book(self) -> CertBook:
        return CertBook([self.cert])

    def write(self, directory: Path, agent: Agent, name: str) -> tuple[Path, Path, Path]:
        """ca.pem, <name>.pem, <name>-key.pem in ``directory`` (the gossip TLS files of one agent)."""
        directory.mkdir(parents=True, exist_ok=True)
        ca, cert, key = directory / "ca.pem", directory / f"{name}.pem", directory / f"{name}-key.pem"
        ca.write_bytes(cert_pem(self.cert))
        cert.write_bytes(cert_pem(agent.cert))
        key.write_bytes(key_pem(agent.key))
        key.chmod(0o600)
        return ca, cert, key
