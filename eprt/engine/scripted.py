"""The scripted token source behind the real runner (docs/scenarios.md, "The scripted model"): a
scenario runs the real scheduler, the real ModelRunner (its frames, its KV accounting, its
prefill runs) and the real ShardExecutor (slot table, block manager, prefix cache, snapshot rows,
owner pools, each pass's batch); only the arithmetic and the draws are scripted: ScriptedModel's
passes compute nothing, ScriptedTokens answers each row's token from its request's script, and
ScriptedDrafter proposes from its draft script. Under dp attention the other ranks' rows of each
pass come back as zeros (ScriptedExchange), as no rank but rank 0 is there.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from eprt.comm.transport import LocalTransport
from eprt.engine.adapter_slots import LoraAdapters
from eprt.engine.adapters import AdapterRegistry
from eprt.engine.dp_executor import dp_executor
from eprt.engine.executor import ShardExecutor
from eprt.engine.runner import ModelRunner
from eprt.model.config import LinearAttentionConfig, ModelConfig
from eprt.ops.numpy_ops import NumpyOps
from eprt.scheduler.interface import RowFailure

HIDDEN = 4  # the scripted model's hidden size (its passes compute nothing)


def scripted_config(vocab_size: int, hybrid: bool = False) -> ModelConfig:
    """A two-layer model config of the smallest sizes; ``hybrid``: its first layer keeps recurrent state."""
    return ModelConfig(
        model_type="qwen3_next" if hybrid else "qwen3_moe",
        vocab_size=vocab_size,
        hidden_size=HIDDEN,
        num_layers=2,
        num_heads=1,
        num_kv_heads=1,
        head_dim=2,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=1 << 20,
        tie_word_embeddings=True,
        num_experts=2,
        top_k=1,
        moe_intermediate_size=2,
        norm_topk_prob=True,
        intermediate_size=2,
        sparse_layers=(True, True),
        linear_attention=LinearAttentionConfig(1, 1, 1, 1, 2) if hybrid else None,
        layer_types=("linear_attention", "full_attention") if hybrid else (),
    )


class ScriptedModel:
    """MoEModel's interface for the executor, without arithmetic: every pass gives zeros."""

    def __init__(self, cfg: ModelConfig):
        self.cfg, self.ops = cfg, NumpyOps()
        self.w = SimpleNamespace(mtp=None, expert_start=0, expert_end=cfg.num_experts)
        self.inv_freq = np.zeros(1, np.float32)
        self.lora = self.lora_rows = self.exchange_lora_rows = self.exchange = self.slots = None

    def embed(self, ids: np.ndarray, image_rows=None, image_mask=None) -> np.ndarray:
        return np.zeros((len(ids), self.cfg.hidden_size), np.float32)  # [T, D]

    def hidden_states(self, h, batch, kv, state=None, deepstack=None):
        return h

    def logits(self, h) -> np.ndarray:
        return np.zeros((len(h), self.cfg.vocab_size), np.float32)  # [T, V]

    def idle_pass(self) -> None:
        pass

    def expert_load(self) -> np.ndarray:
        return np.zeros((self.cfg.num_layers, self.cfg.num_experts), np.int64)


class ScriptedLoraSlots:
    """The executor's LoRA slots without weights: which adapter each slot holds (LORA_LOAD,
    LORA_UNLOAD, SLOT_ADAPTER run on them as on real ones); no row gets a delta."""

    def __init__(self, max_loras: int):
        self.max_loras = max_loras
        self.ids = [-1] * max_loras  # adapter id held by each slot (-1: empty)

    def slot_of(self, adapter_id: int) -> int | None:
        return self.ids.index(adapter_id) if adapter_id in self.ids else None

    def read(self, path: str) -> None:
        return None

    def load(self, slot: int, adapter_id: int, adapter) -> None:
        self.ids[slot] = adapter_id

    def unload(self, slot: int) -> None:
        self.ids[slot] = -1

    def rows(self, adapter_ids) -> None:
        return None


def scripted_adapters(ids: list) -> tuple:
    """The adapters of a scenario (ids 1.. as registered in order, one LoRA slot each): the runner's
    part, the executor's slots; (None, None) without adapters."""
    if not ids:
        return None, None
    registry = AdapterRegistry(len(set(ids)))
    for i in range(1, max(ids) + 1):
        registry.register(f"adapter-{i}", f"scripted:{i}", check=False)
    return LoraAdapters(registry), ScriptedLoraSlots(len(set(ids)))


class ScriptedExchange:
    """dp attention's exchange with rank 0 alone present: the other ranks' rows come back as zeros."""

    def __init__(self, ranks: int, rank: int = 0):
        self.transport = SimpleNamespace(rank=rank, size=ranks)
        self.counts = [0] * ranks

    def begin(self, owners) -> None:
        self.counts = np.bincount(np.asarray(owners, np.int64), minlength=self.transport.size).tolist()

    def collect(self, rows: np.ndarray, counts: list | None = None) -> np.ndarray:
        n = sum(self.counts if counts is None else counts)
        return np.zeros((n, rows.shape[1]), rows.dtype)


class ScriptedTokens:
    """The runner's token source from per-request scripts: the token at position p of a request
    whose original prompt has P tokens is ``script[p - P]`` (the last entry past the script's end);
    ``failures[seq_id] = i`` answers its output token i with a RowFailure."""

    def __init__(self, scripts: dict, failures: dict | None = None):
        self.scripts = {k: (int(n), list(s)) for k, (n, s) in scripts.items()}  # seq_id -> (prompt length, script)
        self.failures = dict(failures or {})

    def token(self, seq, position: int):
        prompt_len, script = self.scripts[seq.seq_id]
        i = position - prompt_len
        if seq.think is not None:  # a discarded EOS took its entry: the step again answers the next one
            i += seq.think.discarded
        if i < 0:
            raise ValueError(f"s{seq.seq_id}: asked for a token inside the prompt (position {position})")
        if self.failures.get(seq.seq_id) == i:
            return RowFailure(f"planted failure of s{seq.seq_id} at output {i}")
        return script[min(i, len(script) - 1)]

    def draw(self, seqs: list, out, index, positions: list, result, plan=None) -> list:
        return [self.token(s, p) for s, p in zip(seqs, positions)]

    def targets(self, rows: list, drafts: list, out) -> list[list]:
        return [[self.token(r.seq, r.length + 1 + i) for i in range(len(d) + 1)] for r, d in zip(rows, drafts)]


class ScriptedDrafter:
    """Drafts from each request's draft script, aligned like its script: a sequence with i output
    tokens proposes ``drafts[i : i + k]``."""

    in_pass = False

    def __init__(self, scripts: ScriptedTokens, drafts: dict):
        self.scripts, self.drafts = scripts, {k: list(v) for k, v in drafts.items()}

    def draft(self, seq, k: int) -> list[int]:
        prompt_len, _ = self.scripts.scripts[seq.seq_id]
        i = len(seq.token_ids) - prompt_len
        return self.drafts.get(seq.seq_id, [])[i : i + k]


def scripted_runner(
    tokens: ScriptedTokens,
    *,
    vocab_size: int,
    max_slots: int,
    block_size: int,
    num_blocks: int,
    prefix_cache: bool = True,
    snapshots: int = 0,
    rank_blocks: list | None = None,
    drafts: dict | None = None,
    transport=None,
    rank: int = 0,
    adapters: tuple = (),
) -> ModelRunner:
    """The real runner and executor over the scripted model: ``snapshots`` > 0, a hybrid model keeping
    that many recurrent-state snapshots; ``rank_blocks``, dp attention with one pool per rank of those
    sizes (``num_blocks`` unused); ``transport``: where its frames go (default: a world of one);
    ``rank``: the rank its executor is (a worker's: its executor alone is used); ``adapters``: the
    adapter ids its requests use."""
    model = ScriptedModel(scripted_config(vocab_size, hybrid=snapshots > 0))
    part, lora = scripted_adapters(list(adapters))
    if rank_blocks is not None:
        exchange = ScriptedExchange(len(rank_blocks), rank)
        executor = dp_executor(model, list(rank_blocks), block_size, max_slots, exchange, prefix_cache, lora=lora)
    else:
        executor = ShardExecutor(
            model, num_blocks, block_size, max_slots, prefix_cache, None, snapshots or None, lora, snapshot_pool=False
        )
    drafter = ScriptedDrafter(tokens, drafts or {})
    transport = LocalTransport() if transport is None else transport
    return ModelRunner(executor, transport, drafter=drafter, adapters=part, tokens=tokens)
