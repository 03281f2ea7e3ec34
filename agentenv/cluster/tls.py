"""TLS between the cluster's components and for its clients: what a component verifies
the nodes and schedulers it calls with (a CA bundle, else the system's), and the check
that a certificate and key it serves with load together.

A node serving TLS (``AENV_TLS_CERT``/``AENV_TLS_KEY``) reports an ``https://`` URL in its
heartbeats; gateways reach it there, verifying its certificate against their CA bundle
(``--ca-file``/``AENV_CA_FILE``) for the control plane, the data-plane relay and
WebSockets alike. Nodes and gateways verify an ``https://`` scheduler the same way.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
from pathlib import Path


class TlsSetupError(Exception):
    """A certificate, key or CA bundle that cannot be used."""


def client_context(ca_file: Path | str | None) -> ssl.SSLContext:
    """What a component verifies the servers it calls with: ``ca_file``'s certificates
    (PEM, one or more), else the system's trusted ones. Host names (or IP addresses) are
    checked against the URL called."""
    try:
        return ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
    except (OSError, ssl.SSLError) as exc:
        raise TlsSetupError(f"cannot use CA bundle {ca_file}: {exc}") from exc


def check_server_files(cert: Path | str, key: Path | str) -> None:
    """The certificate (with its chain) and its key load together: a clear start-up
    error rather than one from inside uvicorn."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as exc:
        raise TlsSetupError(f"cannot serve TLS with {cert} and key {key}: {exc}") from exc


def add_server_arguments(parser: argparse.ArgumentParser, verified_by: str) -> None:
    """``--tls-cert``/``--tls-key`` (env ``AENV_TLS_CERT``/``AENV_TLS_KEY``): serve over TLS;
    ``verified_by`` says who checks the certificate."""
    parser.add_argument(
        "--tls-cert",
        default=os.environ.get("AENV_TLS_CERT"),
        help="serve over TLS with this certificate chain (PEM; env AENV_TLS_CERT); " + verified_by,
    )
    parser.add_argument(
        "--tls-key",
        default=os.environ.get("AENV_TLS_KEY"),
        help="the certificate's private key (PEM; env AENV_TLS_KEY)",
    )


def check_server_arguments(prog: str, args: argparse.Namespace) -> None:
    """Exit with a clear message unless the TLS options of :func:`add_server_arguments`
    are both absent or both usable."""
    if (args.tls_cert is None) != (args.tls_key is None):
        sys.exit(f"{prog}: --tls-cert and --tls-key go together")
    if args.tls_cert is not None:
        try:
            check_server_files(args.tls_cert, args.tls_key)
        except TlsSetupError as exc:
            sys.exit(f"{prog}: {exc}")
