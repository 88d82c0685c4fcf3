"""The control channel between the trainer's coordinator and a rollout worker
(docs/design.md, "Placement: two worlds in one job").

One TCP connection per worker (`multiprocessing.connection` over a socket, authenticated with
the job's key: an HMAC challenge each way before any message), carrying ``(kind, payload)``
messages of plain data: requests, finished samples (`megarl.rollout.completion_arrays`' flat
arrays), heartbeats, stop. Every wait has a timeout and fails naming the peer and what it
waited for; a peer that is gone (its process exited, its socket closed) fails the next wait
at once, naming it.

    listener = ChannelListener(authkey)                # coordinator: a free port on host
    ch = listener.accept("rollout worker 0", timeout_s=600)
    ch = connect(host, port, authkey, "coordinator")   # worker
    ch.send("request", {...}); kind, payload = ch.recv("a finished sample", timeout_s=1800)
"""

from __future__ import annotations

import socket
import time
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Any

DEFAULT_TIMEOUT_S = 1800.0


class ChannelError(RuntimeError):
    """The peer timed out, went away or failed authentication."""


class Channel:
    """One end of a connection: ``send`` and ``recv`` of ``(kind, payload)`` messages.
    ``peer``: the other end, as error messages name it."""

    def __init__(self, conn: Connection, peer: str) -> None:
        self.conn, self.peer = conn, peer

    def send(self, kind: str, payload: Any = None) -> None:
        try:
            self.conn.send((kind, payload))
        except (OSError, EOFError, ValueError) as e:
            raise ChannelError(f"{self.peer} is gone: sending {kind!r} failed "
                               f"({type(e).__name__}: {e})") from None

    def poll(self, timeout_s: float = 0.0) -> bool:
        """Whether a message (or the peer's end) is waiting, within ``timeout_s``."""
        try:
            return self.conn.poll(timeout_s)
        except (OSError, EOFError, ValueError):
            return True  # the next recv reports it

    def recv(self, what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[str, Any]:
        """The next message; ``what``: what the caller waits for (named if it never comes)."""
        if not self.poll(timeout_s):
            raise ChannelError(f"{self.peer} sent nothing for {timeout_s:g} s while waiting "
                               f"for {what}")
        try:
            kind, payload = self.conn.recv()
        except (OSError, EOFError) as e:
            raise ChannelError(f"{self.peer} is gone (its connection closed) while waiting "
                               f"for {what} ({type(e).__name__})") from None
        return kind, payload

    def close(self) -> None:
        self.conn.close()


class ChannelListener:
    """The coordinator's side: a listening socket on ``host`` (a free port unless given)."""

    def __init__(self, authkey: bytes, host: str = "127.0.0.1", port: int = 0) -> None:
        if not authkey:
            raise ValueError("the control channel needs a non-empty authkey")
        self.authkey = authkey
        self.sock = socket.create_server((host, port))
        self.host, self.port = self.sock.getsockname()[:2]

    def accept(self, peer: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Channel:
        """The next worker's connection, authenticated; ``peer``: how errors name it."""
        self.sock.settimeout(timeout_s)
        try:
            sock, _ = self.sock.accept()
        except TimeoutError:
            raise ChannelError(f"{peer} did not connect to {self.host}:{self.port} within "
                               f"{timeout_s:g} s") from None
        sock.setblocking(True)
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.authkey)
            answer_challenge(conn, self.authkey)
        except Exception as e:  # noqa: BLE001 - AuthenticationError, or the peer left
            conn.close()
            raise ChannelError(f"{peer} failed the channel's authentication "
                               f"({type(e).__name__}: {e})") from None
        return Channel(conn, peer)

    def close(self) -> None:
        self.sock.close()


def connect(host: str, port: int, authkey: bytes, peer: str,
            timeout_s: float = DEFAULT_TIMEOUT_S) -> Channel:
    """A worker's side: connect to the coordinator at ``host:port`` (retried until it listens,
    for up to ``timeout_s``) and authenticate."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=max(
                0.1, deadline - time.monotonic()))
            break
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ChannelError(f"{peer} at {host}:{port} did not accept a connection "
                                   f"within {timeout_s:g} s ({type(e).__name__}: {e})") from None
            time.sleep(0.2)
    sock.setblocking(True)
    conn = Connection(sock.detach())
    try:
        answer_challenge(conn, authkey)
        deliver_challenge(conn, authkey)
    except Exception as e:  # noqa: BLE001
        conn.close()
        raise ChannelError(f"{peer} at {host}:{port}: the channel's authentication failed "
                           f"({type(e).__name__}: {e})") from None
    return Channel(conn, peer)
