"""A checkpoint's weights in the layout `from_pretrained` expects.

    ckpt/model-0000i-of-0000n.safetensors   each tensor once, in model order, in shards
    ckpt/model.safetensors.index.json       of at most `max_shard_bytes` (default "50GB")

or one `model.safetensors` (no index) when they fit one shard, as `save_pretrained`
writes them; each tensor in the dtype the model holds it in (fp32 masters), or in an
export dtype (then the share files keep the masters). Every tensor is written from where
it lives through `direct.py`'s staging buffer; only a cast or non-contiguous one is
copied, alone, so a save adds at most one tensor's bytes to the host
(`preflight.save_buffer_bytes`). Docs: docs/user_guide.md "8. Checkpoints".
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lazytrain_accel.checkpoints.direct import DirectFile, Staging

WEIGHTS = "model.safetensors"
INDEX = f"{WEIGHTS}.index.json"
#: `PreTrainedModel.save_pretrained(max_shard_size="50GB")`, in bytes (10**9 a GB).
DEFAULT_MAX_SHARD_BYTES = 50 * 10**9
#: `checkpoint_dtype` values: the dtype the model holds each tensor in, or a named one.
CHECKPOINT_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
    "float16": torch.float16}

Named = Sequence[tuple[str, torch.Tensor]]


def export_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype `tensor` is written in: `dtype` for floating tensors when one is named
    (integer and quantized tensors keep theirs), else its own."""
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def exported_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    return tensor.numel() * export_dtype(tensor, dtype).itemsize


# ---- a streaming safetensors writer (no second copy of the model) ------------------------
_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
           torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
           torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def write_safetensors(path: Path, tensors: Named, *, dtype: torch.dtype | None = None,
                      metadata: Mapping[str, str] | None = None,
                      staging: Staging | None = None) -> int:
    """Write `tensors` as a safetensors file one tensor at a time (`tensor_bytes`),
    through `staging` (a new buffer if None: files written one after another share one).
    Returns the bytes written; the file is fsynced."""
    header = safetensors_header(tensors, dtype=dtype, metadata=metadata)
    staging = staging if staging is not None else Staging()
    with DirectFile(path, staging) as f:  # past the page cache: checkpoints/direct.py
        f.write(header)
        for _, t in tensors:
            f.write(tensor_bytes(t, dtype))
        f.finish()
        f.fsync()
    return len(header) + sum(exported_bytes(t, dtype) for _, t in tensors)


def safetensors_header(tensors: Named, *, dtype: torch.dtype | None = None,
                       metadata: Mapping[str, str] | None = None) -> bytes:
    """The length-prefixed header of a safetensors file of `tensors` in this order (known
    before any byte of data is: shapes and dtypes, not values)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, t in tensors:
        kind = export_dtype(t, dtype)
        if kind not in _DTYPES:
            raise ValueError(f"{name}: dtype {kind} has no safetensors code")
        size = exported_bytes(t, dtype)
        header[name] = {"dtype": _DTYPES[kind], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def tensor_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> memoryview:
    """`tensor`'s bytes in `export_dtype`: a view of the tensor where it lives; only a
    tensor cast, non-contiguous or on a device is copied, alone."""
    data = tensor.detach()
    kind = export_dtype(data, dtype)
    if data.device.type != "cpu" or not data.is_contiguous() or data.dtype != kind:
        data = data.to("cpu", kind).contiguous()
    return memoryview(data.reshape(-1).view(torch.uint8).numpy())

def plan_shards(tensors: Named, *, max_shard_bytes: int, dtype: torch.dtype | None
                ) -> list[list[tuple[str, torch.Tensor]]]:
    """`tensors` cut in order into runs of at most `max_shard_bytes` (a larger tensor
    alone in its shard, as `save_pretrained` does); order kept, so the writer walks the
    masters layer group by layer group."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
    shards: list[list[tuple[str, torch.Tensor]]] = []
    used_bytes = max_shard_bytes  # forces a first shard
    for name, tensor in tensors:
        size = exported_bytes(tensor, dtype)
        if used_bytes + size > max_shard_bytes and (not shards or shards[-1]):
            shards.append([])
            used_bytes = 0
        shards[-1].append((name, tensor))
        used_bytes += size
    return shards or [[]]


def shard_file(index: int, count: int) -> str:
    """The shard names `save_pretrained` uses (1-based)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_weight_files(directory: Path, tensors: Named, *, max_shard_bytes: int,
                       dtype: torch.dtype | None) -> list[str]:
    """Write `tensors` (each once) into `directory` as `model.safetensors` or as shards
    and their index; returns the files written. Every file is fsynced."""
    shards = plan_shards(tensors, max_shard_bytes=max_shard_bytes, dtype=dtype)
    if len(shards) == 1:
        write_safetensors(directory / WEIGHTS, shards[0], dtype=dtype)
        return [WEIGHTS]
    files = [shard_file(i + 1, len(shards)) for i in range(len(shards))]
    staging = Staging()  # one buffer for every shard: its pages are touched once
    for file, shard in zip(files, shards, strict=True):
        write_safetensors(directory / file, shard, dtype=dtype, staging=staging)
    write_index(directory, files, [[(name, exported_bytes(t, dtype)) for name, t in shard]
                                   for shard in shards])
    return [*files, INDEX]


def write_index(directory: Path, files: Sequence[str],
                shards: Sequence[Sequence[tuple[str, int]]]) -> None:
    """`model.safetensors.index.json`: each tensor's shard, and the weights' bytes
    (`shards`: each file's tensors as (name, bytes written))."""
    weight_map = {name: file for file, shard in zip(files, shards, strict=True)
                  for name, _ in shard}
    total_bytes = sum(nbytes for shard in shards for _, nbytes in shard)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}
    (directory / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))


def weight_files(directory: Path) -> dict[str, Path] | None:
    """Each saved tensor's file: from the index, else every key of `model.safetensors`;
    None when `directory` holds neither."""
    directory = Path(directory)
    if (directory / INDEX).is_file():
        weight_map = json.loads((directory / INDEX).read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    if not (directory / WEIGHTS).is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(directory / WEIGHTS), framework="pt") as f:
        return dict.fromkeys(f.keys(), directory / WEIGHTS)
