"""Multi-LoRA across expert shards, written once and run at several world sizes:

    mpiexec -n 1|2|3 python -m pytest --with-mpi tests/mpi/test_lora_mpi.py

7 experts split unevenly (4+3, 3+2+2); each rank reads only its experts' adapter factors.
A batch mixing the base model and two adapters (one with fused-expert LoRA, ranks 4 and 2 by
pattern; one attention-only of rank 8) gives every row the greedy tokens of transformers with
that adapter merged by peft, and one LoRA slot serving both (LRU eviction, LORA_LOAD on every
rank) gives the same tokens.
"""

import os

import pytest
from checkpoints import reference_greedy
from lora_adapters import peft_adapter
from test_expert_parallel_mpi import COMM, engine_config, run_everywhere, shared_checkpoint

from eprt.api import GenerationRequest, SamplingParams

PROMPTS = [[5, 77, 3, 140, 9, 9, 31, 200, 17], [7, 7, 7, 7, 7], [90, 91, 92, 93, 94, 95]]
STEPS = 8


def adapters_and_references(base):
    """Rank 0 writes the adapters and computes the merged references; every rank gets them."""
    out = None
    if COMM.rank == 0:
        root = os.path.dirname(base)
        a1 = peft_adapter(
            base,
            os.path.join(root, "lora7-experts"),
            seed=3,
            r=4,
            lora_alpha=8,
            target_modules=["v_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            rank_pattern={"down_proj": 2},
            alpha_pattern={"down_proj": 6},
        )
        a2 = peft_adapter(
            base, os.path.join(root, "lora7-attn"), seed=4, r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"]
        )
        jobs = [(None, base), ("experts", a1[1]), ("attn", a2[1])]
        refs = [reference_greedy(path, p, STEPS)[0] for (_, path), p in zip(jobs, PROMPTS)]
        out = ({"experts": a1[0], "attn": a2[0]}, refs)
    return COMM.bcast(out, root=0)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("attention", ["replicated", "dp"])
@pytest.mark.parametrize("max_loras", [2, 1])
def test_mixed_adapter_batch_matches_peft_merged_at_every_world_size(max_loras, attention):
    """Under dp attention each owner applies the attention deltas of its rows, and every rank the
    expert deltas of every gathered row."""
    base = shared_checkpoint("qwen3_moe")
    dirs, refs = adapters_and_references(base)
    cfg = engine_config(base, lora_modules=tuple(dirs.items()), max_loras=max_loras, attention=attention)
    params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
    names = [None, "experts", "attn"]
    reqs = lambda: [GenerationRequest(p, params, adapter=a) for a, p in zip(names, PROMPTS)]  # noqa: E731
    multi = run_everywhere(cfg, reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == refs
