"""What tcp endpoints need beyond ``bind``/``connect``: IPv6 literals, the address other hosts
reach this one at, and telling a CURVE key the server refuses from a server that is down.

ZeroMQ leaves IPv6 off unless a socket asks for it (``tcp://[::1]:5555`` then fails with "No
such device"); it retries a refused CURVE handshake forever without a word, so a wrong key
looks exactly like a service that is not running. These helpers let every socket of the
package say which it is.
"""

from __future__ import annotations

import socket

import zmq

__all__ = ["HandshakeWatch", "family_for", "outward_address"]

_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def family_for(sock: zmq.Socket, endpoint: str | None) -> None:
    """Turn IPv6 on for ``sock`` when ``endpoint`` names a bracketed IPv6 address."""
    if endpoint and endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)


def _loopback(host: str) -> bool:
    return host.startswith("127.") or host in ("localhost", "::1", "[::1]")


def outward_address(toward: str | None = None) -> str:
    """This host's address as other hosts see it: the interface a route to ``toward`` (the
    service's host) leaves by, else the one the default route leaves by, else the host name's.
    The host name alone often resolves to 127.0.1.1 (Debian's hosts file), which other hosts
    would take for their own loopback. Nothing is sent: a UDP ``connect`` only picks a route."""
    for target in (toward, "10.255.255.255"):
        if not target or _loopback(target):
            continue
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((target.strip("[]"), 9))
                ip = str(s.getsockname()[0])
        except OSError:
            continue
        if not _loopback(ip):
            return ip
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class HandshakeWatch:
    """Counts a CURVE client socket's failed handshakes (a server that refuses this key drops
    every attempt; a server that is down never gets that far). Close before the context."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        self.failures = 0
        self.succeeded = False

    def refused(self, times: int = 3) -> bool:
        """Whether the server refused ``times`` handshakes and accepted none."""
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            self.succeeded |= event == zmq.EVENT_HANDSHAKE_SUCCEEDED
            self.failures += bool(event & _FAILED)
        return not self.succeeded and self.failures >= times

    def close(self) -> None:
        if not self.monitor.closed:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
