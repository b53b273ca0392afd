"""Train eprt's built-in default model (a small Qwen3-MoE) on the docstrings of Python's standard library
and on chat exchanges made of them (each assistant turn ended by <eos>, as eprt's byte tokenizer renders a chat).

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
import re
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's eprt: the chat template the model is trained on is the one it serves with
from eprt.model.tokenizer import ByteTokenizer  # noqa: E402

TOKENIZER = ByteTokenizer()
BYTE_VOCAB, EOS = ByteTokenizer.vocab_size, ByteTokenizer.EOS  # bytes 0..255, <bos>=256, <eos>=257
SHIPPED_DIR = os.path.join(ROOT, "eprt", "model", "default_model")
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
QUESTIONS = ("What does {} do?", "What is {}?", "Explain {}.", "Tell me about {}.", "How do I use {}?", "{}?")
MAX_REPLY = 160  # characters: a docstring whose first sentence is longer makes no chat exchange
SAMPLE_PROMPTS = ("Hello, experts", "Return the", "The socket module")  # greedy: bfloat16 must not change them
CHAT_PROMPTS = ("What does json.dumps do?", "Hello!", "Explain the socket module.", "How do I sort a list?")
CHAT_REPLY_LIMIT = 256  # tokens: a greedy chat reply must end its turn (<eos>) within this
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
    # then the chat phase: the loss on assistant replies (and their <eos>) only, short replies only
    chat_steps: int = 100
    chat_peak_lr: float = 1e-3
    chat_warmup_steps: int = 10
    chat_max_reply: int = 64  # characters


@dataclass(frozen=True)
class Phase:
    """One training phase: its steps, learning-rate schedule and the seed of its window draws."""

    steps: int
    peak_lr: float
    warmup_steps: int
    final_lr_fraction: float
    seed: int

    @staticmethod
    def pretraining(s: TrainSettings) -> Phase:
        return Phase(s.steps, s.peak_lr, s.warmup_steps, s.final_lr_fraction, s.seed)

    @staticmethod
    def chat(s: TrainSettings) -> Phase:
        return Phase(s.chat_steps, s.chat_peak_lr, s.chat_warmup_steps, s.final_lr_fraction, s.seed + 1)


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


def first_sentence(doc: str) -> str:
    """The docstring's summary paragraph up to its first sentence end (all of it if none)."""
    summary = reflow(doc).split("\n\n")[0].strip()
    m = re.match(r"(.+?[.!?])(?:\s|$)", summary, re.S)
    return m.group(1) if m else summary


def exchange(subject: str, doc: str, i: int, max_reply: int) -> list[dict] | None:
    """A question about ``subject`` (the i-th of QUESTIONS, in turn) and the docstring's first
    sentence as the answer; None if that sentence is longer than ``max_reply`` characters."""
    reply = first_sentence(doc)
    if not reply or len(reply) > max_reply:
        return None
    question = QUESTIONS[i % len(QUESTIONS)].format(subject)
    return [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]


def rendered(turns: list[dict]) -> list[int]:
    """Ids of a chat as the byte tokenizer's template renders it: an assistant turn ends with <eos>."""
    return TOKENIZER.apply_chat_template(turns, add_generation_prompt=False, tokenize=True)


def modules(root: str):
    """(index, module name, syntax tree) of each standard-library file that parses, in sorted order."""
    for i, path in enumerate(stdlib_files(root)):
        module = os.path.relpath(path, root)[:-3].replace(os.sep, ".").removesuffix(".__init__")
        try:
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read())
        except (SyntaxError, UnicodeDecodeError):
            continue
        yield i, module, tree


def module_exchanges(module: str, tree: ast.Module, max_reply: int) -> list[tuple[str, list[dict] | None]]:
    """(reflowed docstring, its chat exchange or None) of each docstring of the module, in order."""
    out = []
    for i, (qualname, doc) in enumerate(docstrings(tree, module)):
        subject = f"the {module} module" if qualname == module else qualname
        out.append((reflow(doc), exchange(subject, doc, i, max_reply)))
    return out


def corpus(root: str) -> tuple[list[int], list[int], str]:
    """(training ids, held-out ids, sha256 of both): each docstring as UTF-8 bytes followed by <eos>,
    then its chat exchange (when it makes one), which the template ends with <eos>."""
    train, held_out = [], []
    for i, module, tree in modules(root):
        ids = train if i % HELD_OUT_EVERY else held_out
        for text, turns in module_exchanges(module, tree, MAX_REPLY):
            ids += [*text.encode("utf-8"), EOS, *(rendered(turns) if turns else [])]
    digest = hashlib.sha256(repr((train, held_out)).encode()).hexdigest()
    return train, held_out, digest


def chat_exchanges(root: str, max_reply: int) -> list[tuple[list[int], int]]:
    """(ids, where the reply starts) of the training modules' exchanges with replies of at most
    ``max_reply`` characters: the chat phase's data."""
    out = []
    for i, module, tree in modules(root):
        if i % HELD_OUT_EVERY:
            for _, turns in module_exchanges(module, tree, max_reply):
                if turns:
                    prompt = TOKENIZER.apply_chat_template(turns[:1], tokenize=True)
                    out.append((rendered(turns), len(prompt)))
    return out


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


def learning_rate(step: int, s: Phase) -> float:
    if step < s.warmup_steps:
        return s.peak_lr * (step + 1) / s.warmup_steps
    progress = (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)
    return s.peak_lr * (s.final_lr_fraction + (1 - s.final_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, data, s: TrainSettings, phase: Phase, labels=None, starts=None) -> None:
    """AdamW on windows of ``data`` (a stream of ids) drawn at random, at any offset or at one of
    ``starts``; the loss on ``labels`` (-100: none) or on ``data`` itself. Matmuls in bfloat16,
    weights and optimizer in float32."""
    import torch

    gen = torch.Generator().manual_seed(phase.seed)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": s.weight_decay}, {"params": other, "weight_decay": 0}],
        lr=phase.peak_lr,
        betas=(0.9, 0.95),
    )
    labels = data if labels is None else labels
    model.train()
    start = time.time()
    for step in range(phase.steps):
        if starts is None:
            offsets = torch.randint(0, len(data) - s.context - 1, (s.batch,), generator=gen)
        else:
            offsets = starts[torch.randint(0, len(starts), (s.batch,), generator=gen)]
        x = torch.stack([data[o : o + s.context] for o in offsets.tolist()])  # [B, T]
        y = torch.stack([labels[o : o + s.context] for o in offsets.tolist()])  # [B, T]
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, phase)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=y)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == phase.steps - 1:
            ce = out.loss.item() - s.router_aux_loss_coef * out.aux_loss.item()
            print(f"step {step:4d}  train loss {ce:.3f} nats/byte  {time.time() - start:6.0f} s", flush=True)


def chat_stream(exchanges: list[tuple[list[int], int]], context: int):
    """(ids, labels, starts) of the chat phase: the exchanges one after another, labels -100 on
    each user turn (and the marker that opens the reply), windows starting at an exchange."""
    import torch

    ids, labels, starts = [], [], []
    for exchange, reply_at in exchanges:
        starts.append(len(ids))
        ids += exchange
        labels += [-100] * reply_at + exchange[reply_at:]
    starts = [o for o in starts if o + context < len(ids)]
    as_tensor = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return as_tensor(ids), as_tensor(labels), as_tensor(starts)


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


def greedy(model, prompt: list[int], max_tokens: int = 48) -> list[int]:
    """Greedy continuation; it stops at <eos> (config.json's eos_token_id), which it includes."""
    import torch

    ids = torch.tensor([prompt])  # [1, T]
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


def shipped_record() -> dict:
    path = os.path.join(SHIPPED_DIR, "training.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def bits(nats: float) -> str:
    return f"{nats:.4f} nats/byte ({nats / math.log(2):.3f} bits/byte)"


def chat_prompt(question: str) -> list[int]:
    return TOKENIZER.apply_chat_template([{"role": "user", "content": question}], tokenize=True)


def samples(model) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of SAMPLE_PROMPTS (48 each) and of the chat replies to CHAT_PROMPTS (up to <eos>)."""
    texts = [greedy(model, list(p.encode("utf-8"))) for p in SAMPLE_PROMPTS]
    return texts, [greedy(model, chat_prompt(q), CHAT_REPLY_LIMIT) for q in CHAT_PROMPTS]


def chat_turns(replies: list[list[int]]) -> tuple[dict, bool]:
    """({question: tokens of the reply with its <eos>, or None if it did not end}, whether all ended)."""
    turns = {q: len(r) if r[-1:] == [EOS] else None for q, r in zip(CHAT_PROMPTS, replies)}
    for q, r in zip(CHAT_PROMPTS, replies):
        ending = f"ends its turn after {len(r)} tokens" if turns[q] else f"did NOT end in {CHAT_REPLY_LIMIT} tokens"
        print(f"chat {q!r}: {TOKENIZER.decode(r)!r} {ending}")
    return turns, all(turns.values())


def check_shipped(shipped: dict, held_out: list[int], context: int) -> int:
    """0 if the shipped weights give the recorded held-out loss and end every sample chat's turn."""
    import torch
    import transformers

    if not shipped:
        print(f"no shipped model in {SHIPPED_DIR}", file=sys.stderr)
        return 2
    model = transformers.AutoModelForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32)
    loss = held_out_loss(model, held_out, context)
    print(f"shipped weights: held-out loss {bits(loss)}; recorded {bits(shipped['held_out_loss'])}")
    _, ended = chat_turns(samples(model)[1])
    return 0 if abs(loss - shipped["held_out_loss"]) <= TOLERANCE and ended else 1


PRETRAINING_FIELDS = ("seed", "steps", "batch", "context", "peak_lr", "warmup_steps", "final_lr_fraction")
PRETRAINING_FIELDS += ("weight_decay", "router_aux_loss_coef")


def load_pretrained(model_dir: str, settings: TrainSettings, digest: str):
    """(model, its record) of a model this script saved without a chat phase (``--chat-steps 0``)
    from the same corpus and pretraining settings: the chat phase starts from its weights."""
    import torch
    import transformers

    with open(os.path.join(model_dir, "training.json")) as f:
        record = json.load(f)
    mine = dataclasses.asdict(settings)
    differ = [k for k in PRETRAINING_FIELDS if record["settings"].get(k) != mine[k]]
    if record.get("corpus_sha256") != digest or differ or record["settings"].get("chat_steps", 0):
        raise SystemExit(f"{model_dir} was not pretrained on this corpus with these settings (differ: {differ})")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="grouped_mm"
    )
    model.config.output_router_logits = True
    return model, record


def pretrained(settings: TrainSettings, corpus_ids: tuple, from_dir: str | None):
    """(model, {held_out_loss, train_seconds}) after the pretraining phase, its weights rounded to
    bfloat16 (as ``--chat-steps 0`` saves them), or loaded from ``from_dir``."""
    train_ids, held_out, digest = corpus_ids
    if from_dir:
        model, record = load_pretrained(from_dir, settings, digest)
        return model, {k: record[k] for k in ("held_out_loss", "train_seconds")}
    model = new_model(settings)
    start = time.time()
    train(model, train_ids, settings, Phase.pretraining(settings))
    seconds = time.time() - start
    round_to_bfloat16(model)
    return model, dict(
        held_out_loss=round(held_out_loss(model, held_out, settings.context), 5), train_seconds=round(seconds)
    )


def chat_phase(model, settings: TrainSettings) -> dict:
    """Train on the training modules' short exchanges, the loss on the replies and their <eos> only."""
    exchanges = chat_exchanges(sysconfig.get_paths()["stdlib"], settings.chat_max_reply)
    ids, labels, starts = chat_stream(exchanges, settings.context)
    start = time.time()
    if settings.chat_steps:
        train(model, ids, settings, Phase.chat(settings), labels, starts)
    return dict(exchanges=len(exchanges), bytes=len(ids), train_seconds=round(time.time() - start))


def train_and_save(settings: TrainSettings, corpus_ids: tuple, out_dir: str, from_dir: str | None) -> tuple:
    """Pretrain (or load), chat phase, round to bfloat16, evaluate and save;
    (held-out loss, every sample chat ended its turn)."""
    import torch

    train_ids, held_out, digest = corpus_ids
    model, pretraining = pretrained(settings, corpus_ids, from_dir)
    print(f"pretraining: held-out loss {bits(pretraining['held_out_loss'])}, {pretraining['train_seconds']} s")
    chat = chat_phase(model, settings)
    float32_samples = samples(model)
    round_to_bfloat16(model)
    bfloat16_samples = samples(model)
    same = bfloat16_samples == float32_samples
    print(
        f"greedy tokens of {len(SAMPLE_PROMPTS)} prompts (48 each) and {len(CHAT_PROMPTS)} chat replies "
        f"with bfloat16 weights: {'identical to' if same else 'DIFFERENT from'} float32"
    )
    turns, ended = chat_turns(bfloat16_samples[1])
    loss = held_out_loss(model, held_out, settings.context)
    seconds = pretraining["train_seconds"] + chat["train_seconds"]
    print(f"trained in {seconds:.0f} s on {settings.threads} threads; held-out loss {bits(loss)}")
    record = dict(
        held_out_loss=round(loss, 5),
        bfloat16_greedy_same_as_float32=same,
        chat_reply_tokens=turns,
        train_seconds=seconds,
        pretraining=pretraining,
        chat_phase=chat,
        corpus_sha256=digest,
        python=sys.version.split()[0],
        torch=torch.__version__,
        settings=dataclasses.asdict(settings),
        training_bytes=len(train_ids),
        held_out_bytes=len(held_out),
    )
    save(model, out_dir, record)
    return loss, ended or not settings.chat_steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory to write the trained model to")
    ap.add_argument(
        "--check", action="store_true", help="only evaluate the shipped weights (held-out loss, chat turns ending)"
    )
    ap.add_argument("--steps", type=int, default=TrainSettings.steps, help="pretraining steps")
    ap.add_argument("--chat-steps", type=int, default=TrainSettings.chat_steps, help="chat phase steps (0: none)")
    ap.add_argument(
        "--pretrained", metavar="DIR", help="skip pretraining: start the chat phase from a --chat-steps 0 model"
    )
    ap.add_argument("--threads", type=int, default=TrainSettings.threads)
    args = ap.parse_args(argv)
    if not args.check and not args.out:
        ap.error("give --out DIR to train, or --check to evaluate the shipped weights")
    import torch

    settings = TrainSettings(steps=args.steps, threads=args.threads, chat_steps=args.chat_steps)
    torch.set_num_threads(settings.threads)
    corpus_ids = corpus(sysconfig.get_paths()["stdlib"])
    train_ids, held_out, digest = corpus_ids
    print(
        f"corpus: {len(train_ids)} training bytes, {len(held_out)} held-out bytes, sha256 {digest[:16]} "
        f"(Python {sys.version.split()[0]})"
    )
    shipped = shipped_record()
    comparable = shipped.get("corpus_sha256") in (None, digest)
    if not comparable:
        print(f"note: the shipped model was trained on a different corpus (Python {shipped['python']}); ", end="")
        print("losses are not comparable")
    if args.check:
        return check_shipped(shipped, held_out, settings.context)
    loss, ended = train_and_save(settings, corpus_ids, args.out, args.pretrained)
    if shipped and comparable and os.path.realpath(args.out) != os.path.realpath(SHIPPED_DIR):
        diff = loss - shipped["held_out_loss"]
        print(
            f"shipped held-out loss {bits(shipped['held_out_loss'])}; difference {diff:+.4f} nats/byte "
            f"(tolerance {TOLERANCE})"
        )
        return 0 if abs(diff) <= TOLERANCE and ended else 1
    return 0 if ended else 1


if __name__ == "__main__":
    sys.exit(main())
