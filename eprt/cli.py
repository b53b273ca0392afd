"""The ``eprt`` command: one sub-command per entry point, each in its own module.

Each sub-command module exposes ``add_arguments(parser)`` and ``main(args) -> int``;
they are imported only when chosen (``eprt env`` never imports the model).
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": ("eprt.entry.generate", "generate text for one or more prompts (one batch)"),
    "scenario": ("eprt.entry.scenario", "run a scheduler scenario file and print its trace"),
    "run": ("eprt.serve.batch", "offline batch generation from a JSONL file"),
    "serve": ("eprt.serve.server", "OpenAI-compatible HTTP server on rank 0"),
    "replay": ("eprt.entry.replay", "rerun one rank's recorded command stream on one CPU and find where it diverges"),
    "stats": ("eprt.entry.stats", "expert-load statistics of eprt run --stats-out, optionally plotted"),
    "env": ("eprt.entry.envcmd", "list the EPRT_ environment variables"),
    "plan": ("eprt.entry.plan", "capacity planner: weight and KV bytes per rank, wire bytes, decode-step bounds"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser; sub-command arguments are added only for ``only`` (imports stay lazy)."""
    parser = argparse.ArgumentParser(prog="eprt", description="Expert-parallel MoE runtime")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == only:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the program itself (not a caller in-process): each rank under its supervisor
        from eprt.comm.launcher import supervise

        supervise()
    argv = sys.argv[1:] if argv is None else argv
    chosen = argv[0] if argv and argv[0] in COMMANDS else None
    args = build_parser(chosen).parse_args(argv)
    from eprt.comm.transport import StartupFailed

    try:
        return int(importlib.import_module(COMMANDS[args.command][0]).main(args) or 0)
    except (ValueError, OSError, StartupFailed) as e:  # bad input (config, checkpoint, request,
        print(f"eprt {args.command}: error: {e}", file=sys.stderr)  # file) or a rank that could
        return 2  # not start: no traceback


if __name__ == "__main__":
    sys.exit(main())
