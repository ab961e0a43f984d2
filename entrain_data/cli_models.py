"""``entrain-data models | synth | profile``: presets, synthetic indexes and macro profiles.

Handlers raise :class:`~entrain_data.errors.InvalidInput` on bad input; ``cli.main``
turns that into a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from .calibration import Calibration
from .cost_model import calibrate
from .errors import InvalidInput
from .metadata import read_index, write_index
from .presets import ModelSpec, list_presets, load_module
from .profiler import macro_profile
from .real_workloads import list_real_workloads, real_workload
from .workloads import describe_workload, list_workloads, synthesize

__all__ = [
    "cmd_calibrate",
    "register",
    "cmd_models",
    "cmd_synth",
    "cmd_profile",
    "model_spec_from_args",
    "add_model_arguments",
    "output_path",
    "write_output",
]


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """``--encoder`` (repeatable), ``--llm``, ``--frozen-encoder``, ``--calibration``: shared with ``plan``."""
    p.add_argument(
        "--encoder",
        action="append",
        default=[],
        metavar="E",
        help="encoder preset name or JSON config path (repeat for vision + audio)",
    )
    p.add_argument("--llm", required=True, metavar="L", help="LLM preset name or JSON config path")
    p.add_argument(
        "--frozen-encoder", action="store_true", help="encoders are frozen (forward only)"
    )
    p.add_argument(
        "--calibration", metavar="JSON", help="calibration file (Calibration.to_dict) to apply"
    )


def model_spec_from_args(args: argparse.Namespace) -> ModelSpec:
    """The :class:`ModelSpec` named by ``--encoder``/``--llm``/``--frozen-encoder``."""
    return ModelSpec.from_names(
        list(args.encoder), args.llm, frozen_encoders=bool(args.frozen_encoder)
    )


def calibration_from_args(args: argparse.Namespace) -> Calibration | None:
    path = getattr(args, "calibration", None)
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise InvalidInput(f"calibration file not found: {p}")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{p}: not a UTF-8 JSON calibration file ({exc.reason})") from exc
    except json.JSONDecodeError as exc:
        raise InvalidInput(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    return Calibration.from_dict(d.get("calibration", d) if isinstance(d, dict) else d)


def _vision_summary(m) -> str:
    if m.kind == "vision":
        if m.resize == "dynamic":
            res = f"dynamic {m.min_pixels}-{m.max_pixels} px"
        elif m.resize == "tiles":
            res = f"{m.image_size}px tiles <= {m.max_tiles}" + ("+thumb" if m.thumbnail else "")
        else:
            res = f"fixed {m.image_size}px"
        extra = (
            f", window {m.window_patches}p ({len(m.full_attention_layers)} full)"
            if m.window_patches
            else ""
        )
        return f"patch {m.patch_size}, merge {m.merge}x{m.merge}, {res}{extra}"
    if m.kind == "audio":
        return f"{m.n_mels} mel, {m.audio_window_seconds:g}s windows, pool {m.audio_pool}"
    return f"vocab {m.vocab}"


def cmd_models(args: argparse.Namespace) -> int:
    """List the presets with their key config numbers."""
    mods = [load_module(n) for n in list_presets()]
    if args.json:
        print(json.dumps({m.name: m.to_dict() for m in mods}, indent=2))
        return 0
    print(
        f"{'preset':<26} {'kind':<6} {'layers':>6} {'hidden':>6} {'ffn':>6} {'heads':>5} {'kv':>3} {'params':>8}  tokens"
    )
    for m in mods:
        params = m.parameters(4096 if m.is_encoder else 0) / 1e9
        print(
            f"{m.name:<26} {m.kind:<6} {m.layers:>6} {m.hidden:>6} {m.ffn:>6} {m.heads:>5} {m.kv_heads:>3} "
            f"{params:>7.2f}B  {_vision_summary(m)}"
        )
    return 0


def cmd_synth(args: argparse.Namespace) -> int:
    """Write the index of a named synthetic workload (or of a real metadata table with --data-dir)."""
    if args.list:
        for name in list_workloads():
            print(f"{name:<20} {describe_workload(name)}")
        for name in list_real_workloads():
            print(f"{name:<20} real metadata table (needs --data-dir, e.g. ../shared/data)")
        return 0
    if not args.name:
        raise InvalidInput("synth: give a workload NAME (see --list)")
    if args.output is None:
        raise InvalidInput("synth: give the output index path with -o")
    if args.samples is not None and args.samples < 0:
        raise InvalidInput(f"synth: --samples must be >= 0, got {args.samples}")
    if args.name in list_real_workloads():
        if not args.data_dir:
            raise InvalidInput(f"synth: {args.name!r} is built from real metadata: give --data-dir")
        table = real_workload(args.name, args.data_dir)
        if args.samples is not None and args.samples < len(table):
            rng = np.random.default_rng(args.seed)
            table = table.take(np.sort(rng.choice(len(table), size=args.samples, replace=False)))
    else:
        table = synthesize(args.name, 65536 if args.samples is None else args.samples, args.seed)
    path = write_index(table, args.output)
    print(f"wrote {len(table)} samples of {args.name!r} (seed {args.seed}) to {path}")
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """Macro-profile an index under a model and print the table."""
    png = output_path(args.png, "--png") if args.png else None
    out = output_path(args.json, "--json") if args.json else None
    table = read_index(args.index)
    spec = model_spec_from_args(args)
    prof = macro_profile(
        table,
        spec,
        args.global_batch,
        batches=args.batches,
        seed=args.seed,
        calibration=calibration_from_args(args),
    )
    print(prof.format_table())
    if png is not None:
        write_output(png, "--png", prof.plot)
        print(f"plot: {png}")
    if out is not None:
        text = prof.to_json(include_batches=not args.no_batches)
        write_output(out, "--json", lambda p: p.write_text(text))
        print(f"profile: {out}")
    sys.stdout.flush()
    return 0


def output_path(path: str | Path, what: str) -> Path:
    """``path`` once it is known to be writable (its nearest existing folder writable, no
    file in the way, not a folder itself): checked before the work, so a typo in ``-o``
    costs a one-line error, not a finished plan or fit thrown away."""
    out = Path(path)
    if out.is_dir():
        raise InvalidInput(f"{what} {out}: is a folder, give a file path")
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise InvalidInput(f"{what} {out}: cannot write there, {parent} is not a folder")
    target = out if out.exists() else parent
    if not os.access(target, os.W_OK):
        raise InvalidInput(f"{what} {out}: cannot write there ({target} is not writable)")
    return out


def write_output(path: Path, what: str, write: Callable[[Path], object]) -> None:
    """Run ``write(path)`` (parents created) and say an OS failure as one line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as exc:
        raise InvalidInput(f"{what} {path}: cannot write ({exc.strerror or exc})") from exc


def _read_measurements(path: Path) -> list[dict]:
    """The JSON lines of a measurements file, each field checked and named as FILE:LINE."""
    if not path.is_file():
        raise InvalidInput(f"measurements file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{path}: not UTF-8 JSON lines ({exc.reason})") from exc
    rows = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            d = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidInput(f"{path}:{i}: not valid JSON ({exc.msg})") from exc
        if not isinstance(d, dict) or not {"module", "seconds", "keys"} <= set(d):
            raise InvalidInput(
                f"{path}:{i}: expected an object with 'module', 'seconds' and 'keys'"
            )
        secs, keys = d["seconds"], d["keys"]
        if not isinstance(d["module"], str):
            raise InvalidInput(f"{path}:{i}: field 'module' must be a string, got {d['module']!r}")
        if isinstance(secs, bool) or not isinstance(secs, (int, float)) or not secs > 0:
            raise InvalidInput(f"{path}:{i}: field 'seconds' must be a number > 0, got {secs!r}")
        if not isinstance(keys, list) or not keys or any(isinstance(k, (list, dict)) for k in keys):
            raise InvalidInput(
                f"{path}:{i}: field 'keys' must be a non-empty list of sample keys, got {keys!r}"
            )
        if d.get("phase", "forward") not in ("forward", "step"):
            raise InvalidInput(
                f"{path}:{i}: field 'phase' must be 'forward' or 'step', got {d['phase']!r}"
            )
        rows.append(d)
    if not rows:
        raise InvalidInput(f"{path}: no measurements")
    return rows


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Fit the cost model to measured times (JSON lines: module, seconds, keys[, phase]) and save it."""
    out = output_path(args.output, "calibration")
    table = read_index(args.index)
    spec = model_spec_from_args(args)
    rows = _read_measurements(Path(args.measurements))
    row_of = {str(k): i for i, k in enumerate(table.keys)}
    cal = calibration_from_args(args)
    by_module: dict[tuple[str, str], tuple[list, list]] = {}
    for i, d in enumerate(rows, 1):
        missing = [k for k in d["keys"] if str(k) not in row_of]
        if missing:
            raise InvalidInput(
                f"{args.measurements}:{i}: key {missing[0]!r} is not in {args.index}"
            )
        if d["module"] != "llm" and d["module"] not in spec.module_names + (spec.llm.name,):
            raise InvalidInput(
                f"{args.measurements}:{i}: field 'module' is {d['module']!r}, not a module of "
                f"the model (have {', '.join(spec.module_names)})"
            )
        g, s = by_module.setdefault((str(d["module"]), str(d.get("phase", "forward"))), ([], []))
        g.append([row_of[str(k)] for k in d["keys"]])
        s.append(float(d["seconds"]))
    for (module, phase), (groups, secs) in by_module.items():
        cal = calibrate(table, spec, module, groups, secs, phase=phase, previous=cal)
    print(
        f"{'module':<26} {'phase':<8} {'linear':>8} {'quadratic':>9} {'constant s':>10} {'rel RMS':>8} {'R^2':>7} {'n':>5}"
    )
    for name, f in cal.modules.items():
        print(
            f"{name:<26} {f.phase:<8} {f.linear:8.4f} {f.quadratic:9.4f} {f.constant:10.5f} "
            f"{f.rel_rms:8.2%} {f.r2:7.4f} {f.n:>5}"
        )
    text = json.dumps(cal.to_dict(), indent=2)
    write_output(out, "calibration", lambda p: p.write_text(text))
    print(f"calibration: {out}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``models``, ``synth`` and ``profile`` to the ``entrain-data`` parser."""
    p = subparsers.add_parser("models", help="list the model presets")
    p.add_argument("--json", action="store_true", help="print the full configs as JSON")
    p.set_defaults(handler=cmd_models)

    p = subparsers.add_parser("synth", help="write the index of a named synthetic workload")
    p.add_argument("name", nargs="?", metavar="NAME", help="workload name (see --list)")
    p.add_argument(
        "--samples",
        type=int,
        default=None,
        help="number of samples (default 65536; real tables: all rows)",
    )
    p.add_argument(
        "--data-dir", metavar="DIR", help="shared data folder for the real metadata tables"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", metavar="INDEX", help="output Parquet index")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    p.set_defaults(handler=cmd_synth)

    p = subparsers.add_parser("profile", help="macro-profile an index: per-module batch-sum spread")
    p.add_argument("index", metavar="INDEX", help="Parquet index")
    add_model_arguments(p)
    p.add_argument(
        "--global-batch", type=int, default=512, metavar="B", help="samples per global batch"
    )
    p.add_argument("--batches", type=int, default=32, metavar="K", help="global batches to draw")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", metavar="PATH", help="plot CV vs B to this PNG")
    p.add_argument("--json", metavar="PATH", help="write the profile as JSON")
    p.add_argument(
        "--no-batches", action="store_true", help="leave the batch indices out of --json"
    )
    p.set_defaults(handler=cmd_profile)

    p = subparsers.add_parser("calibrate", help="fit the cost model to measured step times")
    p.add_argument("index", metavar="INDEX", help="Parquet index holding the measured samples")
    p.add_argument(
        "measurements",
        metavar="MEASUREMENTS",
        help="JSON lines: {module, seconds, keys: [sample keys run together], phase: forward|step}",
    )
    add_model_arguments(p)
    p.add_argument(
        "-o", "--output", required=True, metavar="JSON", help="calibration file to write"
    )
    p.set_defaults(handler=cmd_calibrate)
