"""``eprt run``: the command (its flags, the files checked before any rank loads, the engine's
launch) of offline batch generation from a JSONL file (``eprt/serve/batch.py``; docs/serving.md,
"eprt run").
"""

from __future__ import annotations

import sys

from eprt.api import EXIT_BAD_INPUT
from eprt.serve import reasoning
from eprt.serve.batch import check_files, run_batch


def add_arguments(parser) -> None:
    from eprt.engine.engine import add_engine_arguments

    parser.add_argument(
        "--input",
        required=True,
        metavar="JSONL",
        help='prompts, one JSON object per line: {"id", "prompt" or "prompt_ids", ...}',
    )
    parser.add_argument(
        "--output",
        required=True,
        metavar="JSONL",
        help="results, appended as they finish; ids already there are skipped (resume)",
    )
    parser.add_argument(
        "--stats-out",
        metavar="JSON",
        help="write the expert-load statistics (tokens per layer and expert) here at the end; see eprt stats",
    )
    reasoning.add_arguments(parser)
    add_engine_arguments(parser)


def main(args) -> int:
    from eprt.engine.engine import launch_engine
    from eprt.engine.expert_load import write_stats

    def check() -> None:  # before any rank loads the model
        check_files(args.input, args.output)
        reasoning.check_name(args.reasoning_parser)

    with launch_engine(args, precheck=check) as engine:  # worker ranks never get past this line
        try:
            parser = reasoning.resolve(args.reasoning_parser, engine.tokenizer) if engine.tokenizer else None
        except ValueError as e:  # the named format's delimiters are not tokens of this model
            print(f"eprt run: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        code = run_batch(engine, args.input, args.output, in_flight=max(64, 4 * args.max_batch), reasoning=parser)
        if args.stats_out:
            write_stats(args.stats_out, engine.expert_load(refresh=True), engine.model_name, engine.transport.size)
        return code
