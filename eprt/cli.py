"""The ``eprt`` command: one sub-command per entry point, each in its own module.

Each sub-command module exposes ``add_arguments(parser)`` and ``main(args) -> int``;
they are imported only when chosen, so ``eprt scenario`` never imports the model.
"""
from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "generate": ("eprt.entry.generate", "generate text for one or more prompts (one batch)"),
    "scenario": ("eprt.scheduler.scenario", "run a scheduler scenario file and print its trace"),
    "run": ("eprt.serve.batch", "offline batch generation from a JSONL file"),
    "serve": ("eprt.serve.server", "OpenAI-compatible HTTP server on rank 0"),
    "env": ("eprt.entry.envcmd", "list the EPRT_ environment variables"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eprt", description="Expert-parallel MoE runtime")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # Build only the chosen sub-command's parser when we can tell which it is.
    if argv and argv[0] in COMMANDS:
        parser = argparse.ArgumentParser(prog="eprt")
        sub = parser.add_subparsers(dest="command")
        module_name, help_text = COMMANDS[argv[0]]
        p = sub.add_parser(argv[0], help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        args = parser.parse_args(argv)
        return int(module.main(args) or 0)
    args = build_parser().parse_args(argv)
    return int(importlib.import_module(args._module).main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
