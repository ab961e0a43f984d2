"""The coordinator's ROUTER sockets, made, secured and bound in one place.

``front`` serves ranks, ``back`` local workers, ``remote`` (optional, tcp) workers on other
hosts. What crosses hosts is CURVE-encrypted when the service has keys. A failed bind closes
every socket made so far and names the endpoint, so a second service on a taken address
stops with one line instead of a traceback; a taken address is :class:`AddressInUse`.
"""

from __future__ import annotations

import zmq

from entrain_data.errors import AddressInUse, InvalidInput
from entrain_data.tcp import family_for

from .config import ServiceConfig

__all__ = ["open_sockets"]


def open_sockets(
    ctx: zmq.Context, cfg: ServiceConfig
) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket | None]:
    """Bound ``(front, back, remote)``; ``remote`` is None without ``cfg.remote_endpoint``."""
    front = ctx.socket(zmq.ROUTER)
    back = ctx.socket(zmq.ROUTER)
    remote = ctx.socket(zmq.ROUTER) if cfg.remote_endpoint else None
    socks = [front, back, remote]
    try:
        for s in socks:
            if s is not None:
                s.setsockopt(zmq.LINGER, 0)
        front.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client may reuse its identity
        for s in (front, remote):
            if s is not None and cfg.curve_secret_key:
                s.curve_server = True
                s.curve_secretkey = cfg.curve_secret_key
                s.curve_publickey = cfg.curve_public_key
        for s, ep in zip(socks, [cfg.endpoint, cfg.worker_endpoint, cfg.remote_endpoint]):
            if s is None:
                continue
            family_for(s, ep)
            try:
                s.bind(ep)
            except zmq.ZMQError as exc:
                if exc.errno == zmq.EADDRINUSE:
                    raise AddressInUse(
                        f"cannot serve on {ep}: address already in use", endpoint=ep
                    ) from None
                raise InvalidInput(f"cannot serve on {ep}: {exc.strerror}") from None
    except BaseException:
        for s in socks:
            if s is not None:
                s.close(linger=0)
        raise
    return front, back, remote
