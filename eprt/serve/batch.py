"""``eprt run``: offline batch generation from a JSONL file, with continuous batching.

Input, one JSON object per line (blank lines are ignored)::

    {"id": "a", "prompt": "text", "max_tokens": 32, "temperature": 0.7, "stop": ["\\n"]}
    {"id": "b", "prompt_ids": [1, 2, 3]}

``id`` (string or integer) is optional; the fields after the prompt are those of
``eprt.serve.params`` (max_tokens defaults to 16, as in OpenAI's completions API).

Output, one line per input line in the order requests FINISH (each written and flushed
at once): the result, ``GenerationResult.to_json()`` plus ``"line"`` (the input line
number), or ``{"id": ..., "line": N, "error": "..."}`` for a line that could not be
served. A bad line never stops the job; the exit code is 0 and the summary says how
many failed. Running the same command again skips every line whose id (or, without an
id, whose line number) is already in the output, so an interrupted job resumes where
it stopped; delete a line from the output to run it again. A line repeating an earlier
line's id is an error; its record carries ``"duplicate_of"`` (the first line's number)
and is keyed by its own line number, so it never marks the first line as done.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

from eprt.api import GenerationRequest, RequestError, SamplingParams
from eprt.serve.loop import EngineLoop
from eprt.serve.params import FieldError, check_text, encode_prompt, parse_options, parse_token_ids
from eprt.serve.progress import Progress
from eprt.serve.stream import LiveRequest

log = logging.getLogger("eprt.serve")

LINE_FIELDS = frozenset({"id", "prompt", "prompt_ids", "max_tokens", "temperature", "top_p",
                         "top_k", "seed", "stop", "timeout"})
_POLL_S = 0.01      # how long the writer sleeps when no request made progress


def add_arguments(parser) -> None:
    from eprt.engine.engine import add_engine_arguments

    parser.add_argument("--input", required=True, metavar="JSONL",
                        help="prompts, one JSON object per line: {\"id\", \"prompt\" or \"prompt_ids\", ...}")
    parser.add_argument("--output", required=True, metavar="JSONL",
                        help="results, appended as they finish; ids already there are skipped (resume)")
    add_engine_arguments(parser)


def main(args) -> int:
    from eprt.engine.engine import launch_engine

    with launch_engine(args) as engine:     # worker ranks never get past this line
        return run_batch(engine, args.input, args.output, in_flight=max(64, 4 * args.max_batch))


@dataclass
class Line:
    number: int                   # 1-based line number in the input
    id: object                    # the line's "id" (str or int), None when it has none
    obj: Optional[dict] = None    # the parsed line, None when it is not a JSON object
    error: Optional[str] = None   # why the line cannot be served, found before submission
    duplicate_of: Optional[int] = None  # number of the earlier line with the same id

    @property
    def key(self) -> tuple:
        """What marks this line done in the output: its id, else (no id, or a repeated id) its number."""
        if self.id is None or self.duplicate_of is not None:
            return ("line", self.number)
        return ("id", json.dumps(self.id))


def read_lines(path: str) -> list:
    """Every non-blank input line, parsed as far as finding its id."""
    lines = []
    with open(path, "rb") as f:         # split on b"\n" only: a stray \r or bad byte spoils one line
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                lines.append(Line(number, None, error=f"not valid UTF-8: byte {raw[e.start]:#04x} at "
                                                      f"offset {e.start}"))
                continue
            except json.JSONDecodeError as e:
                lines.append(Line(number, None, error=f"not valid JSON: {e.msg} at column {e.colno}"))
                continue
            except RecursionError:
                lines.append(Line(number, None, error="not valid JSON: nested too deeply"))
                continue
            if not isinstance(obj, dict):
                lines.append(Line(number, None, error=f"expected a JSON object, got {type(obj).__name__}"))
                continue
            line_id = obj.get("id")
            if line_id is not None and (not isinstance(line_id, (str, int)) or isinstance(line_id, bool)):
                lines.append(Line(number, None, error=f"id must be a string or an integer, got {line_id!r}"))
                continue
            if isinstance(line_id, str):
                try:
                    check_text(line_id, "id")
                except FieldError as e:
                    lines.append(Line(number, None, error=str(e)))
                    continue
            lines.append(Line(number, line_id, obj))
    return lines


def finished_keys(path: str) -> set:
    """Keys of the records already in the output; a torn last line (from a crash) is cut off."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb+") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            log.warning("%s: dropping an incomplete last line left by an interrupted run", path)
            f.truncate(end)
    keys = set()
    for raw in data[:end].splitlines():
        try:
            rec = json.loads(raw)
            keys.add(Line(rec["line"], rec.get("id"), duplicate_of=rec.get("duplicate_of")).key)
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path} has a line that eprt run did not write: {raw[:80]!r}") from None
    return keys


def build_request(line: Line, engine) -> tuple:
    """A line's GenerationRequest and stop strings; FieldError names what is wrong."""
    obj = line.obj
    unknown = sorted(set(obj) - LINE_FIELDS)
    if unknown:
        raise FieldError(unknown[0], f"unknown field {unknown[0]!r} (known: {', '.join(sorted(LINE_FIELDS))})")
    if ("prompt" in obj) == ("prompt_ids" in obj):
        raise FieldError("prompt", "give exactly one of prompt (text) or prompt_ids (token ids)")
    if "prompt" in obj:
        prompt_ids = encode_prompt(engine.tokenizer, obj["prompt"], "prompt")
    else:
        prompt_ids = parse_token_ids(obj["prompt_ids"], "prompt_ids", engine.vocab_size)
    opts = parse_options(obj, engine.vocab_size, default_max_tokens=SamplingParams().max_tokens)
    request_id = f"line-{line.number}" if line.id is None else str(line.id)
    return GenerationRequest(prompt_ids, opts.params, request_id=request_id,
                             timeout_s=opts.timeout_s), opts.stop_strings


class BatchWriter:
    """Submits lines (keeping ``in_flight`` requests queued) and writes results as they finish."""

    def __init__(self, engine, lines: list, out, progress: Progress, in_flight: int):
        self.engine, self.lines, self.out, self.progress = engine, lines, out, progress
        self.in_flight = in_flight
        self.unfinished = len(lines)    # lines with nothing written yet
        self.error: Optional[BaseException] = None

    def run(self, loop: EngineLoop) -> None:
        try:
            self._run(loop)
        except BaseException as e:       # reported by the main thread
            self.error = e
        finally:
            loop.stop.set()

    def _run(self, loop: EngineLoop) -> None:
        todo = iter(self.lines)
        live: dict = {}                  # LiveRequest -> Line
        exhausted = False
        while True:
            engine_gone = loop.stopped.is_set()
            while not exhausted and len(live) < self.in_flight and not loop.stop.is_set():
                line = next(todo, None)
                if line is None:
                    exhausted = True
                else:
                    self._submit(line, live)
            done = []
            for req in live:
                req.pump()
                if req.finished():
                    done.append(req)
            for req in done:
                result, _ = req.result()
                self._write(live.pop(req), result.to_json(), failed=result.finish_reason == "error",
                            tokens=len(result.token_ids))
            if engine_gone or (not live and (exhausted or loop.stop.is_set())):
                return                   # what is still live when the engine is gone never finishes
            if not done:
                time.sleep(_POLL_S)

    def _submit(self, line: Line, live: dict) -> None:
        if line.error is None:
            try:
                request, stops = build_request(line, self.engine)
                live[LiveRequest(self.engine, request, stops)] = line
                return
            except RequestError as e:
                line.error = str(e)
        self._write(line, {"error": line.error}, failed=True)

    def _write(self, line: Line, record: dict, failed: bool, tokens: int = 0) -> None:
        record = {"id": line.id, "line": line.number, **{k: v for k, v in record.items() if k != "id"}}
        if line.duplicate_of is not None:
            record["duplicate_of"] = line.duplicate_of
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()
        self.unfinished -= 1
        self.progress.add(failed, tokens)


def run_batch(engine, input_path: str, output_path: str, in_flight: int = 64,
              progress_stream=None) -> int:
    """Run every not-yet-finished line of ``input_path``; 0 unless the job itself failed."""
    progress_stream = progress_stream or sys.stderr
    try:
        lines = read_lines(input_path)
        done = finished_keys(output_path)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"eprt run: {e}", file=sys.stderr)
        return 2
    todo, first_line = [], {}           # first_line: id key -> number of the first line using it
    for line in lines:
        if line.id is not None:
            first = first_line.setdefault(line.key, line.number)
            if first != line.number:
                line.duplicate_of = first
                line.error = f"duplicate id {line.id!r} (first used on line {first})"
        if line.key not in done:
            todo.append(line)
    start = time.monotonic()
    progress = Progress(len(todo), progress_stream)
    loop = EngineLoop(engine)
    with open(output_path, "a", encoding="utf-8") as out:
        writer = BatchWriter(engine, todo, out, progress, in_flight)
        thread = threading.Thread(target=writer.run, args=(loop,), name="eprt-run-writer", daemon=True)
        thread.start()
        try:
            loop.run()
        finally:
            loop.stop.set()
            thread.join()
            progress.close()
    if writer.error is not None:
        raise writer.error
    skipped = len(lines) - len(todo)
    print(f"eprt run: wrote {progress.done} results to {output_path} ({progress.failed} failed, "
          f"{skipped} skipped as already done) in {time.monotonic() - start:.1f}s", file=progress_stream)
    if writer.unfinished:
        print(f"eprt run: interrupted with {writer.unfinished} lines unfinished; run the same command "
              f"again to resume", file=progress_stream)
        return 1
    return 0
