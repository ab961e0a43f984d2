"""DeepSpeed config from the plan: the user's config (in any form DeepSpeed takes) with the
plan's batch geometry and ZeRO stage merged in. Re-exported by :mod:`.deepspeed`."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import logging
import os
from collections.abc import Mapping
from typing import Any

from ..errors import InvalidInput
from ..plan import ParallelPlan

__all__ = ["ZERO_STAGE", "deepspeed_config"]

log = logging.getLogger(__name__)

ZERO_STAGE = {"none": 0, "optimizer": 1, "gradients": 2, "full": 3}
"""ZeRO stage of each ``ParallelPlan.sharding``."""


def _load_user_config(user_config: Mapping[str, Any] | str | os.PathLike | None) -> dict:
    """The user's config as a dict, from what ``deepspeed.initialize(config=...)`` accepts: a
    mapping, a path to a JSON file, base64-encoded JSON (and here JSON text too)."""
    if user_config is None:
        return {}
    if isinstance(user_config, Mapping):
        return copy.deepcopy(dict(user_config))
    if not isinstance(user_config, (str, os.PathLike)):
        raise InvalidInput(
            f"deepspeed config: expected a dict, a path to a JSON file or JSON text, got "
            f"{type(user_config).__name__}"
        )
    text = os.fspath(user_config)
    if os.path.isfile(text):
        try:
            with open(text, encoding="utf-8") as f:
                loaded = json.load(f)
        except (OSError, ValueError) as exc:
            raise InvalidInput(f"deepspeed config file {text!r}: {exc}") from None
    else:
        try:
            raw = text if text.lstrip().startswith("{") else base64.urlsafe_b64decode(text)
            loaded = json.loads(raw)
        except (ValueError, binascii.Error):
            raise InvalidInput(
                f"deepspeed config {text[:80]!r}: neither an existing file, JSON text nor "
                "base64-encoded JSON"
            ) from None
    if not isinstance(loaded, dict):
        raise InvalidInput(f"deepspeed config {text[:80]!r}: holds a {type(loaded).__name__}")
    return loaded


def deepspeed_config(
    plan: ParallelPlan, user_config: Mapping[str, Any] | str | os.PathLike | None = None
) -> dict[str, Any]:
    """The user's DeepSpeed config (a dict, a JSON file's path, JSON text) with the plan's
    batch geometry merged in.

    ``gradient_accumulation_steps`` = microbatches per replica per iteration;
    ``train_micro_batch_size_per_gpu`` = the mean samples per microbatch (a
    nominal figure: balanced microbatches vary in size, DeepSpeed only uses it
    for bookkeeping); ``train_batch_size`` consistent with both and ``dp``,
    as DeepSpeed asserts, so also nominal: a user's ``train_batch_size`` equal to
    ``plan.global_batch`` is accepted and replaced. Other conflicting user values
    are an error naming the key.

    ``zero_optimization.stage`` from ``plan.sharding`` (none 0, optimizer 1,
    gradients 2, full 3) unless the user config sets one; a different stage is
    kept, with a warning, since the plan's memory estimate assumed its own.
    Activation recomputation (``plan.stages[i].recompute``) is the model's to
    apply (``deepspeed.checkpointing.checkpoint`` around its blocks).
    """
    cfg = _load_user_config(user_config)
    zero = dict(cfg.get("zero_optimization") or {})
    stage = ZERO_STAGE[plan.sharding]
    if "stage" in zero and zero["stage"] != stage:
        log.warning(
            "deepspeed config: zero_optimization.stage=%s, the plan's sharding %r is stage %d "
            "(its memory estimate assumed that)",
            zero["stage"],
            plan.sharding,
            stage,
        )
    zero.setdefault("stage", stage)
    cfg["zero_optimization"] = zero
    micro = max(1, plan.global_batch // (plan.dp * plan.microbatches))
    wanted = {
        "gradient_accumulation_steps": plan.microbatches,
        "train_micro_batch_size_per_gpu": micro,
        "train_batch_size": micro * plan.microbatches * plan.dp,
    }
    if cfg.get("train_batch_size") == plan.global_batch != wanted["train_batch_size"]:
        log.info(
            "deepspeed config: train_batch_size=%d (plan.global_batch) set to the nominal %d "
            "(= micro %d x accumulation %d x dp %d) that DeepSpeed checks; every step still "
            "trains the plan's whole global batch",
            plan.global_batch,
            wanted["train_batch_size"],
            micro,
            plan.microbatches,
            plan.dp,
        )
        cfg["train_batch_size"] = wanted["train_batch_size"]
    for key, value in wanted.items():
        if key in cfg and cfg[key] != value:
            raise InvalidInput(
                f"deepspeed config: {key}={cfg[key]} conflicts with the plan ({value}); "
                "drop it from the config, the plan sets it"
            )
        cfg[key] = value
    return cfg
