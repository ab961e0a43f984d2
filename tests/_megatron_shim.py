"""TEST-ONLY: run megatron-core 0.16.1's schedules, p2p exchange and GPTModel on a CPU-only box.

Megatron-Core assumes CUDA in a handful of places that have nothing to do with
what the adapter tests check (device placement, stream syncs, CUDA RNG forks):

- ``schedules``: ``torch.zeros(..., device="cuda")`` for the token counter;
- ``p2p_communication`` and ``megatron.core.utils`` (the attention score
  buffer): ``torch.cuda.current_device()`` and ``torch.cuda.synchronize()``;
- ``LanguageModule.setup_embeddings_and_output_layer``: ``weight.data.cuda()``
  before the first/last-stage all-reduce of tied embeddings;
- the CUDA RNG tracker's ``fork()`` around dropout (the tests use dropout 0).

:func:`install_cpu_shim` redirects exactly these to the CPU inside the calling
process (a spawned test rank). It changes no numerics, and does nothing on a
machine with CUDA. Nothing in ``entrain_data`` or ``examples/`` imports it.
"""

from __future__ import annotations

import types
from typing import Any

import torch

__all__ = ["install_cpu_shim"]


class _ModuleProxy(types.ModuleType):
    """A stand-in for a module (``torch``, ``torch.cuda``) seen by one Megatron module only:
    the given attributes are replaced, everything else is the real module's."""

    def __init__(self, real: types.ModuleType, **overrides: Any):
        super().__init__(real.__name__)
        self._real = real
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _cpu_zeros(*args: Any, device: Any = None, **kw: Any) -> torch.Tensor:
    return torch.zeros(*args, device="cpu" if device == "cuda" else device, **kw)


def _cpu_torch() -> _ModuleProxy:
    cuda = _ModuleProxy(torch.cuda, current_device=lambda: "cpu", synchronize=lambda *a: None)
    return _ModuleProxy(torch, zeros=_cpu_zeros, cuda=cuda)


def install_cpu_shim() -> None:
    """Point Megatron-Core's CUDA-only calls at the CPU in this process (no-op with CUDA)."""
    if torch.cuda.is_available():
        return
    import megatron.core.utils as mcore_utils
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mcore_random

    proxy = _cpu_torch()
    for module in (schedules, p2p_communication, mcore_utils):
        module.torch = proxy
    # tied embeddings: the last stage's copy goes "to the GPU" before the first/last all-reduce
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    # no CUDA RNG to fork: Megatron's own no-op tracker (dropout is 0 in the tests)
    mcore_random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def _gloo_subgroups(*args: Any, backend: Any = None, **kw: Any) -> Any:
    import torch.distributed as dist

    return dist.new_subgroups_by_enumeration(
        *args, backend=None if backend == "nccl" else backend, **kw
    )


def install_multimodule_cpu_shim() -> None:
    """:func:`install_cpu_shim`, plus the two CUDA-only spots of 0.16.1's ``BridgeCommunicator``
    (the encoder -> LLM bridge of the multi-module communicator), in this process only:

    - ``torch.cuda.current_device()`` as the device of every buffer it allocates;
    - ``backend='nccl'`` hard-coded for its leader-broadcast groups
      (bridge_communicator.py:114, :123): those groups use the default (gloo) backend.

    Point-to-point sends, broadcasts and shapes are Megatron's own, unchanged.
    """
    install_cpu_shim()
    if torch.cuda.is_available():
        return
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import bridge_communicator

    bridge_communicator.torch = _cpu_torch()
    bridge_communicator.dist = _ModuleProxy(dist, new_subgroups_by_enumeration=_gloo_subgroups)


class _NullStream:
    """A CUDA stream stand-in: work is issued in program order on the CPU."""

    def __init__(self, *args: Any, **kw: Any):
        pass

    def wait_stream(self, other: Any) -> None:
        pass

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def install_ddp_cpu_shim() -> None:
    """:func:`install_cpu_shim`, plus the CUDA-only spots of 0.16.1's ``DistributedDataParallel``
    (grad buffers allocated on ``torch.cuda.current_device()``, the communication stream) and
    distributed optimizer (``param.type() == 'torch.cuda.FloatTensor'`` dispatch), in this
    process only. Buffers, reductions and the optimizer's arithmetic are Megatron's own."""
    install_cpu_shim()
    if torch.cuda.is_available():
        return
    import megatron.core.utils as mcore_utils
    from megatron.core.distributed import (
        distributed_data_parallel,
        finalize_model_grads,
        param_and_grad_buffer,
    )
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    cuda = _ModuleProxy(
        torch.cuda,
        current_device=lambda: "cpu",
        synchronize=lambda *a: None,
        empty_cache=lambda: None,
        Stream=_NullStream,
        stream=lambda s: _NullStream(),
        default_stream=lambda *a: _NullStream(),
    )

    def on_cpu(make: Any) -> Any:
        def wrapped(*args: Any, device: Any = None, **kw: Any) -> torch.Tensor:
            return make(*args, device="cpu" if str(device).startswith("cuda") else device, **kw)

        return wrapped

    proxy = _ModuleProxy(
        torch, cuda=cuda, **{f: on_cpu(getattr(torch, f)) for f in ("zeros", "tensor", "empty")}
    )
    for module in (
        distributed_data_parallel, finalize_model_grads, param_and_grad_buffer,
        clip_grads, distrib_optimizer, optimizer, mcore_utils,
    ):  # fmt: skip
        module.torch = proxy
    real_type = torch.Tensor.type

    def cuda_type(self: torch.Tensor, *args: Any, **kw: Any) -> Any:
        out = real_type(self, *args, **kw)
        if args or kw or self.device.type != "cpu":
            return out
        return out.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type  # type: ignore[method-assign]


__all__ += ["install_multimodule_cpu_shim", "install_ddp_cpu_shim"]
