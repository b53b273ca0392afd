"""eprt against llama.cpp on the CPU, side by side in one run: decode at batch 1 and 32, and
prefill of a long prompt, each at three weight precisions.

    python benchmarks/bench_llamacpp.py [--llama-src /tmp/llama/src/vendor/llama.cpp]
        [--llama-lib /tmp/llama/build/bin] [--llama-py /tmp/llama/py] [--gguf-dir /tmp/llama/gguf]
        [--dir /tmp/eprt-bench-moe] [--threads 1] [--repeats 5] [--new-tokens 32] [--prefill 512]

The ~115M Qwen3-MoE of bench_decode_cpu.py (built once, with its bfloat16 copy), converted from
that copy to GGUF (once, into --gguf-dir) at f32, bf16 and q8_0 with llama.cpp's
convert_hf_to_gguf.py (the random model has no tokenizer: the files carry llama.cpp's "no
vocabulary" with the model's 8192 ids; prompts are token ids). Pairs: eprt f32 (the bf16 copy
widened at load) against llama.cpp f32, eprt bf16 (resident) against bf16, eprt int8 (per-group,
quantized at load) against q8_0, both sides on --threads threads.

llama.cpp runs in this process through its C API (the llama-cpp-python binding of the same
source, on the shared libraries of --llama-lib), with its default context settings (a float16
KV cache, flash attention where it runs, a KV stream per sequence, 512-token ubatches); eprt
through its engine as bench_decode_cpu.py does (``--cpu-weights``, ``--cpu-threads``, a float32
KV cache, prefill in its CPU default 512-token chunks). Both sample greedily: llama.cpp's next
tokens are the argmax of its logits, taken here.

Measured by the wall clock, the six engines open together and run in turn, one of each per
repeat, so the machine's drifts hit them alike; figures are the median [min, max] of --repeats:
- decode tok/s at batch B (1 and 32 prompts of 16 random tokens): B * (N - 1) / (t_N - t_1), the
  time to N new tokens less the time to 1, back to back (bench_decode_cpu.py's measure);
- prefill tok/s: P / (time to the first token of one prompt of P random tokens).
Tokens: each eprt precision's greedy tokens against llama.cpp's at the same precision, per batch
(identical rows, and how many tokens agree before the first difference: the model is random, so
near-ties in its logits and router can go either way between two correct implementations), and
eprt f32's against llama.cpp f32 computing as eprt does (a float32 KV cache, no flash attention),
run once after the timed runs.

llama.cpp, built from the llama-cpp-python sdist's vendored source (no network beyond PyPI):

    mkdir -p /tmp/llama && cd /tmp/llama
    pip download --no-binary :all: --no-deps llama-cpp-python -d dl && tar xzf dl/llama_cpp_python-*.tar.gz
    ln -sfn llama_cpp_python-* src
    amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S src/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \\
        -DCMAKE_C_FLAGS="$amx" -DCMAKE_CXX_FLAGS="$amx" -DBUILD_SHARED_LIBS=ON -DLLAMA_CURL=OFF \\
        -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \\
        -DLLAMA_BUILD_APP=OFF
    cmake --build build -j2 --target llama llama-batched-bench llama-bench
    mkdir -p py && cp -r src/llama_cpp py/ && pip install --no-deps --target py diskcache

(-march=native without AMX: on the development machine, a VM whose CPU has AMX, llama.cpp
0c1e570's AMX q8_0 kernel stops with an illegal instruction, a tile op before its tile
configuration; f32 and bf16 do not use it.)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import subprocess
import sys

from bench_decode_cpu import (  # sets the BLAS threads before NumPy loads
    BENCH_MODEL,
    alternate,
    decode_timing,
    eprt_engine,
    eprt_run,
    timed_both,
)

_KEEP = []  # ctypes callbacks handed to llama.cpp

import numpy as np  # noqa: E402

PAIRS = (("f32", "f32"), ("bf16", "bf16"), ("int8", "q8_0"))  # eprt --cpu-weights, llama.cpp GGUF type
PROMPT_LEN = 16

# llama.cpp's converter with the vocabulary written as none (the model's vocab_size dummy ids)
CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path.insert(0, src)
import conversion.qwen as qwen

def set_vocab(self):
    self.gguf_writer.add_tokenizer_model("none")
    self.gguf_writer.add_vocab_size(self.hparams["vocab_size"])

qwen.Qwen3MoeModel.set_vocab = set_vocab
sys.argv = [src + "/convert_hf_to_gguf.py"] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def missing(args) -> str | None:
    """What of llama.cpp is not where the arguments say, in words; None when all is there."""
    need = {
        "--llama-src (llama.cpp's source, for its converter)": os.path.join(args.llama_src, "convert_hf_to_gguf.py"),
        "--llama-lib (llama.cpp's shared libraries)": os.path.join(args.llama_lib, "libllama.so"),
        "--llama-py (the llama-cpp-python binding)": os.path.join(args.llama_py, "llama_cpp", "llama_cpp.py"),
    }
    gone = [f"{what}: no {path}" for what, path in need.items() if not os.path.exists(path)]
    return "; ".join(gone) or None


def gguf_files(args, checkpoint: str) -> dict:
    """{GGUF type: path} of the checkpoint converted by llama.cpp's converter (once)."""
    os.makedirs(args.gguf_dir, exist_ok=True)
    files = {}
    for _, outtype in PAIRS:
        path = os.path.join(args.gguf_dir, f"bench-moe-{outtype}.gguf")
        if not os.path.exists(path):
            part = path + ".part"
            cmd = [sys.executable, "-c", CONVERT, args.llama_src, checkpoint, "--outtype", outtype, "--outfile", part]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"llama.cpp's converter failed at {outtype}:\n{done.stderr[-2000:]}")
            os.replace(part, path)
        files[outtype] = path
    return files


def load_binding(args):
    """llama.cpp's C API (llama-cpp-python's ctypes binding, on --llama-lib's libraries), its
    logging off, the backend up."""
    os.environ["LLAMA_CPP_LIB_PATH"] = args.llama_lib
    sys.path.insert(0, args.llama_py)
    import llama_cpp.llama_cpp as llama

    quiet = llama.llama_log_callback(lambda level, text, data: None)
    llama.llama_log_set(quiet, ctypes.c_void_p())
    llama.llama_backend_init()
    _KEEP.append(quiet)  # the callback must outlive this function
    return llama


def llama_model(llama, stack, path: str):
    """A GGUF model loaded on the CPU, freed with ``stack``."""
    params = llama.llama_model_default_params()
    params.n_gpu_layers = 0
    model = llama.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    stack.callback(llama.llama_model_free, model)
    return model


def llama_context(llama, stack, model, seqs: int, seq_len: int, threads: int, exact: bool = False):
    """A context of ``seqs`` sequences of up to ``seq_len`` tokens each (a KV stream each, the
    default), a batch of up to all of them at once (run in ubatches of the default 512 tokens),
    on ``threads`` threads, freed with ``stack``. Its defaults otherwise (a float16 KV cache,
    flash attention where it runs); ``exact``: a float32 KV cache and no flash attention (which
    takes queries to float16), as eprt computes."""
    params = llama.llama_context_default_params()
    params.n_ctx = params.n_batch = seqs * seq_len
    params.n_seq_max = seqs
    params.n_threads = params.n_threads_batch = threads
    if exact:
        params.type_k = params.type_v = llama.GGML_TYPE_F32
        params.flash_attn_type = llama.LLAMA_FLASH_ATTN_TYPE_DISABLED
    ctx = llama.llama_init_from_model(model, params)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    stack.callback(llama.llama_free, ctx)
    return ctx


def fill(batch, entries) -> None:
    """Write (token, position, sequence, wants logits) entries into a llama_batch."""
    for i, (token, pos, seq, logits) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
        batch.seq_id[i][0], batch.logits[i] = seq, logits
    batch.n_tokens = len(entries)


def greedy_step(llama, ctx, batch, entries, n_vocab: int) -> np.ndarray:
    """Decode ``entries`` and return the argmax token of each row that wanted logits."""
    fill(batch, entries)
    rc = llama.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")
    rows = sum(1 for e in entries if e[3])
    return np.ctypeslib.as_array(llama.llama_get_logits(ctx), shape=(rows, n_vocab)).argmax(axis=1)


def llama_run(llama, stack, ctx, model, prompts, tokens: dict, key):
    """run(k): ``prompts`` through llama.cpp to k greedy tokens each (the cache cleared first),
    their ids kept in ``tokens[key]``."""
    n_vocab = llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model))
    batch = llama.llama_batch_init(max(sum(map(len, prompts)), len(prompts)), 0, 1)
    stack.callback(llama.llama_batch_free, batch)
    memory = llama.llama_get_memory(ctx)

    def run(k):
        llama.llama_memory_clear(memory, False)  # its cells, not its buffers
        entries = [(t, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, t in enumerate(p)]
        out = [greedy_step(llama, ctx, batch, entries, n_vocab)]
        for i in range(1, k):
            entries = [(int(out[-1][s]), len(p) + i - 1, s, True) for s, p in enumerate(prompts)]
            out.append(greedy_step(llama, ctx, batch, entries, n_vocab))
        tokens[key] = np.stack(out, axis=1).tolist()

    return run


def open_pairs(stack, llama, models, bf16_path, prompts, seq_len, threads, tokens) -> dict:
    """{(side, precision): run(k)} for the three pairs, eprt and llama.cpp alternating, warmed up."""
    runs = {}
    for weights, outtype in PAIRS:
        engine = eprt_engine(stack, bf16_path, len(prompts), (weights, threads), max_model_len=seq_len)
        runs[("eprt", weights)] = eprt_run(engine, prompts, threads, tokens, ("eprt", weights))
        ctx = llama_context(llama, stack, models[outtype], len(prompts), seq_len, threads)
        runs[("llama.cpp", outtype)] = llama_run(
            llama, stack, ctx, models[outtype], prompts, tokens, ("llama.cpp", outtype)
        )
    for run in runs.values():
        run(2)  # warm-up
    return runs


def agreement(ours, theirs) -> str:
    """Identical rows, and tokens agreeing before each row's first difference (median, min)."""
    same = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(ours, theirs)]
    rows = sum(s == len(x) for s, x in zip(same, ours))
    return f"{rows}/{len(ours)} rows identical, agreeing prefix median {np.median(same):.0f} min {min(same)}"


def report(name: str, count: float, seconds: dict) -> None:
    """One line per pair: tok/s of each side, median [min, max], eprt / llama.cpp per repeat."""
    for weights, outtype in PAIRS:
        ours, theirs = seconds[("eprt", weights)], seconds[("llama.cpp", outtype)]
        ratios = [t / o for o, t in zip(ours, theirs)]
        print(
            f"{name:>16} {weights + ' / ' + outtype:>12} {spread_tps(count, ours):>24} "
            f"{spread_tps(count, theirs):>24} {np.median(ratios):6.2f} [{min(ratios):.2f}, {max(ratios):.2f}]",
            flush=True,
        )


def report_tokens(name: str, tokens: dict) -> None:
    """Each eprt precision's greedy tokens against llama.cpp's, and f32 against llama.cpp's exact f32."""
    pairs = [(("eprt", w), ("llama.cpp", t)) for w, t in PAIRS] + [(("eprt", "f32"), ("llama.cpp exact", "f32"))]
    for ours, theirs in pairs:
        what = f"{ours[1]} / {theirs[1]}{' (f32 KV, no flash attention)' if 'exact' in theirs[0] else ''}"
        print(f"{name:>16} tokens {what}: {agreement(tokens[ours], tokens[theirs])}", flush=True)


def spread_tps(count: float, seconds) -> str:
    rates = [count / s for s in seconds]
    return f"{np.median(rates):.1f} [{min(rates):.1f}, {max(rates):.1f}]"


def bench_decode(llama, models, bf16_path, prompts, args) -> None:
    tokens, name = {}, f"decode batch {len(prompts)}"
    with contextlib.ExitStack() as stack:
        runs = open_pairs(stack, llama, models, bf16_path, prompts, 256, args.threads, tokens)
        seconds = alternate(runs, args.repeats, lambda: None, decode_timing(args.new_tokens))
        exact = llama_context(llama, stack, models["f32"], len(prompts), 256, args.threads, exact=True)
        llama_run(llama, stack, exact, models["f32"], prompts, tokens, ("llama.cpp exact", "f32"))(args.new_tokens)
    report(name, len(prompts) * (args.new_tokens - 1), seconds["wall"])
    report_tokens(name, tokens)


def bench_prefill(llama, models, bf16_path, prompt, args) -> None:
    with contextlib.ExitStack() as stack:
        runs = open_pairs(stack, llama, models, bf16_path, [prompt], len(prompt) + 256, args.threads, {})
        seconds = alternate(runs, args.repeats, lambda: None, lambda run: timed_both(lambda: run(1)))
    report(f"prefill {len(prompt)}", len(prompt), seconds["wall"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-src", default="/tmp/llama/src/vendor/llama.cpp", help="llama.cpp's source tree")
    ap.add_argument("--llama-lib", default="/tmp/llama/build/bin", help="where its libllama.so is")
    ap.add_argument("--llama-py", default="/tmp/llama/py", help="where the llama_cpp binding package is")
    ap.add_argument("--gguf-dir", default="/tmp/llama/gguf", help="the converted model's GGUF files (made once)")
    ap.add_argument("--dir", default="/tmp/eprt-bench-moe")
    ap.add_argument("--threads", type=int, default=1, help="compute threads of each side")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--prefill", type=int, default=512, help="prompt tokens of the prefill measure")
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    gone = missing(args)
    if gone:
        print(f"skipped: llama.cpp not found ({gone}); build it as this script's docstring says")
        return
    from checkpoints import build_bf16_copy, build_checkpoint

    bf16_path = build_bf16_copy(build_checkpoint("qwen3_moe", args.dir, **BENCH_MODEL), args.dir + "-bf16")
    files = gguf_files(args, bf16_path)
    llama = load_binding(args)
    rng = np.random.default_rng(0)
    vocab = BENCH_MODEL["vocab_size"]
    print(f"model: {bf16_path} and {', '.join(files.values())}; {args.threads} thread(s) each, wall clock")
    print(f"llama.cpp: {llama.llama_print_system_info().decode().strip()}")
    print(f"{'':>16} {'eprt / llama':>12} {'eprt tok/s':>24} {'llama.cpp tok/s':>24} eprt / llama.cpp")
    with contextlib.ExitStack() as stack:
        models = {t: llama_model(llama, stack, path) for t, path in files.items()}
        for b in [int(x) for x in args.batches.split(",")]:
            bench_decode(llama, models, bf16_path, rng.integers(3, vocab, size=(b, PROMPT_LEN)).tolist(), args)
        bench_prefill(llama, models, bf16_path, rng.integers(3, vocab, size=args.prefill).tolist(), args)


if __name__ == "__main__":
    main()
