"""The checks of the settings that need files but neither sockets nor the network.

``region-agent run`` makes them before it binds anything (:meth:`Agent.start`), and
``region-agent check-config`` makes exactly these: one function, so a file ``check-config``
passes is one ``run`` takes, and both refuse a bad one with the same one-line
:class:`~region_agent.app.settings.SettingsError` naming the setting. Listener conflicts among
the configured addresses are checked by the settings model itself (:mod:`region_agent.app.listeners`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from region_agent.app.settings import AgentSettings, SettingsError
from region_agent.globaldns.acme.tsig import TsigConfigError
from region_agent.globaldns.acme.tsig_keys import build_keyring, inline_keys
from region_agent.gossip.keyfile import load_keyring

if TYPE_CHECKING:
    from region_agent.gossip.tls import GossipTls

__all__ = ["check_files", "gossip_tls"]


def check_files(settings: AgentSettings) -> None:
    """Raise :class:`SettingsError` for the first setting whose file or secret ``run`` would refuse."""
    check_tsig_keys(settings)
    if settings.gossip.enabled:
        check_keyring(settings)
        check_identity(settings, gossip_tls(settings))


def check_tsig_keys(settings: AgentSettings) -> None:
    """The TSIG keys as the DNS service builds them (inline keys plus the keys file)."""
    acme = settings.dns.acme
    specs = inline_keys(acme)
    if not specs and acme.tsig_keys_file is None:
        return
    try:
        build_keyring(specs, acme.tsig_keys_file)
    except TsigConfigError as exc:  # names the key (or the file) but not the setting of inline keys
        text = str(exc)
        raise SettingsError(text if text.startswith("dns.acme.") else f"dns.acme.tsig_keys: {text}") from None


def check_keyring(settings: AgentSettings) -> None:
    path = settings.gossip.keyring_file
    assert path is not None  # the settings require it with gossip enabled
    try:
        load_keyring(path)
    except (ValueError, OSError) as exc:
        raise SettingsError(f"gossip.keyring_file: {exc}") from None


def gossip_tls(settings: AgentSettings) -> GossipTls | None:
    """The TLS files loaded and checked (readable, PEM, the certificate matching the key), or None unset."""
    g = settings.gossip
    if g.tls_ca_file is None or g.tls_cert_file is None or g.tls_key_file is None:
        return None
    from region_agent.gossip.tls import GossipTls

    try:
        return GossipTls.from_files(g.tls_ca_file, g.tls_cert_file, g.tls_key_file)
    except (ValueError, OSError) as exc:
        raise SettingsError(f"gossip.tls_*: {exc}") from None


def check_identity(settings: AgentSettings, tls: GossipTls | None) -> None:
    """The identity certificate names this agent (or, a lab, ``allow_unsigned`` says none is needed)."""
    if tls is None or tls.signer is None:
        if not settings.gossip.allow_unsigned:
            why = "no TLS files" if tls is None else tls.identity_problem
            raise SettingsError(f"gossip.tls_cert_file: identity certificates are required in cluster mode ({why})")
        return
    identity = tls.signer.identity
    if not identity.covers(settings.region, settings.node):
        raise SettingsError(f"gossip.tls_cert_file: the certificate names {identity.name}, not this agent "
                            f"({settings.region}/{settings.node})")
