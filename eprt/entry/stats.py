"""``eprt stats FILE [--plot PNG]``: the expert-load statistics of ``eprt run --stats-out``: each
MoE layer's imbalance (max/mean tokens per expert) and each rank's share, and with ``--plot`` a
layer x expert heat map beside the per-rank load (matplotlib: the ``plot`` extra)."""

from __future__ import annotations

import numpy as np

from eprt.engine.expert_load import imbalance, rank_load, read_stats


def summary(counts: np.ndarray, model: str, world: int) -> str:
    ratios, load = imbalance(counts), rank_load(counts, world)
    moe = [i for i in range(len(counts)) if counts[i].any()]
    lines = [f"{model}: {len(moe)} MoE layers x {counts.shape[1]} experts, {int(counts.sum())} routed tokens"]
    lines += ["layer  tokens  max/mean  busiest expert"]
    lines += [f"{i:>5}  {int(counts[i].sum()):>6}  {ratios[i]:>8.2f}  {int(counts[i].argmax()):>14}" for i in moe]
    share = load / max(load.sum(), 1)
    lines += [f"rank {r}: {int(n)} tokens ({100 * s:.1f}%)" for r, (n, s) in enumerate(zip(load, share))]
    if world > 1:
        lines.append(f"rank imbalance (max - mean) / mean: {(load.max() - load.mean()) / max(load.mean(), 1):.2f}")
    return "\n".join(lines)


def plot(counts: np.ndarray, model: str, world: int, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'eprt[plot]'") from None
    fig, (heat, bars) = plt.subplots(1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [3, 1]})
    image = heat.imshow(counts, aspect="auto", cmap="viridis", interpolation="nearest")
    heat.set(xlabel="expert", ylabel="layer", title=f"{model}: tokens per expert")
    heat.set_yticks(range(counts.shape[0]))
    if counts.shape[1] <= 64:
        heat.set_xticks(range(counts.shape[1]))
    fig.colorbar(image, ax=heat, label="tokens")
    load = rank_load(counts, world)
    bars.bar(range(world), load, color="tab:orange")
    bars.axhline(load.mean(), color="black", linestyle="--", linewidth=1, label="mean")
    bars.set(xlabel="rank", ylabel="tokens", title=f"per-rank load ({world} ranks)", xticks=range(world))
    bars.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def add_arguments(parser) -> None:
    parser.add_argument("file", help="a statistics file written by eprt run --stats-out")
    parser.add_argument("--plot", metavar="PNG", help="draw the heat map and the per-rank load into this PNG")
    parser.add_argument(
        "--ranks", type=int, default=None, help="per-rank load for this many ranks (default: the run's)"
    )


def main(args) -> int:
    counts, model, world = read_stats(args.file)
    if args.ranks is not None:
        if not 1 <= args.ranks <= counts.shape[1]:
            raise ValueError(
                f"--ranks must be in [1, {counts.shape[1]}] (one expert per rank at least), got {args.ranks}"
            )
        world = args.ranks
    print(summary(counts, model, world))
    if args.plot:
        plot(counts, model, world, args.plot)
        print(f"plot written to {args.plot}")
    return 0
