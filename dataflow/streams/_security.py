"""Where streams listen, and CURVE authentication and encryption with key files."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from dataflow.model._errors import InvalidArgumentError

log = logging.getLogger("dataflow.streams")

DEFAULT_ENDPOINT = "tcp://127.0.0.1:0"


@dataclass(frozen=True, kw_only=True)
class CurveServerConfig:
    """CURVE for the binding side (a consumer's receiver).

    Make the files with ``zmq.auth.create_certificates(directory, name)``,
    which writes ``name.key`` (public) and ``name.key_secret`` (secret).
    """

    secret_key_file: Path
    """This receiver's ``.key_secret`` certificate."""
    authorized_keys_dir: Path
    """Directory of the public ``.key`` certificates of the producers allowed to connect."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "secret_key_file", Path(self.secret_key_file))
        object.__setattr__(self, "authorized_keys_dir", Path(self.authorized_keys_dir))
        _load_secret(self.secret_key_file)
        if not self.authorized_keys_dir.is_dir():
            raise InvalidArgumentError(
                f"authorized_keys_dir {self.authorized_keys_dir} is not a directory"
            )


@dataclass(frozen=True, kw_only=True)
class CurveClientConfig:
    """CURVE for the connecting side (a producer's sender)."""

    secret_key_file: Path
    """This producer's ``.key_secret`` certificate (its ``.key`` goes to the consumers)."""
    server_public_key_file: Path
    """The consumers' public ``.key`` certificate."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "secret_key_file", Path(self.secret_key_file))
        object.__setattr__(self, "server_public_key_file", Path(self.server_public_key_file))
        _load_secret(self.secret_key_file)
        _load_public(self.server_public_key_file)


def _load_public(path: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read a CURVE certificate from {path}: {exc}") from exc
    return public


def _load_secret(path: Path) -> tuple[bytes, bytes]:
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise InvalidArgumentError(f"cannot read a CURVE certificate from {path}: {exc}") from exc
    if secret is None:
        raise InvalidArgumentError(f"{path} holds no secret key; pass the .key_secret file")
    return public, secret


def secure_server(
    ctx: zmq.Context, sock: zmq.Socket, curve: CurveServerConfig
) -> ThreadAuthenticator:
    """Make ``sock`` a CURVE server that admits only the authorized keys; before bind."""
    auth = ThreadAuthenticator(ctx, log=logging.getLogger("dataflow.streams.auth"))
    auth.start()
    auth.configure_curve(domain="*", location=str(curve.authorized_keys_dir))
    public, secret = _load_secret(curve.secret_key_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    return auth


def secure_client(sock: zmq.Socket, curve: CurveClientConfig) -> None:
    """Make ``sock`` a CURVE client of the configured server; before connect."""
    public, secret = _load_secret(curve.secret_key_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = _load_public(curve.server_public_key_file)


def bind_address(endpoint: str) -> str:
    """ZeroMQ's spelling of ``endpoint``: port 0 (any free port) becomes ``*``."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-1] + "*"
    return endpoint


def warn_if_exposed(endpoint: str, curve: object | None) -> None:
    """Log a warning when a plain-text endpoint listens beyond loopback."""
    if curve is not None or not endpoint.startswith("tcp://"):
        return
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        log.warning(
            "ref stream listens on %s without CURVE: anyone who reaches it can inject refs; "
            "configure curve= or bind to 127.0.0.1",
            endpoint,
        )
