"""``entrain-data index`` and ``entrain-data serve`` (registered through the entry-point group)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from entrain_data.errors import InvalidInput

__all__ = ["register", "cmd_index", "cmd_serve", "cmd_worker", "format_stats"]

log = logging.getLogger(__name__)


def format_stats(stats: dict[str, Any]) -> str:
    """One line a person can read: served, rate, queues, skipped, assignment latency, workers."""
    up = max(float(stats.get("uptime_s", 0.0)), 1e-9)
    q = stats.get("queue", {})
    lat = stats.get("assignment_latency_s", {})
    workers = " ".join(
        f"w{w['worker']}:{w['samples_per_s']:.1f}/s(gen{w['generation']})"
        for w in stats.get("workers", [])
    )
    return (
        f"[{stats.get('state', '?')} {up:.0f}s] microbatches {stats['microbatches_served']} "
        f"samples {stats['samples_served']} ({stats['samples_served'] / up:.1f}/s) "
        f"bytes {stats['bytes_served'] / 1e6:.1f} MB ({stats['bytes_served'] / 1e6 / up:.2f} MB/s) "
        f"queue ready/queued/in-flight {q.get('ready', 0)}/{q.get('queued', 0)}/{q.get('in_flight', 0)} "
        f"skipped {stats['skipped_samples']} reissued {stats['tasks_reissued']} "
        f"rejected {stats['rejected_messages']} "
        f"assign {1e3 * lat.get('mean', 0.0):.1f} ms mean / {1e3 * lat.get('max', 0.0):.1f} ms max | "
        f"{workers}"
    )


def cmd_index(args: argparse.Namespace) -> int:
    from entrain_data.cli_models import output_path, write_output
    from entrain_data.metadata import write_index

    from .index_builder import build_index

    out = output_path(args.output, "index")  # before the work: a typo costs one line, not hours
    if args.skipped:
        output_path(args.skipped, "--skipped")

    columns = None
    if args.columns:
        columns = {}
        for item in args.columns:
            field, sep, column = item.partition("=")
            if not sep:
                raise InvalidInput(f"--column must be FIELD=COLUMN, got {item!r}")
            columns[field] = column
    pkg = logging.getLogger("entrain_data")
    level = pkg.level
    if args.quiet:  # per-folder notes too; errors still reach the terminal
        pkg.setLevel(logging.ERROR)
    skipped: list[dict[str, str]] = []
    try:
        table = build_index(
            args.inputs,
            tokenizer=args.tokenizer,
            progress=not args.quiet,
            on_error=args.on_error,
            parquet_columns=columns,
            skipped=skipped,
            metadata=args.metadata,
            captions=args.captions,
        )
    finally:  # main() called in a process that goes on (a notebook, a test) keeps its logging
        pkg.setLevel(level)
    if len(table) == 0:  # every sample skipped (none found: build_index said so)
        where = Path(args.skipped or f"{args.output}.skipped.jsonl")
        where.write_text("".join(json.dumps(s) + "\n" for s in skipped))
        raise InvalidInput(
            f"no sample could be indexed: every one found was skipped ({len(skipped)}; keys "
            f"and errors in {where}); {args.output} not written"
        )
    write_output(out, "index", lambda path: write_index(table, path))
    if not args.quiet:
        print(
            f"wrote {args.output}: {len(table)} samples, {int(table.image_counts.sum())} images, "
            f"{int(table.audio_counts.sum())} audio clips"
        )
    if skipped:  # one line, quiet or not: the keys are in the file, not on the terminal
        where = Path(args.skipped or f"{args.output}.skipped.jsonl")
        where.write_text("".join(json.dumps(s) + "\n" for s in skipped))
        print(f"skipped {len(skipped)} sample(s); keys and errors in {where}", file=sys.stderr)
    return 0


def _seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0 (``nan`` compares false to any bound)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return v


def _curve_keys(args: argparse.Namespace) -> tuple[bytes | None, bytes | None]:
    if not args.curve_secret_key:
        return None, None
    import zmq

    secret = Path(args.curve_secret_key).read_bytes().strip()
    if len(secret) != 40:
        raise InvalidInput(f"{args.curve_secret_key}: expected a 40-character Z85 CURVE secret key")
    return secret, zmq.curve_public(secret)


def worker_key_argument(public: bytes) -> str:
    """``--curve-server-key=KEY`` as a shell reads it back: a Z85 key holds shell characters
    ($ & ! ...) and starts with '-' one time in 85, which argparse takes for an option when
    the key is a separate word."""
    return f"--curve-server-key={shlex.quote(public.decode())}"


def cmd_serve(args: argparse.Namespace) -> int:
    from .service import make_config, serve_foreground

    secret, public = _curve_keys(args)
    cfg = make_config(
        plan=args.plan,
        index=args.index,
        endpoint=args.endpoint,
        workers=args.workers,
        seed=args.seed,
        epochs=args.epochs,
        on_error=args.on_error,
        skipped_path=args.skipped,
        max_skipped=args.max_skipped,
        curve_secret_key=secret,
        curve_public_key=public,
        window=args.window,
        stats_interval=args.stats_interval,
        ranks=args.ranks,
        remote_endpoint=args.remote_endpoint,
    )

    def ready() -> None:  # printed once bound: a failed start prints only its error
        ranks = f"ranks {args.ranks}, " if args.ranks else ""
        print(
            f"entrain-data serve: {cfg.endpoint} ({ranks}{args.workers} workers, seed "
            f"{args.seed}, {args.epochs} epoch(s)); Ctrl-C to stop",
            flush=True,
        )
        if public is not None:
            print(
                f"CURVE public key (give it to clients): {public.decode()}; remote workers: "
                f"entrain-data worker {worker_key_argument(public)} ...",
                flush=True,
            )

    t0 = time.monotonic()
    stats = serve_foreground(
        cfg, on_stats=lambda s: print(format_stats(s), flush=True), on_ready=ready
    )
    took = time.monotonic() - t0
    if stats.get("stopped_by"):  # a signal (Ctrl-C): one line, the workers are already stopped
        print(
            f"entrain-data serve: {stats['stopped_by']} after {took:.1f}s "
            f"({stats['microbatches_served']} microbatches, {stats['samples_served']} samples "
            "served); workers stopped",
            flush=True,
        )
    else:
        print(format_stats(stats), flush=True)
        print(f"stopped after {took:.1f}s", flush=True)
    if stats.get("skipped_samples") or stats.get("left_out_samples"):
        print(f"samples not delivered are listed in {args.skipped}", flush=True)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from .service import check_endpoint, remote_source
    from .worker import run_remote_worker

    if not check_endpoint(args.connect).startswith("tcp://"):
        raise InvalidInput(
            f"--connect: remote workers join over tcp://HOST:PORT, got {args.connect}"
        )
    key = args.curve_server_key.encode() if args.curve_server_key else None
    if key is not None and len(key) != 40:
        raise InvalidInput("--curve-server-key: expected the 40-character Z85 public key")
    source = remote_source(args.index, args.plan, on_error=args.on_error)
    print(f"entrain-data worker: joining {args.connect}; Ctrl-C to stop", flush=True)
    run_remote_worker(args.connect, source, curve_server_key=key)
    print("entrain-data worker: the service said stop", flush=True)
    return 0


class _DefaultsShown(argparse.HelpFormatter):
    """Help that shows every option's default, except where there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default is not None and action.default is not False
        if shown and action.default != argparse.SUPPRESS and "default" not in text:
            text += " (default: %(default)s)"
        return text


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``index`` and ``serve`` to the ``entrain-data`` parser."""
    p = subparsers.add_parser(
        "index",
        help="build the Parquet index of WebDataset shards, tables or folders",
        formatter_class=_DefaultsShown,
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="tar shards (brace patterns, globs and object-store prefixes allowed), Parquet "
        "tables, folders of loose files (name.jpg + name.txt/name.json), folders with a metadata.jsonl/.csv/.parquet "
        "(ImageFolder), JSON/JSONL/CSV metadata files (LLaVA, ShareGPT); shards and tables may "
        "be s3://, gs://, https:// URLs",
    )
    p.add_argument("-o", "--output", required=True, metavar="INDEX", help="output Parquet index")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="Hugging Face tokenizer name or path: its exact token counts (default: byte-level, "
        "one token per UTF-8 byte plus BOS/EOS; exact for the default packer, about 4x a "
        "word-piece or BPE count, so give the tokenizer you train with for exact counts)",
    )
    p.add_argument(
        "--column",
        dest="columns",
        action="append",
        metavar="FIELD=COLUMN",
        help="map a field to a Parquet column or metadata field (repeatable). Parquet: text, "
        "text_tokens, image, audio (bytes), key, ... Metadata files: text, media (file_name), "
        "image, audio, video (file paths), key. Stored in the index, so serve reads the same "
        "way (default: text; metadata: file_name, messages/conversations/text/caption(s), "
        "image(s), audio(s), video(s) as present)",
    )
    p.add_argument(
        "--metadata",
        default=None,
        metavar="FILE",
        help="read each folder or object-store prefix INPUT through this JSON/JSONL/CSV/Parquet "
        "file inside it, one "
        "sample per record (default: metadata.jsonl, .csv or .parquet if present, else "
        "sidecar files)",
    )
    p.add_argument(
        "--captions",
        choices=("first", "each"),
        default="first",
        help="a text field holding a list of captions: one sample with the first caption "
        "(one image decode per record) or one sample per caption",
    )
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="raise",
        help="a bad sample: stop naming its file and key/line, or leave it out and list it "
        "in --skipped",
    )
    p.add_argument(
        "--skipped",
        metavar="PATH",
        default=None,
        help="where skipped samples are written (JSON lines; default: INDEX.skipped.jsonl)",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar and no summary; only a skipped-samples line and errors",
    )
    p.set_defaults(handler=cmd_index)

    p = subparsers.add_parser(
        "serve",
        help="run the loader service in the foreground",
        formatter_class=_DefaultsShown,
    )
    p.add_argument(
        "--index", required=True, metavar="INDEX", help="index from `entrain-data index`"
    )
    p.add_argument(
        "--plan", required=True, metavar="PLAN", help="plan.json from `entrain-data plan`"
    )
    p.add_argument(
        "--endpoint",
        default=None,
        help="ipc://PATH or tcp://HOST:PORT the ranks connect to (default: ipc in a temp dir)",
    )
    p.add_argument(
        "--workers", type=int, default=2, metavar="N", help="worker processes (read, decode, pack)"
    )
    p.add_argument(
        "--ranks",
        default=None,
        metavar="A-B",
        help="serve only global ranks A..B (inclusive): one service per node, each computing the "
        "same global schedule (default: every rank of the plan)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="shuffle and assignment seed")
    p.add_argument("--epochs", type=int, default=1, metavar="E", help="epochs to serve, then exit")
    p.add_argument(
        "--on-error",
        choices=("raise", "skip"),
        default="skip",
        help="an undecodable sample: skip it (recorded, within --max-skipped) or stop the service",
    )
    p.add_argument(
        "--max-skipped",
        default="1%",
        metavar="N|P%",
        help="error budget: stop once more samples than this (a count or a share of the index) "
        "were skipped",
    )
    p.add_argument(
        "--skipped",
        metavar="PATH",
        default="entrain-skipped.jsonl",
        help="record of every sample not delivered and why (JSON lines; written only if any)",
    )
    p.add_argument(
        "--window", type=int, default=4, metavar="N",
        help="microbatches per rank prepared ahead (bounds memory)",
    )  # fmt: skip
    p.add_argument(
        "--stats-interval",
        type=_seconds,
        default=10.0,
        metavar="SECONDS",
        help="print counters this often (0: only at the end)",
    )
    p.add_argument(
        "--curve-secret-key",
        metavar="PATH",
        help="file holding the server's Z85 CURVE secret key (tcp encryption + auth)",
    )
    p.add_argument(
        "--remote-endpoint",
        metavar="tcp://HOST:PORT",
        help="also accept workers from other hosts here (`entrain-data worker --connect`); "
        "CURVE with --curve-secret-key",
    )
    p.set_defaults(handler=cmd_serve)

    p = subparsers.add_parser(
        "worker",
        help="a remote worker: join a service over tcp and pack its tasks",
        formatter_class=_DefaultsShown,
    )
    p.add_argument(
        "--connect",
        required=True,
        metavar="tcp://HOST:PORT",
        help="the service's --remote-endpoint",
    )
    p.add_argument(
        "--index", required=True, metavar="INDEX", help="the same index the service serves"
    )
    p.add_argument("--plan", required=True, metavar="PLAN", help="the same plan the service serves")
    p.add_argument("--on-error", choices=("raise", "skip"), default="skip", help="as the service's")
    p.add_argument(
        "--curve-server-key",
        metavar="KEY",
        help="the service's Z85 CURVE public key (40 characters); write it as "
        "--curve-server-key='KEY': a key may start with '-' and holds shell characters",
    )
    p.set_defaults(handler=cmd_worker)
