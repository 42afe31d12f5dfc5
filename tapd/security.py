"""CurveZMQ for everything that leaves the host.

Keys are ZeroMQ certificates, as `zmq.auth` (and czmq) write them: `NAME.key` holds
the public key, and `NAME.key_secret` holds both keys (mode 0600). `tapd keygen` writes
a pair. A daemon's `--tcp` endpoint is a CURVE server with its own pair. It admits
only the clients whose public certificates are in its allowed directory, and the ZAP
handler below checks each of them, counting and logging refusals. Clients
(subscribers, forwarding daemons, `tapd status` from afar) load their own pair plus the
daemon's public key.
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import os
from pathlib import Path
from typing import Any

import zmq
import zmq.auth
from zmq.utils import z85

from tapd.errors import ConfigError
from tapd.runtime import check_endpoint_dir
from tapd.settings import CURVE_SECRET, CURVE_SERVER_KEY

logger = logging.getLogger("tapd.security")

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # fixed by the ZAP specification (RFC 27)


def keygen(directory: Path, name: str) -> tuple[Path, Path]:
    """Write NAME.key (public) and NAME.key_secret (0600) into `directory`."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (directory / f"{name}{suffix}").exists():
            raise ConfigError(f"{directory / (name + suffix)} exists; not overwriting a key")
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_keypair(secret_file: Path) -> tuple[bytes, bytes]:
    """(public, secret) from a NAME.key_secret file."""
    try:
        public, secret = zmq.auth.load_certificate(secret_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read key pair {secret_file}: {exc}") from exc
    if secret is None:
        raise ConfigError(f"{secret_file} holds no secret key (use the .key_secret file)")
    return public, secret


def load_public(public_file: Path) -> bytes:
    try:
        public, _ = zmq.auth.load_certificate(public_file)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read public key {public_file}: {exc}") from exc
    return public


def load_allowed(directory: Path) -> set[bytes]:
    """The public keys (Z85) of every NAME.key certificate in `directory`."""
    if not directory.is_dir():
        raise ConfigError(f"allowed-keys directory {directory} does not exist")
    return {key for key, _ in zmq.auth.load_certificates(directory).items()}


@dataclasses.dataclass(frozen=True)
class ClientKeys:
    """What a client needs to talk to a CURVE daemon."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def from_files(cls, server_public_file: Path, secret_file: Path) -> ClientKeys:
        public, secret = load_keypair(secret_file)
        return cls(load_public(server_public_file), public, secret)

    @classmethod
    def from_environment(cls) -> ClientKeys | None:
        """TAPD_CURVE_SERVER_KEY (the daemon's NAME.key) and TAPD_CURVE_SECRET (ours)."""
        server, secret = CURVE_SERVER_KEY.read(), CURVE_SECRET.read()
        if not server and not secret:
            return None
        if not (server and secret):
            raise ConfigError("set both TAPD_CURVE_SERVER_KEY and TAPD_CURVE_SECRET, or neither")
        return cls.from_files(server, secret)

    def apply(self, sock: zmq.Socket[Any]) -> None:
        sock.curve_serverkey = self.server_public
        sock.curve_publickey = self.public
        sock.curve_secretkey = self.secret


def secure_client(sock: zmq.Socket[Any], endpoint: str, keys: ClientKeys | None = None) -> None:
    """Before connecting `sock` to `endpoint`: on ipc, check that the socket's directory
    is ours, private and not a link (creating it 0700 if missing, so that nobody else
    can), else raise ConfigError: a squatter's directory would hand our taps to its
    daemon. On tcp, use `keys`, else the key files named by TAPD_CURVE_SERVER_KEY /
    TAPD_CURVE_SECRET if set (else plain, which a daemon admits only with --insecure)."""
    check_endpoint_dir(endpoint)
    if endpoint.startswith("tcp://"):
        keys = keys or ClientKeys.from_environment()
        if keys is not None:
            keys.apply(sock)


def make_server(sock: zmq.Socket[Any], secret_file: Path) -> None:
    """Make `sock` a CURVE server whose clients the ZAP handler vets."""
    public, secret = load_keypair(secret_file)
    sock.curve_server = True
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.zap_domain = b"tapd"


class ZapHandler:
    """Answers libzmq's ZAP requests on the daemon's own thread (it is polled with the
    other sockets): CURVE clients whose key is allowed pass, all others are refused."""

    def __init__(self, context: zmq.Context[Any], allowed: set[bytes]) -> None:
        self.allowed = allowed
        self.refused = 0
        self.socket = context.socket(zmq.REP)
        self.socket.linger = 0
        self.socket.bind(ZAP_ENDPOINT)

    def handle(self) -> None:
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._answer(frames))

    def _answer(self, frames: list[bytes]) -> list[bytes]:
        if len(frames) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, _domain, address, _identity, mechanism = frames[:6]
        credentials = frames[6:]
        # CURVE's credential is the raw 32-byte client key; certificates hold it in Z85.
        key = z85.encode(credentials[0]) if mechanism == b"CURVE" and credentials else b""
        if key and key in self.allowed:
            return [version, request_id, b"200", b"OK", b"", b""]
        self.refused += 1
        log = logger.warning if self.refused <= 20 else logger.debug
        log(
            "refused a %s peer from %r with public key %r: not in the allowed keys "
            "(%d refused so far)",
            mechanism.decode(errors="replace"),
            address.decode(errors="replace"),
            key.decode() or "none",
            self.refused,
        )
        return [version, request_id, b"400", b"key not allowed", b"", b""]

    def close(self) -> None:
        self.socket.close(linger=0)


# Handshake failures that never reach ZAP, by libzmq's protocol error code.
_HANDSHAKE_REASONS: dict[int, str] = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "no_key",  # a plain (NULL) client
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "wrong_server_key",  # or a corrupted handshake
}


_HUNG_UP = frozenset((errno.EPIPE, errno.ECONNRESET))
_REASON_TEXT = {
    "closed_during_handshake": "it hung up during the handshake (a client with no key, "
    "which saw the mismatch first, or one that gave up)",
}


class HandshakeMonitor:
    """Counts the peers a CURVE socket refuses before ZAP is asked: a client with no key
    (a plain ZeroMQ peer), one with the wrong server key, one that does not speak ZMTP.
    libzmq reports those only as socket monitor events; ZAP sees only well-formed CURVE
    clients, whose refusals `ZapHandler` counts. Each reason is logged once."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        self._watched = sock
        events = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        self.socket: zmq.Socket[Any] = sock.get_monitor_socket(events)
        self.refused = 0
        self.by_reason: collections.Counter[str] = collections.Counter()

    def handle(self) -> None:
        # Imported here, where a refused handshake is read, not at the top: the module
        # imports zmq.asyncio (asyncio, ssl: ~30 ms of CPU), which every process that
        # imports tapd (daemon, CLI, emitters, subscribers) would pay at its start.
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                return
            value = int(event["value"])
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                # An errno, not a protocol error: a client with no key that saw the
                # mismatch first and hung up makes our next write fail (EPIPE).
                reason = "closed_during_handshake" if value in _HUNG_UP else "bad_handshake"
                detail = f"errno {errno.errorcode.get(value, value)}"
            else:
                reason = _HANDSHAKE_REASONS.get(value, "bad_handshake")
                detail = f"libzmq error {value:#x}"
            self.refused += 1
            self.by_reason[reason] += 1
            log = logger.warning if self.by_reason[reason] == 1 else logger.debug
            log(
                "refused a peer on %r: %s (%s; further ones counted in auth_refused, not logged)",
                event["endpoint"].decode(errors="replace"),
                _REASON_TEXT.get(reason, reason.replace("_", " ")),
                detail,
            )

    def close(self) -> None:
        try:
            self._watched.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(linger=0)
