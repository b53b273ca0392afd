"""The built-in default model (8 experts: 8, 4+4, 3+3+2 per rank) gives a single rank's greedy tokens
at every world size; run by tests/run_all.sh at mpiexec -n 1, 2 and 3."""

import pytest
from test_default_model import readme_command
from test_expert_parallel_mpi import COMM, run_everywhere, run_single

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig
from eprt.model.tokenizer import ByteTokenizer


@pytest.mark.mpi(min_size=1)
def test_default_model_greedy_text_equals_single_rank():
    prompt, n = readme_command()
    prompts = [ByteTokenizer().encode(p) for p in (prompt, "Return the", "The socket module")]
    cfg = EngineConfig(model=None, device="cpu", max_batch=4)
    reqs = lambda: [GenerationRequest(p, SamplingParams(max_tokens=n)) for p in prompts]  # noqa: E731
    multi = run_everywhere(cfg, reqs)
    single = run_single(cfg, reqs)
    if COMM.rank == 0:
        assert [r.token_ids for r in multi] == [r.token_ids for r in single]
        assert [r.text for r in multi] == [r.text for r in single] and all(r.text for r in multi)
