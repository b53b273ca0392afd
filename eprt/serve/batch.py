"""``eprt run``: offline batch generation from a JSONL file, with continuous batching; results
are written as they finish, keyed by ``id`` or content hash so a rerun resumes, and the
output file is locked (input and output formats: docs/serving.md, "eprt run").
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial

from eprt.api import (
    ENGINE_FAILED,
    EXIT_BAD_INPUT,
    EngineClosed,
    GenerationRequest,
    JobFailure,
    RequestError,
    SamplingParams,
    is_engine_failure,
    is_int,
)
from eprt.serve import reasoning
from eprt.serve.chat_output import ChatOutput
from eprt.serve.guided import GUIDED_FIELDS, compile_guide, parse_guide
from eprt.serve.loop import EngineLoop
from eprt.serve.media import MediaPolicy, image_bytes
from eprt.serve.params import (
    PROCESSING,
    FieldError,
    check_text,
    context_room,
    encode_prompt,
    fit_to_context,
    parse_choices,
    parse_options,
    parse_token_ids,
    parse_truncation,
    truncate_prompt,
)
from eprt.serve.progress import Progress
from eprt.serve.stream import LiveChoices, LiveRequest

log = logging.getLogger("eprt.serve")

LINE_FIELDS = frozenset(
    {
        "id",
        "prompt",
        "prompt_ids",
        "images",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "timeout",
        "model",
        "truncate_prompt_tokens",
    }
    | {"n", "best_of", "response_format", "structured_outputs"}
    | set(GUIDED_FIELDS)
    | set(reasoning.BUDGET_FIELDS)
    | set(PROCESSING)
)
_POLL_S = 0.01  # how long the writer sleeps when no request made progress


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


def check_files(input_path: str, output_path: str) -> None:
    """Before the model loads: the input can be read, and the output written and not being written
    by another ``eprt run``; OSError or ValueError naming the file otherwise. Creates nothing."""
    try:
        with open(input_path, "rb") as f:
            f.read(1)
    except OSError as e:
        raise type(e)(f"--input {input_path}: {e.strerror or e}") from None
    if os.path.isdir(output_path):
        raise IsADirectoryError(f"--output {output_path} is a directory")
    folder = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"--output {output_path}: its directory {folder} does not exist")
    if os.path.exists(output_path):
        os.close(lock_output(output_path))  # OutputLocked now rather than after loading
    elif not os.access(folder, os.W_OK):
        raise PermissionError(f"--output {output_path}: cannot create a file in {folder}")


@dataclass
class Line:
    number: int  # 1-based line number in the input (reported, never a key)
    id: object  # the line's "id" (str or int), None when it has none
    digest: str  # SHA-256 of the line's canonical JSON (of its bytes if not JSON)
    obj: dict | None = None  # the parsed line, None when it is not a JSON object
    error: str | None = None  # why the line cannot be served, found before submission
    duplicate_of: int | None = None  # number of the earlier line with the same id
    copy: int = 1  # which identical copy of its key this line is (1, 2, ...)

    @property
    def key(self) -> tuple:
        """What marks this line done in the output: its id; without an id its content hash;
        a repeated id is an error keyed by id and content. Copies of one key are counted."""
        if self.duplicate_of is not None:
            return ("duplicate", json.dumps(self.id), self.digest, self.copy)
        if self.id is not None:
            return ("id", json.dumps(self.id))
        return ("hash", self.digest, self.copy)


def _digest(raw: bytes, obj=None) -> str:
    if obj is not None:
        raw = json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode(
            "utf-8", "surrogatepass"
        )
    return hashlib.sha256(raw.strip()).hexdigest()


def read_lines(path: str) -> list:
    """Every non-blank input line, parsed as far as finding its id."""
    lines = []
    with open(path, "rb") as f:  # split on b"\n" only: a stray \r or bad byte spoils one line
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            lines.append(_read_line(number, raw))
    return lines


def _read_line(number: int, raw: bytes) -> Line:
    try:
        obj = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        return Line(number, None, _digest(raw), error=f"not valid UTF-8: byte {raw[e.start]:#04x} at offset {e.start}")
    except json.JSONDecodeError as e:
        return Line(number, None, _digest(raw), error=f"not valid JSON: {e.msg} at column {e.colno}")
    except RecursionError:
        return Line(number, None, _digest(raw), error="not valid JSON: nested too deeply")
    if not isinstance(obj, dict):
        return Line(number, None, _digest(raw), error=f"expected a JSON object, got {type(obj).__name__}")
    digest = _digest(raw, obj)
    line_id = obj.get("id")
    if line_id is not None and not (isinstance(line_id, str) or is_int(line_id)):
        return Line(number, None, digest, error=f"id must be a string or an integer, got {line_id!r}")
    if isinstance(line_id, str):
        try:
            check_text(line_id, "id")
        except FieldError as e:
            return Line(number, None, digest, error=str(e))
    return Line(number, line_id, digest, obj)


def record_key(rec: dict):
    """The key a record of the output marks done; None for a record that marks nothing done:
    a line cut short by an engine failure (older versions wrote those) or one without a hash."""
    if not isinstance(rec, dict) or "line" not in rec:
        raise KeyError("line")
    if rec.get("finish_reason", "error") == "error" and str(rec.get("error", "")).startswith(ENGINE_FAILED + ":"):
        return None
    digest, copy = rec.get("input_hash"), rec.get("copy", 1)
    if rec.get("duplicate_of") is not None:
        return None if digest is None else ("duplicate", json.dumps(rec.get("id")), digest, copy)
    if rec.get("id") is not None:
        return ("id", json.dumps(rec["id"]))
    return None if digest is None else ("hash", digest, copy)


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
            keys.add(record_key(json.loads(raw)))
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"{path} has a line that eprt run did not write: {raw[:80]!r}") from None
    keys.discard(None)
    return keys


def _with_reasoning(record: dict, output) -> dict:
    """A record with its thinking block's text as ``reasoning`` (its ``text`` is the rest)."""
    if isinstance(output, ChatOutput):
        record["reasoning"] = output.reasoning
    return record


class OutputLocked(OSError):
    """Another ``eprt run`` holds the output file."""


def lock_output(path: str) -> int:
    """An exclusive lock on the output file (created if absent), held until the descriptor is
    closed; OutputLocked at once if another process holds it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise OutputLocked(
            f"{path} is being written by another eprt run (it holds the file's lock): "
            f"wait for it to finish, or give another --output"
        ) from None
    return fd


def build_request(line: Line, engine, parser=None) -> tuple:
    """A line's GenerationRequest and its RequestOptions (stop strings); FieldError names what is
    wrong. ``parser``: the model's thinking block (--reasoning-parser), counted and split from the
    text, with the line's budget."""
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
    prompt_ids = truncate_prompt(prompt_ids, parse_truncation(obj, engine.max_model_len, "images" in obj))
    rows = None
    if "images" in obj:  # expanded to each image's placeholders (and encoded) before the context is sized
        req = GenerationRequest(prompt_ids, images=line_images(obj["images"]))
        engine.images.apply(req)
        prompt_ids, rows = req.prompt_ids, req.image_embeds
    room = context_room(prompt_ids, engine.max_model_len, "prompt_ids" if "prompt_ids" in obj else "prompt")
    opts = parse_options(
        obj, engine.vocab_size, default_max_tokens=SamplingParams().max_tokens, tokenizer=engine.tokenizer
    )
    request_id = f"line-{line.number}" if line.id is None else str(line.id)
    guide, guide_field = parse_guide(obj)
    compile_guide(engine, guide, guide_field)
    params = dataclasses.replace(fit_to_context(parse_choices(obj, opts.params), room), guide=guide)
    params.thinking = reasoning.request_thinking(obj, parser)
    model = obj.get("model")
    if model is not None and not isinstance(model, str):
        raise FieldError("model", f"model must be a string (the base model or a LoRA adapter name), got {model!r}")
    adapter = None if model in (None, engine.model_name) else model  # unknown names: refused at submit
    req = GenerationRequest(
        prompt_ids, params, request_id=request_id, timeout_s=opts.timeout_s, image_embeds=rows, adapter=adapter
    )
    return req, opts


def line_images(value) -> list:
    """A line's ``images``: a list of image file paths or data: URLs -> their encoded bytes."""
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise FieldError("images", "images must be a non-empty list of image file paths or data: URLs")
    policy = MediaPolicy(allowed_local_path="/")  # the operator's own input file may name any local image
    return [
        image_bytes(
            v if ":" in v.split("/", 1)[0] else "file://" + os.path.abspath(v), policy, "images", f"images[{i}]"
        )
        for i, v in enumerate(value)
    ]


class BatchWriter:
    """Submits lines (keeping ``in_flight`` requests queued) and writes results as they finish.

    Once the loop is asked to stop (SIGTERM/SIGINT) no line is submitted, queued requests that
    have no token yet are cancelled, and running ones finish. What is cut short (cancelled, or
    ended by an engine failure) is not written, so a rerun answers it."""

    def __init__(self, engine, lines: list, out, progress: Progress, in_flight: int, reasoning=None):
        self.engine, self.lines, self.out, self.progress = engine, lines, out, progress
        self.reasoning = reasoning  # the model's thinking block (--reasoning-parser), None: none
        self.in_flight = in_flight
        self.unfinished = len(lines)  # lines with nothing written yet
        self.engine_failures = 0  # lines cut short by an engine failure (not written)
        self.engine_failure: str | None = None
        self.error: BaseException | None = None

    def run(self, loop: EngineLoop) -> None:
        try:
            self._run(loop)
        except BaseException as e:  # reported by the main thread
            self.error = e
        finally:
            loop.stop.set()

    def _run(self, loop: EngineLoop) -> None:
        todo = iter(self.lines)
        live: dict = {}  # LiveRequest -> Line
        dropped: set = set()  # requests cancelled by a stop before their first token
        exhausted = False
        while True:
            engine_gone = loop.stopped.is_set()
            while not exhausted and len(live) < self.in_flight and not loop.stop.is_set():
                line = next(todo, None)
                if line is None:
                    exhausted = True
                else:
                    exhausted = not self._submit(line, live)
            if loop.stop.is_set():
                for req in live:
                    if req not in dropped and not req.token_ids:
                        req.pump()
                        if not req.token_ids and not req.finished():
                            dropped.add(req)
                            req.cancel()
            done = []
            for req in live:
                req.pump()
                if req.finished():
                    done.append(req)
            for req in done:
                self._finish(live.pop(req), req, req in dropped)
            if engine_gone or (not live and (exhausted or loop.stop.is_set())):
                return  # what is still live when the engine is gone never finishes
            self.progress.tick()
            if not done:
                time.sleep(_POLL_S)

    def _finish(self, line: Line, req: LiveRequest, dropped: bool) -> None:
        if dropped:
            return  # cancelled by the stop before its first token: runs again next time
        if isinstance(req, LiveChoices):
            self._finish_choices(line, req)
            return
        result, _ = req.result()
        if is_engine_failure(result):
            self.engine_failures += 1
            self.engine_failure = result.error
            return  # not the line's fault: runs again next time
        record = _with_reasoning(result.to_json(), req.text)
        self._write(line, record, failed=result.finish_reason == "error", tokens=len(result.token_ids))

    def _finish_choices(self, line: Line, req: LiveChoices) -> None:
        """A line of several choices: one record with the first one's fields and ``choices``."""
        pairs = req.ranked()  # (result, its LiveRequest)
        results = [result for result, _ in pairs]
        failure = next((r for r in results if is_engine_failure(r)), None)
        if failure is not None:
            self.engine_failures += 1
            self.engine_failure = failure.error
            return  # not the line's fault: runs again next time
        records = [_with_reasoning(r.to_json(), live.text) for r, live in pairs]
        record = {**records[0], "choices": [rec | {"index": r.index} for rec, r in zip(records, results)]}
        failed = any(r.finish_reason == "error" for r in results)
        self._write(line, record, failed=failed, tokens=sum(len(r.token_ids) for r in results))

    def _submit(self, line: Line, live: dict) -> bool:
        """Submit (or record as bad) one line; False when the engine takes no more requests. A
        line whose request cannot be built or submitted is recorded with its error, whatever the
        error (only a JobFailure, shared state, is not the line's)."""
        if line.error is None:
            try:
                request, opts = build_request(line, self.engine, self.reasoning)
                several = request.params.choices > 1
                thinking = request.params.thinking  # the text split into reasoning and text
                output = None if thinking is None else partial(ChatOutput, prompt=request.prompt_ids, spec=thinking)
                kind = LiveChoices if several else LiveRequest
                submitted = kind(self.engine, request, opts.stop_strings, include_stop=opts.include_stop, output=output)
                live[submitted] = line
                return True
            except EngineClosed:
                return False  # not the line's fault: it stays unfinished
            except RequestError as e:
                line.error = str(e)
            except JobFailure:
                raise
            except Exception as e:  # a bug one line's fields reach: that line's error, not the job's
                log.exception("line %d: its request could not be built", line.number)
                line.error = f"{type(e).__name__}: {e}"
        self._write(line, {"error": line.error}, failed=True)
        return True

    def _write(self, line: Line, record: dict, failed: bool, tokens: int = 0) -> None:
        record = {
            "id": line.id,
            "line": line.number,
            "input_hash": line.digest,
            **{k: v for k, v in record.items() if k != "id"},
        }
        if line.copy > 1:
            record["copy"] = line.copy
        if line.duplicate_of is not None:
            record["duplicate_of"] = line.duplicate_of
        self.out.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.out.flush()
        self.unfinished -= 1
        self.progress.add(failed, tokens)


def plan(lines: list, done: set) -> list:
    """The lines still to answer; marks repeated ids as errors and numbers identical copies."""
    todo, first_line, copies = [], {}, {}  # first_line: id -> number of the first line using it
    for line in lines:
        if line.id is not None:
            first = first_line.setdefault(json.dumps(line.id), line.number)
            if first != line.number:
                line.duplicate_of = first
                line.error = f"duplicate id {line.id!r} (first used on line {first})"
        if line.duplicate_of is not None or line.id is None:
            base = line.key[:-1]
            line.copy = copies[base] = copies.get(base, 0) + 1
        if line.key not in done:
            todo.append(line)
    return todo


def run_batch(
    engine, input_path: str, output_path: str, in_flight: int = 64, progress_stream=None, reasoning=None
) -> int:
    """Run every not-yet-finished line of ``input_path``; 0 unless the job itself failed or was cut short;
    ``reasoning``: the model's ReasoningParser (records then split reasoning from text)."""
    progress_stream = progress_stream or sys.stderr
    try:
        lock = lock_output(output_path)
    except OSError as e:
        print(f"eprt run: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        return _run_locked(engine, input_path, output_path, in_flight, progress_stream, reasoning)
    finally:
        os.close(lock)


def _run_locked(engine, input_path: str, output_path: str, in_flight: int, progress_stream, reasoning) -> int:
    try:
        lines = read_lines(input_path)
        todo = plan(lines, finished_keys(output_path))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        print(f"eprt run: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    start = time.monotonic()
    progress = Progress(len(todo), progress_stream, "eprt run", tokens=lambda: engine.generation_tokens)
    loop = EngineLoop(engine)
    engine_error: BaseException | None = None
    with open(output_path, "a", encoding="utf-8") as out:
        writer = BatchWriter(engine, todo, out, progress, in_flight, reasoning)
        thread = threading.Thread(target=writer.run, args=(loop,), name="eprt-run-writer", daemon=True)
        thread.start()
        try:
            loop.run()
        except BaseException as e:  # the engine failed: report what was done, then re-raise
            engine_error = e
        finally:
            loop.stop.set()
            thread.join()
            progress.close(final=True)
    if writer.error is not None:
        raise writer.error
    skipped = len(lines) - len(todo)
    print(
        f"eprt run: wrote {progress.done} results to {output_path} ({progress.failed} failed, "
        f"{skipped} skipped as already done) in {time.monotonic() - start:.1f}s",
        file=progress_stream,
    )
    if writer.engine_failures:
        print(
            f"eprt run: {writer.engine_failures} lines were cut short by an engine failure "
            f"({writer.engine_failure}); they are not recorded and run again on resume",
            file=progress_stream,
        )
    if writer.unfinished:
        print(
            f"eprt run: interrupted with {writer.unfinished} lines unfinished; run the same command again to resume",
            file=progress_stream,
        )
    if engine_error is not None:
        raise engine_error
    return 1 if writer.unfinished else 0
