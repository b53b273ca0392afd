"""Structured outputs' cost on the CPU backend: the default model (byte tokenizer), batch 32,
every request guided by a JSON schema vs the same 32 requests unguided (both sampled at T=0.8,
so both take the host sampling path), one run:

- decode step ms = (t_N - t_1) / (N - 1) over N steps, the best of 5 interleaved rounds
  (schemas too long to finish within N);
- of it, the mask's share: time argmax_batch spends in GuidedRows.allowed (waiting for the masks
  computed on a thread during the forward pass, unpacking, masking) and in GuidedRows.advance;
- the mask computation alone for 32 rows (what the thread does, overlapped with the forward).

    python benchmarks/bench_structured.py [--steps 48] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

from bench_decode_cpu import THREADS  # noqa: F401  (sets the BLAS threads before NumPy loads)

from eprt.api import GenerationRequest, Guide, SamplingParams  # noqa: E402
from eprt.engine.engine import EngineConfig, launch_engine  # noqa: E402
from eprt.engine.structured import GuidedRows  # noqa: E402
from eprt.model.tokenizer import ByteTokenizer  # noqa: E402

ROWS = 32
REPEAT = 5  # rounds of every case, interleaved; each case's fastest round counts (a shared machine)
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
    """Wall time spent inside GuidedRows.allowed / advance / _fill (the masks' share of a step)."""

    def __init__(self):
        self.allowed = self.advance = self.fill = 0.0
        self.fills = 0
        for name in ("allowed", "advance", "_fill"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        inner = getattr(GuidedRows, name)
        meter = self

        def timed(self, *args):
            t = time.perf_counter()
            try:
                return inner(self, *args)
            finally:
                dt = time.perf_counter() - t
                if name == "_fill":
                    meter.fill += dt
                    meter.fills += 1
                else:
                    setattr(meter, name, getattr(meter, name) + dt)

        setattr(GuidedRows, name, timed)


def run(engine, guide, steps: int) -> float:
    """Seconds of one decode step of ROWS requests: (t_N - t_1) / (N - 1)."""
    prompts = [ByteTokenizer().encode(f"Record {i}: ") for i in range(ROWS)]

    def go(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.8, seed=1, guide=guide, ignore_eos=guide is None)
        t = time.perf_counter()
        results = engine.generate([GenerationRequest(p, params) for p in prompts])
        assert all(len(r.token_ids) == n for r in results), "a request finished early: lengthen the schema"
        return time.perf_counter() - t

    go(2)  # warm-up (and the tokenizer's llguidance view, built once)
    return (go(steps) - go(1)) / (steps - 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--repeats", type=int, default=REPEAT, help="interleaved rounds; the best of each case counts")
    args = ap.parse_args()
    meter = Meter()
    cases = {"none": None, **{k: Guide("json_schema", json.dumps(v)) for k, v in SCHEMAS.items()}}
    best = {k: (float("inf"), 0.0, 0.0, 0.0) for k in cases}  # step s, allowed, advance, fill (per step / call)
    with launch_engine(EngineConfig(model=None, device="cpu", max_batch=ROWS, prefix_cache=False)) as engine:
        for _ in range(args.repeats):
            for name, guide in cases.items():
                meter.allowed = meter.advance = meter.fill = 0.0
                meter.fills = 0
                steps_before = engine.runner.decode_steps
                step = run(engine, guide, args.steps)
                per = max(engine.runner.decode_steps - steps_before, 1)
                fill = meter.fill / max(meter.fills, 1)
                if step < best[name][0]:
                    best[name] = (step, meter.allowed / per, meter.advance / per, fill)
    plain = best["none"][0]
    print(f"default model, CPU, batch {ROWS}, T=0.8, {args.steps} steps, {args.threads} BLAS threads")
    print(f"{'guide':>18} {'step ms':>8} {'+ms':>6} {'+%':>6} {'allowed ms':>11} {'advance ms':>10} {'fill ms':>8}")
    for name, (step, allowed, advance, fill) in best.items():
        extra = step - plain
        print(
            f"{name:>18} {step * 1e3:8.2f} {extra * 1e3:6.2f} {100 * extra / plain:5.1f}% "
            f"{allowed * 1e3:11.3f} {advance * 1e3:10.3f} {fill * 1e3:8.3f}"
        )
    print("allowed: per decode step, in argmax_batch (the thread's masks; a prompt's first token computes its own)")
    print("advance: per step, consuming tokens and starting the next masks; fill: one mask computation of the")
    print("rows (on the thread)")


if __name__ == "__main__":
    main()
