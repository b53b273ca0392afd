"""EPLB (docs/eplb.md): placement policies, the token-to-replica choice, the EPLB_PLACEMENT frame, and
ranks simulated by threads whose forward passes must give the single-rank logits bit for bit."""

import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from eprt.comm import protocol as P
from eprt.engine.config import EplbConfig
from eprt.engine.executor import ShardExecutor
from eprt.engine.expert_load import write_stats
from eprt.model.loader import load_model
from eprt.model.placement import (
    Placement,
    balanced,
    balanced_packing,
    choose_slots,
    contiguous,
    imbalance_ratio,
    replica_table,
    slot_ranges,
)
from eprt.ops.numpy_ops import NumpyOps

SKEWED = np.array([[70, 10, 290, 490, 130, 530, 20, 10], [60, 100, 10, 40, 2290, 50, 60, 10]])


def test_balanced_packing_fills_each_pack_to_its_capacity_heaviest_first():
    pack = balanced_packing(np.array([[5.0, 1, 4, 2, 3]]), [3, 2])
    assert np.bincount(pack[0], minlength=2).tolist() == [3, 2]
    assert pack[0].tolist() == [0, 0, 1, 0, 1]  # 5 -> 0, 4 -> 1, 3 -> 1 (lighter), 2 -> 0, 1 -> 0 (1 is full)
    with pytest.raises(ValueError, match="do not fill"):
        balanced_packing(np.ones((1, 4)), [2, 1])


@pytest.mark.parametrize("world,redundant", [(2, 0), (2, 2), (3, 1), (4, 4)])
def test_global_policy_holds_every_expert_and_beats_contiguous(world, redundant):
    slots = 8 + redundant
    placed = balanced(SKEWED, slots, world)
    assert placed.table.shape == (2, slots)
    assert all(set(row) == set(range(8)) for row in placed.table.tolist())
    ranks = [b - a for a, b in slot_ranges(slots, world)]
    assert [placed.local_experts(r).shape[1] for r in range(world)] == ranks
    plain = imbalance_ratio(contiguous(2, 8, 8, world).rank_tokens(SKEWED))
    ours = imbalance_ratio(placed.rank_tokens(SKEWED))
    assert (ours <= plain + 1e-9).all() and ours.sum() < plain.sum()
    if redundant >= world:  # the hot expert of layer 1 (2290 of 2650 tokens) gets replicas
        assert placed.replica_counts()[1, 4] > 1


def test_hierarchical_policy_keeps_each_group_on_one_node():
    placed = balanced(SKEWED, 12, 4, groups=4, nodes=2)
    for row in placed.table:
        for node in (row[:6], row[6:]):  # 2 nodes of 2 ranks, 6 slots each
            assert {int(e) // 2 for e in node} <= set(range(4)) and len({int(e) // 2 for e in node}) == 2
    with pytest.raises(ValueError, match="divisible"):
        balanced(SKEWED, 12, 4, groups=3, nodes=2)


def rank_sets(placed: Placement) -> list:
    """Per layer, each rank's experts as a sorted list (the order of a rank's own slots is free)."""
    return [[sorted(row[a:b]) for a, b in slot_ranges(len(row), placed.world)] for row in placed.table.tolist()]


def test_hierarchical_policy_gives_deepseeks_published_placement():
    # The example of DeepSeek's EPLB README (github.com/deepseek-ai/EPLB): 2 layers of 12 experts in 4
    # groups, 16 replicas on 2 nodes of 4 GPUs. Its phy2log, two slots per GPU:
    #   [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    #    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]
    weight = np.array(
        [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
    )
    published = [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    want = rank_sets(Placement(np.array(published, np.int32), 12, 8))
    assert rank_sets(balanced(weight, 16, 8, groups=4, nodes=2)) == want


def test_global_policy_replicates_by_load_per_replica_and_packs_heaviest_first():
    # Worked by hand from DeepSeek's algorithm. Loads 10, 6, 3, 1 on 6 slots of 3 ranks: the first
    # extra slot goes to expert 0 (10 per replica), the second to expert 1 (6 against 0's 5), so the
    # replicas carry 5, 3, 3, 1, 5, 3 tokens. Heaviest first into the lightest rank with room:
    # 5 -> r0, 5 -> r1, 3 -> r2, 3 -> r2, 3 -> r0, 1 -> r1: ranks {0, 1}, {0, 3}, {1, 2} at 8, 6, 6.
    # Every extra slot to the heaviest expert instead (10/3 per replica) would give 6 + 1 on one rank.
    placed = balanced(np.array([[10, 6, 3, 1]]), 6, 3)
    assert rank_sets(placed) == [[[0, 1], [0, 3], [1, 2]]]
    assert placed.replica_counts().tolist() == [[2, 2, 1, 1]]
    assert placed.rank_tokens(np.array([[10, 6, 3, 1]])).tolist() == [[8.0, 6.0, 6.0]]


def test_placement_refuses_an_expert_on_no_slot():
    with pytest.raises(ValueError, match="expert 3 of layer 0 on no slot"):
        Placement(np.array([[0, 1, 2, 0]]), 4, 2)


def test_replica_choice_is_deterministic_and_keeps_parts_of_min_rows():
    placed = Placement(np.array([[0, 1, 0, 2, 0, 3]]), 4, 3)  # expert 0 on slots 0, 2, 4
    replicas = replica_table(placed)
    assert replicas[0, 0].tolist() == [0, 2, 4]
    ids = np.zeros((12, 1), np.int64)  # 12 tokens, all to expert 0
    slots = choose_slots(placed, replicas, 0, ids, min_rows=5)
    assert np.bincount(slots[:, 0], minlength=6)[[0, 2, 4]].tolist() == [6, 6, 0]  # 12 // 5 = 2 parts
    assert np.array_equal(slots, choose_slots(placed, replicas, 0, ids, min_rows=5))
    assert sorted(np.bincount(choose_slots(placed, replicas, 0, ids, min_rows=1)[:, 0])[[0, 2, 4]]) == [4, 4, 4]
    few = choose_slots(placed, replicas, 0, np.zeros((4, 1), np.int64), min_rows=5)
    assert len(set(few[:, 0].tolist())) == 1  # 4 rows: one replica, the per-row bits of a single copy


def test_replicated_expert_goes_whole_to_its_least_loaded_rank_and_splits_only_above_a_share():
    # 4 ranks of 2 slots; expert 0 on slots 0 (rank 0) and 6 (rank 3), expert 1 on slots 1 (rank 0) and 7
    placed = Placement(np.array([[0, 1, 2, 3, 4, 5, 0, 1]]), 6, 4)
    replicas = replica_table(placed)
    ids = np.array([[0, 2]] * 6 + [[1, 4]] * 6 + [[3, 5]] * 2)  # 28 rows, 7 a rank; expert 0: 6, expert 1: 6
    slots = choose_slots(placed, replicas, 0, ids, min_rows=5)
    # single-copy loads: rank 0 none, rank 1 (2, 3) 8, rank 2 (4, 5) 8, rank 3 none; expert 0 (6 rows,
    # under a share) goes whole to rank 0, then expert 1 whole to rank 3, the least loaded
    assert slots[:6, 0].tolist() == [0] * 6 and slots[6:12, 0].tolist() == [7] * 6
    owner = placed.slot_rank[slots.reshape(-1)]
    assert np.bincount(owner, minlength=4).tolist() == [6, 8, 8, 6]
    hot = np.array([[0, 2]] * 12 + [[3, 4]] * 2)  # expert 0: 12 rows, over a share (7): two parts of 6
    slots = choose_slots(placed, replicas, 0, hot, min_rows=5)
    assert slots[:6, 0].tolist() == [0] * 6 and slots[6:12, 0].tolist() == [6] * 6
    assert choose_slots(placed, replicas, 0, hot, min_rows=7)[:12, 0].tolist() == [0] * 12  # parts of < 7


def test_eplb_placement_frame_round_trips_and_refuses_a_wrong_size():
    cmd = P.EplbPlacement(epoch=3, layers=2, slots=3, table=(0, 1, 2, 2, 1, 0))
    words = P.encode(cmd)
    assert words[:5].tolist() == [0, P.EPLB_PLACEMENT, 3, 2, 3]
    assert P.decode_all(words) == [cmd]
    with pytest.raises(P.ProtocolError, match="EPLB_PLACEMENT of 2 x 3"):
        P.encode(P.EplbPlacement(1, 2, 3, (0, 1)))
    with pytest.raises(P.ProtocolError, match="EPLB_PLACEMENT of 0 x 3"):
        P.decode_all([0, P.EPLB_PLACEMENT, 1, 0, 3])


# ---- ranks as threads -------------------------------------------------------------------------
class ThreadWorld:
    """W ranks in threads; combine(rank) sums the ranks' partials in rank order, as the transport does;
    gather(rank) concatenates the ranks' rows in rank order (EPLB's combine, the transport's allgather_rows)."""

    def __init__(self, world: int):
        self.world, self.parts = world, [None] * world
        self.barrier = threading.Barrier(world)

    def combine(self, rank: int):
        def allsum(partial):
            self.parts[rank] = partial
            self.barrier.wait()
            out = self.parts[0].copy()
            for p in self.parts[1:]:
                out += p
            self.barrier.wait()
            return out

        return allsum

    def gather(self, rank: int):
        def allgather_rows(rows, counts):
            assert rows.shape[0] == counts[rank], (rows.shape, counts, rank)
            self.parts[rank] = rows
            self.barrier.wait()
            out = np.concatenate(self.parts)
            self.barrier.wait()
            return out

        return allgather_rows

    def run(self, fn):
        out, errors = [None] * self.world, []

        def one(rank):
            try:
                out[rank] = fn(rank)
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        if errors:
            raise errors[0]
        return out


PROMPTS = [list(range(90, 130)), [5, 77, 3, 140, 9, 9, 31, 200, 17, 64, 12, 250, 11], [8, 7]]


def forward_logits(path, rank, world, combine, placement_for, switch_at=None, gather=None):
    """Prefill PROMPTS, then 6 decode steps of all three; EPLB switches to ``switch_at[1]`` after
    decode step ``switch_at[0]``. Returns every logits row, stacked."""
    lm = load_model(path, NumpyOps(), 512, rank, world, combine, placement_for, gather)
    ex = ShardExecutor(lm.model, 64, 4, 4, prefix_cache=False)
    rows = []
    for s, p in enumerate(PROMPTS):
        ex.allocate(s, p)
        rows.append(ex.prefill(s, p, 0, len(p)))
    for step in range(6):
        rows.append(ex.decode([0, 1, 2], [3 + step, 40 + step, 200 - step]))
        if switch_at is not None and step == switch_at[0]:
            ex.switch_placement(1, switch_at[1])
    return np.concatenate(rows)


def threaded_logits(path, world, start, switch):
    tw = ThreadWorld(world)
    return tw.run(lambda r: forward_logits(path, r, world, tw.combine(r), lambda c: start, switch, tw.gather(r)))


@pytest.mark.parametrize("arch", ["deepseek_v3", "qwen3_moe"])
def test_placed_experts_give_the_single_rank_logits_bit_for_bit(checkpoint, arch):
    """At 2, 3 and 4 ranks, contiguous / balanced with redundant slots / a switch in mid-decode: the
    logits equal one rank without EPLB exactly (deepseek_v3: grouped routing over 3 groups)."""
    extra = {"n_group": 3, "topk_group": 2} if arch == "deepseek_v3" else {}
    path = checkpoint(arch, **extra)
    lm = load_model(path, NumpyOps(), 512)
    cfg = lm.model.cfg
    want = forward_logits(path, 0, 1, lambda p: p, lambda c: None)
    counts = np.random.default_rng(1).zipf(1.6, (cfg.num_layers, cfg.num_experts)) * 10
    for world, redundant in [(2, 2), (3, 3), (4, 2)]:
        slots = cfg.num_experts + redundant
        placed = balanced(counts, slots, world)
        plain = contiguous(cfg.num_layers, cfg.num_experts, slots, world)
        for start, switch in [(plain, None), (placed, None), (plain, (2, placed.table))]:
            for rank_logits in threaded_logits(path, world, start, switch):
                assert np.array_equal(rank_logits, want), (world, redundant, switch is not None)


def test_switch_reads_only_the_experts_a_rank_newly_holds(checkpoint):
    path = checkpoint("qwen3_moe")
    E = 6
    plain = contiguous(3, E, E + 2, 2)
    lm = load_model(path, NumpyOps(), 512, 0, 2, lambda p: p, placement_for=lambda c: plain)
    new = plain.table.copy()
    new[0, :4] = [5, 4, 3, 2]  # rank 0 held 0 1 2 3 (layer 0): 4 and 5 are new
    new[0, 4:] = [0, 1, 0, 1]
    ex = ShardExecutor(lm.model, 16, 4, 2, prefix_cache=False)
    sparse = sum(lm.model.cfg.sparse_layers[:1])
    assert ex.switch_placement(1, new) == 2 * sparse
    full = load_model(path, NumpyOps(), 512)
    if lm.model.cfg.sparse_layers[0]:
        assert np.array_equal(lm.model.w.layers[0].w_gate_up, full.model.w.layers[0].w_gate_up[[5, 4, 3, 2]])
    with pytest.raises(ValueError, match="epoch 3 after epoch 1"):
        ex.switch_placement(3, new)


def test_eplb_config_names_the_bad_field(tmp_path):
    with pytest.raises(ValueError, match="--num-redundant-experts must be >= 0, got -1"):
        EplbConfig(num_redundant_experts=-1).validate()
    with pytest.raises(ValueError, match="--eplb-policy must be one of"):
        EplbConfig(policy="round_robin").validate()
    assert EplbConfig(init_expert_placement=str(tmp_path / "x.json")).active and not EplbConfig().active


def test_count_nodes_logs_when_a_nodes_ranks_outnumber_its_cores(monkeypatch, caplog):
    import socket

    from eprt.engine import eplb

    here = socket.gethostname()
    transport = type("T", (), {"rank": 0, "allgather_text": lambda self, text: [here] * 3 + ["other"]})()
    monkeypatch.setattr(eplb.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(logging.getLogger("eprt"), "propagate", True)  # an engine run here may have stopped it
    with caplog.at_level("INFO", logger="eprt.engine"):
        assert eplb.count_nodes(transport, EplbConfig()) == 2
        assert eplb.count_nodes(transport, EplbConfig(nodes=4)) == 4
    assert "EPLB: 3 ranks share this node's 2 CPU cores" in caplog.text
    caplog.clear()
    monkeypatch.setattr(eplb.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    with caplog.at_level("INFO", logger="eprt.engine"):
        eplb.count_nodes(transport, EplbConfig())
    assert "share this node" not in caplog.text


def test_init_placement_file_must_match_the_model(checkpoint, tmp_path):
    from eprt.engine.eplb import initial_placement

    cfg = load_model(checkpoint("qwen3_moe"), NumpyOps(), 64).config
    stats = tmp_path / "stats.json"
    write_stats(str(stats), np.ones((2, 6), np.int64), "qwen3_moe", 2)
    with pytest.raises(ValueError, match=r"counts of shape \[2, 6\], this model has \[3, 6\]"):
        initial_placement(EplbConfig(init_expert_placement=str(stats)), cfg, 2, 1)
    write_stats(str(stats), SKEWED[:, :6].repeat(2, axis=0)[:3], "qwen3_moe", 2)
    placed = initial_placement(EplbConfig(init_expert_placement=str(stats), num_redundant_experts=2), cfg, 2, 1)
    assert placed.table.shape == (3, 8)


# ---- rank 0's rebalancing loop and its figures --------------------------------------------------
class FakeModelForRebalance:
    """What the Rebalancer reads: cumulative expert counts and the slots' placement."""

    def __init__(self, placement):
        self.counts = np.zeros((2, 8), np.int64)
        self.slots = type("Slots", (), {"placement": placement, "epoch": 0})()

    def expert_load(self):
        return self.counts.copy()


class FakeRunnerForRebalance:
    def __init__(self, model):
        self.executor = type("Executor", (), {"model": model})()
        self.switched = []

    def switch_placement(self, epoch, table):
        self.switched.append((epoch, table.copy()))
        model = self.executor.model
        model.slots.placement, model.slots.epoch = Placement(table, 8, 2), epoch
        return 3


def test_rebalancer_uses_the_window_counts_and_sends_a_new_placement_only_when_it_changes():
    from eprt.engine.eplb import Rebalancer
    from eprt.model.config import ModelConfig

    cfg = type("Cfg", (), {"num_layers": 2, "num_experts": 8, "sparse_layers": [True, True], "routing": None})()
    assert not isinstance(cfg, ModelConfig)  # only the fields the Rebalancer reads
    model = FakeModelForRebalance(contiguous(2, 8, 10, 2))
    runner = FakeRunnerForRebalance(model)
    eplb = Rebalancer(runner, EplbConfig(num_redundant_experts=2, interval=4, window=2), cfg, 2, 1)
    old = np.zeros((2, 8), np.int64)
    old[:, 7] = 1000  # before the window: expert 7 hot
    model.counts += old
    eplb.after_step()
    eplb.after_step()  # step 2: the window's first counts are taken here
    model.counts[:, 3] += 500  # inside the window: expert 3 (one copy, on rank 0) hot
    eplb.after_step()
    assert runner.switched == []
    eplb.after_step()  # step 4: rebalance from the window only
    assert len(runner.switched) == 1 and runner.switched[0][0] == 1
    table = runner.switched[0][1]
    assert (table == 3).sum(axis=1).tolist() == [3, 3]  # both redundant slots to expert 3, not 7
    before, after = eplb.last
    assert (after < before).all() and eplb.experts_read == 3
    for _ in range(4):  # the same load again: nothing better, nothing sent
        model.counts[:, 3] += 500
        eplb.after_step()
    assert len(runner.switched) == 1
    figures = eplb.figures(model.counts)
    assert figures["epoch"] == 1 and (figures["eplb"] < figures["contiguous"]).all()
    assert "EPLB epoch 1: rank imbalance contiguous" in eplb.summary(model.counts)


def test_metrics_show_each_layers_rank_imbalance_contiguous_and_placed():
    from eprt.serve.metrics import eplb_families

    figures = {"epoch": 2, "layers": [1, 3], "contiguous": np.array([0.5, 0.7]), "eplb": np.array([0.1, 0.05])}
    ratio, epoch = eplb_families(figures)
    samples = {(s.labels["layer"], s.labels["placement"]): s.value for s in ratio.samples}
    assert samples == {("1", "contiguous"): 0.5, ("3", "contiguous"): 0.7, ("1", "eplb"): 0.1, ("3", "eplb"): 0.05}
    assert epoch.samples[0].value == 2


@pytest.mark.skipif(
    shutil.which("g++") is None or shutil.which("mpiexec") is None, reason="cusim needs g++ and mpiexec"
)
def test_cuda_backend_on_cusim_gives_the_same_tokens_across_live_rebalances():
    """The CuPy path (device gather of the (token, choice) rows, staged all-gather of each rank's rows) at 2 ranks
    on cusim: the default model's greedy tokens equal EPLB off's, with rebalances every 3 steps."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "OMPI_"))}
    env["PYTHONPATH"] = f"{root / 'tests'}{os.pathsep}{root}"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "cusim.run", "-m", "eprt", "generate", "--device", "cuda"]
    cmd += ["--prompt-ids", "90,91,92,93,94,95,96,97,98,99,100,101", "--prompt-ids", "5,77,3", "--max-tokens", "8"]
    cmd += ["--ignore-eos", "--json", "--gpu-memory-utilization", "0.5"]
    runs = [
        subprocess.run(cmd + extra, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        for extra in ([], ["--num-redundant-experts", "2", "--eplb-interval", "3"])
    ]
    assert all(r.returncode == 0 for r in runs), runs[1].stderr[-3000:]
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.count("token_ids") == 2
    assert "EPLB epoch 1:" in runs[1].stderr and "on cuda" in runs[1].stderr


def test_redundant_slots_let_more_ranks_than_experts_load(checkpoint):
    path = checkpoint("qwen3_moe")  # 6 experts
    placement = contiguous(3, 6, 8, 8)  # 8 ranks, one slot each
    lm = load_model(path, NumpyOps(), 64, 7, 8, placement_for=lambda c: placement)
    assert (lm.model.w.expert_start, lm.model.w.expert_end) == (7, 8)
    assert lm.model.slots.placement.local_experts(7)[:, 0].tolist() == [1, 1, 1]  # slot 7 holds expert 7 mod 6
    with pytest.raises(ValueError, match="8 ranks but the model has only 6 experts"):
        load_model(path, NumpyOps(), 64, 7, 8)
