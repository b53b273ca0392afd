"""``eprt generate``: generate for one or more prompts as one continuous batch; ``--json``
prints one ``GenerationResult.to_json()`` object per prompt, in order. On SIGTERM/SIGINT the
running prompts finish, queued ones are reported not run, and the exit status is 1.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys

import numpy as np

from eprt.api import EXIT_BAD_INPUT, STOPPED, GenerationRequest, RequestError, SamplingParams
from eprt.engine.engine import add_engine_arguments, launch_engine
from eprt.serve import reasoning
from eprt.serve.chat_output import split
from eprt.serve.media import read_local_image
from eprt.serve.params import check_text
from eprt.serve.progress import Progress

PROGRESS_DELAY_S = 1.0  # a generation done sooner shows no progress


def _ids(text: str) -> tuple:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--prompt-ids wants comma-separated integers, got {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("--prompt-ids is empty")
    return ("ids", ids)


def _embeds(text: str) -> tuple:
    """``I:FILE`` -> (I, FILE); a FILE without an all-digit ``I:`` prefix is for prompt 0."""
    index, sep, path = text.partition(":")
    if sep and index.isascii() and index.isdigit():
        return int(index), path
    return 0, text


def _load_embeds(path: str) -> np.ndarray:
    """The float32 [n, D] rows stored in a .npy file; RequestError names the file when they are not."""
    try:
        rows = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise RequestError(f"--image-embeds {path}: cannot read it as a .npy array ({e})") from None
    if not isinstance(rows, np.ndarray):  # an NpzFile: a zip of named arrays
        rows.close()
        raise RequestError(f"--image-embeds {path}: is an .npz archive; save one array with np.save (.npy)")
    if rows.ndim != 2 or rows.dtype.kind != "f":
        raise RequestError(
            f"--image-embeds {path}: want a 2-D float array [n, D], got {rows.dtype} of shape {rows.shape}"
        )
    return rows.astype(np.float32)


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None, help="sampling seed given to every prompt")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's EOS ids")
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="logprobs of each generated token and its top N (--json)",
    )
    parser.add_argument(
        "--prompt-logprobs", type=int, default=None, metavar="N", help="logprobs of each prompt token and its top N"
    )
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--min-tokens", type=int, default=0)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prompt",
        dest="prompts",
        action="append",
        type=lambda s: ("text", s),
        default=[],
        metavar="TEXT",
        help="a text prompt (repeatable; needs the model's tokenizer)",
    )
    parser.add_argument(
        "--prompt-ids",
        dest="prompts",
        action="append",
        type=_ids,
        metavar="1,2,3",
        help="a prompt as token ids (repeatable, keeps its place among --prompt)",
    )
    _add_sampling_arguments(parser)
    parser.add_argument(
        "--image-embeds",
        action="append",
        type=_embeds,
        default=[],
        metavar="[I:]FILE.npy",
        help="float32 [n, D] rows for the n image placeholders of prompt I (default 0)",
    )
    parser.add_argument(
        "--image",
        dest="images",
        action="append",
        type=_embeds,
        default=[],
        metavar="[I:]FILE",
        help="a PNG/JPEG/WebP image for prompt I (default 0), repeatable, in the order of its image "
        "placeholders (vision models; a prompt without placeholders gets the images in front)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per prompt (per choice) per line")
    parser.add_argument("-n", "--n", type=int, default=1, help="choices per prompt, sharing its prefill (default 1)")
    parser.add_argument(
        "--best-of", type=int, default=None, help="generate this many choices per prompt, print the n most likely"
    )
    parser.add_argument(
        "--adapter", default=None, metavar="NAME", help="generate with the LoRA adapter NAME of --lora-modules"
    )
    reasoning.add_arguments(parser, budget=True)
    add_engine_arguments(parser)


def _thinking(args, tokenizer):
    """The prompts' thinking block (--reasoning-parser) with --max-thinking-tokens; RequestError for
    a budget without one."""
    try:
        parser = reasoning.resolve(args.reasoning_parser, tokenizer) if tokenizer is not None else None
    except ValueError as e:
        raise RequestError(str(e)) from None
    if parser is None or isinstance(parser, reasoning.HarmonyParser):  # (harmony: split by the server only)
        if args.max_thinking_tokens is not None:
            raise RequestError(
                "--max-thinking-tokens needs the model's thinking block of delimiter tokens: give --reasoning-parser"
            )
        return None
    return parser.thinking(args.max_thinking_tokens)


def check_args(args) -> None:
    """The flags alone, before any rank loads the model; ValueError naming the flag."""
    if not args.prompts:
        raise ValueError("give at least one --prompt or --prompt-ids")
    for flag, value in (("--logprobs", args.logprobs), ("--prompt-logprobs", args.prompt_logprobs)):
        if value is not None and not args.json:
            raise ValueError(
                f"{flag} is printed in the --json records only (plain text has no place for it): add --json"
            )
    _params(args).validate(vocab_size=1)  # the flags alone; stop ids (none here) need the real vocabulary
    reasoning.check_name(args.reasoning_parser)
    if args.max_thinking_tokens is not None and args.max_thinking_tokens < 0:
        raise ValueError(f"--max-thinking-tokens must be >= 0, got {args.max_thinking_tokens}")


def _params(args) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        n=args.n,
        best_of=args.best_of,
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
    )


def _requests(args, tokenizer, thinking=None) -> list:
    params = _params(args)
    params.thinking = thinking
    reqs = []
    for kind, value in args.prompts:
        if kind == "text":
            if tokenizer is None:
                raise RequestError("--prompt needs a tokenizer.json in the model directory; use --prompt-ids")
            ids = tokenizer.encode(check_text(value, "--prompt")) if value else []
            if not ids:
                raise RequestError(f"--prompt {value!r} encodes to no tokens")
        else:
            ids = value
        reqs.append(GenerationRequest(prompt_ids=ids, params=params, adapter=getattr(args, "adapter", None)))
    for index, path in args.image_embeds:
        if not 0 <= index < len(reqs):
            raise RequestError(f"--image-embeds names prompt {index}, but there are {len(reqs)} prompts")
        reqs[index].image_embeds = _load_embeds(path)
    for index, path in args.images:
        if not 0 <= index < len(reqs):
            raise RequestError(f"--image names prompt {index}, but there are {len(reqs)} prompts")
        reqs[index].images = (reqs[index].images or []) + [read_local_image(path, "--image", "--image")]
    return reqs


def _record(res, engine, thinking) -> dict:
    """``--json``'s object of a result: with a thinking block, its text split into reasoning and text."""
    record = res.to_json()
    if thinking is not None and res.finish_reason != "error":
        eos = engine.tokenizer.eos_token_ids
        record["reasoning"], record["text"] = split(engine.tokenizer, res.prompt_ids, res.token_ids, thinking, eos)
    return record


def _progress(engine, reqs: list) -> Progress:
    """The live progress of ``reqs`` on stderr (the results go to stdout)."""
    budget = sum(r.params.max_tokens * r.params.choices for r in reqs)
    tokens = lambda: engine.generation_tokens  # noqa: E731
    return Progress(len(reqs), sys.stderr, "eprt generate", tokens, PROGRESS_DELAY_S, budget=budget)


class Drain:
    """Rank 0's SIGTERM/SIGINT handler: the first asks the engine to stop admitting (running
    prompts finish), a second abandons the run (KeyboardInterrupt)."""

    def __init__(self, engine):
        self.engine = engine
        self.signal: str | None = None

    def install(self) -> None:
        for s in (signal.SIGTERM, signal.SIGINT):
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.signal is not None:
            raise KeyboardInterrupt(f"second {name}: abandoning the prompts in flight")
        self.signal = name
        print(
            f"eprt generate: {name}: finishing the prompts already running; the others are not run "
            f"(send it again to abort)",
            file=sys.stderr,
            flush=True,
        )
        self.engine.request_stop()


def main(args) -> int:
    check_args(args)  # every rank: bad flags leave before loading
    with launch_engine(args) as engine:  # worker ranks never get past this line
        drain = Drain(engine)
        drain.install()
        try:
            thinking = _thinking(args, engine.tokenizer)
            reqs = _requests(args, engine.tokenizer, thinking)
            progress = _progress(engine, reqs)
            per_prompt = engine.generate_choices(reqs, on_step=progress.set_done, strict=True)
            progress.close()
        except (RequestError, OSError) as e:
            print(f"eprt generate: {e}", file=sys.stderr)
            return EXIT_BAD_INPUT
        results = [r for choices in per_prompt for r in choices]  # choice by choice, prompt by prompt
        not_run = sum(r.finish_reason == "error" and (r.error or "").startswith(STOPPED) for r in results)
        if not_run:
            print(
                f"eprt generate: stopped by {drain.signal}: {not_run} of {len(results)} prompts were not run",
                file=sys.stderr,
                flush=True,
            )
        failed = 0
        for res in results:
            failed += res.finish_reason == "error"
            if args.json:
                print(json.dumps(_record(res, engine, thinking)), flush=True)
            elif res.finish_reason == "error":
                print(f"eprt generate: {res.error}", file=sys.stderr, flush=True)
                print(flush=True)  # one output line per prompt, an empty one for a failure
            else:
                print(res.text if engine.tokenizer is not None else " ".join(map(str, res.token_ids)), flush=True)
        return 1 if failed else 0
