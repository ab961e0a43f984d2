"""``entrain-data``: the command-line entry point.

Core commands (models, synth, profile, plan) are registered here; the loader
service and demo register theirs through the ``entrain_data.cli`` entry-point
group, so the core never imports workers/ or adapters/.

Every expected failure (an :class:`~entrain_data.errors.EntrainError`, bad
arguments) prints one line ``entrain-data: error: ...`` and exits 2, never a
traceback.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points

from . import __version__
from .errors import EntrainError

__all__ = ["main", "build_parser"]

Handler = Callable[[argparse.Namespace], int | None]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def _seed(text: str) -> int:
    """An argparse type: a seed >= 0 (numpy refuses a negative one with a traceback)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {v}")
    return v


def _checked_seeds(sub: argparse._SubParsersAction) -> None:
    """Every command's ``--seed`` (plugins' too) parsed by :func:`_seed`: one rule for all."""
    for command in sub.choices.values():
        for action in command._actions:
            if action.dest == "seed" and action.type is int:
                action.type = _seed


_ALSO_NAMED = {"gpus": ("world_size",)}
"""Library names of a flag's value other than its dest (``Cluster(world_size)`` is ``--gpus``)."""


def _as_flags(message: str, command: argparse.ArgumentParser | None) -> str:
    """A library error said in the command's flags: ``global_batch`` -> ``--global-batch``
    (a parameter name with ``_`` anywhere outside quotes and paths; a one-word one only where
    the message starts with it, ``dp must be ...``, ``tp=3 must ...``)."""
    if command is None:
        return message
    for action in command._actions:
        flag = next((o for o in action.option_strings if o.startswith("--")), None)
        if flag is None or flag == "--help":
            continue
        for dest in (action.dest, *_ALSO_NAMED.get(action.dest, ())):
            name = re.escape(dest)
            if "_" in dest:
                message = re.sub(rf"(?<![\w./'\"-]){name}(?![\w./'\"-])", flag, message)
            else:
                message = re.sub(rf"^{name}(?= must\b|=)", flag, message)
    return message


def _core_registrars() -> list[Callable[[argparse._SubParsersAction], None]]:
    from . import cli_models, cli_plan

    return [cli_models.register, cli_plan.register]


def build_parser() -> argparse.ArgumentParser:
    """The full parser: core commands plus those of installed plugins."""
    parser = _Parser(prog="entrain-data", description=__doc__.splitlines()[0])
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)"
    )
    parser.add_argument(
        "--version",
        action="version",
        version=f"entrain-data {__version__}",
        help="print the version",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for register in _core_registrars():
        register(sub)
    for ep in sorted(entry_points(group="entrain_data.cli"), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as exc:  # a missing optional plugin must not break the core commands
            logging.getLogger(__name__).debug("command plugin %r not loaded: %s", ep.name, exc)
            continue
        register(sub)
    _checked_seeds(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=[logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)],
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Handler = args.handler
    try:
        return int(handler(args) or 0)
    except EntrainError as exc:
        sub = parser._subparsers._group_actions[0] if parser._subparsers else None
        command = sub.choices.get(args.command) if sub is not None else None
        print(f"entrain-data: error: {_as_flags(str(exc), command)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("entrain-data: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
