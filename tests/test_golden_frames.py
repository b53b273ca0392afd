"""Every golden scenario through the real runner and executor (the scripted token source in place of
the arithmetic and the draws: eprt/engine/scripted.py), its frames checked against docs/protocol.md:
- the words the runner sent decode, command by command, by the declarations docs/protocol.md's
  command table is checked against (tests/test_protocol.py), the stream ends with SHUTDOWN, and
  every frame is the "Framing" section's (a count, then at most 511 words, or one overflow);
- a worker replays the stream through the real worker loop (eprt/comm/worker.py) onto a real
  executor of its own, without an error: every command fits its slot table and KV accounting
  ("Slots": the worker checks every command before it changes anything, refuses anything but an
  ACCEPT after a VERIFY, a FORK of an unprefilled slot, a PREFILL without its OWNER under dp...),
  and after every step its mirrored state (the digests of --check-state: slots, blocks, prefix
  cache, owners, snapshot rows) is rank 0's;
- the frames the trace prints are exactly the stream's commands of the kinds the trace shows, each
  slot's in stream order (the trace prints a batched prefill's OWNER frames with their chunks,
  the stream sends them ahead of the run): the goldens' frame lines are the real frame writer's.
"""

import copy
import dataclasses
import pathlib

import numpy as np
import pytest

from eprt.comm import protocol as P
from eprt.comm.transport import LocalLink, Transport
from eprt.comm.worker import run_worker
from eprt.engine.accounting import Accounts
from eprt.engine.runner import ModelRunner
from eprt.engine.scripted import ScriptedTokens
from eprt.engine.sequences import ExecutorError
from eprt.engine.state_check import state_digests
from eprt.entry.scenario import load, run, scenario_runner
from eprt.scheduler.scheduler import Scheduler
from eprt.scheduler.step import StepPlan, StepResult
from eprt.scheduler.trace import SHOWN, frame_lines

SCENARIOS = pathlib.Path(__file__).parent / "scenarios"
TOMLS = sorted(SCENARIOS.glob("*.toml"))


class Sent(LocalLink):
    """Rank 0's link in a world of two whose worker is replayed here: it keeps every frame sent."""

    size = 2  # frames are sent (a world of one only counts them)

    def __init__(self):
        self.frames: list[np.ndarray] = []

    def send_frame(self, out, n):
        assert n == out[0]
        self.frames.append(out[1 : n + 1].copy())


class Root(Transport):
    def __init__(self):
        super().__init__(Sent())
        self.frames = self.link.frames


class Replay:
    """The worker's side: hands back rank 0's frames; before frame i it records the worker
    executor's digests (every command of the frames before i has run by then)."""

    rank = 1

    def __init__(self, frames, executor):
        self.frames, self.executor = frames, executor
        self.at = 0
        self.digests: dict[int, dict] = {}  # frames consumed -> the worker's digests then
        self.errors: list[str] = []

    def recv_frame(self):
        self.digests[self.at] = state_digests(self.executor)
        frame = self.frames[self.at]
        self.at += 1
        return frame

    def recv_rows(self, n, width):
        raise AssertionError("no scenario sends vision rows")

    def report_error(self, text):
        self.errors.append(text)


def blocks(lines: list) -> list[tuple]:
    """Frame lines split into commands (each starts with its preamble's line)."""
    out: list = []
    for line in lines:
        if line.startswith("ep_broadcast_cmd_for_seq"):
            out.append([])
        out[-1].append(line)
    return [tuple(b) for b in out]


def by_slot(commands: list[tuple]) -> dict:
    """Each preamble slot word's commands, in order."""
    out: dict = {}
    for c in commands:
        out.setdefault(c[0].split(",")[0], []).append(c)
    return out


def worker_executor(sc):
    """The worker rank's executor: the scenario's, built alone (rank 1 under dp attention)."""
    e = sc.engine
    tokens = ScriptedTokens({r.id: (len(r.prompt), r.script) for r in sc.requests})
    runner = scenario_runner(sc, tokens, rank=0 if e.rank_blocks is None else 1)
    runner.executor.compute_logits = False  # a worker never samples
    return runner.executor


@pytest.mark.parametrize("path", TOMLS, ids=[p.stem for p in TOMLS])
def test_golden_scenario_frames_follow_the_protocol_and_a_worker_mirrors_rank0(path):
    sc = load(str(path))
    root, steps = Root(), []

    def after_step(sched):  # as --check-state does: the step's queued commands go out now
        root.flush()
        steps.append((len(root.frames), state_digests(sched.model.executor)))

    result = run(sc, transport=root, after_step=after_step)
    assert result.trace == path.with_suffix(".trace").read_text()  # the golden, through the real runner

    # every frame: a count, then its words; the stream decodes by the declarations, SHUTDOWN last
    assert all(0 < len(f) for f in root.frames)
    commands = P.decode_all(np.concatenate(root.frames), max_slots=sc.engine.max_batch, vocab_size=sc.engine.vocab_size)
    assert isinstance(commands[-1], P.Shutdown) and not any(isinstance(c, P.Shutdown) for c in commands[:-1])

    # a worker replays it without an error and mirrors rank 0 after every step
    replay = Replay(root.frames, worker_executor(sc))
    assert run_worker(replay, replay.executor, sc.engine.max_batch, sc.engine.vocab_size) == 0, replay.errors
    assert replay.at == len(root.frames)
    for sent, digests in steps[:-1]:  # (the last step is the shutdown: every slot freed on both)
        assert replay.digests[sent] == digests, f"the worker's state differs after {sent} frames"

    # the trace's frame lines are the stream's commands of the kinds it shows, each slot's in stream order
    traced = blocks([line for line in result.lines if line.startswith("ep_")])
    sent = [tuple(frame_lines(c)) for c in commands if isinstance(c, SHOWN)]
    assert sorted(traced) == sorted(sent)
    assert by_slot(traced) == by_slot(sent)
    dp_rows = [f"rows_per_rank({list(c.counts)})" for c in commands if isinstance(c, P.DecodeDp)]
    assert [line for line in result.lines if line.startswith("rows_per_rank")] == dp_rows


def test_a_plan_whose_row_length_drifts_from_the_slot_fails_the_step(monkeypatch):
    """The slot table is the one record of a sequence's length: the scheduler's ``len`` is its
    planning view, carried in the plan's rows and checked against the slot when a decode step
    executes. thinking.toml's discarded EOS with its rollback left out of rank 0's accounting (the
    scheduler's len went back, the slot's not) fails the next decode step, naming the row."""
    monkeypatch.setattr(Accounts, "rollback", lambda self, seq, n: None)
    with pytest.raises(ExecutorError, match=r"slot 0: the plan's row has length 5 but the slot holds 6 tokens"):
        run(load(str(SCENARIOS / "thinking.toml")))


def test_the_seed_scenario_driven_by_schedule_execute_update(monkeypatch):
    """A tick driven from outside as vLLM v1's loop: ``plan = schedule()`` (frozen data),
    ``result = model.execute(plan)``, ``update(plan, result)``; the seed trace comes out unchanged,
    and ``update`` refuses a plan ``schedule`` did not return."""
    plans = []

    def step(sched):
        if sched.is_shut_down:
            return False
        while (plan := sched.schedule()) is not None:
            with pytest.raises(dataclasses.FrozenInstanceError):
                plan.decode = None
            with pytest.raises(RuntimeError, match="the plan schedule"):
                sched.update(StepPlan(), StepResult())
            plans.append(plan)
            sched.update(plan, sched.model.execute(plan))
        return not sched.is_shut_down and (sched.in_flight() or sched._inbox.closed)

    monkeypatch.setattr(Scheduler, "step", step)
    path = SCENARIOS / "request_timeout.toml"
    assert run(load(str(path))).trace == path.with_suffix(".trace").read_text()
    assert plans[-1].shutdown and any(p.decode is not None for p in plans)


COUNTERS = {  # statistics read by the engine's stats, never by the scheduler's plans
    "prompt_tokens_computed", "prefill_passes", "decode_steps", "decode_rows", "accepted_tokens",
    "proposed_tokens", "verify_steps", "verify_rows",
}  # fmt: skip


def _kept(obj) -> dict:
    """What ``obj`` holds: plain values and containers by value, other objects by identity."""
    out = {}
    for k, v in vars(obj).items():
        if k in COUNTERS:
            continue
        plain = v is None or isinstance(v, (bool, int, float, str, bytes, tuple))
        out[k] = v if plain else copy.copy(v) if isinstance(v, (list, dict, set)) else id(v)
    return out


@pytest.mark.parametrize("name", ["speculative", "thinking", "lora_adapters", "dp_preemption", "fork_choices"])
def test_no_runner_method_keeps_state_for_a_later_scheduler_call(monkeypatch, name):
    """A step's tokens, logprobs, frames and failures are in its StepResult: executing a plan leaves
    the runner and its parts (the token source, speculation, the accounting, the pools) holding what
    they held, but for their statistics counters."""
    inner, checked = ModelRunner.execute, []

    def execute(runner, plan):
        parts = [runner, runner.sampler, runner.drafts, runner.kv, runner.pools]
        before = [_kept(p) for p in parts]
        result = inner(runner, plan)
        assert [_kept(p) for p in parts] == before
        checked.append(plan)
        return result

    monkeypatch.setattr(ModelRunner, "execute", execute)
    path = SCENARIOS / f"{name}.toml"
    assert run(load(str(path))).trace == path.with_suffix(".trace").read_text()
    assert any(p.decode is not None or p.verify is not None for p in checked)
