"""``entrain-data plan``: the static parallel plan for a cluster, model and index."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .cli_models import (
    add_model_arguments,
    calibration_from_args,
    model_spec_from_args,
    output_path,
    write_output,
)
from .errors import InvalidInput
from .metadata import read_index
from .plan import SHARDING, Cluster, ParallelPlan
from .planner import RECOMPUTE, make_plan

__all__ = ["register", "cmd_plan", "format_plan"]

_SHARDING_TEXT = {
    "none": "none (plain DDP: weights, gradients and Adam state replicated)",
    "optimizer": "optimizer (ZeRO-1 / Megatron distributed optimizer: Adam state and master "
    "weights sharded over dp)",
    "gradients": "gradients (ZeRO-2: gradients and optimizer state sharded over dp)",
    "full": "full (ZeRO-3 / FSDP per block: weights, gradients and optimizer state sharded "
    "over dp)",
}


def format_plan(plan: ParallelPlan) -> str:
    """The plan as a short human-readable table."""
    lines = [
        f"layout       dp={plan.dp} tp={plan.tp} pp={plan.pp} "
        f"({plan.world_size} GPUs, {plan.gpus_per_node} per node)",
        f"microbatches {plan.microbatches} per replica per iteration "
        f"(global batch {plan.global_batch}, ~{plan.global_batch / (plan.dp * plan.microbatches):.1f} samples each)",
        f"token cap    {plan.max_tokens} LLM tokens per microbatch; deferral budget {plan.defer_budget} tokens"
        + (f"; samples may wait up to {plan.max_delay} iteration(s)" if plan.max_delay else ""),
        f"schedule     {plan.schedule}",
        f"sharding     {_SHARDING_TEXT.get(plan.sharding, plan.sharding)}",
        "recompute    "
        + (
            "stages " + ", ".join(str(s.index) for s in plan.stages if s.recompute)
            if any(s.recompute for s in plan.stages)
            else ("every stage" if plan.recompute else "none")
        ),
        "stages:",
    ]
    memory = list(plan.memory_gb) + [float("nan")] * (len(plan.stages) - len(plan.memory_gb))
    for st, mem in zip(plan.stages, memory):
        layers = ", ".join(f"{s.module}[{s.layer_start}:{s.layer_end}]" for s in st.segments)
        lines.append(
            f"  {st.index:>3}  {layers:<48} load/microbatch {st.expected_load * 1e3:8.2f} ms"
            f"  mem {mem:6.1f} GB" + ("  recompute" if st.recompute else "")
        )
    lines += [
        f"iteration    {plan.expected_iteration_time:.4f} s expected (ideal balance {plan.ideal_iteration_time:.4f} s)",
        f"oracle gap   {plan.oracle_gap * 100:.2f}% slower than the best layout chosen per batch",
        f"worst static {plan.worst_static_gap * 100:.1f}% of throughput lost by the worst simulated feasible layout",
        f"search       {plan.search.get('feasible_layouts', 0)} feasible layouts, "
        f"{plan.search.get('simulated_layouts', 0)} simulated on {plan.search.get('profiled_batches', 0)} "
        f"profiled batches in {plan.search.get('seconds', 0):.2f} s",
    ]
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    """Plan, print and save."""
    out = output_path(args.output, "plan")
    if args.max_delay < 0:  # before the search, not after it
        raise InvalidInput(f"--max-delay must be >= 0, got {args.max_delay}")
    table = read_index(args.index)
    spec = model_spec_from_args(args)
    cal = calibration_from_args(args)
    cluster = Cluster(
        args.gpus,
        args.gpus_per_node,
        args.gpu_memory_gb,
        intra_node_gbps=args.intra_node_gbps,
        inter_node_gbps=args.inter_node_gbps,
    )
    plan = make_plan(
        table,
        spec,
        cluster,
        args.global_batch,
        dp=args.dp,
        tp=args.tp,
        pp=args.pp,
        microbatches=args.microbatches,
        batches=args.batches,
        seed=args.seed,
        schedule=args.schedule,
        calibration=cal.to_dict() if cal is not None else None,
        max_tokens=args.max_tokens,
        shardings=SHARDING if args.sharding == "auto" else (args.sharding,),
        recompute=args.recompute,
    )
    if args.max_delay:
        plan = replace(plan, max_delay=args.max_delay)
    print(format_plan(plan))
    write_output(out, "plan", plan.save)
    print(f"plan: {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``plan`` to the ``entrain-data`` parser."""
    p = subparsers.add_parser("plan", help="derive the static parallel plan")
    p.add_argument("index", metavar="INDEX", help="Parquet index")
    add_model_arguments(p)
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="world size")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--gpu-memory-gb", type=float, default=80.0)
    bw = Cluster(1)
    p.add_argument(
        "--intra-node-gbps",
        type=float,
        default=bw.intra_node_gbps,
        metavar="GB/S",
        help="per-GPU bandwidth inside a node in GB/s, prices the data-parallel all-gather / "
        f"reduce-scatter / all-reduce (default: {bw.intra_node_gbps:g}, NVLink 4 on H100)",
    )
    p.add_argument(
        "--inter-node-gbps",
        type=float,
        default=bw.inter_node_gbps,
        metavar="GB/S",
        help="per-GPU bandwidth across nodes in GB/s (default: "
        f"{bw.inter_node_gbps:g}, one 400 Gb/s InfiniBand NIC per GPU)",
    )
    p.add_argument(
        "--sharding",
        choices=("auto", *SHARDING),
        default="auto",
        help="what the data-parallel group shards: none (DDP), optimizer (ZeRO-1 / distributed "
        "optimizer), gradients (ZeRO-2), full (ZeRO-3 / FSDP per block); auto: the planner "
        "scores each on memory per GPU and communication time (default: auto)",
    )
    p.add_argument(
        "--recompute",
        choices=RECOMPUTE,
        default="stage",
        help="activation recomputation: stage (each stage that does not fit without it "
        "recomputes, its extra forward time scored against the layouts that need none), all "
        "(every stage when one needs it), always, never (default: stage)",
    )
    p.add_argument("--global-batch", type=int, required=True, metavar="B")
    p.add_argument("--dp", type=int, help="pin the data-parallel degree")
    p.add_argument("--tp", type=int, help="pin the tensor-parallel degree")
    p.add_argument("--pp", type=int, help="pin the pipeline degree")
    p.add_argument("--microbatches", type=int, help="pin the microbatches per iteration")
    p.add_argument(
        "--max-delay",
        type=int,
        default=0,
        metavar="K",
        help="opt-in bounded delay: a sample heavier than a mean microbatch may wait up to K "
        "iterations (within its epoch) so the heavy ones land together (default: 0, every sample "
        "trains in its own iteration, Entrain's contract)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="T",
        help="pin the LLM token cap of a microbatch (default: derived so every global batch of "
        "the index fits; a cap some sample or heavy batch exceeds is refused at plan time)",
    )
    p.add_argument("--batches", type=int, default=8, metavar="K", help="profiled global batches")
    p.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True, metavar="PLAN", help="plan JSON to write")
    p.set_defaults(handler=cmd_plan)
