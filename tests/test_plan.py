"""``eprt plan`` against what eprt really does: the loader's bytes and arrays per rank, the KV pool
the engine allocates (CPU, --num-blocks) and the GPU pool formula, the frame words rank 0 sends."""

import json
import os
import shutil

import numpy as np
import pytest
from checkpoints import build_bf16_copy, build_fp8_copy, building

from eprt.comm.protocol import DecodeBatch
from eprt.comm.transport import LocalTransport
from eprt.engine import startup
from eprt.engine.config import EngineConfig
from eprt.entry import capacity, plan
from eprt.entry.capacity import Hardware, Settings, make_plan
from eprt.model.config import load_config
from eprt.model.loader import load_model
from eprt.ops import device
from eprt.ops.cpu_weights import ScaledPanels
from eprt.ops.gptoss_ops import Mxfp4Weight
from eprt.ops.numpy_ops import NumpyOps, numba_available


def _plan(path, **settings):
    hardware = {k: settings.pop(k) for k in ("gpu_mem_gib",) if k in settings}
    return make_plan(path, load_config(path), Settings(**settings), Hardware(**hardware))


def _resident_by_precision(weights) -> dict:
    """Bytes of the distinct arrays a loaded model holds, by precision: float32 arrays f32, bf16 bits
    (uint16) bf16, ScaledPanels their kind (fp8, int8: bytes and scales), MXFP4 experts their blocks
    and scales (a tied head is the embedding itself unless int8 made a copy)."""
    held = {}  # id -> (precision, array)
    for a in [weights.embed, weights.norm, weights.lm_head, *(v for lw in weights.layers for v in vars(lw).values())]:
        if isinstance(a, np.ndarray):
            held[id(a)] = ({np.float32: "f32", np.uint16: "bf16"}[a.dtype.type], a)
        elif isinstance(a, Mxfp4Weight):
            held.update({id(p): ("mxfp4", p) for p in (a.blocks, a.scales)})
        elif isinstance(a, ScaledPanels):
            held.update({id(p): (a.kind, p) for p in (a.data, a.scales)})
    out = {}
    for kind, a in held.values():
        out[kind] = out.get(kind, 0) + a.nbytes
    return out


def _resident_bytes(weights) -> int:
    return sum(_resident_by_precision(weights).values())


def _fused_copy(path: str, out: str) -> str:
    """``path`` re-saved with fused expert tensors (experts.gate_up_proj [E, 2I, D], down_proj [E, D, I])."""
    with building(out) as temp:
        if temp is not None:
            _save_fused(path, temp[0])
    return out


def _save_fused(path: str, out: str) -> None:
    from safetensors.numpy import load_file, save_file

    cfg = load_config(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    g, u, d = cfg.expert_names
    for i in range(cfg.num_layers):
        m = f"model.layers.{i}.{cfg.moe_prefix}.experts"
        experts = range(cfg.num_experts)
        gate_up = [
            np.concatenate([tensors.pop(f"{m}.{e}.{g}.weight"), tensors.pop(f"{m}.{e}.{u}.weight")]) for e in experts
        ]
        tensors[f"{m}.gate_up_proj"] = np.stack(gate_up)
        tensors[f"{m}.down_proj"] = np.stack([tensors.pop(f"{m}.{e}.{d}.weight") for e in experts])
    save_file(tensors, os.path.join(out, "model.safetensors"))
    shutil.copy(os.path.join(path, "config.json"), out)


def _cpu_ops(precision: str) -> NumpyOps:
    """The CPU backend at --cpu-weights ``precision``: the compiled path's packing where numba is
    installed (bytes only: the products are not compiled), else the NumPy path (float32)."""
    if not numba_available():
        return NumpyOps(experts="numpy", weights=precision)
    ops = NumpyOps(experts="numba", weights=precision)
    ops.packer.first = lambda kind: None  # what it holds does not depend on the compiled products
    return ops


def _check_weights_match_the_loader(path: str, ranks: int, precision: str = "f32") -> None:
    planned = _plan(path, ranks=ranks, dtype="fp32", cpu_weights=precision)
    for rank in range(ranks):
        loaded = load_model(path, _cpu_ops(precision), 64, rank=rank, world=ranks)
        w, where = planned.weights[rank], f"rank {rank} of {ranks}, --cpu-weights {precision}"
        assert (w.expert_start, w.expert_end) == (loaded.model.w.expert_start, loaded.model.w.expert_end)
        assert w.read_bytes == loaded.bytes_read, where
        assert dict(w.precisions) == _resident_by_precision(loaded.model.w), where
        assert w.resident_bytes == _resident_bytes(loaded.model.w), where


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_weight_bytes_per_rank_equal_the_loaders(checkpoint, arch, ranks):
    # 6 experts: uneven splits over 4 ranks (2, 2, 1, 1); every architecture's own tensors
    _check_weights_match_the_loader(checkpoint(arch), ranks)


def test_weight_bytes_of_a_bf16_checkpoint_and_of_fused_experts(checkpoint, ckpt_root):
    _check_weights_match_the_loader(checkpoint("qwen3_moe", dtype="bfloat16"), 4)
    fused = _fused_copy(checkpoint("olmoe"), os.path.join(ckpt_root, "olmoe-float32-fused"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in capacity.SafetensorsCheckpoint(fused)
    _check_weights_match_the_loader(fused, 4)  # the loader reads a fused tensor whole
    if numba_available():  # the rank's rows of a fused tensor packed at int8
        _check_weights_match_the_loader(fused, 2, "int8")


needs_numba = pytest.mark.skipif(
    not numba_available(), reason="the CPU's bf16, FP8 and int8 weights are the compiled path's (the cpu extra)"
)


def _copy(checkpoint, arch: str, kind: str) -> str:
    """``arch``'s test checkpoint: float32, its bf16 copy or its FP8 copy (blocks of 16 x 32), the
    copies tests/test_cpu_weights.py loads."""
    source = checkpoint(arch)
    if kind == "bf16":
        return build_bf16_copy(source, f"{source}-bf16copy")
    return build_fp8_copy(source, f"{source}-fp8-16x32", (16, 32))[0] if kind == "fp8" else source


@needs_numba
@pytest.mark.parametrize(
    "kind, precision", [("bf16", "auto"), ("bf16", "int8"), ("fp8", "auto"), ("fp8", "int8"), ("float32", "bf16")]
)
def test_cpu_resident_weights_per_rank_equal_numpy_ops(checkpoint, arch, kind, precision):
    """--dtype fp32 --cpu-weights X: each rank's bytes by precision, read and resident, as NumpyOps
    holds them after load_model (panels of 16 rows at X, FP8 kept with its per-lane scales, int8
    padded with its group scales, q/k/v apart where one stays FP8, float32 the rest)."""
    path = _copy(checkpoint, arch, kind)
    for ranks in (1, 2):
        _check_weights_match_the_loader(path, ranks, precision)


@needs_numba
def test_q_k_v_stay_apart_where_one_stays_fp8(checkpoint):
    """K and V of 8 rows (one KV head of 8) cannot stay FP8, Q of 32 can: the loader keeps Q FP8 and
    K and V float32 apart (not one 48-row FP8 matrix)."""
    source = checkpoint("qwen3_moe", num_key_value_heads=1, head_dim=8)
    path = build_fp8_copy(source, f"{source}-fp8-16x32", (16, 32))[0]
    _check_weights_match_the_loader(path, 2, "auto")


@needs_numba
def test_int8_groups_of_64_from_the_environment(checkpoint, monkeypatch):
    monkeypatch.setenv("EPRT_CPU_INT8_GROUP", "64")
    path = _copy(checkpoint, "deepseek_v3", "bf16")  # K = 48 (q_b_proj) and 32 (down_proj) pad to 64
    assert _plan(path, ranks=1, dtype="fp32", cpu_weights="int8").settings.int8_group == 64
    _check_weights_match_the_loader(path, 2, "int8")


@needs_numba
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])  # an untied head; a tied one (int8: its copy)
def test_cpu_decode_bound_reads_the_resident_bytes(checkpoint, arch):
    """At batch 256 every expert is touched (1 - (1 - k/E)^256 rounds to 1): a decode step reads every
    resident byte but the embedding table, 256 float32 embedding rows, and the head (a tied one: the
    table, or int8's copy of it), as held at each precision."""
    path = _copy(checkpoint, arch, "bf16")
    rows = 256 * load_config(path).hidden_size * 4
    for precision in ("auto", "f32", "int8"):
        step = _plan(path, ranks=1, dtype="fp32", cpu_weights=precision).decode[2]
        w = load_model(path, _cpu_ops(precision), 64).model.w
        table = 0 if w.lm_head is w.embed else w.embed.nbytes
        assert (step.batch, step.hbm_bytes) == (256, _resident_bytes(w) - table + rows), precision


def test_config_only_directory_counts_by_the_config_dtype(checkpoint, tmp_path):
    path = checkpoint("qwen2_moe")  # float32
    shutil.copy(os.path.join(path, "config.json"), tmp_path)
    from_config, from_headers = _plan(str(tmp_path), ranks=3), _plan(path, ranks=3)
    assert from_config.weight_source == "config.json dtype float32"
    assert [w.read_bytes for w in from_config.weights] == [w.read_bytes for w in from_headers.weights]
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "dtype": "float8_e4m3fn"}))
    with pytest.raises(ValueError, match="config.json field 'dtype' is 'float8_e4m3fn'"):
        _plan(str(tmp_path), ranks=3)
    for name in os.listdir(path):  # with the headers, config.json's dtype is not needed
        if name.endswith(".safetensors"):
            shutil.copy(os.path.join(path, name), tmp_path)
    assert _plan(str(tmp_path), ranks=3).weights == from_headers.weights


def test_a_header_that_disagrees_with_the_config_is_named(checkpoint, tmp_path):
    path = checkpoint("mixtral")
    for name in os.listdir(path):
        shutil.copy(os.path.join(path, name), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "intermediate_size": 97}))
    with pytest.raises(ValueError, match="experts.0.w1.weight' has shape .* config implies"):
        _plan(str(tmp_path), ranks=2)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_gpt_oss_weight_bytes_and_windowed_kv_equal_the_engines(ckpt_root, mxfp4):
    """gpt_oss: fused experts and their biases (float32), sinks, MXFP4 blocks and scales counted as the
    bytes they stay; a KV block spans max(full, sliding) layers, and the longest sequence leaves room
    for a prefill chunk's window blocks as the engine's does."""
    from checkpoints import build_gptoss_checkpoint

    path = build_gptoss_checkpoint(
        os.path.join(ckpt_root, f"gpt_oss-{'mxfp4' if mxfp4 else 'bf16'}"), "bfloat16", mxfp4
    )
    for ranks in (1, 2, 4):
        _check_weights_match_the_loader(path, ranks)
    if numba_available():  # the experts stay MXFP4 under every choice; the rest at it
        for ranks, precision in ((1, "auto"), (2, "int8"), (2, "bf16")):
            _check_weights_match_the_loader(path, ranks, precision)
    weights = 3 * 64 * 32  # per expert and layer: gate, up, down of D = 64, I = 32
    per_expert = (weights // 2 + weights // 32 if mxfp4 else 2 * weights) + 4 * (2 * 32 + 64)  # + float32 biases
    assert _plan(path, ranks=1).weights[0].expert_bytes == 4 * 6 * per_expert  # 4 layers of 6 experts
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, block_size=4, num_blocks=40, max_prefill_tokens=6)
    started = startup.start_rank(cfg, "cpu", LocalTransport())
    kv = _plan(path, ranks=1, dtype="fp32", max_batch=4, block_size=4, num_blocks=40, prefill_chunk=6)
    pool = started.executor.kv
    assert kv.kv.bytes_per_block * kv.kv.blocks == sum({id(a): a.nbytes for a in pool.k + pool.v}.values())
    assert kv.kv.max_model_len == started.max_model_len == (40 - 5) * 4 - 1  # a chunk of 6: 5 window blocks


def test_kv_pool_equals_the_engines_allocation_on_the_cpu(checkpoint):
    path = checkpoint("qwen3_moe")
    for num_blocks, max_len in ((40, 100), (400, None)):
        cfg = EngineConfig(
            model=path, device="cpu", max_batch=4, block_size=4, num_blocks=num_blocks, max_model_len=max_len
        )
        started = startup.start_rank(cfg, "cpu", LocalTransport())
        kv = _plan(path, ranks=1, dtype="fp32", max_batch=4, block_size=4, num_blocks=num_blocks, max_model_len=max_len)
        pool = started.executor.kv
        assert (kv.kv.blocks, kv.kv.tokens) == (pool.num_blocks, pool.num_blocks * pool.block_size)
        assert kv.kv.max_model_len == started.max_model_len
        assert kv.kv.bytes_per_block * kv.kv.blocks == sum(a.nbytes for a in pool.k + pool.v)
        assert kv.kv.problem == ""


def test_a_max_model_len_the_pool_cannot_hold_is_refused_by_both(checkpoint):
    path = checkpoint("qwen3_moe")
    cfg = EngineConfig(model=path, device="cpu", max_batch=4, block_size=4, num_blocks=10, max_model_len=60)
    with pytest.raises(ValueError, match="does not fit the KV pool of 10 blocks"):
        startup.start_rank(cfg, "cpu", LocalTransport())
    kv = _plan(path, ranks=1, dtype="fp32", max_batch=4, block_size=4, num_blocks=10, max_model_len=60).kv
    assert "does not fit the KV pool of 10 blocks" in kv.problem and kv.max_model_len == 0


class _GpuLike:
    name, kv_itemsize = "cuda", 2


@pytest.mark.parametrize("gpu_mem_mib, max_batch", [(1.2, 32), (2.0, 32), (64.0, 2)])
def test_kv_pool_equals_the_gpu_pool_formula_for_each_rank(checkpoint, monkeypatch, gpu_mem_mib, max_batch):
    """startup._kv_blocks on a GPU with the memory the loaded weights (held in bf16) leave free:
    memory binds at 1.2 and 2 MiB (uneven splits, so the ranks differ), the slots' need at 64 MiB."""
    path, ranks, reserved = checkpoint("olmoe"), 4, 0.25 / 1024
    total = int(gpu_mem_mib * (1 << 20))
    kv = _plan(path, ranks=ranks, max_batch=max_batch, gpu_mem_gib=gpu_mem_mib / 1024, reserved_gib=reserved).kv
    engine_blocks = []
    for rank in range(ranks):
        loaded = load_model(path, NumpyOps(), None, rank=rank, world=ranks)
        free = total - _resident_bytes(loaded.model.w) // 2 - int(reserved * (1 << 30))  # fp32 here, bf16 there
        monkeypatch.setattr(
            device, "kv_pool_blocks", lambda b, u, s, free=free: device.pool_blocks(free, total, b, u, s)
        )
        cfg = EngineConfig(model=path, max_batch=max_batch)
        engine_blocks.append(startup._kv_blocks(cfg, _GpuLike(), loaded.config, loaded.model.max_len))
    assert list(kv.blocks_per_rank) == engine_blocks
    assert kv.blocks == min(engine_blocks) and kv.tokens == 16 * min(engine_blocks)
    if gpu_mem_mib < 2:
        assert len(set(engine_blocks)) == 2  # the ranks with two experts have less room


def test_weights_that_leave_no_room_are_reported_not_raised(checkpoint):
    kv = _plan(checkpoint("olmoe"), ranks=2, gpu_mem_gib=0.5 / 1024, reserved_gib=0).kv
    assert kv.blocks == 0 and kv.blocks_per_rank == (None, None)
    assert kv.problem.startswith("rank 0: its weights")


def test_frame_bytes_are_the_words_rank_zero_flushes():
    for batch in (1, 32, 255, 256, 300):
        transport = LocalTransport()
        transport.send(DecodeBatch(tuple(range(batch)), (7,) * batch))
        transport.flush()
        words = transport.stats.words  # the count word goes in front of them
        expected = 4 * (512 if words + 1 <= 512 else words + 1)
        assert capacity.decode_wire(_small_config(), batch, 2).frame_bytes == expected


def _small_config():
    from eprt.model.config import config_from_dict

    return config_from_dict(
        {
            "model_type": "mixtral",
            "hidden_size": 512,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 64,
            "vocab_size": 100,
        }
    )


def test_combine_bytes_follow_the_transports_rule():
    cfg = _small_config()  # 2 MoE layers, hidden 512: [T, 512] float32 is 1 MiB at T = 512
    assert capacity.decode_wire(cfg, 32, 1).total == 0
    assert capacity.decode_wire(cfg, 32, 2).combine_bytes == 2 * 32 * 512 * 4
    assert capacity.decode_wire(cfg, 511, 4).combine == "all-gather"
    assert capacity.decode_wire(cfg, 511, 4).combine_bytes == 2 * 3 * 511 * 512 * 4
    big = capacity.decode_wire(cfg, 512, 3)  # 262144 floats: slices of 87382, 87381, 87381
    assert big.combine == "reduce-scatter + all-gather"
    assert big.combine_bytes == 2 * 4 * (2 * 87382 + 262144 - 87382)
    assert capacity.decode_wire(cfg, 512, 2).combine == "all-gather"  # two ranks keep the all-gather


def test_cli_table_json_and_refusals(checkpoint, capsys):
    from eprt.cli import main

    path = checkpoint("qwen2_moe")
    assert main(["plan", "--model", path, "--ranks", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [w["expert_end"] - w["expert_start"] for w in out["weights"]] == [2, 2, 2]
    assert set(out["decode"]) == {"1", "32", "256"} and out["fits"] is True
    assert out["decode"]["1"]["binding"] in ("HBM", "link", "compute")
    assert main(["plan", "--model", path, "--ranks", "2"]) == 0
    table = capsys.readouterr().out
    assert "job capacity" in table and "one rank's pool" in table and "binding" in table
    assert main(["plan", "--model", path, "--ranks", "2", "--attention", "dp", "--num-blocks", "50"]) == 0
    assert "job capacity: 1600 tokens. Attention is dp" in capsys.readouterr().out  # 2 x 50 blocks of 16
    assert main(["plan", "--model", path, "--ranks", "2", "--num-blocks", "50"]) == 0
    assert "job capacity: 800 tokens. Attention is replicated" in capsys.readouterr().out
    assert main(["plan", "--model", path, "--ranks", "7"]) == 2
    assert "--ranks must be in [1, num_experts=6], got 7" in capsys.readouterr().err
    assert plan.size(3 << 30) == "3.00 GiB"


def test_cli_cpu_weights_table_json_and_refusals(checkpoint, capsys, monkeypatch):
    """--dtype fp32 --cpu-weights X: the resident precision in the header, the table and the JSON;
    --cpu-weights with the GPU's dtype, a bad int8 group: exit 2 naming the flag, value and choices."""
    from eprt.cli import main

    monkeypatch.delenv("EPRT_CPU_WEIGHTS", raising=False)
    path = _copy(checkpoint, "qwen2_moe", "bf16")
    argv = ["plan", "--model", path, "--dtype", "fp32"]
    assert main([*argv, "--cpu-weights", "bf16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["settings"]["cpu_weights"], out["settings"]["int8_group"]) == ("bf16", None)
    w = out["weights"][0]
    assert set(w["precisions"]) == {"bf16", "f32"} and sum(w["precisions"].values()) == w["resident_bytes"]
    assert main(argv) == 0  # --cpu-weights as the engine reads it: EPRT_CPU_WEIGHTS, auto by default
    table = capsys.readouterr().out
    assert "CPU backend: weights --cpu-weights auto, KV float32" in table and "bf16 " in table and "held as" in table
    monkeypatch.setenv("EPRT_CPU_INT8_GROUP", "64")
    assert main([*argv, "--cpu-weights", "int8"]) == 0
    assert "--cpu-weights int8, groups of 64 along k" in capsys.readouterr().out
    monkeypatch.setenv("EPRT_CPU_INT8_GROUP", "48")
    assert main([*argv, "--cpu-weights", "int8"]) == 2
    assert "EPRT_CPU_INT8_GROUP must be one of (32, 64), got 48" in capsys.readouterr().err
    for gpu in (["--cpu-weights", "int8"], ["--cpu-weights", "f32", "--exchange", "both"]):
        assert main(["plan", "--model", path, *gpu]) == 2
        err = capsys.readouterr().err
        assert f"--cpu-weights {gpu[1]} is the CPU backend's (--dtype fp32); --dtype bf16 is the GPU backend" in err
    with pytest.raises(ValueError, match="int8_group 64 is --cpu-weights int8's, but the CPU weights are bf16"):
        _plan(path, ranks=1, dtype="fp32", cpu_weights="bf16", int8_group=64)
    with pytest.raises(ValueError, match=r"int8_group must be one of \(32, 64\), got 16"):
        _plan(path, ranks=1, dtype="fp32", cpu_weights="int8", int8_group=16)


@pytest.mark.parametrize("ranks,redundant", [(2, 2), (4, 3)])
def test_redundant_expert_slots_cost_what_the_loader_holds(checkpoint, ranks, redundant):
    """EPLB's redundant slots: each rank's slots, read and resident bytes as loaded under the contiguous
    placement (slot s holds expert s mod E); combines all-gather each rank's own (token, choice) rows."""
    from eprt.model.placement import contiguous

    path = checkpoint("qwen2_moe")
    cfg = load_config(path)
    planned = _plan(path, ranks=ranks, dtype="fp32", num_redundant_experts=redundant)
    placement = contiguous(cfg.num_layers, cfg.num_experts, cfg.num_experts + redundant, ranks)
    for rank in range(ranks):
        loaded = load_model(path, NumpyOps(), 64, rank, ranks, placement_for=lambda c: placement)
        w = planned.weights[rank]
        assert (w.expert_start, w.expert_end) == placement.rank_range(rank)
        assert w.read_bytes == loaded.bytes_read and w.resident_bytes == _resident_bytes(loaded.model.w)
    plain = _plan(path, ranks=ranks, dtype="fp32")
    assert sum(w.expert_bytes for w in planned.weights) > sum(w.expert_bytes for w in plain.weights)
    rows = capacity.DECODE_BATCHES[1] * cfg.top_k  # (token, choice) rows of a combine, over every rank
    layers = sum(cfg.sparse_layers)
    assert planned.decode_wire[1].combine_bytes == layers * 4 * cfg.hidden_size * (rows - rows // ranks)
    assert planned.decode_wire[1].combine == "all-gather of each rank's rows"


def test_exchange_table_for_deepseek_v3_at_8_32_144(capsys):
    """--exchange both: the all-gather's bytes follow (P - 1) x rows x D x (2 + 4) plus the routing's
    all-gather; the all-to-all's, the expected other ranks holding one of a row's k experts."""
    from eprt.cli import main
    from eprt.entry.exchange_plan import remote_ranks

    config = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "configs", "deepseek-v3")
    argv = ["plan", "--model", config, "--ranks", "8,32,144", "--exchange", "both", "--max-batch", "128"]
    assert main([*argv, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["exchange"]
    by = {(r["ranks"], r["exchange"]): r for r in rows}
    assert len(rows) == 6
    for P in (8, 32, 144):
        meta = (P - 1) * 128 * 8 * 8
        assert by[P, "allgather"]["sent_bytes"] == (P - 1) * 128 * 7168 * 6 + meta
        a2a = by[P, "alltoall"]
        assert a2a["sent_bytes"] == pytest.approx(a2a["remote_ranks"] * 128 * 7168 * 6 + meta)
        assert 0 < a2a["remote_ranks"] < min(8, P - 1)
        assert a2a["step_bytes"] == pytest.approx(2 * 58 * a2a["sent_bytes"])
    ratio = by[144, "alltoall"]["step_bytes"] / by[144, "allgather"]["step_bytes"]
    assert 0.05 < ratio < 8 / 144 + 0.002  # about k / P
    assert remote_ranks(16, 2, 16) == pytest.approx(15 * 2 / 16)  # one expert a rank: (P - 1) k / E
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "InfiniBand 50 GB/s" in table and "NVLink 900 GB/s" in table and "top-8 of 256" in table
    assert main(["plan", "--model", config, "--ranks", "8,32"]) == 2
    assert "need --exchange" in capsys.readouterr().err
