"""n choices of one prompt at every world size: FORK keeps the workers' slots and KV in step, and
the choices equal a single rank's; run by tests/run_all.sh at mpiexec -n 1, 2 and 3."""

import pytest
from test_expert_parallel_mpi import COMM, LocalTransport, engine_config, shared_checkpoint

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.model.tokenizer import ByteTokenizer


def _choices(cfg, transport=None, prompts=None):
    """(per-prompt choices, prompt tokens computed) on rank 0; None on workers."""
    prompts = prompts or [ByteTokenizer().encode(p) for p in ("Once upon a time, there was a", "The socket module")]
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=42, n=4, ignore_eos=True)
    try:
        with launch_engine(cfg, transport=transport) as engine:
            out = engine.generate_choices([GenerationRequest(p, params) for p in prompts])
            return out, engine.stats()["prompt_tokens_computed"], sum(len(p) for p in prompts)
    except SystemExit as e:  # worker ranks leave the engine at SHUTDOWN
        assert e.code == 0, f"worker rank {COMM.rank} exited with {e.code}"
        return None


@pytest.mark.mpi(min_size=1)
def test_n4_choices_fork_on_every_rank_and_equal_a_single_rank():
    cfg = EngineConfig(model=None, device="cpu", max_batch=8, prefix_cache=False)
    multi = _choices(cfg)
    single = _choices(cfg, LocalTransport()) if COMM.rank == 0 else None
    if COMM.rank == 0:
        (m, computed, prompt_tokens), (s, _, _) = multi, single
        assert computed == prompt_tokens  # one prefill per prompt, not one per choice
        tokens = [[r.token_ids for r in choices] for choices in m]
        assert tokens == [[r.token_ids for r in choices] for choices in s]
        assert all(len({tuple(t) for t in choices}) == 4 for choices in tokens)


@pytest.mark.mpi(min_size=1)
def test_hybrid_choices_fork_their_recurrent_state_on_every_rank():
    """qwen3_next (linear attention, snapshots on): FORK copies the recurrent state on every rank."""
    cfg = engine_config(shared_checkpoint("qwen3_next"), prefix_cache=True)
    cfg.max_batch = 8
    prompts = [list(range(3, 30)), list(range(40, 51))]
    multi = _choices(cfg, prompts=prompts)
    single = _choices(cfg, LocalTransport(), prompts) if COMM.rank == 0 else None
    if COMM.rank == 0:
        (m, computed, prompt_tokens), (s, _, _) = multi, single
        assert computed == prompt_tokens
        assert [[r.token_ids for r in c] for c in m] == [[r.token_ids for r in c] for c in s]
