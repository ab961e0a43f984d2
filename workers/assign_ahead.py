"""Assignment in the background: the coordinator's serving loop never waits for ``assign``.

The coordinator asks :meth:`AssignAhead.slot` for the rows of a microbatch; when
that iteration is not assigned yet the call returns ``None`` at once and the
iteration (with the next ``ahead`` ones) is queued for a daemon thread, which
runs the :class:`~.schedule.Scheduler` (the only thread that touches it). The
serving loop meanwhile keeps receiving credits, delivering finished microbatches
and answering ranks. Results are a pure function of the seed, so an iteration
dropped from the bounded cache is simply assigned again if a lagging rank needs it.
The cache drops the iteration used least recently: a replica many iterations behind
the others keeps the one it is reading (dropping the oldest dropped it the moment it
was assigned again, and that rank never got a microbatch).
"""

from __future__ import annotations

import heapq
import logging
import threading
from collections import OrderedDict
from typing import Any

from entrain_data.errors import EntrainError

from .schedule import Scheduler, Slot

__all__ = ["AssignAhead"]

log = logging.getLogger(__name__)


class AssignAhead:
    """Assigned iterations, computed ``ahead`` of the furthest one asked for, in one thread."""

    def __init__(self, scheduler: Scheduler, *, ahead: int = 2, cache: int = 16) -> None:
        self.scheduler = scheduler
        self.shape = scheduler.shape
        self.ahead, self.cache = ahead, max(cache, ahead + 2)
        self.error: EntrainError | None = None
        self._done: OrderedDict[tuple[int, int], list[list[Slot]]] = OrderedDict()  # LRU
        self._asked: set[tuple[int, int]] = set()
        self._heap: list[tuple[int, int]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="entrain-assign", daemon=True)
        self._thread.start()

    def slot(self, replica: int, position: int) -> Slot | None:
        """The rows of (replica, position), or ``None`` while its iteration is being assigned."""
        epoch, it, mb = self.shape.locate(position)
        key = (epoch, it)
        with self._cv:
            slots = self._done.get(key)
            if slots is not None:
                self._done.move_to_end(key)
                return slots[replica][mb]
            for k in range(self.ahead + 1):
                e, i = divmod(epoch * self.shape.iterations + it + k, self.shape.iterations)
                self._ask((e, i))
            self._cv.notify()
        return None

    def _ask(self, key: tuple[int, int]) -> None:
        if key not in self._done and key not in self._asked:
            self._asked.add(key)
            heapq.heappush(self._heap, key)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap and not self._closed:
                    self._cv.wait(1.0)
                if self._closed:
                    return
                key = heapq.heappop(self._heap)
            try:
                slots = self.scheduler.slots(*key)
            except EntrainError as exc:
                self.error = type(exc)(f"assignment of epoch {key[0]} iteration {key[1]}: {exc}")
                log.error("%s", self.error)
                return
            except Exception as exc:  # a bug in a method must stop the service, not hang it
                self.error = EntrainError(
                    f"assignment of epoch {key[0]} iteration {key[1]} failed: "
                    f"{type(exc).__name__}: {exc}"
                )
                log.exception("assignment failed")
                return
            with self._cv:
                self._asked.discard(key)
                self._done[key] = slots
                while len(self._done) > self.cache:  # least recently used: re-assigned if needed
                    self._done.popitem(last=False)

    @property
    def latencies(self) -> list[float]:
        return self.scheduler.latencies

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(5.0)

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {"assigned_ahead": len(self._done), "queued": len(self._heap)}
