"""One copy of a microbatch for every tensor-parallel peer on a host: a file in shared memory.

Tensor-parallel ranks of one replica (and of one pipeline stage) read the same
microbatch. Sending it over ipc to each costs one transfer per peer; instead the
worker writes the tensors once into a file under the service's directory in
``/dev/shm`` and sends each peer only the ``batch`` header naming it. Each peer
maps the file read-only; its tensors view the mapping, so the bytes exist once in
memory however many peers read them. The coordinator unlinks the file once every
peer has moved past the microbatch (a mapping outlives the unlink) and removes the
directory when it stops.

File layout: the tensors' bytes in the header's order, each starting at a multiple
of :data:`ALIGN`; the header's ``shm`` field holds ``{"path", "offsets"}``.
"""

from __future__ import annotations

import mmap
import os
import tempfile
from collections.abc import Sequence
from typing import Any

from .errors import ProtocolError

__all__ = ["ALIGN", "make_shared_dir", "write_shared", "map_shared"]

ALIGN = 64


def make_shared_dir() -> str | None:
    """A private directory in shared memory (``/dev/shm``), or None where there is none."""
    root = "/dev/shm"
    if not (os.path.isdir(root) and os.access(root, os.W_OK)):
        return None
    return tempfile.mkdtemp(prefix="entrain-shm-", dir=root)


def write_shared(path: str, buffers: Sequence[Any]) -> list[int]:
    """Write ``buffers`` into a new file at ``path``; returns each one's offset."""
    offsets: list[int] = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        pos = 0
        for buf in buffers:
            pad = -pos % ALIGN
            if pad:
                os.write(fd, bytes(pad))
                pos += pad
            offsets.append(pos)
            view = memoryview(buf).cast("B")
            while view:
                n = os.write(fd, view)
                view, pos = view[n:], pos + n
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return offsets


def map_shared(shm: Any, specs: Sequence[Any], root: str | None) -> list[memoryview]:
    """Views of a shared microbatch's tensors, for ``protocol.decode`` to check and wrap.

    ``shm`` is the header's field, ``specs`` its ``tensors`` list; ``root`` the
    service's shared directory (from the welcome): a path outside it is refused.
    """
    if root is None or not isinstance(shm, dict):
        raise ProtocolError("a shared microbatch, but the service named no shared directory")
    path, offsets = shm.get("path"), shm.get("offsets")
    if not isinstance(path, str) or not isinstance(offsets, list) or len(offsets) != len(specs):
        raise ProtocolError(f"malformed shared microbatch field {shm!r}")
    real = os.path.realpath(path)
    if os.path.dirname(real) != os.path.realpath(root):
        raise ProtocolError(f"shared microbatch {path!r} is outside {root!r}")
    try:
        fd = os.open(real, os.O_RDONLY)
    except OSError as exc:
        raise ProtocolError(f"shared microbatch {path!r}: {exc.strerror}") from None
    try:
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
    whole = memoryview(mm) if mm is not None else memoryview(b"")
    views = []
    for spec, off in zip(specs, offsets):
        nbytes = spec[3] if isinstance(spec, list) and len(spec) == 4 else None
        if not isinstance(off, int) or not isinstance(nbytes, int) or off < 0:
            raise ProtocolError(f"shared microbatch {path!r}: bad offset {off!r}")
        if off + nbytes > size:
            raise ProtocolError(
                f"shared microbatch {path!r}: {size} bytes, tensor ends at {off + nbytes}"
            )
        views.append(whole[off : off + nbytes])
    return views
