"""Mutual TLS between our own services (router -> P/D, D -> P, P -> D).

Given `--tls-cert/--tls-key/--tls-ca`, a service accepts control RPCs only from peers that
present a certificate signed by the CA, and presents its own certificate when it calls one.
Without them every channel is plaintext: fine on a private network that only the cluster
reaches, nowhere else (docs/DEPLOY.md). A server certificate must name the address its peers
dial (an IP or DNS subject alternative name), since clients check it as HTTPS clients do."""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import grpc

@dataclass(frozen=True)
class Tls:
    cert: bytes  # PEM: this service's certificate (chain)
    key: bytes  # PEM: its private key
    ca: bytes  # PEM: the CA every peer's certificate must be signed by

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Tls | None:
        files = (args.tls_cert, args.tls_key, args.tls_ca)
        if not any(files):
            return None
        if not all(files):
            raise SystemExit("error: --tls-cert, --tls-key and --tls-ca go together")
        cert, key, ca = (_read(path) for path in files)
        return cls(cert, key, ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def add_tls_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("mutual TLS of the control RPCs (all three, or none: plaintext)")
    g.add_argument("--tls-cert", help="PEM certificate this process presents (as server and as client)")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument("--tls-ca", help="PEM CA that signs every peer's certificate; peers without one are refused")


def tls_flags(args: argparse.Namespace) -> list[str]:
    """The TLS flags of `args` as given, for a child process."""
    flags = []
    for name in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(args, name):
            flags += ["--" + name.replace("_", "-"), getattr(args, name)]
    return flags


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise SystemExit(f"error: cannot read {path}: {e.strerror}") from None


def blocking_channel(addr: str, tls: Tls | None) -> grpc.Channel:
    """A blocking channel to one of our services, for tools that wait on them (`pdflash up`)."""
    return grpc.insecure_channel(addr) if tls is None else grpc.secure_channel(addr, tls.channel_credentials())
