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
from fake_engine import FakeEngine

from eprt.api import ENGINE_FAILED, EngineClosed
from eprt.serve.batch import run_batch

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


def test_vllms_stop_string_and_truncation_fields_on_lines(tmp_path):
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "cut", "prompt": "hello world", "stop": ["wor"], "max_tokens": 20},
            {"id": "kept", "prompt": "hello world", "stop": ["wor"], "include_stop_str_in_output": True},
            {"id": "last2", "prompt_ids": [97, 98, 99, 100], "truncate_prompt_tokens": 2, "max_tokens": 2},
            {"id": "bad", "prompt": "abc", "truncate_prompt_tokens": 0},
            {"id": "any_k", "prompt": "abc", "top_k": -1, "max_tokens": 1},
        ],
    )
    out = tmp_path / "out.jsonl"
    assert run(FakeEngine(), inp, out)[0] == 0
    records = {r["id"]: r for r in read_records(out)}
    assert records["cut"]["text"] == "hello " and records["kept"]["text"] == "hello wor"
    assert records["last2"]["prompt_ids"] == [99, 100] and records["last2"]["text"] == "cd"
    assert "truncate_prompt_tokens must be -1 (max_model_len) or an integer in [1" in records["bad"]["error"]
    assert records["any_k"]["text"] == "a"


def test_mixed_good_and_bad_lines(tmp_path):
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "a", "prompt": "hello"},  # 1
            {"id": "b", "prompt_ids": [104, 105, 106], "max_tokens": 2},
            '{"id": "c", "prompt": ',  # 3: not JSON
            {"id": "d"},  # 4: no prompt
            {"id": "e", "prompt": "x", "temperature": -1},  # 5: bad parameter
            {"id": "f", "prompt": "x", "max_tokn": 3},  # 6: misspelt field
            {"id": "g", "prompt": "x" * 600},  # 7: longer than the context
            {"id": "a", "prompt": "again"},  # 8: duplicate id
            {"id": "h", "prompt": "FAIL here"},  # 9: the engine fails it
            "",  # 10: blank, ignored
            {"prompt": "no id here", "stop": [" id"]},  # 11
            "[1, 2]",  # 12: not an object
            {"id": 7, "prompt_ids": [1, 2], "seed": "x"},  # 13: bad parameter type
        ],
    )
    out = tmp_path / "out.jsonl"
    rc, log = run(FakeEngine(), inp, out)
    assert rc == 0
    records = {r["line"]: r for r in read_records(out)}
    assert sorted(records) == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13]
    assert (records[1]["id"], records[1]["text"], records[1]["finish_reason"]) == ("a", "hello", "stop")
    assert records[1]["token_ids"] == list(b"hello") + [256]
    assert (records[2]["text"], records[2]["finish_reason"]) == ("hi", "length")
    assert (records[11]["id"], records[11]["text"], records[11]["finish_reason"]) == (None, "no", "stop")
    expected_errors = {
        3: "not valid JSON",
        4: "exactly one of prompt",
        5: "temperature",
        6: "'max_tokn'",
        7: "context",
        8: "duplicate id 'a' (first used on line 1)",
        9: "fake engine failure",
        12: "expected a JSON object",
        13: "seed",
    }
    for line, words in expected_errors.items():
        assert words in records[line]["error"], records[line]
    assert records[4]["id"] == "d" and records[13]["id"] == 7
    assert records[8]["duplicate_of"] == 1 and "duplicate_of" not in records[1]
    assert "9 failed" in log and "wrote 12 results" in log


def test_results_are_written_and_flushed_as_they_finish(tmp_path):
    engine = FakeEngine(token_delay=0.005)
    inp = write_lines(
        tmp_path / "in.jsonl", [{"id": "long", "prompt": "L" * 200, "max_tokens": 200}, {"id": "short", "prompt": "s"}]
    )
    out = tmp_path / "out.jsonl"
    seen = {}

    def watch():  # what the file holds while the long request still runs
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
    inp = write_lines(
        tmp_path / "in.jsonl",
        [{"id": "a", "prompt": "aa"}, {"id": "b", "prompt": "bb"}, {"prompt": "no id"}, {"id": "c", "prompt": "cc"}],
    )
    out = tmp_path / "out.jsonl"
    assert run(FakeEngine(), inp, out)[0] == 0
    kept = [r for r in read_records(out) if r["line"] in (1, 3)]
    out.write_text(
        "".join(json.dumps(r) + "\n" for r in kept) + '{"id": "c", "line": 4, "te'
    )  # a crash in the middle of a write
    engine = FakeEngine()
    rc, log = run(engine, inp, out)
    assert rc == 0
    assert [r.request_id for r in engine.submitted] == ["b", "c"]
    records = read_records(out)  # every line is whole JSON again
    assert sorted(r["line"] for r in records) == [1, 2, 3, 4]
    assert "2 skipped as already done" in log
    rc, log = run(FakeEngine(), inp, out)  # nothing left to do
    assert rc == 0 and "wrote 0 results" in log and len(read_records(out)) == 4


def test_rerun_after_a_duplicate_error_still_runs_the_first_line(tmp_path):
    inp = write_lines(
        tmp_path / "in.jsonl",
        [{"id": "a", "prompt": "aa"}, {"id": "a", "prompt": "again"}, {"id": "b", "prompt": "bb"}],
    )
    out = tmp_path / "out.jsonl"
    rc, _ = run(FakeEngine(), inp, out)
    assert rc == 0
    duplicate = next(r for r in read_records(out) if r["line"] == 2)
    assert duplicate["duplicate_of"] == 1 and "duplicate id 'a'" in duplicate["error"]
    out.write_text(json.dumps(duplicate) + "\n")  # stopped before line 1 finished
    engine = FakeEngine()
    rc, log = run(engine, inp, out)
    assert rc == 0 and "1 skipped as already done" in log
    assert sorted(r.request_id for r in engine.submitted) == ["a", "b"]
    records = {r["line"]: r for r in read_records(out)}
    assert sorted(records) == [1, 2, 3] and records[1]["text"] == "aa"
    rc, log = run(FakeEngine(), inp, out)  # nothing left, duplicate not rewritten
    assert rc == 0 and "wrote 0 results" in log and len(read_records(out)) == 3


INTERRUPTIBLE = """
import sys
sys.path.insert(0, {tests!r})
from fake_engine import FakeEngine
from eprt.api import ENGINE_FAILED, EngineClosed
from eprt.serve.batch import run_batch
sys.exit(run_batch(FakeEngine(token_delay=0.01, max_batch=2), {inp!r}, {out!r}, in_flight={in_flight}))
"""


def start_batch_job(inp, out, in_flight: int = 2, results: int = 1):
    """``run_batch`` on a slow fake engine in a child process, once ``results`` records are written."""
    script = INTERRUPTIBLE.format(tests=str(TESTS), inp=str(inp), out=str(out), in_flight=in_flight)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (out.exists() and len(out.read_text().splitlines()) >= results):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            proc.wait()
            raise AssertionError("no results from the batch job")
        time.sleep(0.01)
    return proc


def test_interrupted_run_resumes_where_it_stopped(tmp_path):
    ids = [f"r{i}" for i in range(12)]
    inp = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": f"{i}: " + "z" * 30, "max_tokens": 40} for i in ids])
    out = tmp_path / "out.jsonl"
    proc = start_batch_job(inp, out, results=2)
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 1
        assert "run the same command again to resume" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first = [r["id"] for r in read_records(out)]
    assert 2 <= len(first) < len(ids)  # stopped early, in-flight ones finished
    engine = FakeEngine()
    rc, _ = run(engine, inp, out)
    assert rc == 0
    assert sorted(r.request_id for r in engine.submitted) == sorted(set(ids) - set(first))
    records = read_records(out)
    assert sorted(r["id"] for r in records) == sorted(ids)  # each id exactly once
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


# ---- records keyed by id or content (not line number), a lock on the output, engine failures -----------


def test_inserting_and_editing_lines_between_runs_is_safe(tmp_path):
    """Was: keyed by line number, an inserted first line answered some prompts twice and never itself."""
    rows = [
        {"id": "a", "prompt": "aa"},
        {"prompt": "no id"},
        {"prompt": "same"},
        {"prompt": "same"},
        {"id": "b", "prompt": "bb"},
    ]
    inp = write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    rc, _ = run(FakeEngine(), inp, out)
    assert rc == 0 and len(read_records(out)) == 5
    edited = (
        [{"prompt": "new first"}, {"id": "new", "prompt": "nn"}]
        + rows[:1]
        + [{"prompt": "no id, edited"}]
        + rows[2:]
        + [{"prompt": "same"}]
    )  # inserted, edited, a third copy
    write_lines(inp, edited)
    engine = FakeEngine()
    rc, log = run(engine, inp, out)
    assert rc == 0 and "4 skipped as already done" in log
    assert sorted(r.prompt_ids for r in engine.submitted) == sorted(
        list(p.encode()) for p in ["new first", "nn", "no id, edited", "same"]
    )
    records = read_records(out)
    texts = sorted(r["text"] for r in records)
    assert texts == sorted(["aa", "no id", "same", "same", "bb", "new first", "nn", "no id, edited", "same"])
    assert {r.get("copy", 1) for r in records if r["text"] == "same"} == {1, 2, 3}
    rc, log = run(FakeEngine(), inp, out)  # nothing left
    assert rc == 0 and "wrote 0 results" in log


def test_duplicate_ids_are_per_line_errors_that_stay_recorded(tmp_path):
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "x", "prompt": "one"},
            {"id": "x", "prompt": "two"},
            {"id": "x", "prompt": "two"},
            {"id": "y", "prompt": "three"},
        ],
    )
    out = tmp_path / "out.jsonl"
    rc, _ = run(FakeEngine(), inp, out)
    records = {r["line"]: r for r in read_records(out)}
    assert rc == 0 and sorted(records) == [1, 2, 3, 4]
    assert records[1]["text"] == "one"
    for line in (2, 3):
        assert records[line]["duplicate_of"] == 1
        assert "duplicate id 'x' (first used on line 1)" in records[line]["error"]
    write_lines(
        inp,
        [
            {"id": "y", "prompt": "three"},
            {"id": "x", "prompt": "one"},
            {"id": "x", "prompt": "two"},
            {"id": "x", "prompt": "two"},
        ],
    )  # moved around: still all done
    engine = FakeEngine()
    rc, log = run(engine, inp, out)
    assert rc == 0 and "wrote 0 results" in log and engine.submitted == [] and len(read_records(out)) == 4


def test_a_second_run_on_the_same_output_fails_at_once(tmp_path):
    """Was: two runs on one output wrote every line twice."""
    ids = [f"r{i}" for i in range(8)]
    inp = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": "z" * 20, "max_tokens": 20} for i in ids])
    out = tmp_path / "out.jsonl"
    proc = start_batch_job(inp, out)
    try:
        engine = FakeEngine()
        started = time.monotonic()
        with _stderr() as err:
            rc, _ = run(engine, inp, out)
        assert rc == 2 and time.monotonic() - started < 5 and engine.submitted == []
        assert f"{out} is being written by another eprt run" in err.getvalue()
        assert proc.poll() is None  # the first run was not disturbed
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sorted(r["id"] for r in read_records(out)) == ids  # each exactly once
    rc, log = run(FakeEngine(), inp, out)  # the lock went with the first run
    assert rc == 0 and "wrote 0 results" in log


def test_a_held_lock_refuses_before_touching_the_output(tmp_path):
    import fcntl

    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "aa"}])
    out = tmp_path / "out.jsonl"
    out.write_text('{"id": "z", "line": 1, "te')  # a torn line is not repaired by the loser
    with open(out, "a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with _stderr() as err:
            rc, _ = run(FakeEngine(), inp, out)
    assert rc == 2 and "being written by another eprt run" in err.getvalue()
    assert out.read_text() == '{"id": "z", "line": 1, "te'


class _stderr:
    """Capture sys.stderr (where run_batch reports fatal errors)."""

    def __enter__(self):
        self._old, sys.stderr = sys.stderr, io.StringIO()
        return sys.stderr

    def __exit__(self, *exc):
        sys.stderr = self._old


class DyingEngine(FakeEngine):
    """Fails as the real engine does when a rank dies: after ``die_after`` steps every request in
    flight ends with an engine-failure error, serve_forever raises, and submit refuses."""

    def __init__(self, die_after: int, **kw):
        super().__init__(**kw)
        self.die_after, self.steps, self.dead = die_after, 0, False

    def submit(self, req, on_finish=None):
        if self.dead:
            raise EngineClosed("the engine is shutting down and accepts no new requests")
        return super().submit(req, on_finish)

    def step(self) -> None:
        self.steps += 1
        if self.steps <= self.die_after:
            return super().step()
        with self._lock:
            self.dead = True
            for seq in list(self._running) + list(self._waiting):
                self._finish(seq, "error", f"{ENGINE_FAILED}: RuntimeError: rank 1 died")
        raise RuntimeError("rank 1 died")


def test_lines_cut_short_by_an_engine_failure_run_again_on_resume(tmp_path):
    """Was: written as error records and skipped forever on resume."""
    rows = [{"id": "bad", "prompt": "x", "temperature": -1}, {"id": "fail", "prompt": "FAIL now"}] + [
        {"id": f"r{i}", "prompt": "y" * 12, "max_tokens": 12} for i in range(10)
    ]
    inp = write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    with pytest.raises(RuntimeError, match="rank 1 died"):
        run(DyingEngine(die_after=5, max_batch=3), inp, out, in_flight=6)
    first = {r["id"]: r for r in read_records(out)}
    assert "temperature" in first["bad"]["error"] and "fake engine failure" in first["fail"]["error"]
    assert not any("engine failed" in r.get("error", "") for r in first.values())
    assert len(first) < len(rows)
    engine = FakeEngine()
    rc, log = run(engine, inp, out)
    assert rc == 0
    assert sorted(r.request_id for r in engine.submitted) == sorted(f"r{i}" for i in range(10) if f"r{i}" not in first)
    records = read_records(out)
    assert sorted(r["id"] for r in records) == sorted(r["id"] for r in rows)  # each exactly once
    assert all(r["text"] == "y" * 12 for r in records if r["id"].startswith("r"))


def test_engine_failure_records_of_older_versions_are_retried(tmp_path):
    inp = write_lines(tmp_path / "in.jsonl", [{"id": "a", "prompt": "aa"}, {"id": "b", "prompt": "bb"}])
    out = tmp_path / "out.jsonl"
    write_lines(
        out,
        [
            {
                "id": "a",
                "line": 1,
                "finish_reason": "error",
                "token_ids": [],
                "error": "engine failed: RuntimeError: rank 1 exited",
            },
            {"id": "b", "line": 2, "error": "temperature must be a finite number >= 0"},
        ],
    )
    engine = FakeEngine()
    rc, _ = run(engine, inp, out)
    assert rc == 0 and [r.request_id for r in engine.submitted] == ["a"]


def test_sigterm_drains_running_lines_and_leaves_queued_ones_for_resume(tmp_path):
    """SLURM's --signal=TERM: running requests finish and are recorded, queued ones are cancelled and
    not recorded; the job exits 1 promptly and a rerun completes every line exactly once."""
    ids = [f"r{i}" for i in range(12)]
    inp = write_lines(tmp_path / "in.jsonl", [{"id": i, "prompt": f"{i}: " + "z" * 30, "max_tokens": 40} for i in ids])
    out = tmp_path / "out.jsonl"
    proc = start_batch_job(inp, out, in_flight=12)
    try:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 1
        assert "run the same command again to resume" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    first = read_records(out)
    assert 1 <= len(first) <= 6  # queued lines were not run to the end
    assert all(r["text"] == r["id"] + ": " + "z" * 30 for r in first)  # nothing partial recorded
    rc, _ = run(FakeEngine(), inp, out)
    assert rc == 0
    assert sorted(r["id"] for r in read_records(out)) == sorted(ids)


@pytest.mark.slow
def test_real_engine_batch_under_mpiexec(checkpoint, tmp_path):
    inp = write_lines(
        tmp_path / "in.jsonl",
        [
            {"id": "a", "prompt_ids": [1, 5, 9, 12], "max_tokens": 6},
            {"id": "b", "prompt_ids": [3, 4], "max_tokens": 4},
            {"id": "c", "prompt_ids": [1] * 5000},
        ],
    )
    out = tmp_path / "out.jsonl"
    cmd = [
        "mpiexec",
        "-n",
        "2",
        sys.executable,
        "-m",
        "eprt.cli",
        "run",
        "--model",
        checkpoint("mixtral"),
        "--device",
        "cpu",
        "--input",
        str(inp),
        "--output",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = {r["id"]: r for r in read_records(out)}
    assert 1 <= len(records["a"]["token_ids"]) <= 6 and records["a"]["finish_reason"] in ("stop", "length")
    assert 1 <= len(records["b"]["token_ids"]) <= 4
    assert "error" in records["c"]
    assert "1 failed" in proc.stderr


def test_max_tokens_past_the_context_is_cut_and_a_full_prompt_is_a_line_error(checkpoint, tmp_path):
    from eprt.engine.engine import EngineConfig, launch_engine
    from eprt.serve.batch import run_batch

    lines = [
        {"id": "huge", "prompt_ids": [5, 6, 7], "max_tokens": 10**12},
        {"id": "full", "prompt_ids": [5] * 32},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = EngineConfig(model=checkpoint("mixtral"), device="cpu", max_batch=2, block_size=4, max_model_len=32)
    with launch_engine(cfg) as engine:
        run_batch(engine, str(tmp_path / "in.jsonl"), str(tmp_path / "out.jsonl"), progress_stream=io.StringIO())
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert out["huge"]["finish_reason"] == "length" and len(out["huge"]["token_ids"]) <= 32 - 3
    assert "leaves room for at most 31" in out["full"]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2], ids=["n1", "mpiexec-n2"])
def test_a_line_whose_request_fails_is_recorded_and_a_resume_does_not_crash(tmp_path, world):
    """Issue 35: the line {"repetition_penalty": 1e-320, ...} crashed the job on every resume (0 of
    11 lines written). Now it is a line error; lines failing in their own stage (a planted failing
    logits processor, masks that leave no token) are recorded with their error; the others finish."""
    from planted_faults import PLANTED_SEED

    lines = [{"id": f"g{i}", "prompt": f"line {i}: ", "max_tokens": 16, "ignore_eos": True} for i in range(10)]
    lines[5:5] = [
        {
            "id": "repro",
            "prompt": "aaaa",
            "max_tokens": 8,
            "repetition_penalty": 1e-320,
            "temperature": 1,
            "top_p": 0.5,
        },
        {"id": "planted", "prompt": "aaaa", "max_tokens": 8, "seed": PLANTED_SEED, "presence_penalty": 0.5},
        {"id": "masked", "prompt": "aaaa", "allowed_token_ids": [5], "stop_token_ids": [5], "min_tokens": 2},
    ]
    inp, out = write_lines(tmp_path / "in.jsonl", lines), tmp_path / "out.jsonl"
    launcher = [] if world == 1 else ["mpiexec", "-n", str(world)]
    cmd = [*launcher, sys.executable, str(TESTS / "planted_faults.py"), "run", "--device", "cpu", "--max-batch", "8"]
    cmd += ["--input", str(inp), "--output", str(out)]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    records = {r["id"]: r for r in read_records(out)}
    assert sorted(records) == sorted(line["id"] for line in lines)
    assert "repetition_penalty must be a finite number in [1e-06, 1e+06], got 1e-320" in records["repro"]["error"]
    assert records["planted"]["finish_reason"] == "error" and "planted failure" in records["planted"]["error"]
    assert records["masked"]["finish_reason"] == "error" and "no token is left" in records["masked"]["error"]
    assert all(records[f"g{i}"]["finish_reason"] == "length" for i in range(10))
    assert "(3 failed" in first.stderr and "engine failed" not in first.stderr
    again = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "13 skipped as already done" in again.stderr, again.stderr
    assert len(read_records(out)) == len(lines)
