"""Train eprt's built-in default model (a small Qwen3-MoE) on the docstrings of Python's standard library.

    python scripts/train_default_model.py --out eprt/model/default_model   # train and ship (torch, 2 CPU threads)
    python scripts/train_default_model.py --out /tmp/rerun                  # retrain; compare with the shipped loss
    python scripts/train_default_model.py --check                           # held-out loss of the shipped weights
Corpus, split, settings and figures: README, "Built-in default model".
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import hashlib
import json
import math
import os
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass

BYTE_VOCAB, EOS = 258, 257  # eprt.model.tokenizer.ByteTokenizer: bytes 0..255, <bos>=256, <eos>=257
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "eprt", "model", "default_model")
SKIPPED_DIRS = {
    "test",
    "tests",
    "idlelib",
    "lib2to3",
    "site-packages",
    "dist-packages",
    "turtledemo",
    "__pycache__",
    "ensurepip",
    "pydoc_data",
    "tkinter",
}
HELD_OUT_EVERY = 10  # module i is held out when i % 10 == 0 (sorted module order)
CHAT_EVERY = 4  # every 4th function/class docstring also becomes a chat exchange
SAMPLE_PROMPTS = ("Hello, experts", "Return the", "The socket module")  # greedy: bfloat16 must not change them
TOLERANCE = 0.02  # nats per byte: a rerun's held-out loss against the shipped one

ARCHITECTURE = dict(
    model_type="qwen3_moe",
    vocab_size=BYTE_VOCAB,
    hidden_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    intermediate_size=256,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=256,
    eos_token_id=EOS,
    pad_token_id=EOS,
    initializer_range=0.02,
)


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    threads: int = 2
    steps: int = 600
    batch: int = 16
    context: int = 256
    peak_lr: float = 3e-3
    warmup_steps: int = 40
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.01
    router_aux_loss_coef: float = 0.01


# ---------------------------------------------------------------- corpus


def stdlib_files(root: str) -> list[str]:
    """The standard library's .py files (tests, IDLE, Tk and bundled packages left out), sorted."""
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in SKIPPED_DIRS and not x.startswith("test"))
        files += [os.path.join(d, n) for n in names if n.endswith(".py")]
    return sorted(files)


def reflow(doc: str) -> str:
    """Join the wrapped lines of prose paragraphs; keep indented, listed or doctest paragraphs as written."""
    out = []
    for para in doc.split("\n\n"):
        lines = para.split("\n")
        prose = all(ln and not ln[0].isspace() and not ln.startswith((">>>", "...", "-", "*", "+")) for ln in lines)
        out.append(" ".join(ln.strip() for ln in lines) if prose else para)
    return "\n\n".join(out)


def docstrings(tree: ast.Module, module: str) -> list[tuple[str, str]]:
    """(qualified name, cleaned docstring) of the module, its classes and functions, in source order."""
    found = []

    def visit(node, qualname):
        doc = ast.get_docstring(node)
        if doc and doc.isascii():
            found.append((qualname, doc))
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{qualname}.{child.name}")

    visit(tree, module)
    return found


def chat_exchange(qualname: str, doc: str) -> str:
    """The byte tokenizer's chat template (user turn, then assistant) answered by the docstring's summary."""
    summary = reflow(doc).split("\n\n")[0][:400]
    return f"<|user|>\nWhat does {qualname} do?\n<|assistant|>\n{summary}"


def module_documents(path: str, root: str) -> list[str]:
    module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    docs = []
    for i, (qualname, doc) in enumerate(docstrings(tree, module)):
        docs.append(reflow(doc))
        if qualname != module and i % CHAT_EVERY == 0:
            docs.append(chat_exchange(qualname, doc))
    return docs


def corpus(root: str) -> tuple[list[int], list[int], str]:
    """(training ids, held-out ids, sha256 of both): documents as UTF-8 bytes, each followed by <eos>."""
    train, held_out = [], []
    for i, path in enumerate(stdlib_files(root)):
        try:
            docs = module_documents(path, root)
        except (SyntaxError, UnicodeDecodeError):
            continue
        ids = train if i % HELD_OUT_EVERY else held_out
        for doc in docs:
            ids.extend(doc.encode("utf-8"))
            ids.append(EOS)
    digest = hashlib.sha256(repr((train, held_out)).encode()).hexdigest()
    return train, held_out, digest


# ---------------------------------------------------------------- model, training, evaluation


def new_model(settings: TrainSettings):
    import torch
    import transformers

    arch = {k: v for k, v in ARCHITECTURE.items() if k != "model_type"}
    cfg = transformers.Qwen3MoeConfig(
        **arch, output_router_logits=True, router_aux_loss_coef=settings.router_aux_loss_coef
    )
    cfg._experts_implementation = "grouped_mm"  # same arithmetic as the per-expert loop, faster on the CPU
    torch.manual_seed(settings.seed)
    return transformers.Qwen3MoeForCausalLM(cfg)


def learning_rate(step: int, s: TrainSettings) -> float:
    if step < s.warmup_steps:
        return s.peak_lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.peak_lr * (s.final_lr_fraction + (1 - s.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, train_ids: list[int], s: TrainSettings) -> None:
    """AdamW on random windows of the training stream, matmuls in bfloat16 (weights and optimizer in float32)."""
    import torch

    data = torch.tensor(train_ids, dtype=torch.long)
    gen = torch.Generator().manual_seed(s.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": other, "weight_decay": 0}],
        lr=s.peak_lr,
        betas=(0.9, 0.95),
    )
    model.train()
    start = time.time()
    for step in range(s.steps):
        offsets = torch.randint(0, len(data) - s.context - 1, (s.batch,), generator=gen)
        x = torch.stack([data[o : o + s.context] for o in offsets.tolist()])  # [B, T]
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, s)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == s.steps - 1:
            ce = out.loss.item() - s.router_aux_loss_coef * out.aux_loss.item()
            print(f"step {step:4d}  train loss {ce:.3f} nats/byte  {time.time() - start:6.0f} s", flush=True)


def held_out_loss(model, ids: list[int], context: int) -> float:
    """Mean next-token cross entropy (nats per byte) over non-overlapping windows, in float32."""
    import torch

    n = (len(ids) - 1) // context
    data = torch.tensor(ids[: n * context + 1], dtype=torch.long)
    x, y = data[:-1].view(n, context), data[1:].view(n, context)  # [N, T]
    model.eval()
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 32):
            logits = model(input_ids=x[i : i + 32]).logits.float()  # [b, T, V]
            total += torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), y[i : i + 32].reshape(-1), reduction="sum"
            ).item()
    return total / (n * context)


def greedy(model, prompt: str, max_tokens: int = 48) -> list[int]:
    import torch

    ids = torch.tensor([list(prompt.encode("utf-8"))])  # [1, T]
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens)
    return out[0, ids.shape[1] :].tolist()


def round_to_bfloat16(model) -> None:
    """Ship bfloat16: evaluate exactly the weights that are saved."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def save(model, out_dir: str, record: dict) -> None:
    """config.json and model.safetensors (bfloat16, Hugging Face layout) plus training.json."""
    import shutil

    import torch

    model.config.output_router_logits = False
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.to(torch.bfloat16).save_pretrained(tmp)
        for name in ("config.json", "model.safetensors"):
            shutil.copyfile(os.path.join(tmp, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")


def shipped_loss(model_dir: str, held_out: list[int], context: int) -> float:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return held_out_loss(model, held_out, context)


def shipped_record() -> dict:
    path = os.path.join(SHIPPED_DIR, "training.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def bits(nats: float) -> str:
    return f"{nats:.4f} nats/byte ({nats / math.log(2):.3f} bits/byte)"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory to write the trained model to")
    ap.add_argument("--check", action="store_true", help="only evaluate the shipped weights' held-out loss")
    ap.add_argument("--steps", type=int, default=TrainSettings.steps)
    ap.add_argument("--threads", type=int, default=TrainSettings.threads)
    args = ap.parse_args(argv)
    if not args.check and not args.out:
        ap.error("give --out DIR to train, or --check to evaluate the shipped weights")
    import torch

    settings = TrainSettings(steps=args.steps, threads=args.threads)
    torch.set_num_threads(settings.threads)
    train_ids, held_out, digest = corpus(sysconfig.get_paths()["stdlib"])
    print(
        f"corpus: {len(train_ids)} training bytes, {len(held_out)} held-out bytes, sha256 {digest[:16]} "
        f"(Python {sys.version.split()[0]})"
    )
    shipped = shipped_record()
    if shipped.get("corpus_sha256") not in (None, digest):
        print(
            f"note: the shipped model was trained on a different corpus (Python {shipped['python']}); "
            "losses are not comparable"
        )
    if args.check:
        if not shipped:
            print(f"no shipped model in {SHIPPED_DIR}", file=sys.stderr)
            return 2
        loss = shipped_loss(SHIPPED_DIR, held_out, settings.context)
        print(f"shipped weights: held-out loss {bits(loss)}; recorded {bits(shipped['held_out_loss'])}")
        return 0 if abs(loss - shipped["held_out_loss"]) <= TOLERANCE else 1

    model = new_model(settings)
    start = time.time()
    train(model, train_ids, settings)
    seconds = time.time() - start
    float32_tokens = [greedy(model, p) for p in SAMPLE_PROMPTS]
    round_to_bfloat16(model)
    same = [greedy(model, p) for p in SAMPLE_PROMPTS] == float32_tokens
    print(
        f"greedy tokens of {len(SAMPLE_PROMPTS)} prompts (48 each) with bfloat16 weights: "
        f"{'identical to' if same else 'DIFFERENT from'} float32"
    )
    loss = held_out_loss(model, held_out, settings.context)
    print(f"trained in {seconds:.0f} s on {settings.threads} threads; held-out loss {bits(loss)}")
    record = dict(
        held_out_loss=round(loss, 5),
        bfloat16_greedy_same_as_float32=same,
        train_seconds=round(seconds),
        corpus_sha256=digest,
        python=sys.version.split()[0],
        torch=torch.__version__,
        settings=dataclasses.asdict(settings),
        training_bytes=len(train_ids),
        held_out_bytes=len(held_out),
    )
    save(model, args.out, record)
    if shipped and os.path.realpath(args.out) != os.path.realpath(SHIPPED_DIR):
        diff = loss - shipped["held_out_loss"]
        print(
            f"shipped held-out loss {bits(shipped['held_out_loss'])}; difference {diff:+.4f} nats/byte "
            f"(tolerance {TOLERANCE})"
        )
        return 0 if abs(diff) <= TOLERANCE else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
