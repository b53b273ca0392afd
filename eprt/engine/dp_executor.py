"""One rank's executor under dp attention (docs/design.md, "dp attention"): a configuration of the
executor's parts, not another class: the slot table of every slot, a mirror of every rank's block
manager with each sequence in its owner's pool (``block_pools.OwnerBlocks``), KV only for the
slots this rank owns, and the dp passes (``passes.DpPasses``): every forward pass joins the MoE
exchange (``eprt.comm.dp_combine``), with rows or without; its output, each row's greedy token and
final hidden state, reaches rank 0 in one small gather.
"""

from __future__ import annotations

from eprt.cache.owners import OwnerPools
from eprt.engine.block_pools import OwnerBlocks
from eprt.engine.executor import ShardExecutor, window_spec
from eprt.engine.passes import DpOutput, DpPasses
from eprt.model.moe_model import MoEModel

__all__ = ["DpOutput", "dp_executor"]


def dp_executor(
    model: MoEModel,
    pool_sizes: list[int],
    block_size: int,
    max_slots: int,
    exchange,
    prefix_cache: bool = True,
    image_token_id: int | None = None,
    lora=None,
    prefill_tokens: int = 0,
) -> ShardExecutor:
    """The executor of this rank (``exchange.transport.rank``) with one KV pool per rank of the world,
    of ``pool_sizes`` blocks each; ``prefill_tokens``: the largest prefill chunk (``window_spec``)."""
    if model.cfg.is_hybrid:
        raise ValueError(
            f"--attention dp does not serve {model.cfg.model_type} (recurrent state per owner is not built); "
            "use --attention replicated"
        )
    rank, size = exchange.transport.rank, exchange.transport.size
    if len(pool_sizes) != size:
        raise ValueError(f"{len(pool_sizes)} pool sizes for a world of {size} ranks")
    window = window_spec(model.cfg, prefill_tokens)
    pools = OwnerBlocks(OwnerPools(pool_sizes, block_size, prefix_cache, window=window), rank, max_slots)
    executor = ShardExecutor(
        model,
        pool_sizes[rank],
        block_size,
        max_slots,
        prefix_cache,
        image_token_id,
        lora=lora,
        prefill_tokens=prefill_tokens,
        pools=pools,
        passes=lambda ex: DpPasses(ex, exchange),
    )
    executor.owners, executor.prompt_hidden = pools.owners, pools.prompt_hidden  # [slots] each slot's owner rank
    executor.rank, executor.exchange = rank, exchange
    model.exchange = exchange
    return executor
