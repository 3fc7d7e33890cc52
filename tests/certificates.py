"""Test certificates made with the openssl CLI: self-signed ones (a certificate that is its own CA) and ones
signed by such a CA. The `certificates` fixture (conftest) is the suite's one way to get them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from shardserve.server.common.auth import TlsFiles

LOOPBACK = "DNS:localhost,IP:127.0.0.1"
"""The subject alternative names of a certificate that loopback servers present."""


class Certificates:
    """Makes certificates in one folder, each under its own name (NAME.key, NAME.pem)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def self_signed(
        self, name: str, subject: str = "/CN=localhost", alt_names: str = LOOPBACK
    ) -> TlsFiles:
        """A key and a self-signed certificate for `subject`: server certificate, client certificate and CA."""
        key, cert = self._paths(name, "key", "pem")
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            key,
            "-out",
            cert,
            "-subj",
            subject,
            "-addext",
            f"subjectAltName={alt_names}",
        )
        return TlsFiles(cert, key, cert)

    def signed(self, name: str, ca: TlsFiles, subject: str, alt_names: str = LOOPBACK) -> TlsFiles:
        """A key and a certificate for `subject` with `alt_names`, signed by `ca` (a self-signed one of these)."""
        key, request, cert, extensions = self._paths(name, "key", "csr", "pem", "ext")
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            request,
            "-subj",
            subject,
        )
        Path(extensions).write_text(f"subjectAltName={alt_names}\n")
        _openssl(
            "x509",
            "-req",
            "-in",
            request,
            "-CA",
            ca.cert,
            "-CAkey",
            ca.key,
            "-CAcreateserial",
            "-days",
            "1",
            "-out",
            cert,
            "-extfile",
            extensions,
        )
        return TlsFiles(cert, key, ca.cert)

    def _paths(self, name: str, *extensions: str) -> list[str]:
        return [str(self.directory / f"{name}.{extension}") for extension in extensions]


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)
