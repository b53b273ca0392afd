"""Read tensors from safetensors checkpoints without torch, one tensor at a time.

A checkpoint directory holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json``. Files are memory-mapped and only the requested
tensors are read, so a rank that owns a few experts touches only their bytes.
bfloat16 tensors come back as ``uint16`` raw bits and float8_e4m3fn (``F8_E4M3``) as ``uint8``
raw bytes (NumPy has neither); use ``to_float32`` to widen them.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from eprt.api import is_int
from eprt.ops.bf16 import bf16_bits_to_f32

_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "F8_E4M3": np.uint8,  # float8_e4m3fn bytes (FP8 checkpoints)
    "F64": np.float64,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class CheckpointError(ValueError):
    """A missing or malformed checkpoint file or tensor; the message names it."""


@dataclass(frozen=True)
class TensorInfo:
    file: str
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple
    start: int  # byte offsets into the file's data section
    end: int


class SafetensorsCheckpoint:
    """Index of every tensor in a checkpoint directory; reads tensors on demand."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self._infos: dict[str, TensorInfo] = {}
        self._maps: dict[str, tuple[mmap.mmap, int]] = {}
        self.bytes_read = 0
        self.tensors_read = 0
        for path in self._files():
            self._index_file(path)

    def _files(self) -> list[str]:
        index = os.path.join(self.model_dir, "model.safetensors.index.json")
        if os.path.isfile(index):
            try:
                with open(index, encoding="utf-8") as f:
                    weight_map = json.load(f)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                raise CheckpointError(f"{index} is not valid JSON: {e}") from None
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{index} has no weight_map of tensor names to file names")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(f"no .safetensors files in {self.model_dir!r}")
        paths = [os.path.join(self.model_dir, f) for f in files]
        for p in paths:
            if not os.path.isfile(p):
                raise CheckpointError(f"checkpoint shard {p!r} is missing")
        return paths

    def _index_file(self, path: str) -> None:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path!r} is not a safetensors file (too short)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise CheckpointError(
                    f"{path!r} is truncated or corrupt: its header length {n} exceeds the file size {size}"
                )
            try:
                header = json.loads(f.read(n))
            except ValueError as e:
                raise CheckpointError(f"{path!r} has a corrupt safetensors header: {e}") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path!r} has a corrupt safetensors header: not a JSON object")
        data_size = size - 8 - n
        for name, meta in header.items():
            if name != "__metadata__":
                self._infos[name] = _tensor_info(path, name, meta, 8 + n, data_size)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def keys(self):
        return self._infos.keys()

    def info(self, name: str) -> TensorInfo:
        try:
            return self._infos[name]
        except KeyError:
            raise CheckpointError(f"checkpoint {self.model_dir!r} has no tensor {name!r}") from None

    def read(self, name: str) -> np.ndarray:
        """The tensor as stored (bf16 as uint16 bits); a read-only view of the mapped file."""
        info = self.info(name)
        if info.file not in self._maps:
            f = open(info.file, "rb")
            self._maps[info.file] = (mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ), f)
        mm = self._maps[info.file][0]
        dtype = np.dtype(_DTYPES[info.dtype])
        count = int(np.prod(info.shape)) if info.shape else 1
        if (info.end - info.start) != count * dtype.itemsize:
            raise CheckpointError(f"tensor {name!r} size does not match its shape {info.shape}")
        self.bytes_read += info.end - info.start
        self.tensors_read += 1
        return np.frombuffer(mm, dtype=dtype, count=count, offset=info.start).reshape(info.shape)

    def close(self) -> None:
        for mm, f in self._maps.values():
            mm.close()
            f.close()
        self._maps.clear()


def _tensor_info(path: str, name: str, meta, data_start: int, data_size: int) -> TensorInfo:
    """One header entry, checked: known dtype, integer shape, offsets inside the file's data section."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"tensor {name!r} in {path!r} {why}")

    if not isinstance(meta, dict):
        raise bad("has a corrupt header entry")
    dtype, shape, offsets = meta.get("dtype"), meta.get("shape"), meta.get("data_offsets")
    if dtype not in _DTYPES:
        raise bad(f"has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_index(d) for d in shape):
        raise bad(f"has an invalid shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_index(o) for o in offsets)):
        raise bad(f"has invalid data_offsets {offsets!r}")
    start, end = offsets
    if not start <= end <= data_size:
        raise bad(
            f"lies outside the file (data_offsets [{start}, {end}], data section of {data_size} bytes): "
            f"the file is truncated or corrupt"
        )
    return TensorInfo(path, dtype, tuple(shape), data_start + start, data_start + end)


def _is_index(v) -> bool:
    return is_int(v) and v >= 0


def _e4m3fn_table() -> np.ndarray:
    """float32 value of each of the 256 float8_e4m3fn bytes: 1 sign, 4 exponent (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (m/8 * 2^-6); 0x7F and 0xFF are NaN; there is no infinity."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp, man = (b >> 3) & 0xF, b & 0x7
    mag = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * 2.0 ** (exp - 7.0))
    mag[(exp == 0xF) & (man == 0x7)] = np.nan
    return (sign * mag).astype(np.float32)


_E4M3FN = _e4m3fn_table()


def fp8_e4m3_to_f32(raw: np.ndarray) -> np.ndarray:
    """Decode float8_e4m3fn bytes (uint8) to float32, exactly."""
    return _E4M3FN[np.asarray(raw, dtype=np.uint8)]


def to_float32(a: np.ndarray, dtype_name: str) -> np.ndarray:
    """Widen a stored tensor to float32 (bf16 bits are shifted into the high half, FP8 bytes decoded)."""
    if dtype_name == "BF16":
        return bf16_bits_to_f32(a)
    if dtype_name == "F8_E4M3":
        return fp8_e4m3_to_f32(a)
    return a.astype(np.float32)
