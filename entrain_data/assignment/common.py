"""The assignment result, input validation and the invariant checker shared by every method."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

import numpy as np

from .. import compiled
from ..errors import InvalidInput

__all__ = [
    "Assignment",
    "Inputs",
    "Replicas",
    "Candidate",
    "validate_inputs",
    "check_assignment",
    "check_stage_shares",
    "rng_for",
    "relabel_slots",
    "slot_sums",
    "module_cv",
    "module_loads",
    "mountain_positions",
    "random_cut_cv",
    "DEFAULT_PIPELINE_STAGES",
]

DEFAULT_PIPELINE_STAGES = 4
"""Depth of entrain's proxy pipeline where the caller does not give the plan's pp."""


@dataclass(frozen=True, eq=False)
class Assignment:
    """Per replica r and microbatch j: the ordered encoder set and LLM set (sample indices).

    Every sample is in exactly one encoder set and one LLM set of the same
    replica, with LLM microbatch >= encoder microbatch, unless it is in
    ``carried`` (methods that delay work to the next iteration).
    """

    method: str
    dp: int
    microbatches: int
    encoder_sets: list[list[np.ndarray]]
    llm_sets: list[list[np.ndarray]]
    carried: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def encoder_slots(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(replica [n], microbatch [n]) of every sample's encoder set; -1 when carried."""
        return _slots(self.encoder_sets, n)

    def llm_slots(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(replica [n], microbatch [n]) of every sample's LLM set; -1 when carried."""
        return _slots(self.llm_sets, n)

    def to_dict(self) -> dict:
        """JSON-serialisable form (lists of index lists)."""
        return {
            "method": self.method,
            "dp": self.dp,
            "microbatches": self.microbatches,
            "encoder_sets": [[s.tolist() for s in rep] for rep in self.encoder_sets],
            "llm_sets": [[s.tolist() for s in rep] for rep in self.llm_sets],
            "carried": self.carried.tolist(),
        }


def _slots(sets: list[list[np.ndarray]], n: int) -> tuple[np.ndarray, np.ndarray]:
    rep = np.full(n, -1, dtype=np.int64)
    mb = np.full(n, -1, dtype=np.int64)
    for r, row in enumerate(sets):
        for j, s in enumerate(row):
            rep[s] = r
            mb[s] = j
    return rep, mb


@dataclass(frozen=True)
class Inputs:
    """Validated, normalised inputs of :func:`entrain_data.assignment.assign`."""

    enc: np.ndarray  # [B, E] float64 (E >= 1; zeros when there is no encoder)
    llm: np.ndarray  # [B] float64
    tokens: np.ndarray  # [B] int64
    dp: int
    microbatches: int
    max_tokens: int | None
    defer_budget: int | None
    patches: np.ndarray | None = None  # [B, E] int64 encoder patches, None when not given
    patch_cap: np.ndarray | None = None  # [E] int64 cap per encoder set, None: no cap
    max_delay: int = 0
    ages: np.ndarray | None = None  # [B] iterations each sample has already been carried
    frozen: np.ndarray | None = None  # [E] bool: the encoder runs forward only; None: all train
    stages: int = DEFAULT_PIPELINE_STAGES  # the plan's pp: the depth of entrain's proxy pipeline
    depth_known: bool = True  # False: the caller gave no pp (entrain's pick prices several)
    # [E + 1] module totals (each encoder column, the LLM) entrain's proxy lays its stages out
    # on; None: this batch's own. ``max_delay`` sets it to the iteration's fresh samples'
    # (:func:`.delay.assign_delayed`): the plan's stages do not move with what is carried
    layout: np.ndarray | None = None
    # [S, E + 1] the plan's stages as told (assign's ``stage_shares``): the share of each
    # module's work every stage holds; the proxy then lays nothing out (``layout`` unused)
    shares: np.ndarray | None = None

    @property
    def n(self) -> int:
        return len(self.llm)


@dataclass(frozen=True, eq=False)
class Replicas:
    """Level 1's answer as [R, n] arrays (pads: ``valid`` False) with level 2's limits.

    One value instead of nine positional arrays: every level-2 builder, the
    scorer and the pipeline search read what they need from it.
    """

    members: np.ndarray  # [R, n] sample index, -1 pads
    valid: np.ndarray  # [R, n] bool
    has_enc: np.ndarray  # [R, n] bool: the sample has encoder work (may be deferred)
    enc_cols: np.ndarray  # [R, n, E] encoder cost per column
    enc_w: np.ndarray  # [R, n] encoder work, columns normalised to mean 1 and summed
    llm: np.ndarray  # [R, n] LLM cost
    tok: np.ndarray  # [R, n] int64 LLM tokens
    patches: np.ndarray  # [R, n, E] int64 encoder patches (zeros when not given)
    m: int
    cap: int | None  # LLM tokens per L set
    budget: int | None  # deferral buffer, tokens
    patch_cap: np.ndarray | None  # [E] patches per E set
    frozen: np.ndarray | None = None  # [E] bool: forward only (no encoder backward in L sets)
    stages: int = DEFAULT_PIPELINE_STAGES  # depth of the proxy pipeline (the plan's pp)
    depth_known: bool = True  # False: no pp was given; the pick prices UNKNOWN_DEPTHS
    layout: np.ndarray | None = None  # [E + 1] module totals of the proxy's stages (Inputs')
    shares: np.ndarray | None = None  # [S, E + 1] the plan's stage shares, where told (Inputs')

    @cached_property
    def module_costs(self) -> np.ndarray:
        """[R, n, K] per-sample cost of every module level 2 balances: each encoder column,
        with several encoders their sum (they share the encoder stages and are reported as
        one encoder load: each column even but their counts uneven leaves the sum 3x less
        even than a fixed-count cut where every sample carries one fixed-size item), and the
        LLM last. Computed once per value (read by the score, the bounds and the search)."""
        parts = [self.enc_cols]
        if self.encoders_together:
            parts.append(self.enc_cols.sum(axis=2, keepdims=True))
        return np.concatenate(parts + [self.llm[..., None]], axis=2)

    @cached_property
    def encoders_together(self) -> bool:
        """Whether more than one encoder column carries work (their sum is a module then)."""
        return int((self.enc_cols != 0).any(axis=(0, 1)).sum()) > 1

    @cached_property
    def cut_cv(self) -> np.ndarray:
        """[R, K] :func:`random_cut_cv` of :attr:`module_costs`: the yardstick of the score's
        straggler rule, the search's CV limits and the light work's bound, once per value."""
        return random_cut_cv(self.module_costs, self.valid, self.m)

    def take(self, replicas: np.ndarray) -> Replicas:
        """The same value restricted to some replicas (rows), e.g. the slowest ones. It keeps
        the batch's modules (:attr:`encoders_together`) whatever the rows hold: two subsets
        of one batch must compare module by module (a subset without the one sample of a
        second encoder had one module fewer, and the light work's CV check failed on the
        shapes). :attr:`module_costs` and :attr:`cut_cv` already computed are taken along
        (each row's is its own)."""
        arrays = ("members", "valid", "has_enc", "enc_cols", "enc_w", "llm", "tok", "patches")
        out = replace(self, **{k: getattr(self, k)[replicas] for k in arrays})
        out.__dict__["encoders_together"] = self.encoders_together
        for name in ("module_costs", "cut_cv"):
            if name in self.__dict__:
                out.__dict__[name] = self.__dict__[name][replicas]
        return out


@dataclass(frozen=True, eq=False)
class Candidate:
    """A level-2 answer for every replica: E and L microbatch per member, and the replicas
    where it breaks a cap or the budget (they must not use it)."""

    eidx: np.ndarray  # [R, n] encoder microbatch, -1 pads
    lidx: np.ndarray  # [R, n] LLM microbatch, -1 pads
    failed: np.ndarray  # [R] bool
    profile: np.ndarray | None = None  # [R, m, K] intended load share per module (None: even)


def module_loads(rp: Replicas, eidx: np.ndarray, lidx: np.ndarray) -> np.ndarray:
    """[R, m, K] per-microbatch load of each module of :meth:`Replicas.module_costs` (the
    encoders from the E sets, the LLM from the L sets)."""
    m, valid = rp.m, rp.valid
    e_loads = slot_sums(eidx, rp.enc_cols, valid & (eidx >= 0), m)
    l_loads = slot_sums(lidx, rp.llm, valid & (lidx >= 0), m)[..., None]
    parts = [e_loads]
    if rp.encoders_together:  # as in Replicas.module_costs
        parts.append(e_loads.sum(axis=2, keepdims=True))
    return np.concatenate(parts + [l_loads], axis=2)


def module_cv(loads: np.ndarray) -> np.ndarray:
    """[..., K] per-microbatch CV of each module's ``loads`` [..., m, K] (0 where a module has
    none)."""
    mean = loads.mean(axis=-2)
    return np.where(mean > 0, loads.std(axis=-2) / np.where(mean > 0, mean, 1.0), 0.0)


def random_cut_cv(cost: np.ndarray, valid: np.ndarray, m: int) -> np.ndarray:
    """[R, K] expected per-microbatch CV of each module (``cost`` [R, n, K]) when a replica's
    samples are cut into ``m`` equal-count microbatches at random: what a method that does not
    look at costs gets, the yardstick for how much unevenness is small."""
    n = np.maximum(valid.sum(axis=1), 1).astype(np.float64)[:, None]  # [R, 1]
    c = np.where(valid[..., None], cost, 0.0)
    mean = c.sum(axis=1) / n
    var = (np.where(valid[..., None], c - mean[:, None, :], 0.0) ** 2).sum(axis=1) / n
    rel = np.sqrt(var) / np.where(mean > 0, mean, 1.0)
    # a microbatch of n/m samples drawn without replacement: CV = rel * sqrt((1 - 1/m) m / n)
    return np.where(mean > 0, rel * np.sqrt((1 - 1 / m) * m / np.maximum(n, m)), 0.0)


def mountain_positions(load: np.ndarray) -> np.ndarray:
    """[R, m] new position of each microbatch so the heaviest of ``load`` [R, m] sits in the
    middle and the lightest at the edges (1F1B runs the first forward and the last backward
    alone; ties keep their order)."""
    r_count, m = load.shape
    centre = (m - 1) / 2
    pos_order = np.argsort(np.abs(np.arange(m) - centre), kind="stable")
    heavy_first = np.argsort(-load, axis=1, kind="stable")  # [R, m] old bin ids
    newpos = np.empty((r_count, m), dtype=np.int64)
    np.put_along_axis(newpos, heavy_first, np.broadcast_to(pos_order, (r_count, m)), axis=1)
    return newpos


def relabel_slots(new_slot: np.ndarray, idx: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[R, n] slots ``idx`` moved to ``new_slot`` [R, m] (old slot -> new slot, one map per
    replica); pads and samples without a slot (-1) stay as they are."""
    moved = np.take_along_axis(new_slot, np.maximum(idx, 0), axis=1)
    return np.where(valid & (idx >= 0), moved, idx)


def slot_sums(idx: np.ndarray, values: np.ndarray, valid: np.ndarray, m: int) -> np.ndarray:
    """[R, m, *extra] sums of ``values`` [R, n, *extra] over the members of each slot ``idx``.

    One ``bincount`` over flattened (replica, slot, column) keys: several times faster
    than ``np.add.at``, which dominates the level-2 cost otherwise; compiled, one loop
    (both add every member in index order, so the sums are the same).
    """
    r_count = idx.shape[0]
    valid = valid & (idx >= 0)  # unplaced members (a failed candidate's -1) count nowhere
    extra = values.shape[2:]
    k = math.prod(extra)  # (np.prod costs more than the compiled sum on small arrays)
    if compiled.enabled() and idx.size:
        from .sets_kernel import slot_sums_rows  # numba is imported with it

        vals = np.ascontiguousarray(values, dtype=np.float64).reshape(idx.shape + (k,))
        return slot_sums_rows(idx, vals, valid, m).reshape((r_count, m) + extra)
    key = (np.arange(r_count)[:, None] * m + np.where(valid, idx, 0)).astype(np.int64)
    w = np.where(valid.reshape(valid.shape + (1,) * len(extra)), values, 0.0)
    flat = (key[..., None] * k + np.arange(k)).ravel() if extra else key.ravel()
    out = np.bincount(flat, weights=w.reshape(-1).astype(np.float64), minlength=r_count * m * k)
    return out.reshape((r_count, m) + extra)


def validate_inputs(
    encoder_cost,
    llm_cost,
    tokens,
    dp,
    microbatches,
    max_tokens,
    defer_budget,
    encoder_patches=None,
    max_encoder_patches=None,
    max_delay=0,
    ages=None,
    frozen_encoders=False,
    pipeline_stages=None,
    stage_shares=None,
) -> Inputs:
    """Check shapes, values and feasibility; raise :class:`InvalidInput` naming the problem."""
    enc, llm = _real_array("encoder_cost", encoder_cost), _real_array("llm_cost", llm_cost)
    tok = np.asarray(tokens)
    if tok.dtype == bool or not (
        np.issubdtype(tok.dtype, np.integer) or np.issubdtype(tok.dtype, np.floating)
    ):
        raise InvalidInput(f"tokens must be whole numbers, got dtype {tok.dtype}")
    if enc.ndim == 1:
        enc = enc[:, None]
    if enc.ndim != 2:
        raise InvalidInput(f"encoder_cost must be [B] or [B, E], got shape {enc.shape}")
    if llm.ndim != 1 or tok.ndim != 1:
        raise InvalidInput(
            f"llm_cost and tokens must be one-dimensional, got {llm.shape} and {tok.shape}"
        )
    b = len(llm)
    if enc.shape[0] != b or len(tok) != b:
        raise InvalidInput(
            f"mismatched lengths: encoder_cost has {enc.shape[0]} rows, llm_cost {b}, tokens {len(tok)}"
        )
    columns = enc.shape[1]  # as given: stage_shares names these (and the LLM)
    if columns == 0:
        enc = np.zeros((b, 1))
    for name, arr in (("encoder_cost", enc), ("llm_cost", llm)):
        bad = np.flatnonzero(~np.isfinite(arr).all(axis=-1) if arr.ndim == 2 else ~np.isfinite(arr))
        if len(bad):
            raise InvalidInput(f"{name} is NaN or infinite for sample {int(bad[0])}")
        bad = np.flatnonzero((arr > MAX_COST).any(axis=-1) if arr.ndim == 2 else arr > MAX_COST)
        if len(bad):
            raise InvalidInput(
                f"{name} of sample {int(bad[0])} is above {MAX_COST:g}: costs are relative, "
                "scale them down (their squares overflow)"
            )
        bad = np.flatnonzero((arr < 0).any(axis=-1) if arr.ndim == 2 else arr < 0)
        if len(bad):
            raise InvalidInput(f"{name} is negative for sample {int(bad[0])}")
    if not np.issubdtype(tok.dtype, np.integer) and (
        not np.isfinite(tok).all() or np.any(tok != np.round(tok))
    ):
        raise InvalidInput("tokens must be whole numbers")
    bad = np.flatnonzero(tok < 0)
    if len(bad):
        raise InvalidInput(f"tokens is negative for sample {int(bad[0])}")
    bad = np.flatnonzero(tok > 2**62)  # before the cast, which would wrap them negative
    if len(bad):
        raise InvalidInput(f"tokens is {tok[bad[0]]} for sample {int(bad[0])}: too large")
    tok = tok.astype(np.int64)
    dp, microbatches = whole("dp", dp, 1), whole("microbatches", microbatches, 1)
    if b < dp * microbatches:
        raise InvalidInput(
            f"{b} samples cannot fill dp={dp} x microbatches={microbatches} = {dp * microbatches} "
            "microbatches (need at least one sample each)"
        )
    if max_tokens is not None:
        max_tokens = whole("max_tokens", max_tokens, 1, "or None")
        big = np.flatnonzero(tok > max_tokens)
        if len(big):
            i = int(big[0])
            raise InvalidInput(
                f"sample {i} has {int(tok[i])} tokens, more than the token cap max_tokens={int(max_tokens)}"
            )
    if defer_budget is not None:
        defer_budget = whole("defer_budget", defer_budget, 0, "or None")
    patches, patch_cap = _check_patches(enc.shape[1], b, encoder_patches, max_encoder_patches)
    max_delay = whole("max_delay", max_delay, 0)
    age = np.zeros(b, np.int64) if ages is None else np.asarray(ages)
    if age.shape != (b,) or not np.issubdtype(age.dtype, np.integer) or (age < 0).any():
        raise InvalidInput(f"ages must be [{b}] integers >= 0 (iterations carried), got {age!r}")
    depth_known = pipeline_stages is not None
    if pipeline_stages is None:
        pipeline_stages = DEFAULT_PIPELINE_STAGES
    if (
        isinstance(pipeline_stages, bool)
        or not isinstance(pipeline_stages, (int, np.integer))
        or not 1 <= pipeline_stages <= MAX_PIPELINE_STAGES
    ):
        raise InvalidInput(
            f"pipeline_stages must be an integer from 1 to {MAX_PIPELINE_STAGES} (the plan's "
            f"pp) or None, got {pipeline_stages!r}"
        )
    shares = check_stage_shares(stage_shares, columns, pipeline_stages if depth_known else None)
    if shares is not None:
        pipeline_stages, depth_known = len(shares), True
        if columns == 0:  # the zero encoder column stands where the LLM does (it has no work)
            shares = np.concatenate([shares[:, -1:], shares], axis=1)
    return Inputs(
        enc,
        llm,
        tok,
        dp,
        microbatches,
        max_tokens,
        defer_budget,
        patches,
        patch_cap,
        int(max_delay),
        age.astype(np.int64),
        _check_frozen(enc.shape[1], frozen_encoders),
        int(pipeline_stages),
        depth_known,
        shares=shares,
    )


# the proxy pipeline's cost grows with the depth (10,000 stages took 7 s for 64 samples)
MAX_PIPELINE_STAGES = 1024
MAX_COST = 1e150  # a cost's square must stay finite (the CVs); costs are relative anyway
_SHARE_TOLERANCE = 1e-6  # how far a module's shares may sum from 1 (rounding in a plan's JSON)


def check_stage_shares(
    stage_shares, e: int, pipeline_stages: int | None = None
) -> np.ndarray | None:
    """[S, E + 1] float64 from ``stage_shares`` (None passes; ``e`` encoder columns): every
    module's shares are finite, >= 0 and sum to 1 over the stages (each module lives on some
    stage), and S is ``pipeline_stages`` where that is given too."""
    if stage_shares is None:
        return None
    try:
        sh = np.asarray(stage_shares, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"stage_shares must be a numeric [S, {e + 1}] array ({exc})") from exc
    if sh.ndim != 2 or sh.shape[1] != e + 1 or len(sh) < 1:
        raise InvalidInput(
            f"stage_shares must be [S, {e + 1}] (per stage, each encoder column's share then "
            f"the LLM's), got shape {sh.shape}"
        )
    if not np.isfinite(sh).all() or (sh < 0).any():
        raise InvalidInput(f"stage_shares must be finite and >= 0, got {sh.tolist()}")
    sums = sh.sum(axis=0)
    bad = np.flatnonzero(np.abs(sums - 1.0) > _SHARE_TOLERANCE)
    if len(bad):
        k = int(bad[0])
        name = "the LLM" if k == e else f"encoder column {k}"
        raise InvalidInput(
            f"stage_shares: the shares of {name} sum to {sums[k]:.6g} over the stages, not 1"
        )
    if pipeline_stages is not None and len(sh) != pipeline_stages:
        raise InvalidInput(
            f"stage_shares has {len(sh)} stages, not the pipeline depth {pipeline_stages} "
            "(pipeline_stages, the plan's pp)"
        )
    return sh


def _check_frozen(e: int, frozen_encoders) -> np.ndarray | None:
    """[E] bool from one flag for every encoder or one per encoder column; None if none is."""
    f = np.asarray(frozen_encoders)
    if f.dtype != np.bool_ or f.ndim > 1 or (f.ndim == 1 and len(f) != e):
        raise InvalidInput(
            f"frozen_encoders must be one bool or one per encoder column ({e}); "
            f"got {frozen_encoders!r}"
        )
    f = np.broadcast_to(f, (e,)).copy()
    return f if f.any() else None


def _check_patches(e: int, b: int, encoder_patches, max_encoder_patches):
    """([B, E] patches or None, [E] cap or None); a sample above the cap is an error."""
    if encoder_patches is None:
        if max_encoder_patches is not None:
            raise InvalidInput("max_encoder_patches needs encoder_patches (patches per sample)")
        return None, None
    pt = np.asarray(encoder_patches)
    if pt.ndim == 1:
        pt = pt[:, None]
    if pt.shape != (b, e):
        raise InvalidInput(f"encoder_patches must be [{b}] or [{b}, {e}], got shape {pt.shape}")
    if not np.issubdtype(pt.dtype, np.integer) or (pt < 0).any():
        raise InvalidInput("encoder_patches must be integers >= 0")
    pt = pt.astype(np.int64)
    if max_encoder_patches is None:
        return pt, None
    cap = np.asarray(max_encoder_patches)
    if cap.ndim > 1 or cap.size not in (1, pt.shape[1]):
        raise InvalidInput(
            f"max_encoder_patches must be one cap or one per encoder column ({pt.shape[1]}), "
            f"got {max_encoder_patches!r}"
        )
    cap = np.broadcast_to(cap.reshape(-1), (pt.shape[1],))
    if cap.dtype == bool or not np.issubdtype(cap.dtype, np.integer) or (cap < 1).any():
        raise InvalidInput(
            f"max_encoder_patches must be positive integers (one or one per encoder), "
            f"got {max_encoder_patches!r}"
        )
    over = np.argwhere(pt > cap[None, :])
    if len(over):
        i, k = (int(v) for v in over[0])
        raise InvalidInput(
            f"sample {i} has {int(pt[i, k])} patches for encoder {k}, more than the patch cap "
            f"max_encoder_patches={int(cap[k])}"
        )
    return pt, cap.astype(np.int64)


def whole(name: str, value: Any, low: int, extra: str = "") -> int:
    """``value`` as an int >= ``low``, or an InvalidInput naming ``name`` (a bool is no count)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InvalidInput(
            f"{name} must be an integer >= {low} {extra}".rstrip() + f", got {value!r}"
        )
    return int(value)


def _real_array(name: str, value: Any) -> np.ndarray:
    """``value`` as float64, or an InvalidInput naming ``name`` (strings, objects, complex)."""
    arr = np.asarray(value)
    if arr.dtype == bool or not (
        np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)
    ):
        raise InvalidInput(f"{name} must be real numbers, got dtype {arr.dtype}")
    return arr.astype(np.float64)


def rng_for(seed: int, iteration: int, salt: int = 0) -> np.random.Generator:
    """A generator that depends only on (seed, iteration, salt): assignments are reproducible."""
    return np.random.default_rng([int(seed) & 0xFFFFFFFF, int(iteration) & 0xFFFFFFFF, salt])


def check_assignment(
    a: Assignment,
    n: int,
    tokens: np.ndarray | None = None,
    max_tokens: int | None = None,
    defer_budget: int | None = None,
    encoder_patches: np.ndarray | None = None,
    max_encoder_patches=None,
) -> None:
    """Raise :class:`InvalidInput` on any broken invariant of ``a`` over ``n`` samples.

    Exactly once in the E sets and in the L sets of one replica (or carried);
    L index >= E index; every L set within ``max_tokens``; every E set within
    ``max_encoder_patches`` (per encoder column of ``encoder_patches``); buffered
    encoder output within ``defer_budget`` at every microbatch boundary.
    """
    if len(a.encoder_sets) != a.dp or len(a.llm_sets) != a.dp:
        raise InvalidInput(f"{a.method}: expected {a.dp} replicas")
    for r in range(a.dp):
        if len(a.encoder_sets[r]) != a.microbatches or len(a.llm_sets[r]) != a.microbatches:
            raise InvalidInput(
                f"{a.method}: replica {r} does not have {a.microbatches} microbatches"
            )
    carried = np.asarray(a.carried, dtype=np.int64)
    for kind, sets in (("encoder", a.encoder_sets), ("LLM", a.llm_sets)):
        parts = [np.asarray(s, dtype=np.int64) for row in sets for s in row] + [carried]
        allidx = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        if len(allidx) and (allidx.min() < 0 or allidx.max() >= n):
            raise InvalidInput(f"{a.method}: {kind} sets hold an index outside 0..{n - 1}")
        counts = np.bincount(allidx, minlength=n)
        if np.any(counts != 1):
            bad = int(np.flatnonzero(counts != 1)[0])
            raise InvalidInput(
                f"{a.method}: sample {bad} appears {int(counts[bad])} times in the {kind} sets"
            )
    er, ej = a.encoder_slots(n)
    lr, lj = a.llm_slots(n)
    live = er >= 0
    if np.any(er[live] != lr[live]):
        bad = int(np.flatnonzero(live & (er != lr))[0])
        raise InvalidInput(
            f"{a.method}: sample {bad} is encoded and consumed on different replicas"
        )
    if np.any(lj[live] < ej[live]):
        bad = int(np.flatnonzero(live & (lj < ej))[0])
        raise InvalidInput(
            f"{a.method}: sample {bad} is consumed by the LLM (microbatch {int(lj[bad])}) before it "
            f"is encoded (microbatch {int(ej[bad])})"
        )
    if encoder_patches is not None and max_encoder_patches is not None:
        pt = np.asarray(encoder_patches, dtype=np.int64).reshape(n, -1)
        pcap = np.broadcast_to(np.asarray(max_encoder_patches, np.int64), (pt.shape[1],))
        for r in range(a.dp):
            for j in range(a.microbatches):
                got = pt[a.encoder_sets[r][j]].sum(axis=0)
                if (got > pcap).any():
                    k = int(np.argmax(got > pcap))
                    raise InvalidInput(
                        f"{a.method}: replica {r} encoder set {j} holds {int(got[k])} patches of "
                        f"encoder {k} > max_encoder_patches={int(pcap[k])}"
                    )
    if tokens is None:
        return
    tokens = np.asarray(tokens, dtype=np.int64)
    for r in range(a.dp):
        for j in range(a.microbatches):
            t = int(tokens[a.llm_sets[r][j]].sum())
            if max_tokens is not None and t > max_tokens:
                raise InvalidInput(
                    f"{a.method}: replica {r} microbatch {j} holds {t} tokens > max_tokens={max_tokens}"
                )
        if defer_budget is not None:
            waiting = 0
            for j in range(a.microbatches):
                waiting += int(tokens[a.encoder_sets[r][j]].sum()) - int(
                    tokens[a.llm_sets[r][j]].sum()
                )
                if waiting > defer_budget:
                    raise InvalidInput(
                        f"{a.method}: replica {r} buffers {waiting} tokens after microbatch {j} "
                        f"> defer_budget={defer_budget}"
                    )
