"""``eprt scenario FILE``: run a scheduler scenario against the recording fake model and
print its trace (file format and trace: docs/scenarios.md)."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field

import tomllib

from eprt.api import GenerationRequest, RequestError, SamplingParams, Thinking, is_int
from eprt.scheduler.clock import VirtualClock
from eprt.scheduler.config import SchedulerConfig
from eprt.scheduler.fake import RecordingModel
from eprt.scheduler.fake_dp import DpRecordingModel
from eprt.scheduler.scheduler import Scheduler
from eprt.scheduler.sequence import RequestHandle

MAX_TICKS = 10_000


class ScenarioError(ValueError):
    """A scenario file that cannot be run as written."""


@dataclass
class EngineSpec:
    num_blocks: int = 1000
    block_size: int = 16
    vocab_size: int = 64
    eos: int = 63
    max_batch: int = 8
    max_prefill_tokens: int = 0
    prefix_cache: bool = True
    max_model_len: int | None = None
    snapshots: int = 0  # > 0: a hybrid model keeping this many recurrent-state snapshots
    speculative_tokens: int = 0  # > 0: the verify lane, up to this many drafts per step
    rank_blocks: list | None = None  # dp attention: the KV blocks of each rank's pool (num_blocks unused)
    think: list | None = None  # [start, end]: the thinking block's delimiters (docs/scenarios.md)


@dataclass
class RequestSpec:
    id: int
    script: list
    prompt: list
    max_tokens: int
    mode: str = "stream"
    arrive_at_tick: int = 1
    timeout_ticks: int | None = None
    cancel_at_tick: int | None = None
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    drafts: list | None = None  # the fake drafter's script (speculative_tokens > 0)
    choices: list = field(default_factory=list)  # scripts of further choices (n > 1), forked after the prompt
    adapter: int = -1  # LoRA adapter id (-1: the base model)
    fail_at: int | None = None  # the output index whose token the fake answers with a RowFailure
    max_thinking_tokens: int | None = None  # the thinking budget (needs [engine] think)


@dataclass
class Scenario:
    name: str
    engine: EngineSpec
    requests: list


@dataclass
class Outcome:
    """What one client saw."""

    spec: RequestSpec
    streamed: list = field(default_factory=list)
    results: list = field(default_factory=list)  # GenerationResult per on_finish call
    finished_at_line: int | None = None  # trace length when on_finish ran
    handle: RequestHandle | None = None
    rejected: str | None = None  # the RequestError of a refused submit
    forks: list = field(default_factory=list)  # Outcome of each further choice


@dataclass
class ScenarioRun:
    lines: list
    outcomes: list
    model: RecordingModel

    @property
    def trace(self) -> str:
        return "".join(line + "\n" for line in self.lines)


# -- reading ---------------------------------------------------------------------------------
def _take(table: dict, key: str, kind, default, where: str):
    if key not in table:
        return default
    value = table[key]
    ok = is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise ScenarioError(f"{where}: {key} must be {getattr(kind, '__name__', kind)}, got {value!r}")
    return value


def parse(doc: dict) -> Scenario:
    unknown = set(doc) - {"name", "engine", "request"}
    if unknown:
        raise ScenarioError(f"unknown top-level keys: {sorted(unknown)}")
    name = _take(doc, "name", str, None, "scenario")
    if name is None:
        raise ScenarioError("the scenario has no name")
    eng = doc.get("engine", {})
    fields = EngineSpec.__dataclass_fields__
    if set(eng) - set(fields):
        raise ScenarioError(f"[engine]: unknown keys {sorted(set(eng) - set(fields))}")
    kinds = {"prefix_cache": bool, "rank_blocks": list, "think": list}
    engine = EngineSpec(**{k: _take(eng, k, kinds.get(k, int), f.default, "[engine]") for k, f in fields.items()})
    if engine.rank_blocks is not None:
        if not engine.rank_blocks or not all(is_int(b) and b >= 1 for b in engine.rank_blocks):
            raise ScenarioError(
                f"[engine]: rank_blocks must be a non-empty list of ints >= 1, got {engine.rank_blocks}"
            )
        if engine.snapshots:
            raise ScenarioError(
                "[engine]: rank_blocks (dp attention) and snapshots (a hybrid model) do not go together"
            )
    if engine.think is not None and (
        len(engine.think) != 2
        or not all(is_int(t) and 0 <= t < engine.vocab_size for t in engine.think)
        or engine.think[0] == engine.think[1]
    ):
        raise ScenarioError(
            f"[engine]: think must be [start, end], two different token ids < {engine.vocab_size}, got {engine.think}"
        )
    for key in ("num_blocks", "block_size", "vocab_size", "max_batch"):
        if getattr(engine, key) < 1:
            raise ScenarioError(f"[engine]: {key} must be >= 1, got {getattr(engine, key)}")
    if not 0 <= engine.eos < engine.vocab_size:
        raise ScenarioError(f"[engine]: eos {engine.eos} is outside the vocabulary [0, {engine.vocab_size})")
    if engine.snapshots < 0:
        raise ScenarioError(f"[engine]: snapshots must be >= 0, got {engine.snapshots}")
    if engine.max_prefill_tokens < 0:
        raise ScenarioError(f"[engine]: max_prefill_tokens must be >= 0, got {engine.max_prefill_tokens}")
    if not 0 <= engine.speculative_tokens <= 4:
        raise ScenarioError(f"[engine]: speculative_tokens must be in [0, 4], got {engine.speculative_tokens}")
    if engine.max_model_len is not None and engine.max_model_len < 2:
        raise ScenarioError(f"[engine]: max_model_len must be >= 2, got {engine.max_model_len}")
    requests = [_parse_request(r, engine) for r in doc.get("request", [])]
    if not requests:
        raise ScenarioError("the scenario has no [[request]]")
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        raise ScenarioError(f"request ids are not unique: {ids}")
    return Scenario(name, engine, requests)


def _parse_request(r: dict, engine: EngineSpec) -> RequestSpec:
    known = {
        "id",
        "prompt_len",
        "prompt",
        "script",
        "max_tokens",
        "mode",
        "arrive_at_tick",
        "timeout_ticks",
        "cancel_at_tick",
        "stop_token_ids",
        "ignore_eos",
        "drafts",
        "choices",
        "adapter",
        "fail_at",
        "max_thinking_tokens",
    }
    where = f"request {r.get('id', '?')}"
    if set(r) - known:
        raise ScenarioError(f"{where}: unknown keys {sorted(set(r) - known)}")
    rid = _take(r, "id", int, None, where)
    if rid is None or rid < 0:
        raise ScenarioError(f"{where}: needs a non-negative integer id")
    script = _take(r, "script", list, [], where)
    if not script or not all(type(t) is int and 0 <= t < engine.vocab_size for t in script):
        raise ScenarioError(f"{where}: script must be a non-empty list of token ids < {engine.vocab_size}")
    if ("prompt" in r) == ("prompt_len" in r):
        raise ScenarioError(f"{where}: give exactly one of prompt and prompt_len")
    prompt = _take(r, "prompt", list, None, where)
    if prompt is None:
        n = _take(r, "prompt_len", int, 0, where)
        if n < 1:
            raise ScenarioError(f"{where}: prompt_len must be >= 1")
        prompt = [rid] + list(range(2, n + 1))  # [i, 2, 3, ...]
    mode = _take(r, "mode", str, "stream", where)
    if mode not in ("stream", "blocking"):
        raise ScenarioError(f'{where}: mode must be "stream" or "blocking", got {mode!r}')
    spec = RequestSpec(
        id=rid,
        script=script,
        prompt=prompt,
        max_tokens=_take(r, "max_tokens", int, len(script), where),
        mode=mode,
        arrive_at_tick=_take(r, "arrive_at_tick", int, 1, where),
        timeout_ticks=_take(r, "timeout_ticks", int, None, where),
        cancel_at_tick=_take(r, "cancel_at_tick", int, None, where),
        stop_token_ids=_take(r, "stop_token_ids", list, [], where),
        ignore_eos=_take(r, "ignore_eos", bool, False, where),
        drafts=_take(r, "drafts", list, None, where),
        choices=_take(r, "choices", list, [], where),
        adapter=_take(r, "adapter", int, -1, where),
        fail_at=_take(r, "fail_at", int, None, where),
        max_thinking_tokens=_take(r, "max_thinking_tokens", int, None, where),
    )
    if spec.drafts is not None and not all(type(t) is int and 0 <= t < engine.vocab_size for t in spec.drafts):
        raise ScenarioError(f"{where}: drafts must be a list of token ids < {engine.vocab_size}")
    for c in spec.choices:
        if not isinstance(c, list) or not c or not all(type(t) is int and 0 <= t < engine.vocab_size for t in c):
            raise ScenarioError(f"{where}: choices must be non-empty scripts of token ids < {engine.vocab_size}")
    if spec.choices and mode != "blocking":
        raise ScenarioError(f'{where}: a request with choices must be mode = "blocking" (one stream per request)')
    if spec.fail_at is not None and spec.fail_at < 0:
        raise ScenarioError(f"{where}: fail_at must be an output index >= 0, got {spec.fail_at}")
    if spec.max_thinking_tokens is not None and (engine.think is None or spec.max_thinking_tokens < 0):
        raise ScenarioError(f"{where}: max_thinking_tokens must be >= 0 and needs [engine] think = [start, end]")
    if spec.arrive_at_tick < 1:
        raise ScenarioError(f"{where}: arrive_at_tick must be >= 1")
    if spec.cancel_at_tick is not None and spec.cancel_at_tick < spec.arrive_at_tick:
        raise ScenarioError(f"{where}: cancel_at_tick comes before arrive_at_tick")
    return spec


def load(path: str) -> Scenario:
    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ScenarioError(f"{path}: {e}") from None
    return parse(doc)


# -- running ---------------------------------------------------------------------------------
class _Tracer:
    def __init__(self, emit):
        self.emit = emit

    def tick(self, k: int) -> None:
        self.emit(f"-- tick {k}")

    def effect(self, line: str) -> None:
        self.emit(line)


def run(sc: Scenario) -> ScenarioRun:
    lines: list = [f"# scenario {sc.name}"]
    e = sc.engine
    scripts = {r.id: (len(r.prompt), r.script) for r in sc.requests}
    failures = {r.id: r.fail_at for r in sc.requests if r.fail_at is not None}
    if e.rank_blocks is not None:
        model = DpRecordingModel(
            lines.append,
            scripts,
            rank_blocks=e.rank_blocks,
            num_slots=e.max_batch,
            block_size=e.block_size,
            prefix_cache=e.prefix_cache,
            drafts={r.id: r.drafts for r in sc.requests if r.drafts is not None},
            failures=failures,
        )
    else:
        model = RecordingModel(
            lines.append,
            scripts,
            num_slots=e.max_batch,
            num_blocks=e.num_blocks,
            block_size=e.block_size,
            prefix_cache=e.prefix_cache,
            snapshots=e.snapshots,
            drafts={r.id: r.drafts for r in sc.requests if r.drafts is not None},
            failures=failures,
        )
    config = SchedulerConfig(
        vocab_size=e.vocab_size,
        eos_token_ids=(e.eos,),
        max_batch=e.max_batch,
        max_prefill_tokens=e.max_prefill_tokens,
        block_size=e.block_size,
        max_model_len=e.max_model_len,
        num_speculative_tokens=e.speculative_tokens,
    )
    sched = Scheduler(model, config, clock=VirtualClock(), tracer=_Tracer(lines.append))
    outcomes = {r.id: Outcome(r) for r in sc.requests}
    last_arrival = max(r.arrive_at_tick for r in sc.requests)
    while not sched.is_shut_down:
        tick = sched.tick + 1
        if tick > MAX_TICKS:
            raise ScenarioError(f"scenario {sc.name} still running after {MAX_TICKS} ticks")
        for r in sc.requests:
            out = outcomes[r.id]
            if r.arrive_at_tick == tick:
                _submit(sched, r, out, lines, e.think)
            if r.cancel_at_tick == tick and out.handle is not None:
                for choice in [out] + out.forks:  # every choice
                    choice.handle.cancel()
        if tick >= last_arrival:
            sched.close()
        sched.step()
    for r in sc.requests:
        lines.append(f"out s{r.id}: {_client_line(outcomes[r.id])}")
        for fork in outcomes[r.id].forks:
            lines.append(f"out s{fork.handle.seq_id}: {_client_line(fork)}")
    return ScenarioRun(lines, [outcomes[r.id] for r in sc.requests], model)


def _submit(sched: Scheduler, r: RequestSpec, out: Outcome, lines: list, think: list | None) -> None:
    out.forks = [Outcome(dataclasses.replace(r, script=script, choices=[])) for script in r.choices]

    def finished(result):
        choice = out if result.index == 0 else out.forks[result.index - 1]
        choice.results.append(result)
        choice.finished_at_line = len(lines)

    params = SamplingParams(
        max_tokens=r.max_tokens,
        stop_token_ids=tuple(r.stop_token_ids),
        ignore_eos=r.ignore_eos,
        n=1 + len(r.choices),
        thinking=None if think is None else Thinking(think[0], think[1], r.max_thinking_tokens),
    )
    request = GenerationRequest(
        prompt_ids=list(r.prompt),
        params=params,
        timeout_s=r.timeout_ticks,
        stream=r.mode == "stream",
        on_token=out.streamed.append,
    )
    try:
        handles = sched.submit_choices(request, on_finish=finished, seq_id=r.id, adapter=r.adapter)
    except RequestError as e:
        out.rejected, out.forks = str(e), []  # (its further choices were never submitted)
        return
    out.handle = handles[0]
    for fork, handle in zip(out.forks, handles[1:]):
        fork.handle = handle
        sched.model.scripts[handle.seq_id] = (len(r.prompt), list(fork.spec.script))


def _client_line(out: Outcome) -> str:
    if out.rejected is not None:
        return f'Rejected("{out.rejected}")'
    res = out.results[-1]
    guard = out.handle.guard
    if out.spec.mode == "blocking":
        return (
            f"Response(tokens=[{', '.join(map(str, res.token_ids))}], {res.finish_reason}, "
            f"think={res.reasoning_tokens or 0}, "
            f"cached={res.cached_tokens}, acc={res.accepted_tokens or 0}, logprobs=0)"
        )
    shown = "".join(f"T{t} " for t in out.streamed)
    g = "None" if guard is None else f'Some("{guard}")'
    return (
        f"{shown}Done({res.finish_reason}, n={len(res.token_ids)}, think={res.reasoning_tokens or 0}, "
        f"cached={res.cached_tokens}, acc={res.accepted_tokens or 0}, guard={g})"
    )


# -- command line ----------------------------------------------------------------------------
def add_arguments(parser) -> None:
    parser.add_argument("file", help="scenario TOML file (format: docs/scenarios.md)")


def main(args) -> int:
    try:
        result = run(load(args.file))
    except (OSError, ScenarioError) as e:
        print(f"eprt scenario: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(result.trace)
    return 0
