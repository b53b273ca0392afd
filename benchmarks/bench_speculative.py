"""Speculative decoding: decode tokens/s and mean accepted length, off vs ngram (vs mtp), batch 1 and 8.

    python benchmarks/bench_speculative.py [--model DIR | --bench-model DIR
        | --copy-model DIR [--copy-size S] [--copy-layers N] | --mtp-model DIR [--mtp-echo] [--mtp-layers N]]
        [--new-tokens 96] [--k 4] [--repeats 3] [--threads N] [--step-costs] [--draft-cost C]

One checkpoint, on the CPU, one rank: the built-in model (3.7 MB: a step costs its Python and
per-token compute, so verifying K + 1 positions costs more than a decode step), --model DIR, or
--bench-model DIR, bench_decode_cpu.py's ~115M-parameter Qwen3-MoE with random weights (built
once), where a step at small batch is bound by reading the weights, as on a serving GPU. A
prompt without a tokenizer is the text's bytes. --copy-model DIR builds (once) tests/checkpoints.py's
copy checkpoint, a qwen3_moe whose induction head continues a text it has seen (the built-in model
does not: it accepts 2.4 of 5 positions on the rewrite text, from its own repetitions), with an MTP
layer in DeepSeek's format that copies too (so off, ngram and mtp run on one checkpoint), at
--copy-size small (the built-in model's experts, hidden 256, --copy-layers layers: 16, so that the
MTP layer costs 1 / 16 of the model per draft, where DeepSeek-V3's costs 1 / 61) or bench (the bench
model's size, 8 layers, bound by reading its weights). Two workloads:
- rewrite: the prompt holds a text twice and the start of a third copy; greedy (lookup pays
  when the model repeats what it has seen);
- sampled: a short code prompt sampled at temperature 1.0 (drafts are rarely accepted: lookup
  does not pay, and the adaptive policy must keep speculation from costing more than it saves).
A checkpoint with an MTP layer (num_nextn_predict_layers and its tensors) gets an mtp column too:
--mtp-model DIR builds (once) tests/checkpoints.py's tiny deepseek_v3 with a random MTP layer,
whose drafts are rarely accepted, or with --mtp-echo the one whose MTP layer drafts what the model
decodes (an upper bound on acceptance, not a real model's), with --mtp-layers N layers of which
all but the first add nothing (so the MTP layer costs 1 / N of the model, as in a deep one).
Decode tokens/s: the tokens after each request's first, over this process's CPU time in the
engine's steps from the one after the batch's first token. The engines of a cell run in lock step
(a step of one, then of the next; which goes first alternates between repeats), so a slower
stretch of this shared machine slows each alike. The table shows the best of --repeats and, in
brackets, the median; the speed-up is the median of the per-repeat ratios to off, with their
quartiles. Mean accepted length: tokens emitted per row with drafts (accepted drafts + 1), from
the engine's counters.

--step-costs: instead, the time of one step at batch 1 and 8 when every row verifies K = 1..4
drafts that are never accepted (the policy forced to draft K), against a decode step (K = 0):
this process's CPU time (with --threads 1 that is the step's compute, less disturbed by other
work on a shared machine than the wall clock), best of --repeats and median.
"""

from __future__ import annotations

import os
import sys


def _threads_from_argv() -> int | None:
    """--threads must take effect before NumPy (OpenBLAS) starts its pool."""
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return int(sys.argv[i + 1])
        if a.startswith("--threads="):
            return int(a.split("=", 1)[1])
    return None


if (_THREADS := _threads_from_argv()) is not None:
    for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[_var] = str(_THREADS)

import argparse  # noqa: E402
import contextlib  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

from eprt.api import GenerationRequest, SamplingParams  # noqa: E402
from eprt.comm.transport import LocalTransport  # noqa: E402
from eprt.engine.engine import EngineConfig, launch_engine  # noqa: E402
from eprt.model.config import load_config  # noqa: E402
from eprt.model.safetensors_io import SafetensorsCheckpoint  # noqa: E402
from eprt.scheduler.speculation import DraftPolicy  # noqa: E402

TEXT = (
    "Return a new list containing all items from the iterable in ascending order. A custom key function "
    "can be supplied to customize the sort order, and the reverse flag can be set to request the result "
    "in descending order."
)
WORKLOADS = {
    "rewrite": (f"{TEXT}\n\n{TEXT}\n\n{TEXT[:40]}", 0.0),
    "sampled": ('def parse_args(argv):\n    """', 1.0),
}
BATCHES = (1, 8)
COPY_SMALL = dict(  # the built-in model's experts, wide enough for the copy construction
    vocab_size=512,
    hidden_size=256,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    max_position_embeddings=1024,
)


def encode(engine, text: str) -> list:
    tok = engine.tokenizer
    return tok.encode(text) if tok is not None else [3 + b for b in text.encode()]


class Batch:
    """One engine's batch of ``batch`` copies of a request, stepped by ``lockstep``: the tokens
    after each request's first, this process's CPU time in the engine's steps from the one after
    the batch's first token, and the engine's verify counters from its start."""

    def __init__(self, engine, prompt: list, batch: int, n: int, temperature: float) -> None:
        self.engine, self.seconds, self.counts = engine, 0.0, [0] * batch
        self.counters = (engine.runner.drafts.verify_rows, engine.runner.kv.accepted_tokens)
        self.handles = [
            engine.submit(
                GenerationRequest(
                    prompt,
                    SamplingParams(max_tokens=n, temperature=temperature, seed=i, ignore_eos=True),
                    stream=True,
                    on_token=lambda _t, i=i: self.counts.__setitem__(i, self.counts[i] + 1),
                )
            )
            for i in range(batch)
        ]

    def done(self) -> bool:
        return all(h.done() for h in self.handles)

    def step(self) -> None:
        decoding = any(self.counts)
        t0 = time.process_time()
        self.engine.step()
        if decoding:
            self.seconds += time.process_time() - t0

    def rate(self) -> float:
        """Decode tokens/s."""
        return sum(c - 1 for c in self.counts) / self.seconds

    def verified(self) -> tuple[int, int]:
        """Rows that had drafts verified, and drafts accepted, since the batch started."""
        runner = self.engine.runner
        return runner.drafts.verify_rows - self.counters[0], runner.kv.accepted_tokens - self.counters[1]


def lockstep(batches: list) -> list[float]:
    """Each batch's decode tokens/s, their engines stepped in turn (a step of one, then of the
    next), so that a slower stretch of a shared machine slows each alike."""
    while not all(b.done() for b in batches):
        for b in batches:
            if not b.done():
                b.step()
    return [b.rate() for b in batches]


def launch(stack, args, method: str | None, k: int):
    cfg = EngineConfig(
        model=args.model,
        device="cpu",
        max_batch=max(BATCHES),
        max_model_len=1024,
        prefix_cache=False,
        speculative_method=method,
        num_speculative_tokens=k,
    )
    return stack.enter_context(launch_engine(cfg, transport=LocalTransport()))


def has_mtp(model_dir: str | None) -> bool:
    """Whether the checkpoint holds an MTP layer --speculative-method mtp can load."""
    if model_dir is None:
        return False
    cfg = load_config(model_dir)
    return cfg.mtp_layers > 0 and f"model.layers.{cfg.num_layers}.eh_proj.weight" in SafetensorsCheckpoint(model_dir)


def speedups(args) -> None:
    runs: dict = {}  # (method, workload, batch) -> decode tok/s per repeat
    accepted: dict = {}
    methods = ("ngram", "mtp") if has_mtp(args.model) else ("ngram",)
    with contextlib.ExitStack() as stack:
        engines = {method: launch(stack, args, method, args.k) for method in (None, *methods)}
        if args.draft_cost is not None:  # the adaptive policy with this cost instead of the measured one
            for m in methods:
                engines[m].runner.drafts.step_costs.draft_cost = lambda rows: args.draft_cost
        for repeat in range(args.repeats):
            order = list(engines.items())[:: -1 if repeat % 2 else 1]  # which engine steps first alternates
            for name, (text, temperature) in WORKLOADS.items():
                for batch in BATCHES:
                    cell = [Batch(e, encode(e, text), batch, args.new_tokens, temperature) for _, e in order]
                    for (method, _), b, rate in zip(order, cell, lockstep(cell)):
                        runs.setdefault((method, name, batch), []).append(rate)
                        old, new = accepted.get((method, name, batch), (0, 0)), b.verified()
                        accepted[method, name, batch] = (old[0] + new[0], old[1] + new[1])
    print(f"decode tok/s (CPU time in each engine's steps): best of {args.repeats} (median); speed-up: the median")
    print("of the per-repeat ratios [their quartiles]")
    head = "".join(f" {m:>18} {'speed-up':>22} {'mean acc len':>13}" for m in methods)
    print(f"{'workload':<9} {'batch':>5} {'off':>18}{head}")
    for name in WORKLOADS:
        for batch in BATCHES:
            off = runs[None, name, batch]
            cells = ""
            for m in methods:
                on = runs[m, name, batch]
                rows, acc = accepted[m, name, batch]
                length = (rows + acc) / rows if rows else 0.0
                ratios = [a / b for a, b in zip(on, off)]
                q1, med, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                best = f"{max(on):>8.1f} ({statistics.median(on):>7.1f})"
                cells += f" {best} {med:>6.2f}x [{q1:.2f}, {q3:.2f}] {length:>13.2f}"
            print(f"{name:<9} {batch:>5} {max(off):>8.1f} ({statistics.median(off):>7.1f}){cells}")
    print("all runs, decode tok/s:")
    for key, values in runs.items():
        print(f"  {key}: {', '.join(f'{v:.0f}' for v in values)}")


class ForcedDrafts(DraftPolicy):
    """Every row drafts as many as it may, every step."""

    def drafts(self, seq, limit: int, *costs) -> int:
        return limit

    def worth_a_verify(self, rows: list, ks: list, cost: float, overhead: float) -> list:
        return ks


class WrongDrafter:
    """Drafts a token the model never emits, so no draft is accepted and every step verifies."""

    in_pass = False

    def draft(self, seq, k: int) -> list:
        return [0] * k


def step_costs(args) -> None:
    times: dict = {}
    with contextlib.ExitStack() as stack:
        engines = {0: launch(stack, args, None, 1)}
        for k in range(1, 5):
            engines[k] = engine = launch(stack, args, "ngram", k)
            engine.runner.drafts.drafter = WrongDrafter()
            engine.scheduler.drafting = ForcedDrafts()
        prompt = encode(engines[0], WORKLOADS["sampled"][0])
        for _ in range(args.repeats):
            for batch in BATCHES:
                for k, engine in engines.items():
                    steps0 = engine.runner.decode_steps
                    t0 = time.process_time()
                    params = [SamplingParams(max_tokens=args.new_tokens, seed=i, ignore_eos=True) for i in range(batch)]
                    engine.generate([GenerationRequest(prompt, p) for p in params])
                    seconds = time.process_time() - t0
                    times.setdefault((batch, k), []).append(seconds / (engine.runner.decode_steps - steps0))
    for batch in BATCHES:
        base = min(times[batch, 0])
        print(f"batch {batch}: decode step {base * 1e3:.3f} ms (median {statistics.median(times[batch, 0]) * 1e3:.3f})")
        for k in range(1, 5):
            best = min(times[batch, k])
            print(
                f"  verify K={k}: {best * 1e3:.3f} ms (median {statistics.median(times[batch, k]) * 1e3:.3f}), "
                f"{best / base:.2f}x a decode step, {(best / base - 1) / k:.2f} decode rows per draft"
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    ap.add_argument("--bench-model", default=None, metavar="DIR", help="build/use bench_decode_cpu.py's model here")
    ap.add_argument("--copy-model", default=None, metavar="DIR", help="build/use the bench model's size that copies")
    ap.add_argument("--copy-size", choices=("small", "bench"), default="small")
    ap.add_argument("--copy-layers", type=int, default=16, help="--copy-size small: the model's layers (>= 2)")
    ap.add_argument("--mtp-model", default=None, metavar="DIR", help="build/use a tiny deepseek_v3 with an MTP layer")
    ap.add_argument("--mtp-echo", action="store_true", help="--mtp-model: the MTP layer drafts what the model decodes")
    ap.add_argument("--mtp-layers", type=int, default=1, help="--mtp-echo: the model's layers (the MTP layer is 1)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=_THREADS, help="BLAS threads (default: the library's)")
    ap.add_argument("--step-costs", action="store_true", help="time decode vs verify-K steps instead")
    ap.add_argument(
        "--draft-cost", type=float, default=None, help="pin a draft's cost in decode rows (0: always draft K)"
    )
    args = ap.parse_args()
    if args.bench_model:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_decode_cpu import BENCH_MODEL
        from checkpoints import build_checkpoint

        args.model = build_checkpoint("qwen3_moe", args.bench_model, **BENCH_MODEL)
    if args.copy_layers < 2:
        ap.error(f"--copy-layers {args.copy_layers}: the copy construction needs at least 2 layers")
    if args.copy_model:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from bench_decode_cpu import BENCH_MODEL
        from checkpoints import build_copy_checkpoint

        size = BENCH_MODEL if args.copy_size == "bench" else dict(COPY_SMALL, num_hidden_layers=args.copy_layers)
        args.model = build_copy_checkpoint(args.copy_model, mtp=True, **size)
        if load_config(args.model).num_layers != size["num_hidden_layers"] or not has_mtp(args.model):
            sys.exit(
                f"--copy-model {args.copy_model} holds another checkpoint (an older copy checkpoint, another "
                f"--copy-size or --copy-layers): it is built once per directory, so pass a new one"
            )
    if args.mtp_model:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from checkpoints import build_mtp_checkpoint

        args.model = build_mtp_checkpoint(args.mtp_model, echo=args.mtp_echo, echo_layers=args.mtp_layers)
    step_costs(args) if args.step_costs else speedups(args)


if __name__ == "__main__":
    main()
