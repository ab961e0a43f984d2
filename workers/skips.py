"""The record of samples the service did not deliver, and the error budget that bounds them.

Two reasons a sample is not delivered: it could not be read or decoded (policy
``skip``), or it fell in the last global batch of an epoch, too small to give
every microbatch a sample. Both are written to the record (JSON lines: ``key``,
``source``, ``reason``, ``epoch``) and logged; only the first kind counts against
the budget (``max_skipped``: a count such as ``10`` or a share such as ``1%`` of
the index), past which the service stops with a clear error instead of training
on what is left.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from entrain_data.errors import InvalidInput, SampleError

__all__ = ["SkipBudget", "SkipRecord", "parse_budget"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SkipBudget:
    """At most ``count`` samples, or ``percent`` % of the index, may be skipped."""

    text: str
    count: int | None = None
    percent: float | None = None

    def limit(self, samples: int) -> int:
        if self.count is not None:
            return self.count
        return math.floor(samples * (self.percent or 0.0) / 100.0 + 1e-9)


def parse_budget(value: str | int | float | None) -> SkipBudget:
    """``10`` (samples), ``"1%"`` (of the index); ``None``: unlimited."""
    if value is None:
        return SkipBudget("unlimited", percent=100.0)
    text = str(value).strip()
    try:
        if text.endswith("%"):
            pct = float(text[:-1])
            if not 0.0 <= pct <= 100.0:
                raise ValueError
            return SkipBudget(text, percent=pct)
        count = int(text)
        if count < 0:
            raise ValueError
        return SkipBudget(text, count=count)
    except ValueError:
        raise InvalidInput(
            f"max_skipped must be a count >= 0 or a percentage such as 1%, got {value!r}"
        ) from None


class SkipRecord:
    """Counts skipped samples (each key once), writes the record, enforces the budget."""

    def __init__(
        self,
        path: str | None,
        budget: SkipBudget,
        samples: int,
        keys: Callable[[], list[str] | None],
    ) -> None:
        self.path = path
        self.budget = budget
        self.samples = samples
        self._keys_fn = keys
        self._keys: list[str] | None = None
        self.skipped: set[str] = set()
        self.first: str | None = None  # the first skip's key and reason, for the budget's error
        self.left_out = 0
        self._opened = False

    def _write(self, entries: list[dict[str, Any]]) -> None:
        if not self.path or not entries:
            return
        with open(self.path, "a" if self._opened else "w", encoding="utf-8") as f:
            for e in entries:
                f.write(json.dumps(e) + "\n")
        self._opened = True

    def _key(self, row: int) -> str:
        if self._keys is None:
            self._keys = self._keys_fn() or []
        return self._keys[row] if row < len(self._keys) else f"row {row}"

    def add_skipped(self, entries: list[dict[str, Any]], epoch: int, iteration: int) -> None:
        """Samples a worker could not read or decode (``{key, source, error}`` each)."""
        new = [e for e in entries if e.get("key") not in self.skipped]
        for e in new:
            self.skipped.add(str(e.get("key")))
            if self.first is None:
                self.first = f"{e.get('key')}: {e.get('error')}"
            log.warning(
                "skipped sample %s in %s: %s", e.get("key"), e.get("source"), e.get("error")
            )
        self._write(
            [
                {
                    "key": e.get("key"),
                    "source": e.get("source"),
                    "reason": f"undecodable: {e.get('error')}",
                    "epoch": epoch,
                    "iteration": iteration,
                }
                for e in new
            ]
        )

    def add_left_out(self, rows: list[int], epoch: int, why: str) -> None:
        """Samples of an epoch's last, too-small global batch (not counted against the budget)."""
        if not rows:
            return
        self.left_out += len(rows)
        log.warning("epoch %d: %d sample(s) left out: %s", epoch, len(rows), why)
        self._write(
            [
                {"key": self._key(r), "source": None, "reason": f"left out: {why}", "epoch": epoch}
                for r in rows
            ]
        )

    def add_epoch_left_out(self, epoch: int, rows: Any, dp: int, microbatches: int) -> None:
        """The rows an epoch's too-small last global batch leaves out, with the reason."""
        why = (
            f"the last global batch of epoch {epoch} has {len(rows)} sample(s), too few for "
            f"dp {dp} x {microbatches} microbatches"
        )
        self.add_left_out([int(r) for r in rows], epoch, why)

    def over_budget(self) -> SampleError | None:
        """The error that stops the service once more samples were skipped than allowed."""
        limit = self.budget.limit(self.samples)
        if len(self.skipped) <= limit:
            return None
        share = 100.0 * len(self.skipped) / max(self.samples, 1)
        where = f"; every one is listed in {self.path}" if self.path else ""
        return SampleError(
            f"{len(self.skipped)} of {self.samples} samples ({share:.1f}%) could not be read, "
            f"decoded or checked, over the error budget max_skipped={self.budget.text}{where}; "
            f"the first: {self.first}"
        )
