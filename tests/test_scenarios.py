"""Golden scenario traces, the ``eprt scenario`` command, and the scheduler's client API
driven against the recording fake model."""

import logging
import pathlib
import threading

import pytest

from eprt import cli
from eprt.api import GenerationRequest, RequestError, SamplingParams
from eprt.scheduler.clock import VirtualClock, WallClock
from eprt.scheduler.config import SchedulerConfig
from eprt.scheduler.fake import RecordingModel
from eprt.scheduler.scenario import ScenarioError, load, parse, run
from eprt.scheduler.scheduler import Scheduler

SCENARIOS = pathlib.Path(__file__).parent / "scenarios"
TOMLS = sorted(SCENARIOS.glob("*.toml"))


def test_every_scenario_has_a_golden():
    assert len(TOMLS) >= 7
    assert sorted(p.stem for p in SCENARIOS.glob("*.trace")) == [p.stem for p in TOMLS]


@pytest.mark.parametrize("path", TOMLS, ids=[p.stem for p in TOMLS])
def test_scenario_reproduces_its_golden_byte_for_byte(path):
    assert run(load(str(path))).trace == path.with_suffix(".trace").read_text()


def test_cli_prints_the_conformance_trace(capsys):
    assert cli.main(["scenario", str(SCENARIOS / "request_timeout.toml")]) == 0
    assert capsys.readouterr().out == (SCENARIOS / "request_timeout.trace").read_text()


@pytest.mark.parametrize(
    "doc, message",
    [
        ({"request": [{"id": 1, "prompt_len": 2, "script": [1]}]}, "no name"),
        ({"name": "x"}, "no \\[\\[request\\]\\]"),
        (
            {"name": "x", "engine": {"max_bach": 2}, "request": [{"id": 1, "prompt_len": 2, "script": [1]}]},
            "unknown keys \\['max_bach'\\]",
        ),
        ({"name": "x", "request": [{"id": 1, "prompt_len": 2, "prompt": [1], "script": [1]}]}, "exactly one"),
        ({"name": "x", "request": [{"id": 1, "prompt_len": 2, "script": [64]}]}, "token ids < 64"),
        ({"name": "x", "request": [{"id": 1, "prompt_len": 2, "script": [1], "mode": "batch"}]}, "mode"),
        (
            {
                "name": "x",
                "request": [{"id": 1, "prompt_len": 2, "script": [1], "arrive_at_tick": 3, "cancel_at_tick": 2}],
            },
            "cancel_at_tick comes before",
        ),
        ({"name": "x", "request": [{"id": 1, "prompt_len": "5", "script": [1]}]}, "prompt_len must be int"),
        (
            {
                "name": "x",
                "request": [{"id": 1, "prompt_len": 2, "script": [1]}, {"id": 1, "prompt_len": 2, "script": [1]}],
            },
            "not unique",
        ),
        (
            {"name": "x", "engine": {"max_batch": 0}, "request": [{"id": 1, "prompt_len": 2, "script": [1]}]},
            "max_batch must be >= 1",
        ),
        (
            {"name": "x", "engine": {"eos": 64}, "request": [{"id": 1, "prompt_len": 2, "script": [1]}]},
            "eos 64 is outside",
        ),
        (
            {"name": "x", "engine": {"think": [4, 4]}, "request": [{"id": 1, "prompt_len": 2, "script": [1]}]},
            "think must be \\[start, end\\]",
        ),
        (
            {"name": "x", "request": [{"id": 1, "prompt_len": 2, "script": [1], "max_thinking_tokens": 3}]},
            "needs \\[engine\\] think",
        ),
    ],
)
def test_bad_scenarios_name_the_problem(doc, message):
    with pytest.raises(ScenarioError, match=message):
        parse(doc)


def test_cli_reports_a_bad_file_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\n[[request]]\nid = 1\nscript = [1]\n')
    assert cli.main(["scenario", str(bad)]) == 2
    assert "prompt and prompt_len" in capsys.readouterr().err


# -- edge guards, through scenario documents ---------------------------------------------------
def _doc(engine, *requests):
    return {"name": "t", "engine": engine, "request": list(requests)}


def test_a_sequence_that_outgrows_the_whole_pool_ends_with_the_kv_capacity_guard():
    res = run(
        parse(_doc({"num_blocks": 2, "block_size": 4}, {"id": 1, "prompt_len": 3, "script": [10], "max_tokens": 20}))
    )
    assert res.lines[-1] == (
        'out s1: T10 T10 T10 T10 T10 Done(length, n=5, think=0, cached=0, acc=0, guard=Some("kv_capacity"))'
    )
    assert res.model.blocks.num_free_blocks() == 2


def test_a_prompt_larger_than_the_pool_fails_alone():
    res = run(
        parse(
            _doc(
                {"num_blocks": 2, "block_size": 4},
                {"id": 1, "prompt_len": 9, "script": [10]},
                {"id": 2, "prompt_len": 2, "script": [20, 63]},
            )
        )
    )
    assert res.outcomes[0].results[0].finish_reason == "error"
    assert "more KV blocks than the whole pool" in res.outcomes[0].results[0].error
    assert res.outcomes[1].results[0].token_ids == [20, 63]


# -- the client API, as the engine uses it ----------------------------------------------------
def _scheduler(scripts, clock, **config):
    lines = []
    model = RecordingModel(
        lines.append, {k: (len(p), s) for k, (p, s) in scripts.items()}, num_slots=config.get("max_batch", 8)
    )
    return Scheduler(model, SchedulerConfig(vocab_size=64, eos_token_ids=(63,), **config), clock=clock), lines


def _req(prompt, max_tokens=8, **kw):
    return GenerationRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens), **kw)


def test_threaded_clients_stream_block_and_cancel():
    scripts = {1: ([1, 2, 3], [10, 11, 63]), 2: ([4, 5], [20, 21, 22, 63]), 3: ([6], [30])}
    sched, lines = _scheduler(scripts, WallClock())
    loop = threading.Thread(target=sched.run)
    loop.start()
    streamed, finished = [], []
    h1 = sched.submit(_req([1, 2, 3], stream=True, on_token=streamed.append), seq_id=1, on_finish=finished.append)
    h2 = sched.submit(_req([4, 5]), seq_id=2)  # blocking client
    h3 = sched.submit(_req([6], max_tokens=100_000), seq_id=3)  # runs until cancelled
    assert h1.result(timeout=10).token_ids == [10, 11, 63] and streamed == [10, 11]
    assert finished == [h1.result()] and h1.result().finish_reason == "stop"
    assert h2.result(timeout=10).token_ids == [20, 21, 22, 63]
    sched.cancel(h3)
    r3 = h3.result(timeout=10)
    assert r3.finish_reason == "stop" and 1 <= len(r3.token_ids) < 100_000
    assert sched.stats()["queued"] == 0 and sched.wait_for_work(timeout=0.01) is False
    sched.close()
    loop.join(timeout=10)
    assert not loop.is_alive() and sched.is_shut_down and lines[-1] == "teardown()"


def test_bad_requests_are_refused_without_disturbing_others():
    sched, _ = _scheduler({1: ([1, 2], [10, 63])}, VirtualClock(), max_model_len=6)
    h = sched.submit(_req([1, 2]), seq_id=1)
    for prompt, message in [
        ([], "empty"),
        ([1, 64], "outside the vocabulary"),
        ([1, 2, 3, 4, 5, 6], "max_model_len=6"),
        ([True], "outside"),
    ]:
        with pytest.raises(RequestError, match=message):
            sched.submit(_req(prompt))
    with pytest.raises(RequestError, match="max_tokens"):
        sched.submit(_req([1], max_tokens=0))
    with pytest.raises(RequestError, match="already in use"):
        sched.submit(_req([1, 2]), seq_id=1)
    sched.close()
    while sched.step():  # True until the shutdown tick
        pass
    assert sched.is_shut_down and h.result(timeout=0).token_ids == [10, 63]
    with pytest.raises(RequestError, match="shutting down"):
        sched.submit(_req([1]))


def test_close_with_cancel_ends_everything_in_flight():
    sched, lines = _scheduler({1: ([1], [10]), 2: ([2], [20])}, VirtualClock(), max_batch=1)
    h1 = sched.submit(_req([1], max_tokens=100), seq_id=1)
    h2 = sched.submit(_req([2], max_tokens=100), seq_id=2)  # still in the inbox
    sched.step()
    sched.close(cancel=True)
    while not sched.is_shut_down:
        sched.step()
    assert (h1.result(timeout=0).finish_reason, len(h1.result().token_ids)) == ("stop", 3)
    assert (h2.result(timeout=0).finish_reason, h2.result().token_ids) == ("stop", [])
    assert sched.is_shut_down  # no tracer: the effects run without fx lines
    assert lines[-4:] == [
        "ep_broadcast_cmd_for_seq(seq=0, cmd=0xffffffff)",
        "synchronize(stream=0)",
        "synchronize(stream=1)",
        "teardown()",
    ]


def test_a_raising_callback_cancels_only_its_request(caplog):
    def boom(token):
        raise RuntimeError("client bug")

    sched, _ = _scheduler({1: ([1], [10]), 2: ([2], [20, 21, 63])}, VirtualClock())
    h1 = sched.submit(_req([1], max_tokens=100, stream=True, on_token=boom), seq_id=1)
    h2 = sched.submit(_req([2]), seq_id=2)
    sched.close()
    eprt_logger = logging.getLogger("eprt")  # an engine run in this process may have stopped
    eprt_logger.addHandler(caplog.handler)  # "eprt" propagating to the root logger
    try:
        while not sched.is_shut_down:
            sched.step()
    finally:
        eprt_logger.removeHandler(caplog.handler)
    assert h1.result(timeout=0).finish_reason == "stop" and h1.result().token_ids == [10, 10]
    assert h2.result(timeout=0).token_ids == [20, 21, 63]
    assert "client callback of request s1 raised" in caplog.text
