"""Tiny Hugging Face MoE checkpoints built locally with transformers (fixed seed).

Used by tests and benchmarks; nothing is downloaded. Each architecture gets a config
that exercises its peculiarities (dense layers, shared expert, q/k norms, tied head)
and an expert count that splits unevenly over 2, 3 and 4 ranks.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile

ARCHS = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe")
DEEPSEEK_LIKE = ("deepseek_v2", "deepseek_v3", "glm4_moe")
HYBRID_ARCHS = ("qwen3_next",)  # linear-attention layers with recurrent state: not in ARCHS (no vision, GPU, plan)
EXPERT_KEY = {"mixtral": "num_local_experts", **{a: "n_routed_experts" for a in DEEPSEEK_LIKE}}

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=512,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

_ARCH = {
    "qwen3_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
        tie_word_embeddings=True,
        head_dim=16,
        rope_theta=10000.0,
    ),
    "qwen2_moe": dict(
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        norm_topk_prob=False,
        shared_expert_intermediate_size=80,
        decoder_sparse_step=2,
        rope_theta=20000.0,
    ),
    "mixtral": dict(num_local_experts=6, num_experts_per_tok=2, rope_theta=1e6),
    "olmoe": dict(num_experts=6, num_experts_per_tok=3, norm_topk_prob=False, clip_qkv=None),
    # DeepSeek family: 3 groups of 2 experts, the best 2 groups compete; layer 0 dense
    "deepseek_v2": dict(  # top-3 from the best 2 groups by their maximum: the third pick is group-limited
        n_routed_experts=6,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        n_shared_experts=2,
        topk_method="group_limited_greedy",
        n_group=3,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        num_key_value_heads=4,
    ),
    "deepseek_v3": dict(
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=3,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=24,
        num_key_value_heads=4,
        num_nextn_predict_layers=1,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ),
    "glm4_moe": dict(
        n_routed_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=3,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=1.8,
        norm_topk_prob=True,
        head_dim=16,
        use_qk_norm=True,
        attention_bias=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    # Gated DeltaNet layers 0 and 2, gated full attention 1 and 3; 2 value heads per key head; layer 1 dense
    "qwen3_next": dict(
        num_hidden_layers=4,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=80,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        head_dim=16,
        full_attention_interval=2,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
}


# The ~115M Qwen3-MoE the CPU and LoRA benchmarks build (benchmarks/bench_decode_cpu.py, bench_lora.py);
# tests/test_gpu_launch_budget.py counts launches at its widths.
BENCH_MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=16,
    num_experts_per_tok=2,
    moe_intermediate_size=512,
    mlp_only_layers=[],
    tie_word_embeddings=False,
    max_position_embeddings=1024,
)


@contextlib.contextmanager
def building(path: str, *more: str, done: str = "config.json"):
    """Build the directory ``path`` (and the directories ``more`` beside it) once, safely across
    processes (pytest-xdist workers, MPI ranks, test phases run at once). Yields None where
    ``path``/``done`` exists, else one new directory for each of ``path``, ``*more`` to fill. A lock
    on a hidden ``.NAME.lock`` beside ``path`` lets one process build while the others wait; when the
    block ends without error the directories move into place, ``path`` last, and a ``*config.json``
    file last within each (a rename where the target is absent or empty), so a reader that checks
    ``path``/``done`` never sees half a checkpoint. The temporaries are hidden and removed on error."""
    if os.path.isfile(os.path.join(path, done)):
        yield None
        return
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    lock_path = os.path.join(parent, f".{name}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not os.path.isfile(os.path.join(path, done)):  # (else built by the process that held the lock)
            work = tempfile.mkdtemp(prefix=f".{name}.", dir=parent)
            try:
                temps = [os.path.join(work, str(i)) for i in range(1 + len(more))]
                for temp in temps:
                    os.mkdir(temp)
                yield temps
                for temp, final in reversed(list(zip(temps, (path, *more)))):
                    _move_into_place(temp, final)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        else:
            yield None
        with contextlib.suppress(FileNotFoundError):  # built: whoever holds or opens the lock finds it so
            os.unlink(lock_path)


def _move_into_place(temp: str, final: str) -> None:
    """Directory ``temp`` renamed to ``final`` (absent or empty), else its files moved into it one by
    one, the ``*config.json`` ones last."""
    if not os.path.isdir(final) or not os.listdir(final):
        os.rename(temp, final)
        return
    for entry in sorted(os.listdir(temp), key=lambda e: e.endswith("config.json")):
        target = os.path.join(final, entry)
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)
        os.replace(os.path.join(temp, entry), target)


def build_checkpoint(arch: str, path: str, dtype: str = "float32", seed: int = 0, **overrides) -> str:
    """Build and save a random ``arch`` checkpoint at ``path`` (skipped if already there; safe
    to call from several processes at once: ``building``)."""
    with building(path) as temp:
        if temp is not None:
            _save_checkpoint(arch, temp[0], dtype, seed, overrides)
    return path


def _save_checkpoint(arch: str, path: str, dtype: str, seed: int, overrides: dict) -> None:
    import torch
    import transformers

    kw = {**_COMMON, **_ARCH[arch], **overrides}
    cfg = transformers.AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # zero-initialized in transformers: random here, so selection-only bias is tested
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.1)
        if arch in HYBRID_ARCHS:  # (1 + w) norms start at w = 0 and dt_bias at 1: random, so both are tested
            for name, p in model.named_parameters():
                if name.endswith(("norm.weight", "dt_bias")):
                    p.add_(torch.randn(p.shape) * 0.2)
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config.pad_token_id = kw["pad_token_id"]
    model.save_pretrained(path)


VL_IMAGE, VL_VIDEO, VL_START, VL_END = 250, 251, 248, 249  # qwen3_vl_moe's special token ids in the tiny vocabulary
VL_PREPROCESSOR = dict(  # Qwen2VLImageProcessor fields; build_vl_checkpoint sets patch_size and size
    image_processor_type="Qwen2VLImageProcessor",
    patch_size=8,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    do_rescale=True,
    rescale_factor=1 / 255,
    do_normalize=True,
    do_convert_rgb=True,
    size={"shortest_edge": 16 * 16, "longest_edge": 64 * 64},
)


GPT_OSS = dict(  # 4 layers, sliding (window 8) and full alternating; limit 0.6 so the clamps bite
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,  # a multiple of 32: MXFP4 blocks
    num_local_experts=6,
    num_experts_per_tok=2,
    sliding_window=8,
    swiglu_limit=0.6,
    max_position_embeddings=256,  # YaRN: 64 original positions x factor 4
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
MXFP4_MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def build_gptoss_checkpoint(path: str, dtype: str = "float32", mxfp4: bool = False, seed: int = 0, **overrides) -> str:
    """A random gpt_oss checkpoint: biases (zero-initialized by transformers) and sinks random so that
    every one of them is tested. ``mxfp4``: the experts quantized to MXFP4 as the released checkpoints
    store them (``*_blocks`` / ``*_scales``, ``quantization_config.quant_method = "mxfp4"``), the rest
    in ``dtype``; its transformers reference is ``load_reference`` (dequantized by transformers).
    Built once across processes (``building``)."""
    with building(path) as temp:
        if temp is not None:
            _save_gptoss_checkpoint(temp[0], dtype, mxfp4, seed, overrides)
    return path


def _save_gptoss_checkpoint(path: str, dtype: str, mxfp4: bool, seed: int, overrides: dict) -> None:
    import torch
    import transformers

    cfg = transformers.AutoConfig.for_model("gpt_oss", **{**GPT_OSS, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(torch.randn(p.shape) * 0.2)
            elif name.endswith("sinks"):
                p.copy_(torch.randn(p.shape))
    model = model.to(getattr(torch, dtype)).eval()
    model.generation_config.pad_token_id = GPT_OSS["pad_token_id"]
    model.save_pretrained(path)
    if mxfp4:
        _quantize_experts_mxfp4(path)


def _mxfp4(w):
    """float [.., N, K] -> (blocks [.., N, K / 32, 16] uint8, scales [.., N, K / 32] uint8): per 32 weights
    the e8m0 scale 2^ceil(log2(amax / 6)), each weight the nearest e2m1 value (low nibble first)."""
    import numpy as np

    values = np.asarray([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)
    b = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(b).max(axis=-1)
    exp = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(np.int32)
    scaled = b / np.exp2(exp)[..., None]
    code = np.abs(np.abs(scaled)[..., None] - values).argmin(axis=-1) + np.where(scaled < 0, 8, 0)
    code = code.astype(np.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8), (exp + 127).astype(np.uint8)


def _quantize_experts_mxfp4(path: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = {}
    for name, t in load_file(file).items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # [E, K, N] -> output-major [E, N, K]
            blocks, scales = _mxfp4(t.float().transpose(1, 2).contiguous().numpy())
            tensors[name + "_blocks"], tensors[name + "_scales"] = map(torch.from_numpy, (blocks, scales))
        else:
            tensors[name] = t
    save_file(tensors, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MXFP4_MODULES_NOT_CONVERTED}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


VL_VARIANTS = {  # name (the directory under the checkpoint root) -> build_vl_checkpoint's overrides
    # vision depth 3 (hidden 32: 2 heads of 16), patch 8, deepstack at vision layers 0 and 1, MRoPE (2, 3, 3)
    "qwen3_vl_moe": {},
    # issue 36's: vision depth 2, hidden 64 (2 heads of 32), patch 16, 256 position embeddings, deepstack
    # at both vision layers, every weight x2
    "qwen3_vl_moe-issue36": dict(
        vision=dict(depth=2, hidden_size=64, intermediate_size=96, patch_size=16, num_position_embeddings=256),
        scale=2.0,
    ),
    # small heads: text head_dim 8 (8 query / 2 KV heads, MRoPE (2, 1, 1)), vision heads of 8, patch 8,
    # deepstack at vision layers 0, 2, 3 into all three language layers
    "qwen3_vl_moe-small-heads": dict(
        text=dict(head_dim=8, num_attention_heads=8, num_key_value_heads=2),
        mrope_section=[2, 1, 1],
        vision=dict(depth=4, hidden_size=16, intermediate_size=32, deepstack_visual_indexes=[0, 2, 3]),
    ),
}


def vl_checkpoint(root: str, name: str = "qwen3_vl_moe") -> str:
    """The VL_VARIANTS checkpoint ``name`` under ``root`` (built once)."""
    return build_vl_checkpoint(os.path.join(root, name), **VL_VARIANTS[name])


_VL_VISION = dict(  # the vision tower of build_vl_checkpoint unless told otherwise
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    patch_size=8,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=64,
    deepstack_visual_indexes=[0, 1],
    initializer_range=0.1,
)


def _vl_config(text: dict | None, vision: dict | None, mrope_section):
    """transformers' Qwen3VLMoeConfig of build_vl_checkpoint: qwen3_moe's tiny text model with
    interleaved MRoPE, _VL_VISION, each with the given fields over them."""
    import transformers

    text_cfg = {k: v for k, v in {**_COMMON, **_ARCH["qwen3_moe"]}.items() if k not in ("rope_theta", "norm_topk_prob")}
    text_cfg["rope_parameters"] = dict(
        rope_type="default", rope_theta=10000.0, mrope_section=list(mrope_section), mrope_interleaved=True
    )
    text_cfg.update(text or {})
    vision_cfg = {**_VL_VISION, "out_hidden_size": text_cfg["hidden_size"], **(vision or {})}
    return transformers.Qwen3VLMoeConfig(
        text_config=text_cfg,
        vision_config=vision_cfg,
        image_token_id=VL_IMAGE,
        video_token_id=VL_VIDEO,
        vision_start_token_id=VL_START,
        vision_end_token_id=VL_END,
        tie_word_embeddings=False,
    )


def build_vl_checkpoint(
    path: str, seed: int = 0, text=None, vision=None, mrope_section=(2, 3, 3), scale: float = 1.0
) -> str:
    """A random qwen3_vl_moe checkpoint with its preprocessor_config.json (skipped if there): by
    default a vision tower of depth 3 with deepstack at vision layers 0 and 1 and interleaved MRoPE
    sections (2, 3, 3) of head_dim 16; ``text`` / ``vision``: config fields over those, ``scale``:
    every weight multiplied by it. At most 4 x 4 merged placeholders an image (64 x 64 pixels at patch 8)."""
    with building(path) as temp:
        if temp is not None:
            _save_vl_checkpoint(temp[0], _vl_config(text, vision, mrope_section), seed, scale)
    return path


def _save_vl_checkpoint(path: str, cfg, seed: int, scale: float) -> None:
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3VLMoeForConditionalGeneration(cfg).eval()
    if scale != 1.0:
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(scale)
    model.generation_config.pad_token_id = _COMMON["pad_token_id"]
    model.save_pretrained(path)
    patch = cfg.vision_config.patch_size
    factor = patch * cfg.vision_config.spatial_merge_size  # pixels a merged placeholder side
    pre = dict(VL_PREPROCESSOR, patch_size=patch, size={"shortest_edge": factor**2, "longest_edge": (4 * factor) ** 2})
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump(pre, f, indent=1)


def load_vl_reference(path: str):
    """The transformers Qwen3VLMoeForConditionalGeneration of a checkpoint, in float32."""
    import torch
    import transformers

    return transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()


def hf_image_inputs(path: str, images) -> dict:
    """transformers' own preprocessing of encoded images: its PIL image processor
    (Qwen2VLImageProcessorPil: PIL + NumPy, no torchvision) built from the checkpoint's
    preprocessor_config.json, given each picture as transformers' load_image opens it (EXIF
    orientation applied); transparency is composited onto white by the processor's RGB conversion.
    Returns pixel_values [N, F] and image_grid_thw [I, 3] tensors."""
    import io
    import json

    from PIL import Image, ImageOps
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    with open(os.path.join(path, "preprocessor_config.json")) as f:
        raw = json.load(f)
    raw.pop("image_processor_type", None)
    pictures = [ImageOps.exif_transpose(Image.open(io.BytesIO(b))) for b in images]
    return dict(Qwen2VLImageProcessorPil(**raw)(images=pictures, return_tensors="pt"))


def vl_reference(path: str, prompt: list, images=(), steps: int = 10) -> tuple:
    """transformers end to end on a qwen3_vl_moe prompt with one VL_IMAGE placeholder per image:
    (the prompt expanded as its processor does, each placeholder repeated grid_h * grid_w / merge**2
    times; the greedy tokens; the first step's logits [V] as float32 NumPy)."""
    import torch

    model, kw, prompt = load_vl_reference(path), {}, list(prompt)
    if images:
        kw = hf_image_inputs(path, images)
        merge = model.config.vision_config.spatial_merge_size
        counts = iter((kw["image_grid_thw"].prod(-1) // merge**2).tolist())
        prompt = [t for tok in prompt for t in ([tok] * (next(counts) if tok == VL_IMAGE else 1))]
    ids = torch.tensor([prompt])
    if images:
        kw["mm_token_type_ids"] = (ids == VL_IMAGE).int()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            do_sample=False,
            max_new_tokens=steps,
            min_new_tokens=steps,
            output_logits=True,
            return_dict_in_generate=True,
            **kw,
        )
    return prompt, out.sequences[0, len(prompt) :].tolist(), out.logits[0][0].float().numpy()


def png_bytes(
    seed: int, w: int, h: int, alpha: bool = False, orientation: int | None = None, fmt: str = "PNG"
) -> bytes:
    """A w x h image of random pixels (PNG unless ``fmt`` says JPEG or WEBP); ``alpha``: RGBA with
    random transparency; ``orientation``: an EXIF Orientation tag (6: viewers turn it 90 degrees
    clockwise, so it shows h x w)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 256, (h, w, 4 if alpha else 3), dtype=np.uint8))
    kw = {}
    if orientation is not None:
        exif = img.getexif()
        exif[0x0112] = orientation
        kw["exif"] = exif
    buf = io.BytesIO()
    img.save(buf, format=fmt, **kw)
    return buf.getvalue()


def load_reference(path: str):
    """The transformers model of a checkpoint, computing in float32."""
    import torch
    import transformers

    extra = {}
    with open(os.path.join(path, "config.json")) as f:
        if (json.load(f).get("quantization_config") or {}).get("quant_method") == "mxfp4":
            extra["quantization_config"] = transformers.Mxfp4Config(dequantize=True)  # in float32
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _quantize_block_fp8(w, block: tuple):
    """float weight [N, K] -> (float8_e4m3fn [N, K], float32 scale_inv [ceil(N/bn), ceil(K/bk)]):
    per block, scale = amax / 448, fp8 = w / scale (round to nearest by torch)."""
    import torch

    bn, bk = block
    N, K = w.shape
    nbn, nbk = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nbn * bn, nbk * bk, dtype=torch.float32)
    padded[:N, :K] = w.float()
    blocks = padded.reshape(nbn, bn, nbk, bk)
    amax = blocks.abs().amax(dim=(1, 3))  # [nbn, nbk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).reshape(nbn * bn, nbk * bk)[:N, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def _fp8_quantized(name: str, t) -> bool:
    """Which tensors an FP8 checkpoint quantizes: 2-D linear weights, not embeddings, head or router."""
    skip = ("embed_tokens", "lm_head", ".gate.weight", "norm")
    return name.endswith(".weight") and t.ndim == 2 and not any(s in name for s in skip)


def build_fp8_copy(source: str, path: str, block: tuple = (128, 128)) -> tuple:
    """An FP8 block-scaled copy of checkpoint ``source`` at ``path`` (F8_E4M3 weights with
    weight_scale_inv, quantization_config in config.json) and, at ``path + "-dequantized"``, the
    float32 checkpoint of its dequantized weights (the transformers reference). Returns both paths."""
    reference = path + "-dequantized"
    with building(path, reference) as temp:
        if temp is not None:
            _save_fp8_copy(source, temp[0], temp[1], block)
    return path, reference


def _save_fp8_copy(source: str, path: str, reference: str, block: tuple) -> None:
    from safetensors.torch import load_file, save_file

    fp8, dequantized = {}, {}
    for name, t in load_file(os.path.join(source, "model.safetensors")).items():
        if _fp8_quantized(name, t):
            q, scale = _quantize_block_fp8(t, block)
            fp8[name], fp8[name + "_scale_inv"] = q, scale
            full = scale.repeat_interleave(block[0], 0)[: t.shape[0]].repeat_interleave(block[1], 1)[:, : t.shape[1]]
            dequantized[name] = q.float() * full
        else:
            fp8[name] = t
            dequantized[name] = t.float()
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    for out, tensors, cfg in (
        (reference, dequantized, {**config, "dtype": "float32"}),
        (
            path,
            fp8,
            {
                **config,
                "quantization_config": {
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "activation_scheme": "dynamic",
                    "weight_block_size": list(block),
                },
            },
        ),
    ):
        os.makedirs(out, exist_ok=True)
        save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
        if os.path.isfile(os.path.join(source, "generation_config.json")):
            shutil.copy(os.path.join(source, "generation_config.json"), out)
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=1)


def build_bf16_copy(source: str, path: str) -> str:
    """A bfloat16 copy of checkpoint ``source`` at ``path`` (every floating tensor rounded to bf16;
    the other files copied); skipped if there, built race-free (``building``)."""
    with building(path) as temp:
        if temp is not None:
            _save_bf16_copy(source, temp[0])
    return path


def _save_bf16_copy(source: str, path: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    for name in os.listdir(source):
        if name != "model.safetensors" and os.path.isfile(os.path.join(source, name)):
            shutil.copy(os.path.join(source, name), path)
    tensors = load_file(os.path.join(source, "model.safetensors"))
    bf16 = {n: t.to(torch.bfloat16) if t.is_floating_point() else t for n, t in tensors.items()}
    save_file(bf16, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**config, "dtype": "bfloat16"}, f, indent=1)


def reference_greedy(path, prompt, steps):
    """transformers in float32, full forward per step: (tokens, logits of each step [steps, V])."""
    import numpy as np
    import torch

    model, ids, rows = load_reference(path), list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].numpy()
            rows.append(logits)
            ids.append(int(np.argmax(logits)))
    return ids[len(prompt) :], np.stack(rows)


def build_mtp_checkpoint(path: str, seed: int = 0, echo: bool = False, echo_layers: int = 1, **overrides) -> str:
    """A deepseek_v3 checkpoint with a multi-token prediction layer (``num_nextn_predict_layers=1``),
    which transformers neither builds nor saves: its tensors, ``model.layers.{L}.*``, are written
    into the saved file here.

    Random (``echo=False``): the MTP layer's decoder tensors have the shapes of main layer 1's,
    seeded random values; its drafts rarely match the model's tokens.
    ``echo=True``: a model where the MTP layer predicts the next token by construction. One MoE
    layer whose attention output is zero (o_proj = 0), so the next token is a function of the
    current one; embeddings of unit RMS; the MTP layer is a copy of that layer fed the next
    token's embedding alone (eh_proj = [I | 0], unit enorm / hnorm), with the model's final norm
    and LM head as its head. So it drafts the token after next, as the model will decode it.
    ``echo_layers`` > 1: more layers after that one, each adding nothing (zero attention output,
    zero expert and shared-expert down projections) but costing a layer's compute, so the MTP
    layer costs 1 / echo_layers of the model, as in a deep model.
    ``overrides``: config fields of the deepseek_v3 checkpoint (expert counts, groups)."""
    with building(path) as temp:
        if temp is not None:
            _save_mtp_checkpoint(temp[0], seed, echo, echo_layers, overrides)
    return path


def _save_mtp_checkpoint(path: str, seed: int, echo: bool, echo_layers: int, overrides: dict) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    overrides.update(dict(num_hidden_layers=echo_layers, first_k_dense_replace=0) if echo else {})
    build_checkpoint("deepseek_v3", path, seed=seed, **overrides)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    L = _COMMON["num_hidden_layers"] if not echo else echo_layers
    D = _COMMON["hidden_size"]
    mtp = f"model.layers.{L}."
    source = "model.layers.0." if echo else "model.layers.1."  # a sparse layer's tensor names and shapes
    g = torch.Generator().manual_seed(seed + 1)
    if echo:
        for name, t in tensors.items():  # layers after 0 add nothing: zero attention, expert outputs
            if name.endswith("o_proj.weight") or (not name.startswith("model.layers.0.") and "down_proj" in name):
                t.zero_()
        e = tensors["model.embed_tokens.weight"]
        rms = e.pow(2).mean(-1, keepdim=True).sqrt()
        tensors["model.embed_tokens.weight"] = (e / torch.where(rms > 0, rms, 1.0)).contiguous()  # (pad row: 0)
    for name in [n for n in tensors if n.startswith(source)]:
        t = tensors[name]
        if echo:
            value = t.clone()
        elif name.endswith("norm.weight"):
            value = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        else:
            value = 0.1 * torch.randn(t.shape, generator=g)
        tensors[mtp + name[len(source) :]] = value.to(t.dtype).contiguous()
    ones = torch.ones(D)
    if echo:
        eh = torch.cat([torch.eye(D), torch.zeros(D, D)], dim=1)
        head_norm, head = tensors["model.norm.weight"].clone(), tensors["lm_head.weight"].clone()
        enorm, hnorm = ones, ones
    else:
        eh = 0.1 * torch.randn(D, 2 * D, generator=g)
        head_norm = 1.0 + 0.1 * torch.randn(D, generator=g)
        head = 0.1 * torch.randn(tensors["lm_head.weight"].shape, generator=g)
        enorm, hnorm = (1.0 + 0.1 * torch.randn(D, generator=g) for _ in range(2))
    for name, value in (
        ("enorm.weight", enorm),
        ("hnorm.weight", hnorm),
        ("eh_proj.weight", eh),
        ("shared_head.norm.weight", head_norm),
        ("shared_head.head.weight", head),
    ):
        tensors[mtp + name] = value.float().clone().contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


COPY_MATCH = 6  # the copy checkpoint's induction head matches the last 6 tokens
COPY_PREV_WEIGHTS = (2.0, 0.5, 1.0, 1.0, 0.5)  # previous-token heads: weights of RoPE pairs 0..4


def build_copy_checkpoint(path: str, seed: int = 0, match: int = COPY_MATCH, mtp: bool = False, **overrides) -> str:
    """A qwen3_moe checkpoint whose greedy output copies its context: after the last ``match``
    tokens it predicts the token that followed their earlier occurrences (an induction head built
    by hand), so prompt lookup pays as it does for a real model rewriting a text. Where those
    tokens are ambiguous (a shared tail longer than ``match``) it may jump to another occurrence.

    rope_theta 1e32 with head_dim 128: RoPE pair f turns by 10^(-f/2) per position, so pairs 0..4
    tell neighbours apart and pairs 9..63 barely turn over 1,000 positions (content matching).
    Residual stream: a constant, the token's id (64 dims, +-1, read by the LM head) and its code
    (110 // match dims, +-1), then the codes of the ``match`` previous tokens, then the predicted id.
    - Layer 0: previous-token heads (offsets 1..match; constant q and k on pairs 0..4, q turned
      back by its offset) copy those codes.
    - Layer 1: one induction head: q is the codes of the current and match - 1 previous tokens,
      k the match previous codes of each position, v its id, written to the predicted-id dims.
    - Every MoE and every later layer adds nothing (zero down_proj / o_proj) but costs its compute.
    ``mtp``: also a multi-token prediction layer in DeepSeek's format (``num_nextn_predict_layers``
    1, ``model.layers.{L}.*``; GLM-4.5 ships the same), which copies too: eh_proj lays its input out
    as the residual of the next position (the embedded next token's id and code, the hidden row's
    code and previous codes one slot further back), and its decoder layer is layer 1's induction
    head, so it drafts the token after next; fed its own output and its draft, the next one.
    ``overrides``: config fields (the size; heads, head_dim and rope are the construction's)."""
    with building(path) as temp:
        if temp is not None:
            _save_copy_checkpoint(temp[0], seed, match, mtp, overrides)
    return path


def _save_copy_checkpoint(path: str, seed: int, match: int, mtp: bool, overrides: dict) -> None:
    import numpy as np
    from safetensors.numpy import load_file, save_file

    shape = dict(num_attention_heads=8, num_key_value_heads=4, head_dim=128, rope_theta=1e32, mlp_only_layers=[])
    shape.update(tie_word_embeddings=False)  # the embedding holds id and code, the LM head reads the prediction
    build_checkpoint("qwen3_moe", path, seed=seed, **{**overrides, **shape})
    file = os.path.join(path, "model.safetensors")
    t = load_file(file)
    D = t["model.embed_tokens.weight"].shape[1]
    V = t["model.embed_tokens.weight"].shape[0]
    Dh, IDS = 128, 64
    content = np.concatenate([np.arange(9, Dh // 2), np.arange(Dh // 2 + 9, Dh)])  # pairs 9..63
    S = len(content) // match  # a token's code: one slot of the induction head's q and k
    C, ID, CODE = 0, 1, 1 + IDS  # residual dims: constant, id, code, previous codes, predicted id
    PREV = [CODE + S * (o + 1) for o in range(match)]
    PRED = CODE + (match + 1) * S
    assert PRED + IDS <= D, f"hidden_size {D}: the copy checkpoint needs at least {PRED + IDS}"
    rng = np.random.default_rng(seed)
    ids = rng.choice([-1.0, 1.0], size=(V, IDS)).astype(np.float32)
    codes = rng.choice([-1.0, 1.0], size=(V, S)).astype(np.float32)
    embed = np.zeros((V, D), np.float32)
    embed[:, C], embed[:, ID : ID + IDS], embed[:, CODE : CODE + S] = 1.0, ids, codes

    def rms(width: int) -> float:  # a token's RMS over the residual with `width` +-1 dims and the constant
        return float(np.sqrt((1.0 + width) / D))

    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name][:] = 0.0
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            t[name][:] = 1.0
    # layer 0: previous-token heads; q head h reads kv head h // 2, offset h + 1
    a = "model.layers.0.self_attn."
    pairs = np.arange(len(COPY_PREV_WEIGHTS))
    theta = 10.0 ** (-pairs / 2)
    u = np.sqrt(np.asarray(COPY_PREV_WEIGHTS, np.float32))
    q, k, v, o = (np.zeros_like(t[a + n + "_proj.weight"]) for n in "qkvo")
    for kv in range((match + 1) // 2):
        k[kv * Dh + pairs, C] = u  # k: u on the first half of pairs 0..4
        v[kv * Dh : kv * Dh + S, CODE : CODE + S] = np.eye(S) * rms(IDS + S)
    for h in range(match):
        turn = theta * (h + 1)  # q = u turned back by the offset: q.R(j - i)k peaks at j = i - offset
        q[h * Dh + pairs, C], q[h * Dh + Dh // 2 + pairs, C] = u * np.cos(turn), -u * np.sin(turn)
        o[PREV[h] : PREV[h] + S, h * Dh : h * Dh + S] = np.eye(S)
    t[a + "q_norm.weight"][:], t[a + "k_norm.weight"][:] = 5.0, 5.0
    t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"], t[a + "o_proj.weight"] = q, k, v, o
    # layer 1: the induction head (q head 0): slot s of q and k on content dims that RoPE barely turns
    a = "model.layers.1.self_attn."
    q, k, v, o = (np.zeros_like(t[a + n + "_proj.weight"]) for n in "qkvo")
    for s, (qsrc, ksrc) in enumerate(zip([CODE, *PREV[:-1]], PREV)):
        dims = content[s * S : (s + 1) * S]
        q[dims, qsrc : qsrc + S] = np.eye(S)
        k[dims, ksrc : ksrc + S] = np.eye(S)
    v[:IDS, ID : ID + IDS] = np.eye(IDS) * rms(IDS + (match + 1) * S)
    o[PRED : PRED + IDS, :IDS] = np.eye(IDS)
    t[a + "q_norm.weight"][:], t[a + "k_norm.weight"][:] = 5.0, 5.0
    t[a + "q_proj.weight"], t[a + "k_proj.weight"], t[a + "v_proj.weight"], t[a + "o_proj.weight"] = q, k, v, o
    t["model.embed_tokens.weight"] = embed
    head = np.zeros((V, D), np.float32)
    head[:, PRED : PRED + IDS] = ids * (6.0 * rms(2 * IDS + (match + 1) * S) / IDS)  # a copied token's logit ~6
    t["lm_head.weight"] = head
    if mtp:
        layers = overrides.get("num_hidden_layers", _COMMON["num_hidden_layers"])
        m = f"model.layers.{layers}."
        for name in [n for n in t if n.startswith("model.layers.1.")]:  # the induction head, its MoE adding nothing
            t[m + name[len("model.layers.1.") :]] = t[name].copy()
        eh = np.zeros((D, 2 * D), np.float32)  # [enorm(next token's embedding) | hnorm(hidden row)] -> residual
        eh[C, C] = 1.0
        eh[ID : ID + IDS, ID : ID + IDS] = np.eye(IDS)
        eh[CODE : CODE + S, CODE : CODE + S] = np.eye(S)
        for dst, src in zip(PREV, [CODE, *PREV[:-1]]):  # the hidden row's codes, one slot further back
            eh[dst : dst + S, D + src : D + src + S] = np.eye(S)
        t[m + "eh_proj.weight"] = eh
        t[m + "enorm.weight"] = np.full(D, rms(IDS + S), np.float32)  # entries +-1 again, as in the residual
        t[m + "hnorm.weight"] = np.full(D, rms(2 * IDS + (match + 1) * S), np.float32)
        t[m + "shared_head.norm.weight"] = np.ones(D, np.float32)
        t[m + "shared_head.head.weight"] = head.copy()
        config = os.path.join(path, "config.json")
        with open(config) as f:
            cfg = json.load(f)
        cfg["num_nextn_predict_layers"] = 1
        with open(config, "w") as f:
            json.dump(cfg, f, indent=2)
    save_file({n: np.ascontiguousarray(x) for n, x in t.items()}, file, metadata={"format": "pt"})
