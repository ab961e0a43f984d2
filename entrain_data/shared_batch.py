"""Same-host microbatches through shared memory: reusable slots a worker writes and ranks map.

Over an ipc socket a microbatch is copied twice (into the kernel, out of it) and
lands in freshly allocated pages the receiver must fault in and the kernel must
clear: for 12 MB images that is most of a rank's CPU. Instead each worker keeps
a pool of files in the service's directory in ``/dev/shm`` (its *segments*),
mapped once, and copies a microbatch into a free one, once however many ranks
read it (tensor-parallel peers, later pipeline stages); each rank gets only the
``batch`` header naming the segment. The rank maps that slot copy-on-write and
its tensors view the mapping: no copy on the rank, and the segment's pages stay
resident, so neither side clears a fresh page.

A segment is free again when every rank it went to has dropped the tensors that
view it: the first page of the file holds one byte per reader, set to 1 by the
writer before it sends, cleared by that reader's finalizer when the last tensor
of that microbatch is garbage. Each byte has one writer at a time, so no atomic
is needed. A rank that dies holding a slot leaves it taken; the pool is bounded
(:data:`POOL_BYTES` per worker, and never the last half of ``/dev/shm``), and
when no slot is free and the pool is full the worker sends the bytes over the
socket as before. The coordinator removes a dead worker's segments and, when it
stops, the directory; mappings outlive both.

Segment layout: the flag page (:data:`HEAD` bytes), then the tensors' bytes in
the header's order, each at a multiple of :data:`ALIGN`. The header's ``shm``
field is ``{"path", "offsets", "reader"}``: offsets are from the file's start,
``reader`` is this rank's flag byte.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import ProtocolError
from .owned_dirs import drop_owned_dir, make_owned_dir, remove_orphaned_dirs

__all__ = [
    "ALIGN",
    "HEAD",
    "POOL_BYTES",
    "SegmentPool",
    "SegmentReader",
    "SHM_ROOT",
    "drop_shared_dir",
    "make_shared_dir",
    "remove_segments",
    "remove_shared_dirs",
]

ALIGN = 64
HEAD = mmap.PAGESIZE  # the flag page: byte i belongs to the slot's reader i
POOL_BYTES = 1 << 30  # per worker
_GRAIN = 1 << 20  # segment capacities are whole MiB, with a quarter of headroom
# MADV_POPULATE_READ (Linux 5.14): maps the slot's pages readable without copying them;
# cheaper for the rank than a fault per 16 pages while it reads them (py-spy, fan-out 8)
_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
_MAX_FILES = 64  # segments a rank keeps open (their flag pages mapped)


SHM_ROOT = "/dev/shm"
_DIR_PREFIX = "entrain-shm-"  # then the pid of the process that made it, "-", a random tail


def make_shared_dir(root: str = SHM_ROOT) -> str | None:
    """A private directory in shared memory (``/dev/shm``), or None where there is none.

    What a service killed with SIGKILL leaves is removed by its
    :class:`~entrain_data.workers.service.ServiceHandle` and by the next service made on this
    host (:mod:`entrain_data.owned_dirs`)."""
    if not (os.path.isdir(root) and os.access(root, os.W_OK)):
        return None
    return make_owned_dir(root, _DIR_PREFIX)


def drop_shared_dir(path: str) -> None:
    """Remove a directory :func:`make_shared_dir` made here, and let go of its lock."""
    drop_owned_dir(path)


def remove_shared_dirs(pid: int | None = None, root: str = SHM_ROOT) -> list[str]:
    """Remove the shared directories whose owner has ended (only those ``pid`` made, when
    given); the removed paths. Ranks that map a segment keep their mapping."""
    return remove_orphaned_dirs(root, _DIR_PREFIX, pid)


def remove_segments(root: str, owner: str) -> None:
    """Unlink every segment of a worker (its ranks' mappings stay valid)."""
    for path in glob.glob(os.path.join(glob.escape(root), f"{glob.escape(owner)}-*.seg")):
        with contextlib.suppress(OSError):
            os.unlink(path)


def _layout(buffers: Sequence[Any]) -> tuple[list[memoryview], list[int], int]:
    views = [memoryview(b).cast("B") for b in buffers]
    offsets, pos = [], HEAD
    for v in views:
        pos += -pos % ALIGN
        offsets.append(pos)
        pos += v.nbytes
    return views, offsets, pos


@dataclass
class _Segment:
    path: str
    mm: mmap.mmap  # the whole file, mapped once: writes are plain copies, no page lookups
    readers: int = 0  # flag bytes its last microbatch set
    to: Any = None  # the ranks its last microbatch went to (they have it mapped)

    @property
    def size(self) -> int:  # the file's bytes, flag page included
        return len(self.mm)

    def free(self) -> bool:
        return not any(self.mm[: self.readers])


class SegmentPool:
    """A worker's segments in ``root``; :meth:`write` puts one microbatch in a free one."""

    def __init__(self, root: str, owner: str, budget: int = POOL_BYTES) -> None:
        self.root, self.owner = root, owner
        os.statvfs(root)  # the directory exists (OSError otherwise)
        self.budget = budget
        self.segments: list[_Segment] = []  # by size, smallest first
        self.used = 0
        self._made = 0

    def write(self, buffers: Sequence[Any], to: Sequence[Any]) -> dict[str, Any] | None:
        """Write ``buffers`` for the ranks ``to`` (any hashable names, one flag byte each); the
        header's ``shm`` field (less ``reader``), or None when no segment is free and the pool
        is full (send them over the socket).

        A free segment that last went to the same ranks is taken first: they have its pages
        mapped already, so reading it costs them no page fault.
        """
        readers, to = len(to), tuple(to)
        if not 0 < readers <= HEAD:
            return None
        views, offsets, end = _layout(buffers)
        fits = [s for s in self.segments if s.size >= end]
        seg = next((s for s in fits if s.to == to and s.free()), None)
        seg = seg or next((s for s in fits if s.free()), None) or self._grow(end)
        if seg is None:
            return None
        seg.mm[:readers] = b"\x01" * readers
        seg.readers, seg.to = readers, to
        for view, off in zip(views, offsets):
            seg.mm[off : off + view.nbytes] = view
        return {"path": seg.path, "offsets": offsets}

    def release(self, slot: dict[str, Any], reader: int) -> None:
        """Give back a reader's claim the worker could not send it."""
        seg = next((s for s in self.segments if s.path == slot["path"]), None)
        if seg is not None:
            seg.mm[reader] = 0

    def _grow(self, end: int) -> _Segment | None:
        size = HEAD + -(-(end - HEAD) * 5 // 4 // _GRAIN) * _GRAIN
        if self.used + size > self.budget:
            return None
        st = os.statvfs(self.root)
        if (st.f_bavail * st.f_frsize - size) * 2 < st.f_blocks * st.f_frsize:
            return None  # the last half of /dev/shm is left to others (NCCL, DataLoaders)
        path = os.path.join(self.root, f"{self.owner}-{self._made}.seg")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None  # the directory is gone (the service is stopping)
        try:
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, never SIGBUS on a write
            mm = mmap.mmap(fd, size, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except OSError:
            with contextlib.suppress(OSError):  # removed already with its directory (a stop)
                os.unlink(path)
            return None
        finally:
            os.close(fd)
        self._made += 1
        self.used += size
        seg = _Segment(path, mm)
        self.segments.append(seg)
        self.segments.sort(key=lambda s: s.size)
        return seg

    def close(self) -> None:
        for seg in self.segments:
            seg.mm.close()
            with contextlib.suppress(OSError):
                os.unlink(seg.path)
        self.segments.clear()


def _clear(flags: mmap.mmap, reader: int) -> None:
    with contextlib.suppress(ValueError, IndexError):  # unmapped already: nothing to free
        flags[reader] = 0


class SegmentReader:
    """A rank's view of workers' segments under ``root`` (the service's directory).

    Each microbatch gets its own private copy-on-write mapping of its slot: reading it
    reads the shared pages, and a training loop that writes into a tensor in place
    copies the pages it writes, never changing what a peer reads or what the segment
    holds when it is reused (a shared mapping kept across microbatches would fault
    less, but an in-place write would then crash on a read-only page or reach peers).
    """

    def __init__(self, root: str | None) -> None:
        self.root = os.path.realpath(root) if root else None
        # fd, flag page, size (a segment never changes size once its worker made it)
        self.files: OrderedDict[str, tuple[int, mmap.mmap, int]] = OrderedDict()

    def _check(self, shm: Any) -> tuple[str, list[Any], int]:
        if self.root is None or not isinstance(shm, dict):
            raise ProtocolError("a shared microbatch, but the service named no shared directory")
        path, offsets, reader = shm.get("path"), shm.get("offsets"), shm.get("reader")
        if (
            not isinstance(path, str)
            or not isinstance(offsets, list)
            or not isinstance(reader, int)
            or not 0 <= reader < HEAD
        ):
            raise ProtocolError(f"malformed shared microbatch field {shm!r:.200}")
        real = os.path.realpath(path)
        if os.path.dirname(real) != self.root:
            raise ProtocolError(f"shared microbatch {path!r} is outside {self.root!r}")
        return real, offsets, reader

    def _open(self, path: str) -> tuple[int, mmap.mmap, int] | None:
        """The segment's descriptor, flag page and size; None when it no longer exists (its worker
        died and the coordinator removed its segments while this header was on its way)."""
        got = self.files.pop(path, None)
        if got is None:
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                return None
            except OSError as exc:
                raise ProtocolError(f"shared microbatch {path!r}: {exc.strerror}") from None
            size = os.fstat(fd).st_size
            if size < HEAD:
                os.close(fd)
                raise ProtocolError(f"shared microbatch {path!r}: no flag page")
            got = (fd, mmap.mmap(fd, HEAD), size)
        self.files[path] = got  # most recently used last
        while len(self.files) > _MAX_FILES:
            os.close(self.files.popitem(last=False)[1][0])  # its flag page stays mapped
        return got

    def release(self, shm: Any) -> None:
        """Free a slot without reading it (a duplicate the rank already holds)."""
        path, _, reader = self._check(shm)
        got = self._open(path)
        if got is not None:
            _clear(got[1], reader)

    def views(self, shm: Any, specs: Sequence[Any]) -> list[memoryview] | None:
        """Views of a microbatch's tensors, for ``protocol.decode`` to check and wrap; the
        slot is freed when the last view (and every tensor made from one) is gone. None when
        the segment is gone with its worker: the microbatch is lost, as one in a dead worker's
        socket queue is, and the rank asks for it again."""
        path, offsets, reader = self._check(shm)
        if len(offsets) != len(specs):
            raise ProtocolError(f"shared microbatch {path!r}: {len(offsets)} offsets")
        got = self._open(path)
        if got is None:
            return None
        fd, flags, size = got
        spans = []
        for spec, off in zip(specs, offsets):
            nbytes = spec[3] if isinstance(spec, list) and len(spec) == 4 else None
            if not isinstance(off, int) or not isinstance(nbytes, int) or off < HEAD:
                _clear(flags, reader)
                raise ProtocolError(f"shared microbatch {path!r}: bad offset {off!r}")
            if off + nbytes > size:
                _clear(flags, reader)
                raise ProtocolError(
                    f"shared microbatch {path!r}: {size} bytes, tensor ends at {off + nbytes}"
                )
            spans.append((off, nbytes))
        start = min((o for o, _ in spans), default=HEAD)
        count = max((o + n for o, n in spans), default=start) - start
        if count == 0:
            _clear(flags, reader)
            return [memoryview(b"") for _ in spans]
        low = start - start % mmap.ALLOCATIONGRANULARITY
        private = mmap.mmap(fd, start + count - low, mmap.MAP_PRIVATE, offset=low)
        with contextlib.suppress(OSError, ValueError):  # older kernels: pages fault in on use
            private.madvise(_POPULATE_READ)  # every page table entry in one call
        holder = np.frombuffer(private, np.uint8, count, start - low)
        weakref.finalize(holder, _clear, flags, reader)
        whole = memoryview(holder)
        return [whole[o - start : o - start + n] for o, n in spans]
