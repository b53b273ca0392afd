"""``eprt plan --exchange``: the MoE exchange's bytes and link time per decode step at several EP
sizes, for the all-gather and the all-to-all exchange (docs/plan.md, "The MoE exchange at scale").

P ranks (one GPU each, G a node), B rows a rank owns in a decode step (dp attention: the wide-EP
deployment), D hidden, k routed experts of E, L MoE layers; rows travel at the weights' dtype
(a bytes), the partial sums come back as float32 (eprt sums in float32), and either exchange
all-gathers each row's routing (k weights and k ids, 4 bytes each) so every rank knows every unit.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from eprt.entry.capacity import size
from eprt.model.loader import expert_shard

EXCHANGES = ("allgather", "alltoall")


@dataclass(frozen=True)
class Links:
    nvlink_gbps: float = 900.0  # per GPU inside a node (H100/H200 NVLink 4), GB/s each way
    ib_gbps: float = 50.0  # per GPU between nodes (one 400 Gb/s InfiniBand NDR port per GPU), GB/s each way
    gpus_per_node: int = 8


@dataclass(frozen=True)
class ExchangeRow:
    ranks: int
    exchange: str
    remote_ranks: float  # other ranks a row visits (alltoall; allgather: all of them)
    sent_bytes: float  # per rank per MoE layer
    recv_bytes: float
    step_bytes: float  # per rank per decode step, sent + received, over every MoE layer
    link_s: float  # per decode step: the slower of the NVLink and the InfiniBand share


def remote_ranks(num_experts: int, top_k: int, ranks: int) -> float:
    """Expected other ranks holding at least one of a row's k experts (uniform routing, experts split
    as the loader splits them): the sum over the other ranks of 1 - C(E - e_r, k) / C(E, k)."""
    total = math.comb(num_experts, top_k)
    shares = [b - a for a, b in (expert_shard(num_experts, r, ranks) for r in range(ranks))]
    return sum(1 - math.comb(num_experts - e, top_k) / total for e in shares[1:])  # rank 0: the most experts


def exchange_rows(cfg, ranks: list[int], batch: int, dtype_bytes: int, links: Links) -> list[ExchangeRow]:
    D, k, E, L = cfg.hidden_size, cfg.top_k, cfg.num_experts, sum(cfg.sparse_layers)
    out = []
    for P in ranks:
        meta = (P - 1) * batch * 8 * k  # the routing's all-gather, each way
        for exchange in EXCHANGES:
            peers = P - 1 if exchange == "allgather" else remote_ranks(E, k, P)
            each_way = peers * batch * D * (dtype_bytes + 4) + meta  # rows out, float32 partials back
            inter = max(0, P - links.gpus_per_node) / max(1, P - 1)  # the share of the peers on other nodes
            layer_s = max((1 - inter) * each_way / (links.nvlink_gbps * 1e9), inter * each_way / (links.ib_gbps * 1e9))
            out.append(ExchangeRow(P, exchange, peers, each_way, each_way, 2 * each_way * L, layer_s * L))
    return out


def render_exchange(cfg, name: str, rows: list[ExchangeRow], batch: int, dtype: str, links: Links) -> str:
    lines = [
        f"eprt plan: the MoE exchange of {name} ({cfg.model_type}: D {cfg.hidden_size}, top-{cfg.top_k} of "
        f"{cfg.num_experts} experts, {sum(cfg.sparse_layers)} MoE layers), a decode step of {batch} rows per rank "
        f"(dp attention), rows in {dtype}, partials back in float32",
        f"links: NVLink {links.nvlink_gbps:g} GB/s per GPU inside a node of {links.gpus_per_node}, InfiniBand "
        f"{links.ib_gbps:g} GB/s per GPU between nodes; uniform routing; latency not counted",
        "",
    ]
    header = ["ranks", "exchange", "other ranks a row visits", "sent/layer", "received/layer", "per step"]
    header += ["link/step", "x"]
    table = []
    for r in rows:
        base = next(b for b in rows if b.ranks == r.ranks and b.exchange == "allgather")
        table.append(
            [
                str(r.ranks),
                r.exchange,
                f"{r.remote_ranks:.2f}",
                size(r.sent_bytes),
                size(r.recv_bytes),
                size(r.step_bytes),
                f"{1e3 * r.link_s:.2f} ms",
                f"{r.step_bytes / base.step_bytes:.3f}",
            ]
        )
    widths = [max(len(h), *(len(t[i]) for t in table)) for i, h in enumerate(header)]
    for row in [header, *table]:
        lines.append("  ".join(c.rjust(w) for c, w in zip(row, widths)))
    lines.append("(x: the step's bytes over the all-gather's at the same ranks)")
    return "\n".join(lines)


def exchange_json(rows: list[ExchangeRow], batch: int, links: Links) -> dict:
    return {"batch_per_rank": batch, "links": asdict(links), "exchange": [asdict(r) for r in rows]}
