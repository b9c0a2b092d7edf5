"""``region-agent keys``: gossip keys, the keyring file, the cluster CA and agent certificates.

=================================================  ===============================================
``keys generate``                                  print a new gossip key (base64 of 32 bytes)
``keys list --file F``                             the keys of a keyring file, fingerprints, primary
``keys install KEY --file F``                      accept KEY too (rotation step 1)
``keys use KEY --file F``                          send with KEY (step 2; KEY must be installed)
``keys remove KEY --file F``                       stop accepting KEY (step 3; not the primary)
``keys init --dir D``                              D/keyring.json with one key, D/ca.pem, D/ca-key.pem
``keys cert --ca-dir D --region R [--node N]``     O/<name>.pem and O/<name>-key.pem signed by the CA (+ O/ca.pem):
``  [--name N] [--ip A] [--dns H] --out O``         the agent's identity certificate, naming its region (and node)
=================================================  ===============================================

The agents re-read the keyring file when it changes (:class:`region_agent.gossip.keyfile.KeyringWatcher`),
so rotation is: ``install`` on every agent's file, then ``use``, then ``remove``. Private keys and
the keyring are written with mode 0600, and never over an existing file (except the keyring,
which the editing commands replace atomically). Exit codes: 0 done, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from region_agent.base.identity import IdentityError, identity_urn
from region_agent.gossip.keyfile import KeyringFileError, fingerprint, load_keyring, save_keyring
from region_agent.gossip.keyring import KeyOperationError, Keyring, encode_key, generate_key, parse_key

KEYRING_FILE = "keyring.json"
CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"
CA_DAYS = 3650
CERT_DAYS = 365


class KeysError(Exception):
    """Bad input to a ``keys`` command: printed as one line, exit code 2."""


# --- certificates ---------------------------------------------------------------------------------

def make_ca(common_name: str = "region-agent gossip CA", *, days: int = CA_DAYS,
            now: datetime | None = None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A self-signed cluster CA: EC P-256, ``days`` long, allowed to sign agent certificates only."""
    now = now or datetime.now(UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue_cert(ca_cert: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, name: str, *,
               region: str | None = None, node: str | None = None,
               ips: Sequence[str] = (), dns: Sequence[str] = (),
               days: int = CERT_DAYS, not_before: datetime | None = None,
               ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """An agent's identity certificate (EC P-256) for both ends of a stream: serverAuth and clientAuth.

    ``region`` (and ``node``) go into the SAN URI ``urn:region-agent:region:<region>[:node:<node>]``
    that every signature this agent makes is checked against; IP and DNS names are optional (peers
    are addressed by IP and the chain to the CA is what counts). ``not_before`` (default now) and
    ``days`` set the validity; tests make expired ones with them.
    """
    if region is None and not ips and not dns:
        raise KeysError("an agent certificate needs --region (and at least one --ip or --dns without it)")
    if node is not None and region is None:
        raise KeysError("--node needs --region")
    try:
        urn = None if region is None else identity_urn(region, node)
    except IdentityError:
        raise KeysError(f"--region {region!r} / --node {node!r}: a region is IATA + number (sfo1), a node "
                        "letters, digits, dots, dashes, underscores") from None
    try:
        addresses = [ipaddress.ip_address(ip) for ip in ips]
    except ValueError as exc:
        raise KeysError(f"--ip: {exc}") from None
    for host in dns:
        if not re.fullmatch(r"(?=.{1,253}$)(\*\.)?([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?)+", host):
            raise KeysError(f"--dns: {host!r} is not a DNS name")
    if days <= 0:
        raise KeysError("--days must be positive")
    start = not_before or datetime.now(UTC) - timedelta(minutes=5)
    key = ec.generate_private_key(ec.SECP256R1())
    sans: list[x509.GeneralName] = [] if urn is None else [x509.UniformResourceIdentifier(urn)]
    sans += [x509.IPAddress(a) for a in addresses]
    sans += [x509.DNSName(h) for h in dns]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=False, crl_sign=False,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def write_new(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` (never replacing a file: keys are not overwritten by mistake)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise KeysError(f"{path} exists; not overwriting it") from None
    except OSError as exc:
        raise KeysError(f"{path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _load_ca(ca_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    cert_path, key_path = ca_dir / CA_CERT_FILE, ca_dir / CA_KEY_FILE
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    except OSError as exc:
        raise KeysError(f"CA certificate {cert_path}: {exc.strerror or exc}") from None
    except ValueError:
        raise KeysError(f"CA certificate {cert_path}: not a PEM certificate") from None
    try:
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except OSError as exc:
        raise KeysError(f"CA key {key_path}: {exc.strerror or exc}") from None
    except (ValueError, TypeError):
        raise KeysError(f"CA key {key_path}: not an unencrypted PEM private key") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise KeysError(f"CA key {key_path}: not an EC key")
    return cert, key


def init_dir(directory: Path) -> list[Path]:
    """A keyring file with one new key and a new cluster CA in ``directory``; the paths written."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KeysError(f"{directory}: {exc.strerror or exc}") from None
    paths = [directory / KEYRING_FILE, directory / CA_CERT_FILE, directory / CA_KEY_FILE]
    for path in paths:
        if path.exists():
            raise KeysError(f"{path} exists; not overwriting it")
    cert, key = make_ca()
    write_new(paths[2], key_pem(key), 0o600)
    write_new(paths[1], cert_pem(cert), 0o644)
    save_keyring(paths[0], Keyring(generate_key()))
    return paths


def safe_name(name: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name).strip(".")
    if not safe:
        raise KeysError(f"--name {name!r} gives no usable file name")
    return safe


def issue_to_dir(ca_dir: Path, name: str | None, out: Path, *, ips: Sequence[str], dns: Sequence[str],
                 region: str | None = None, node: str | None = None,
                 days: int = CERT_DAYS, not_before: datetime | None = None) -> list[Path]:
    """``out/<name>.pem`` and ``out/<name>-key.pem`` (and ``out/ca.pem``, if ``out`` has none).
    ``name`` defaults to ``<region>`` or ``<region>-<node>``."""
    if name is None:
        if region is None:
            raise KeysError("--name or --region is required")
        name = region if node is None else f"{region}-{node}"
    ca_cert, ca_key = _load_ca(ca_dir)
    cert, key = issue_cert(ca_cert, ca_key, name, region=region, node=node, ips=ips, dns=dns, days=days,
                           not_before=not_before)
    base = safe_name(name)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KeysError(f"{out}: {exc.strerror or exc}") from None
    cert_path, key_path = out / f"{base}.pem", out / f"{base}-key.pem"
    for path in (cert_path, key_path):
        if path.exists():
            raise KeysError(f"{path} exists; not overwriting it")
    write_new(key_path, key_pem(key), 0o600)
    write_new(cert_path, cert_pem(cert), 0o644)
    written = [cert_path, key_path]
    ca_copy = out / CA_CERT_FILE
    if not ca_copy.exists():
        write_new(ca_copy, cert_pem(ca_cert), 0o644)
        written.append(ca_copy)
    return written


# --- the keyring file -----------------------------------------------------------------------------

def _key_arg(text: str) -> bytes:
    try:
        return parse_key(text)
    except KeyOperationError as exc:
        raise KeysError(f"bad key: {exc}") from None


def edit_keyring(path: Path, action: str, key_text: str) -> str:
    """Apply ``install``, ``use`` or ``remove`` to the keyring file; a line saying what was done."""
    key = _key_arg(key_text)
    try:
        keyring = load_keyring(path)
    except KeyringFileError as exc:
        raise KeysError(str(exc)) from None
    installed = keyring.keys()
    try:
        if action == "install":
            if key in installed:
                return f"{path}: key already installed"
            keyring.install(key)
        elif action == "use":
            if key not in installed:
                raise KeysError(f"{path}: key not installed; install it everywhere first")
            if key == keyring.primary:
                return f"{path}: key already the primary"
            keyring.use(key)
        elif action == "remove":
            if key == keyring.primary:
                raise KeysError(f"{path}: refusing to remove the primary key; use another key first")
            keyring.remove(key)
        else:  # pragma: no cover - argparse allows only the three
            raise KeysError(f"unknown action {action}")
    except KeyOperationError as exc:
        raise KeysError(f"{path}: {exc}") from None
    try:
        save_keyring(path, keyring)
    except OSError as exc:
        raise KeysError(f"{path}: {exc.strerror or exc}") from None
    return f"{path}: {action} done; {len(keyring.keys())} keys"


def list_keyring(path: Path) -> list[str]:
    """One line per key, primary first: the key, its fingerprint (the name the agents' logs give it,
    "gossip keyring from ...: installed <fingerprint>") and ``(primary)``."""
    try:
        keyring = load_keyring(path)
    except KeyringFileError as exc:
        raise KeysError(str(exc)) from None
    installed = keyring.keys()
    return [f"{encode_key(k)}  {fingerprint(k)}{'  (primary)' if k == keyring.primary else ''}" for k in installed]


# --- the command ----------------------------------------------------------------------------------

def cmd_keys(args: argparse.Namespace) -> int:
    try:
        if args.keys_command == "generate":
            print(encode_key(generate_key()))
        elif args.keys_command == "list":
            print("\n".join(list_keyring(Path(args.file))))
        elif args.keys_command in ("install", "use", "remove"):
            print(edit_keyring(Path(args.file), args.keys_command, args.key))
        elif args.keys_command == "init":
            for path in init_dir(Path(args.dir)):
                print(f"wrote {path}")
        elif args.keys_command == "cert":
            for path in issue_to_dir(Path(args.ca_dir), args.name, Path(args.out), ips=args.ip or [],
                                     dns=args.dns or [], region=args.region, node=args.node, days=args.days):
                print(f"wrote {path}")
    except KeysError as exc:
        print(f"region-agent keys: {exc}", file=sys.stderr)
        return 2
    return 0


def add_keys_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    keys = sub.add_parser("keys", help="gossip keys, the keyring file, the cluster CA and agent certificates")
    keys.set_defaults(func=cmd_keys)
    cmds = keys.add_subparsers(dest="keys_command", required=True)
    cmds.add_parser("generate", help="print a new gossip key (base64)")
    listing = cmds.add_parser("list", help="the keys of a keyring file with their fingerprints (as the agents "
                              "log them), the primary marked")
    listing.add_argument("--file", required=True, help="the keyring file (JSON)")
    for action, text in (("install", "accept KEY too (rotation step 1, on every agent)"),
                         ("use", "encrypt with KEY (step 2; KEY must be installed)"),
                         ("remove", "stop accepting KEY (step 3; not the primary)")):
        edit = cmds.add_parser(action, help=text)
        edit.add_argument("key", metavar="KEY", help="base64 of 16, 24 or 32 bytes")
        edit.add_argument("--file", required=True, help="the keyring file (JSON), replaced atomically")
    init = cmds.add_parser("init", help=f"create {KEYRING_FILE} with one key and a cluster CA in a directory")
    init.add_argument("--dir", required=True)
    cert = cmds.add_parser("cert", help="issue an agent's identity certificate signed by the cluster CA")
    cert.add_argument("--ca-dir", required=True, help=f"the directory with {CA_CERT_FILE} and {CA_KEY_FILE}")
    cert.add_argument("--region", help="the agent's region: what its signatures may write (required for an "
                      "identity; SAN urn:region-agent:region:<region>[:node:<node>])")
    cert.add_argument("--node", help="the agent's node, when the certificate is for one agent (optional: one "
                      "certificate per region is fine)")
    cert.add_argument("--name", help="certificate CN and file names (default <region>[-<node>])")
    cert.add_argument("--ip", action="append", help="an IP address of the agent (repeatable, optional)")
    cert.add_argument("--dns", action="append", help="a DNS name of the agent (repeatable, optional)")
    cert.add_argument("--out", required=True, help="directory for <name>.pem, <name>-key.pem (and ca.pem)")
    cert.add_argument("--days", type=int, default=CERT_DAYS, help=f"validity (default {CERT_DAYS})")
