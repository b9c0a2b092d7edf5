"""``region-agent keys``: generate, edit a keyring file, make the CA and agent certificates; exit codes."""

from __future__ import annotations

import base64
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID

from region_agent.cli.main import main
from region_agent.gossip.keyfile import fingerprint, load_keyring
from region_agent.gossip.keyring import encode_key, parse_key
from region_agent.gossip.tls import GossipTls

NEW = encode_key(b"n" * 32)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["keys", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, _, err = run(capsys, *argv)
    assert code == 2, err
    err = err.strip()
    assert "\n" not in err and "Traceback" not in err and err.startswith("region-agent keys: "), err
    return err


def test_generate_prints_a_key(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "generate")
    assert code == 0 and len(base64.b64decode(out.strip(), validate=True)) == 32
    assert run(capsys, "generate")[1] != out


def test_init_then_rotate_the_keyring_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "cluster"
    code, out, _ = run(capsys, "init", "--dir", str(directory))
    assert code == 0 and out.count("wrote ") == 3
    keyring_file = directory / "keyring.json"
    for name in ("keyring.json", "ca-key.pem"):
        assert stat.S_IMODE((directory / name).stat().st_mode) == 0o600
    old = encode_key(load_keyring(keyring_file).primary)
    file = ["--file", str(keyring_file)]

    def shown(key: str) -> str:  # a key as `keys list` prints it: with the fingerprint the agents log
        return f"{key}  {fingerprint(parse_key(key))}"

    assert run(capsys, "list", *file)[1].splitlines() == [f"{shown(old)}  (primary)"]
    assert run(capsys, "install", NEW, *file)[0] == 0
    assert "already installed" in run(capsys, "install", NEW, *file)[1]
    assert run(capsys, "list", *file)[1].splitlines() == [f"{shown(old)}  (primary)", shown(NEW)]
    assert run(capsys, "use", NEW, *file)[0] == 0
    assert run(capsys, "list", *file)[1].splitlines() == [f"{shown(NEW)}  (primary)", shown(old)]
    assert run(capsys, "remove", old, *file)[0] == 0
    assert run(capsys, "list", *file)[1].splitlines() == [f"{shown(NEW)}  (primary)"]
    assert stat.S_IMODE(keyring_file.stat().st_mode) == 0o600


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "cluster"
    assert run(capsys, "init", "--dir", str(directory))[0] == 0
    keyring_file = directory / "keyring.json"
    file = ["--file", str(keyring_file)]
    primary = encode_key(load_keyring(keyring_file).primary)
    before = keyring_file.read_bytes()

    assert "refusing to remove the primary" in one_line_error(capsys, "remove", primary, *file)
    assert "key not installed" in one_line_error(capsys, "use", NEW, *file)
    assert "key not installed" in one_line_error(capsys, "remove", NEW, *file)
    assert "bad key" in one_line_error(capsys, "install", "not-base64!", *file)
    assert "bad key" in one_line_error(capsys, "install", encode_key(b"short"), *file)
    assert keyring_file.read_bytes() == before  # nothing written on a refusal

    missing = tmp_path / "missing.json"
    assert str(missing) in one_line_error(capsys, "list", "--file", str(missing))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert f"keyring file {broken}: not JSON" in one_line_error(capsys, "install", NEW, "--file", str(broken))

    assert "exists; not overwriting" in one_line_error(capsys, "init", "--dir", str(directory))
    assert "needs --region" in one_line_error(
        capsys, "cert", "--ca-dir", str(directory), "--name", "n0", "--out", str(tmp_path / "n0"))
    assert "--ip" in one_line_error(capsys, "cert", "--ca-dir", str(directory), "--name", "n0", "--ip", "1.2.3",
                                    "--out", str(tmp_path / "n0"))
    assert "is not a DNS name" in one_line_error(capsys, "cert", "--ca-dir", str(directory), "--name", "n0",
                                                 "--dns", "bad name", "--out", str(tmp_path / "n0"))
    assert f"CA certificate {tmp_path / 'nowhere' / 'ca.pem'}" in one_line_error(
        capsys, "cert", "--ca-dir", str(tmp_path / "nowhere"), "--name", "n0", "--ip", "127.0.0.2",
        "--out", str(tmp_path / "n0"))

    with pytest.raises(SystemExit) as exited:  # argparse: a missing option
        main(["keys", "list"])
    assert exited.value.code == 2


def test_agent_certificate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ca_dir, out = tmp_path / "ca", tmp_path / "agents"
    assert run(capsys, "init", "--dir", str(ca_dir))[0] == 0
    code, printed, _ = run(capsys, "cert", "--ca-dir", str(ca_dir), "--name", "sfo1/n0", "--ip", "127.0.0.2",
                           "--ip", "::1", "--dns", "n0.sfo1.example.com", "--out", str(out))
    assert code == 0 and printed.count("wrote ") == 3
    cert = x509.load_pem_x509_certificate((out / "sfo1_n0.pem").read_bytes())
    ca = x509.load_pem_x509_certificate((ca_dir / "ca.pem").read_bytes())
    cert.verify_directly_issued_by(ca)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    assert 364 <= (cert.not_valid_after_utc - cert.not_valid_before_utc).days <= 366
    assert 3649 <= (ca.not_valid_after_utc - ca.not_valid_before_utc).days <= 3651
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.2", "::1"]
    assert san.get_values_for_type(x509.DNSName) == ["n0.sfo1.example.com"]
    eku = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert stat.S_IMODE((out / "sfo1_n0-key.pem").stat().st_mode) == 0o600
    tls = GossipTls.from_files(out / "ca.pem", out / "sfo1_n0.pem", out / "sfo1_n0-key.pem")
    assert tls.subject == "CN=sfo1/n0"
    # the same name again does not overwrite the key
    assert "exists; not overwriting" in one_line_error(
        capsys, "cert", "--ca-dir", str(ca_dir), "--name", "sfo1/n0", "--ip", "127.0.0.2", "--out", str(out))
    code, _, _ = run(capsys, "cert", "--ca-dir", str(ca_dir), "--name", "n1", "--ip", "127.0.0.3", "--days", "30",
                     "--out", str(out))
    assert code == 0
    short = x509.load_pem_x509_certificate((out / "n1.pem").read_bytes())
    assert (short.not_valid_after_utc - short.not_valid_before_utc).days == 30
