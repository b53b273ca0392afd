"""Live progress (issue 36): the engine counts tokens as it generates them (its periodic log and
``eprt_generation_tokens`` too), ``eprt run`` and ``eprt generate`` show requests done / total,
tokens so far and their true rate on stderr (a line redrawn in place on a terminal, plain lines
otherwise), and never write to stdout or the output file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from fake_engine import FakeEngine

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.serve import progress as progress_module
from eprt.serve.batch import run_batch
from eprt.serve.progress import Progress, clock

ROOT = Path(__file__).resolve().parent.parent


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch):
    """The bar is cut to the terminal's width (COLUMNS; pytest-xdist's workers say 80, as a narrow
    terminal would): these checks read whole lines."""
    monkeypatch.setenv("COLUMNS", "200")


def test_the_mode_follows_the_terminal_and_eprt_progress(monkeypatch):
    monkeypatch.delenv("EPRT_PROGRESS", raising=False)
    assert Progress(1, Tty()).mode == "bar" and Progress(1, io.StringIO()).mode == "lines"
    monkeypatch.setenv("EPRT_PROGRESS", "bar")
    assert Progress(1, io.StringIO()).mode == "bar"
    monkeypatch.setenv("EPRT_PROGRESS", "off")
    stream = Tty()
    p = Progress(2, stream)
    p.add(False, 5)
    p.close(final=True)
    assert stream.getvalue() == ""


def test_the_bar_shows_live_tokens_and_their_rate_redrawn_in_place(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    generated = [0]
    stream = Tty()
    p = Progress(64, stream, "eprt run", tokens=lambda: generated[0], mode="bar")
    now[0], generated[0] = 102.0, 3800  # two seconds in, no request finished yet
    p.tick()
    first = stream.getvalue()
    assert first.startswith("\r\x1b[K") and "\n" not in first
    assert "eprt run 0/64 [....................]   0% | 3,800 tokens | 1,900 tokens/s | 0:02<?" in first
    p.tick()  # within the interval: nothing new
    assert stream.getvalue() == first
    now[0], generated[0] = 102.6, 5000
    p.add(False, 80)
    now[0] = 103.2
    p.add(True, 0)
    draws = stream.getvalue()[len(first) :].split("\r\x1b[K")
    assert draws[0] == "" and "1/64 [" in draws[1] and "5,000 tokens | 1,923 tokens/s" in draws[1]
    assert "2/64 [#" not in draws[2] and "2/64 [" in draws[2] and draws[2].endswith("| 1 failed")
    now[0] = 103.0
    p.close()
    assert stream.getvalue().endswith("\n")


def test_a_log_line_clears_the_bar_which_comes_back_below_it(monkeypatch):
    from eprt.comm.logging import setup_logging

    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = Tty()
    log = setup_logging(0, level="INFO", stream=stream)
    try:
        p = Progress(4, stream, "eprt run", tokens=lambda: 0, mode="bar")
        p.tick()
        log.info("running 4, waiting 0")
        now[0] = 0.1  # within the interval: redrawn anyway, below the record
        p.tick()
        p.close()
        log.info("after")
    finally:
        setup_logging(0)
    bar = "eprt run 0/4 [....................]   0% | 0 tokens | 0 tokens/s | 0:00<?"
    assert stream.getvalue() == (
        f"\r\x1b[K{bar}\r\x1b[K[rank 0] INFO eprt: running 4, waiting 0\n"
        f"\r\x1b[K{bar}\r\x1b[K{bar}\n[rank 0] INFO eprt: after\n"
    )


def test_plain_lines_every_interval_and_a_final_one(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = io.StringIO()
    generated = [0]
    p = Progress(3, stream, "eprt run", tokens=lambda: generated[0], mode="lines")
    now[0], generated[0] = 1.0, 50
    p.tick()
    assert stream.getvalue() == ""  # the first line after an interval
    now[0], generated[0] = 5.0, 250
    p.tick()
    assert stream.getvalue() == "eprt run: 0/3 requests done, 0 failed, 250 tokens generated, 50.0 tokens/s, 5s\n"
    now[0] = 6.0
    p.add(False, 300)
    p.close(final=True)
    assert stream.getvalue().splitlines()[-1].startswith("eprt run: 1/3 requests done, 0 failed, 300 tokens")


def test_a_short_job_with_a_delay_shows_nothing(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = Tty()
    p = Progress(1, stream, "eprt generate", tokens=lambda: 10, delay=1.0, mode="bar")
    now[0] = 0.9
    p.set_done(1)
    p.close()
    assert stream.getvalue() == ""
    assert clock(59) == "0:59" and clock(3725) == "1:02:05"


def test_one_long_prompt_moves_the_bar_by_its_token_budget(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])
    stream = Tty()
    generated = [0]
    p = Progress(1, stream, "eprt generate", tokens=lambda: generated[0], mode="bar", budget=1500)
    now[0], generated[0] = 10.0, 750
    p.tick()
    assert "0/1 [##########..........]  50% | 750 tokens | 75 tokens/s | 0:10<0:10" in stream.getvalue()


def test_the_engine_counts_tokens_as_it_generates_them():
    with launch_engine(EngineConfig(model=None, device="cpu")) as engine:
        params = SamplingParams(max_tokens=40, ignore_eos=True)
        handle = engine.submit(GenerationRequest([72, 105], params))
        while engine.generation_tokens < 10:
            engine.step()
        assert not handle.done() and engine.stats()["generation_tokens"] == engine.generation_tokens
        line = engine.stats_line()
        assert f"generated {engine.generation_tokens};" in line and engine.generation_tokens < 40
        while not handle.done():
            engine.step()
        assert engine.generation_tokens == 40 == len(handle.result().token_ids)


def test_eprt_run_counts_tokens_before_requests_finish(tmp_path, monkeypatch):
    monkeypatch.setattr(progress_module, "LINES_INTERVAL_S", 0.05)
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"prompt": "x" * 40, "max_tokens": 40}) + "\n" for _ in range(4)))
    log = io.StringIO()
    engine = FakeEngine(token_delay=0.01, max_batch=4)
    assert run_batch(engine, str(inp), str(tmp_path / "out.jsonl"), progress_stream=log) == 0
    lines = [line for line in log.getvalue().splitlines() if "requests done" in line]
    early = [line for line in lines if line.startswith("eprt run: 0/4 requests done")]
    assert early and any(" 0 tokens generated" not in line for line in early), lines  # tokens before any finished
    assert lines[-1].startswith("eprt run: 4/4 requests done, 0 failed, 160 tokens generated")  # 4 x 40
    assert all(json.loads(line)["finish_reason"] for line in (tmp_path / "out.jsonl").read_text().splitlines())


def test_eprt_generate_draws_the_bar_on_stderr_and_keeps_json_clean(monkeypatch, capsys):
    from eprt import cli
    from eprt.entry import generate

    monkeypatch.setenv("EPRT_PROGRESS", "bar")
    monkeypatch.setattr(generate, "PROGRESS_DELAY_S", 0.0)  # (1 s by default: a short job stays silent)
    args = ["generate", "--device", "cpu", "--prompt", "Hello", "--json", "--max-tokens", "600", "--ignore-eos"]
    assert cli.main(args) == 0
    out, err = capsys.readouterr()
    (record,) = [json.loads(line) for line in out.splitlines()]  # stdout: the JSON alone
    assert len(record["token_ids"]) == 600
    draws = err.split("\r\x1b[K")[1:]
    assert len(draws) >= 2 and draws[0].startswith("eprt generate 0/1 [")
    assert draws[-1].startswith("eprt generate 1/1 [####################] 100% | 600 tokens |")
    assert draws[-1].split("\n")[0].endswith("<0:00")  # the line ended before anything else is written
