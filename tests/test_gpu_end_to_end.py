"""The CuPy backend end to end against the NumPy backend (skipped without a GPU; run on the CPU
by the cusim plugin in CI, see tests/cusim/README.md).

The backends cannot agree token for token forever: the NumPy backend keeps fp32 activations,
the CuPy backend bf16 ones, and an MoE router turns a tiny difference into a different expert
when two experts' scores nearly tie. (On the tiny Mixtral checkpoint, layer 0 at one position
gives its 2nd and 3rd experts probabilities 0.1869 and 0.1852; bf16 rounding of the router
input, ~0.01 in the router logits, swaps them and the next token's logits move by ~1.)

So greedy tokens must be equal up to the first difference, and that difference must be
explained by a decision made at a near-tie: both backends are teacher-forced on the same
context the way generation computed it (the prompt's prefill, then one decode step per token
generated before the difference: prefill and decode run different kernels, so a near-tie can
flip in one and not the other); at the first MoE layer where their expert choices differ,
every flipped position must be a near-tie of the reference router (probability gap between
its k-th and (k+1)-th expert below ROUTE_TIE). If no routing differs, the tokens themselves must be near-ties:
each backend's token within LOGIT_TIE of the other's best logit, whatever its rank there (qwen3_next's
prompt [5, 77, 3], token 9: three tokens within 0.008 of each other on the CPU, 1.702 / 1.696 / 1.694,
so the GPU's choice is the CPU's third).
DeepSeek-style grouped routing (deepseek_v2/v3, glm4_moe) counts a near-tie in its selection
values (scores + bias) or in its group scores.
"""

import numpy as np
import pytest

from eprt.api import GenerationRequest, SamplingParams
from eprt.engine.engine import EngineConfig, launch_engine
from eprt.engine.executor import ShardExecutor
from eprt.model.loader import load_model
from eprt.ops.base import GroupedRouting
from eprt.ops.device import cuda_usable, get_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not cuda_usable(), reason="no usable CUDA device")]

PROMPTS = [[5, 77, 3], [140, 9, 9, 31, 200, 17, 64, 12, 250, 11], list(range(40, 75))]
NEW_TOKENS = 12
ROUTE_TIE = 0.01  # router probability; bf16 rounding moves router logits by ~1e-2
LOGIT_TIE = 0.1  # logits; bf16 activations move these tiny models' logits by ~2e-2


def greedy(path, device):
    cfg = EngineConfig(model=path, device=device, max_batch=4, block_size=16, max_model_len=128)
    with launch_engine(cfg) as engine:
        return [
            r.token_ids
            for r in engine.generate([GenerationRequest(p, SamplingParams(max_tokens=NEW_TOKENS)) for p in PROMPTS])
        ]


def teacher_forced(path, device, prompt, generated=()):
    """(next-token logits [V], per router call in order (router logits [T, E], expert ids [T, k])):
    the prompt's prefill, then a decode step for each of the ``generated`` tokens."""
    ops = get_ops(device)
    routes = []
    route = ops.route  # every MoE layer's routing (router or router_grouped, the count, the permutation)

    def recording_route(logits, top_k, routing, bias, counts, local):
        weights, ids, perm = route(logits, top_k, routing, bias, counts, local)
        grouped = isinstance(routing, GroupedRouting)
        if grouped:
            choice = grouped_choice(ops.to_host(logits), None if bias is None else ops.to_host(bias), routing)
        else:
            choice = ops.to_host(logits).astype(np.float64)
        routes.append((choice, np.sort(ops.to_host(ids), axis=1), grouped))
        return weights, ids, perm

    ops.route = recording_route
    ex = ShardExecutor(load_model(path, ops, max_len=128).model, 8, 16, 1, prefix_cache=False)
    ex.allocate(0, prompt)
    logits = ex.prefill(0, prompt, 0, len(prompt))
    for token in generated:
        logits = ex.decode([0], [token])
    return ops.to_host(logits)[0], routes


def grouped_choice(logits: np.ndarray, bias, routing) -> np.ndarray:
    """DeepSeek routing's selection values [T, E] (float64): scores + bias, -inf outside the kept
    groups, and the group scores' tie as an extra column: the gap between the last kept and the
    first dropped group (inf with one group)."""
    logits = logits.astype(np.float64)
    if routing.scoring == "softmax":
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores /= scores.sum(axis=1, keepdims=True)
    else:
        scores = 1 / (1 + np.exp(-logits))
    choice = scores + (0 if bias is None else bias)
    T, E = choice.shape
    gap = np.full((T, 1), np.inf)
    if routing.n_group > 1:
        groups = np.sort(choice.reshape(T, routing.n_group, -1), axis=-1)
        gs = groups[..., -1] if routing.group_score == "max" else groups[..., -2:].sum(axis=-1)
        order = np.sort(gs, axis=1)[:, ::-1]
        if routing.topk_group < routing.n_group:
            gap[:, 0] = order[:, routing.topk_group - 1] - order[:, routing.topk_group]
        kept = gs >= order[:, routing.topk_group - 1 : routing.topk_group]
        choice = np.where(np.repeat(kept, E // routing.n_group, axis=1), choice, -np.inf)
    return np.concatenate([choice, gap], axis=1)


def route_gap(values: np.ndarray, k: int, grouped: bool) -> float:
    """How close one token's top-k decision was. Softmax router (values = logits): the k-th minus
    the (k+1)-th probability. Grouped routing (values = a grouped_choice row): the smaller of that
    gap in the selection values and the gap between the kept and dropped groups."""
    if not grouped:
        p = np.exp(values - values.max())
        p = np.sort(p / p.sum())[::-1]
        return p[k - 1] - p[k]
    choice = np.sort(values[:-1])[::-1]
    return min(choice[k - 1] - choice[k] if k < choice.size else np.inf, values[-1])


def near_tie(logits: np.ndarray, token: int) -> bool:
    return logits[token] >= logits.max() - LOGIT_TIE


def explain_divergence(path, prompt, generated, want, got) -> str | None:
    """None when the first difference (``want`` on the CPU, ``got`` on the GPU after the prompt and
    the tokens ``generated`` before it) is explained by a near-tie, else why not."""
    ref, ref_routes = teacher_forced(path, "cpu", prompt, generated)
    dev, dev_routes = teacher_forced(path, "cuda", prompt, generated)
    for layer, ((values, ids, grouped), (_, dev_ids, _)) in enumerate(zip(ref_routes, dev_routes)):
        flipped = np.nonzero((ids != dev_ids).any(axis=1))[0]
        if flipped.size == 0:
            continue
        for pos in flipped:
            gap = route_gap(values[pos], ids.shape[1], grouped)
            if gap >= ROUTE_TIE:
                return (
                    f"router call {layer} row {pos}: experts {ids[pos].tolist()} (cpu) vs "
                    f"{dev_ids[pos].tolist()} (cuda) with a router gap of {gap:.4f}"
                )
        return None  # the first routing difference is a near-tie; everything after follows from it
    if near_tie(ref, got) and near_tie(dev, want):
        return None
    return (
        f"same routing, but token {got} (cuda) vs {want} (cpu) is no near-tie: cpu logits "
        f"{ref[want]:.3f} vs {ref[got]:.3f}, cuda {dev[got]:.3f} vs {dev[want]:.3f}"
    )


@pytest.mark.parametrize(
    "arch", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe"]
)
def test_cuda_greedy_tokens_follow_numpy(checkpoint, arch):
    assert_cuda_follows_numpy(checkpoint(arch, dtype="bfloat16"))  # bf16 on disk: the same weights for both


def assert_cuda_follows_numpy(path):
    """Greedy CuPy tokens equal NumPy's up to the first difference, which must be a near-tie."""
    cpu, cuda = greedy(path, "cpu"), greedy(path, "cuda")
    for prompt, want, got in zip(PROMPTS, cpu, cuda):
        assert len(got) == len(want) == NEW_TOKENS
        n = next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)
        if n is not None:
            why = explain_divergence(path, prompt, want[:n], want[n], got[n])
            assert why is None, f"prompt {prompt}: generated token {n} differs ({got[n]} vs {want[n]}): {why}"
