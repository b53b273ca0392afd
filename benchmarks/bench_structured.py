"""Structured outputs' cost on the CPU backend: the default model (byte tokenizer), batch 32,
every request guided by a JSON schema vs the same 32 requests unguided (both sampled at T=0.8,
so both take the host sampling path). Target (issue 22): the guided step under 10% over the
plain one. In one run, rounds of every case interleaved:

- decode step ms: the median over every decode step of every round (the wall time of one
  scheduler step; each generate's first two steps, which hold the prefill, and its last are
  left out), with the interquartile range as the noise;
- step CPU ms: the same with the process's CPU time (every thread's) instead of the wall time:
  on a shared machine, what other processes' load does not stretch;
- overhead: the guided step's median over the plain one's, by either;
- mask ms: per step, the time in GuidedRows.allowed (filling the rows' next bitmasks) and
  GuidedRows.advance (feeding the sampled tokens), all on the step's thread;
- sample ms: per step, the whole of the runner's sampling (argmax_batch, masks included).

    python benchmarks/bench_structured.py [--steps 40] [--repeats 8] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from bench_decode_cpu import THREADS  # noqa: F401  (sets the BLAS threads before NumPy loads)

from eprt.api import GenerationRequest, Guide, SamplingParams  # noqa: E402
from eprt.engine.engine import EngineConfig, launch_engine  # noqa: E402
from eprt.engine.runner import ModelRunner  # noqa: E402
from eprt.engine.structured import GuidedRows  # noqa: E402
from eprt.model.tokenizer import ByteTokenizer  # noqa: E402

ROWS = 32
TARGET = 0.10  # the guided step's overhead over the plain step
SKIP_HEAD, SKIP_TAIL = 2, 1  # steps of each generate left out: the prefill's, the last one
SCHEMAS = {
    "int array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 500},
    "object of strings": {
        "type": "object",
        "properties": {k: {"type": "string", "minLength": 300} for k in ("title", "body")},
        "required": ["title", "body"],
        "additionalProperties": False,
    },
}


class Meter:
    """Wall time of each engine step and, within it, in the masks' methods and in sampling."""

    def __init__(self, engine):
        self.mask = self.sample = 0.0
        self.steps: list[tuple[float, float, float, float]] = []  # (step, step CPU, mask, sample) seconds
        self._time(GuidedRows, "allowed", "mask")
        self._time(GuidedRows, "advance", "mask")
        self._time(ModelRunner, "argmax_batch", "sample")
        inner, meter = engine._step, self

        def step():
            meter.mask = meter.sample = 0.0
            t, cpu = time.perf_counter(), time.process_time()
            inner()
            meter.steps.append((time.perf_counter() - t, time.process_time() - cpu, meter.mask, meter.sample))

        engine._step = step

    def _time(self, cls, name: str, into: str) -> None:
        inner, meter = getattr(cls, name), self

        def timed(self, *args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(self, *args, **kwargs)
            finally:
                setattr(meter, into, getattr(meter, into) + time.perf_counter() - t)

        setattr(cls, name, timed)


def run(engine, meter: Meter, guide, steps: int) -> list[tuple[float, float, float, float]]:
    """The decode steps' (step, step CPU, mask, sample) seconds of one generate of ROWS requests."""
    prompts = [ByteTokenizer().encode(f"Record {i}: ") for i in range(ROWS)]
    params = SamplingParams(max_tokens=steps, temperature=0.8, seed=1, guide=guide, ignore_eos=guide is None)
    meter.steps = []
    results = engine.generate([GenerationRequest(p, params) for p in prompts])
    assert all(len(r.token_ids) == steps for r in results), "a request finished early: lengthen the schema"
    return meter.steps[SKIP_HEAD : len(meter.steps) - SKIP_TAIL]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40, help="tokens per request in one round")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--repeats", type=int, default=8, help="interleaved rounds of every case")
    args = ap.parse_args()
    cases = {"none": None, **{k: Guide("json_schema", json.dumps(v)) for k, v in SCHEMAS.items()}}
    steps: dict[str, list] = {k: [] for k in cases}
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=ROWS, prefix_cache=False)) as engine:
        meter = Meter(engine)
        for guide in cases.values():  # warm-up (the tokenizer's llguidance view, the guides' compilation)
            run(engine, meter, guide, SKIP_HEAD + SKIP_TAIL + 2)
        for _ in range(args.repeats):
            for name, guide in cases.items():
                steps[name] += run(engine, meter, guide, args.steps)
    stats = {k: np.percentile(np.array(v), [25, 50, 75], axis=0) for k, v in steps.items()}  # [quartile, column]
    plain = stats["none"][1]
    print(
        f"default model, CPU backend, batch {ROWS}, T=0.8, {args.threads} BLAS threads; {args.repeats} interleaved "
        f"rounds x {args.steps} tokens, medians over {len(steps['none'])} decode steps per case"
    )
    print(
        f"{'guide':>18} {'step ms':>8} {'(IQR)':>13} {'overhead':>9} {'CPU ms':>7} {'(IQR)':>13} {'overhead':>9}"
        f" {'mask ms':>8} {'sample ms':>10}"
    )
    worst = np.zeros(2)  # wall, CPU
    for name, q in stats.items():
        extra = (q[1, :2] - plain[:2]) / plain[:2]
        worst = np.maximum(worst, extra)
        iqr = [f"{q[0, c] * 1e3:.2f}-{q[2, c] * 1e3:.2f}" for c in (0, 1)]
        print(
            f"{name:>18} {q[1, 0] * 1e3:8.2f} {iqr[0]:>13} {100 * extra[0]:+8.1f}% {q[1, 1] * 1e3:7.2f} {iqr[1]:>13} "
            f"{100 * extra[1]:+8.1f}% {q[1, 2] * 1e3:8.3f} {q[1, 3] * 1e3:10.3f}"
        )
    verdict = ["met" if w < TARGET else "NOT met" for w in worst]
    print(
        f"target: guided step < {100 * TARGET:.0f}% over the plain step: by wall time {verdict[0]}, "
        f"by the process's CPU time {verdict[1]}"
    )
    print("step: wall time of a scheduler step; CPU: the process's CPU time in it (all its threads; unlike the")
    print("wall time, not stretched by other processes taking the cores);")
    print("mask: per step, filling the guided rows' bitmasks and feeding them their tokens (GuidedRows);")
    print("sample: per step, the runner's whole sampling (argmax_batch), masks included")


if __name__ == "__main__":
    main()
