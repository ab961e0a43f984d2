"""A digest of entrain's assignments over the balance bench's rows: speed-ups that must not
change a single assignment are checked by comparing two commits' digests.

Every workload (synthetic and the real tables of ../shared/data) and model, at 512 / dp 4 / 32,
4096 / dp 16 / 16 and 8192 / dp 128 / 16, each in up to three cases: the depth untold, told 4
stages with frozen encoders, and told 8 stages with ``max_delay=2`` (4096 skips the untold
case). One line per case (``row/model/batch/dp/pp/frozen/max_delay digest``), the digest a
hash of ``Assignment.to_dict()``; the last line hashes them all. The batches are
``bench/assign_latency.py``'s draws.

    python bench/assign_digest.py > before.txt     # on the old commit (a worktree)
    python bench/assign_digest.py > after.txt
    diff before.txt after.txt                      # nothing: every assignment the same
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    DEFAULT_MODELS,
    caps,
    drawn_batch,
    model_costs,
    patch_caps,
    workload_names,
    workload_table,
)

from entrain_data.assignment import assign  # noqa: E402

SETTINGS = ((512, 4, 32), (4096, 16, 16), (8192, 128, 16))
# (pipeline_stages, frozen encoders, max_delay): untold, told frozen, told with delay
CASES = ((None, False, 0), (4, True, 0), (8, False, 2))


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default="", help="comma-separated subset (default: all)")
    p.add_argument("--iteration", type=int, default=1, help="assign's iteration (its draws)")
    args = p.parse_args(argv)
    known = workload_names()
    names = [w for w in args.workloads.split(",") if w] or known
    unknown = [n for n in names if n not in known]
    if unknown:
        p.error(f"unknown workload {unknown} (real: ones need ../shared/data)")
    lines = []
    for name in names:
        table = workload_table(name, 65536)
        for model in DEFAULT_MODELS:
            costs = model_costs(model, table, frozen=False)
            if costs is None:  # the model has no encoder for this workload's media
                continue
            for b, dp, m in SETTINGS:
                enc, llm, tok, pt = drawn_batch(costs, b, dp)
                cap, budget = caps(tok, dp, m)
                for pp, frozen, delay in CASES:
                    if b == 4096 and pp is None:
                        continue
                    a = assign(enc, llm, tok, dp=dp, microbatches=m, defer_budget=budget,
                               max_tokens=cap, encoder_patches=pt,
                               max_encoder_patches=patch_caps(pt, dp, m), pipeline_stages=pp,
                               frozen_encoders=frozen, max_delay=delay,
                               iteration=args.iteration)  # fmt: skip
                    line = f"{name}/{model}/{b}/{dp}/{pp}/{frozen}/{delay} "
                    line += _digest(json.dumps(a.to_dict()))
                    print(line, flush=True)
                    lines.append(line)
    print(f"all {len(lines)} {_digest(chr(10).join(lines))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
