"""An ipc endpoint's path, claimed for as long as the service that binds it lives.

ZeroMQ binds an ipc path by unlinking whatever socket file is there, and unlinks it again when
the socket closes. So a probe before the bind (is anyone listening?) leaves a window: two
services started together both find the path free, both bind, both print that they serve,
and the ranks reach only the second; when either stops, it unlinks the other's socket file and
that one serves nobody, silently. Here the service takes an exclusive ``flock`` on a lock file
beside the socket (``PATH.lock``) before it binds and keeps it until its sockets are closed: a
second service is refused (:class:`AddressInUse`) whatever the timing, and a stop unlinks the
socket file only while it still holds the claim, never a successor's.

On a filesystem without ``flock``, or a folder where no lock file can be made (read-only,
the socket made by someone else), nothing is claimed and the probe alone guards, as before:
the bind then says what is wrong with the path.
"""

from __future__ import annotations

import contextlib
import fcntl
import os

from entrain_data.errors import AddressInUse
from entrain_data.owned_dirs import NO_FLOCK  # one list of what 'no flock here' raises

__all__ = ["claim", "release", "remove_unclaimed"]

_TRIES = 3  # a lock file unlinked by a stopping owner between our open and lock: open again


def _path(ep: str) -> str | None:
    return ep[len("ipc://") :] if ep.startswith("ipc://") else None


def claim(ep: str) -> int | None:
    """A descriptor holding ``ep``'s claim (None: not ipc, or no ``flock`` here); raises
    :class:`AddressInUse` where another live process holds it."""
    path = _path(ep)
    if path is None:
        return None
    lock = path + ".lock"
    for _ in range(_TRIES):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError:  # no lock file can be made here (read-only, no folder): the bind will
            return None  # say what is wrong with the path
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise AddressInUse(
                f"endpoint {ep}: is in use: another service listens there", endpoint=ep
            ) from None
        except OSError as exc:
            os.close(fd)
            if exc.errno in NO_FLOCK:  # nobody can hold it here: it guards nothing, remove it
                with contextlib.suppress(OSError):
                    os.unlink(lock)
                return None
            raise
        try:  # the file locked must still be the one at the path (not one its owner unlinked)
            if os.stat(lock).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)
    raise AddressInUse(f"endpoint {ep}: is in use: another service listens there", endpoint=ep)


def release(ep: str, fd: int | None) -> None:
    """Unlink ``ep``'s socket file and lock file (ours while ``fd`` holds the claim), then let
    go. ``fd`` None: unlink the socket file only (no claim was possible here)."""
    path = _path(ep)
    if path is None:
        return
    names = [path] if fd is None else [path, path + ".lock"]
    try:
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name)
    except OSError:  # not ours to remove (a read-only folder): a stop never raises for it
        pass
    finally:
        if fd is not None:
            os.close(fd)


def remove_unclaimed(ep: str) -> None:
    """What a service that is gone left at ``ep`` (a coordinator killed before it unlinked),
    removed unless a live service claims the path now."""
    path = _path(ep)
    if path is None or not (os.path.lexists(path) or os.path.lexists(path + ".lock")):
        return  # nothing left (or its folder is gone already)
    try:
        fd = claim(ep)
    except AddressInUse:  # a live service's now
        return
    release(ep, fd)
