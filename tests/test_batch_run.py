"""``eprt run``: offline batch generation from JSONL, per-line errors, resume.

Most tests drive ``run_batch`` with tests/fake_engine.py (it echoes the prompt back,
one byte-token per step, so every expected text is exact); the last one runs the real
engine under mpiexec.
"""
from __future__ import annotations

import io
import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from eprt.serve.batch import run_batch
from fake_engine import FakeEngine

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def read_records(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(engine, inp: Path, out: Path, **kw) -> tuple:
    log = io.StringIO()
    return run_batch(engine, str(inp), str(out), progress_stream=log, **kw), log.getvalue()


def test_mixed_good_and_bad_lines(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [
        {"id": "a", "prompt": "hello"},                           # 1
        {"id": "b", "prompt_ids": [104, 105, 106], "max_tokens": 2},
        '{"id": "c", "prompt": ',                                 # 3: not JSON
        {"id": "d"},                                              # 4: no prompt
        {"id": "e", "prompt": "x", "temperature": -1},            # 5: bad parameter
        {"id": "f", "prompt": "x", "max_tokn": 3},                # 6: misspelt field
        {"id": "g", "prompt": "x" * 600},                         # 7: longer than the context
        {"id": "a", "prompt": "again"},                           # 8: duplicate id
        {"id": "h", "prompt": "FAIL here"},                       # 9: the engine fails it
        "",                                                       # 10: blank, ignored
        {"prompt": "no id here", "stop": [" id"]},                # 11
        "[1, 2]",                                                 # 12: not an object
        {"id": 7, "prompt_ids": [1, 2], "seed": "x"},             # 13: bad parameter type
    ])
    out = tmp_path / "out.jsonl"
    rc, log = run(FakeEngine(), inp, out)
    assert rc == 0
    records = {r["line"]: r for r in read_records(out)}
    assert sorted(records) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13]
    assert (records[1]["id"], records[1]["text"], records[1]["finish_reason"]) == ("a", "hello", "stop")
    assert records[1]["token_ids"] == list(b"hello") + [256]
    assert (records[2]["text"], records[2]["finish_reason"]) == ("hi", "length")
    assert (records[11]["id"], records[11]["text"], records[11]["finish_reason"]) == (None, "no", "stop")
    expected_errors = {3: "not valid JSON", 4: "exactly one of prompt", 5: "temperature", 6: "'max_tokn'",
                       7: "context", 8: "duplicate id 'a' (first used on line 1)", 9: "fake engine failure",
                       12: "expected a JSON object", 13: "seed"}
    for line, words in expected_errors.items():
        assert words in records[line]["error"], records[line]
    assert records[4]["id"] == "d" and records[13]["id"] == 7
    assert records[8]["duplicate_of"] == 1 and "duplicate_of" not in records[1]
    assert "9 failed" in log and "wrote 12 results" in log


def test_results_are_written_and_flushed_as_they_finish(tmp_path):
    engine = FakeEngine(token_delay=0.005)
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "long", "prompt": "L" * 200, "max_tokens": 200},
                                              {"id": "short", "prompt": "s"}])
    out = tmp_path / "out.jsonl"
    seen = {}

    def watch():                  # what the file holds while the long request still runs
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and "short" not in seen:
            if out.exists() and out.read_text():
                seen["short"] = (read_records(out), engine.stats()["running"])
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    rc, _ = run(engine, inp, out)
    watcher.join()
    assert rc == 0
    records_then, running_then = seen["short"]
    assert [r["id"] for r in records_then] == ["short"] and running_then == 1
    assert [r["id"] for r in read_records(out)] == ["short", "long"]


def test_rerun_skips_finished_ids_and_repairs_a_torn_line(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "aa"}, {"id": "b", "prompt": "bb"},
                                              {"prompt": "no id"}, {"id": "c", "prompt": "cc"}])
    out = tmp_path / "out.jsonl"
    out.write_text(json.dumps({"id": "a", "line": 1, "text": "aa", "finish_reason": "stop"}) + "\n"
                   + json.dumps({"id": None, "line": 3, "text": "no id", "finish_reason": "stop"}) + "\n"
                   + '{"id": "c", "line": 4, "te')            # a crash in the middle of a write
    engine = FakeEngine()
    rc, log = run(engine, inp, out)
    assert rc == 0
    assert [r.request_id for r in engine.submitted] == ["b", "c"]
    records = read_records(out)                               # every line is whole JSON again
    assert sorted(r["line"] for r in records) == [1, 2, 3, 4]
    assert "2 skipped as already done" in log
    rc, log = run(FakeEngine(), inp, out)                     # nothing left to do
    assert rc == 0 and "wrote 0 results" in log and len(read_records(out)) == 4


def test_rerun_after_a_duplicate_error_still_runs_the_first_line(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "aa"}, {"id": "a", "prompt": "again"},
                                              {"id": "b", "prompt": "bb"}])
    out = tmp_path / "out.jsonl"
    rc, _ = run(FakeEngine(), inp, out)
    assert rc == 0
    duplicate = next(r for r in read_records(out) if r["line"] == 2)
    assert duplicate["duplicate_of"] == 1 and "duplicate id 'a'" in duplicate["error"]
    out.write_text(json.dumps(duplicate) + "\n")       # stopped before line 1 finished
    engine = FakeEngine()
    rc, log = run(engine, inp, out)
    assert rc == 0 and "1 skipped as already done" in log
    assert sorted(r.request_id for r in engine.submitted) == ["a", "b"]
    records = {r["line"]: r for r in read_records(out)}
    assert sorted(records) == [1, 2, 3] and records[1]["text"] == "aa"
    rc, log = run(FakeEngine(), inp, out)                     # nothing left, duplicate not rewritten
    assert rc == 0 and "wrote 0 results" in log and len(read_records(out)) == 3


INTERRUPTIBLE = """
import sys
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from eprt.serve.batch import run_batch
sys.exit(run_batch(FakeEngine(token_delay=0.01, max_batch=2), {inp!r}, {out!r}, in_flight=2))
"""


def test_interrupted_run_resumes_where_it_stopped(tmp_path):
    ids = [f"r{i}" for i in range(12)]
    inp = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": f"{i}: " + "z" * 30, "max_tokens": 40}
                                              for i in ids])
    out = tmp_path / "out.jsonl"
    proc = subprocess.Popen([sys.executable, "-c", INTERRUPTIBLE.format(tests=str(TESTS), inp=str(inp), out=str(out))],
                            cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (out.exists() and len(out.read_text().splitlines()) >= 2):
            assert time.monotonic() < deadline and proc.poll() is None, "no results from the batch job"
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 1
        assert "run the same command again to resume" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first = [r["id"] for r in read_records(out)]
    assert 2 <= len(first) < len(ids)                           # stopped early, in-flight ones finished
    engine = FakeEngine()
    rc, _ = run(engine, inp, out)
    assert rc == 0
    assert sorted(r.request_id for r in engine.submitted) == sorted(set(ids) - set(first))
    records = read_records(out)
    assert sorted(r["id"] for r in records) == sorted(ids)       # each id exactly once
    assert all(r["text"] == r["id"] + ": " + "z" * 30 for r in records)


def test_progress_line_and_fatal_errors(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [{"prompt": "abc"}, {"prompt": "de"}, {"prompt": [1]}])
    rc, log = run(FakeEngine(), inp, tmp_path / "out.jsonl")
    assert rc == 0
    assert "eprt run: 3/3 requests done, 1 failed" in log and "tokens/s" in log
    rc, _ = run(FakeEngine(), tmp_path / "missing.jsonl", tmp_path / "out2.jsonl")
    assert rc == 2
    foreign = write_lines(tmp_path / "foreign.jsonl", ["not written by eprt run"])
    rc, _ = run(FakeEngine(), inp, foreign)
    assert rc == 2 and foreign.read_text() == "not written by eprt run\n"


@pytest.mark.slow
def test_real_engine_batch_under_mpiexec(checkpoint, tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt_ids": [1, 5, 9, 12], "max_tokens": 6},
                                              {"id": "b", "prompt_ids": [3, 4], "max_tokens": 4},
                                              {"id": "c", "prompt_ids": [1] * 5000}])
    out = tmp_path / "out.jsonl"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "eprt.cli", "run", "--model", checkpoint("mixtral"),
           "--device", "cpu", "--input", str(inp), "--output", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = {r["id"]: r for r in read_records(out)}
    assert 1 <= len(records["a"]["token_ids"]) <= 6 and records["a"]["finish_reason"] in ("stop", "length")
    assert 1 <= len(records["b"]["token_ids"]) <= 4
    assert "error" in records["c"]
    assert "1 failed" in proc.stderr
