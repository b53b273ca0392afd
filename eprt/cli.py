"""The ``eprt`` command: one sub-command per entry point, each in its own module.

Each sub-command module exposes ``add_arguments(parser)`` and ``main(args) -> int``;
they are imported only when chosen (``eprt env`` never imports the model).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

COMMANDS = {
    "generate": ("eprt.entry.generate", "generate text for one or more prompts (one batch)"),
    "scenario": ("eprt.entry.scenario", "run a scheduler scenario file and print its trace"),
    "run": ("eprt.entry.run", "offline batch generation from a JSONL file"),
    "serve": ("eprt.entry.serve", "OpenAI-compatible HTTP server on rank 0"),
    "replay": ("eprt.entry.replay", "rerun one rank's recorded command stream on one CPU and find where it diverges"),
    "stats": ("eprt.entry.stats", "expert-load statistics of eprt run --stats-out, optionally plotted"),
    "env": ("eprt.entry.envcmd", "list the EPRT_ environment variables"),
    "plan": ("eprt.entry.plan", "capacity planner: weight and KV bytes per rank, wire bytes, decode-step bounds"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; sub-command arguments are added only for ``only`` (imports stay lazy).
    ``parser.commands`` maps each sub-command to its parser."""
    parser = argparse.ArgumentParser(prog="eprt", description="Expert-parallel MoE runtime")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    parser.commands = {}
    for name, (module, help_text) in COMMANDS.items():
        p = parser.commands[name] = sub.add_parser(name, help=help_text, description=help_text)
        if name == only:
            importlib.import_module(module).add_arguments(p)
    return parser


def unrecognized(extra: list, parser: argparse.ArgumentParser) -> str:
    """argparse's message for arguments no flag takes, with the closest flag of ``parser`` for each
    mistyped one ("--promt": did you mean --prompt?)."""
    flags = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    hints = []
    for arg in extra:
        if arg.startswith("--"):
            close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6)
            hints += [f"{arg.split('=', 1)[0]}: did you mean {close[0]}?"] if close else []
    return f"unrecognized arguments: {' '.join(extra)}" + (f" ({'; '.join(hints)})" if hints else "")


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line; a flag no sub-command takes shows that sub-command's usage (exit 2)."""
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    parser = build_parser(chosen)
    if argv and not argv[0].startswith("-") and chosen is None:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1)
        if close:
            parser.error(f"unknown command {argv[0]!r}: did you mean {close[0]!r}?")
    args, extra = parser.parse_known_args(argv)
    if extra:
        parser.commands[args.command].error(unrecognized(extra, parser.commands[args.command]))
    return args


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (not a caller in-process): each rank under its supervisor
        from eprt.comm.launcher import supervise
        from eprt.ops.cpu_threads import limit_blas_spin

        limit_blas_spin()  # (before anything loads NumPy)
        supervise()
    args = parse(sys.argv[1:] if argv is None else argv)  # argparse's errors exit 2 too
    from eprt.api import EXIT_BAD_INPUT
    from eprt.comm.transport import StartupFailed

    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)
    except (ValueError, OSError, StartupFailed) as e:  # bad input (config, checkpoint, request,
        print(f"eprt {args.command}: error: {e}", file=sys.stderr)  # file) or a rank that could
        return EXIT_BAD_INPUT  # not start: no traceback


if __name__ == "__main__":
    sys.exit(main())
