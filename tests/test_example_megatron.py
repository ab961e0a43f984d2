"""``examples/train_megatron.py`` runs: its ``main`` on 2 gloo CPU ranks (1 replica x 2 stages).

The example is written for GPUs; Megatron-Core's CUDA-only calls are pointed at
the CPU by the TEST-ONLY :mod:`_megatron_shim`, installed in each rank before
the example is imported. Neither the example nor the package imports the shim.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
from _dist import one_thread, run_ranks

pytest.importorskip("megatron.core")

pytestmark = pytest.mark.frameworks

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
STEPS = 3
_one_thread = pytest.fixture(autouse=True)(one_thread)


def _example_rank(rank: int, world: int, out_dir: str) -> None:
    from _megatron_shim import install_cpu_shim

    install_cpu_shim()
    sys.path.insert(0, str(EXAMPLES))
    import train_megatron

    losses = train_megatron.main(steps=STEPS)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(losses))


@pytest.mark.timeout(200)
@pytest.mark.slow  # 15-26 s on 2 cores (the default run stays near 10 minutes)
def test_megatron_example_trains_on_two_stages(tmp_path: Path) -> None:
    run_ranks(_example_rank, str(tmp_path), timeout=180)
    first, last = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert first == [], "only the last pipeline stage sees losses"
    assert len(last) == STEPS and all(math.isfinite(x) and x > 0 for x in last)
    assert abs(last[0] - math.log(48)) < 1.0, f"first loss {last[0]:.3f} is not near log(vocab)"
