"""Reading and writing the safetensors format (memory-mapped, bfloat16 included, strict checks).

Format: 8-byte little-endian header length N, N bytes of JSON ``{name: {dtype, shape, data_offsets}}``
(optionally ``__metadata__``), then the raw little-endian tensor bytes. We parse it ourselves so that
bfloat16 works with numpy (via ml_dtypes) and so that a damaged file produces an error naming the file
and tensor instead of a crash deep inside a library.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_NAMES = {v: k for k, v in _DTYPES.items()}
_MAX_HEADER = 100 * 1024 * 1024


class SafetensorsError(ValueError):
  """A safetensors file is malformed."""


def read_header(path: str) -> tuple[dict, int]:
  """Returns (tensor entries, byte offset where data begins)."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise SafetensorsError(f"{path}: file is {size} bytes, too short for a safetensors header")
    (n,) = struct.unpack("<Q", raw)
    if n > min(_MAX_HEADER, size - 8):
      raise SafetensorsError(f"{path}: header length {n} exceeds the file size {size}")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
  if not isinstance(header, dict):
    raise SafetensorsError(f"{path}: header is not a JSON object")
  header.pop("__metadata__", None)
  data_size = size - 8 - n
  for name, entry in header.items():
    try:
      dtype, shape, (begin, end) = _DTYPES[entry["dtype"]], entry["shape"], entry["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise SafetensorsError(f"{path}: tensor {name!r} has a malformed entry {entry!r}") from None
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected or begin < 0:
      raise SafetensorsError(f"{path}: tensor {name!r} {entry['dtype']}{shape} needs {expected} bytes, "
                             f"data_offsets give {end - begin}")
    if end > data_size:
      raise SafetensorsError(f"{path}: tensor {name!r} ends at byte {end} but the file holds only "
                             f"{data_size} data bytes (truncated file?)")
  return header, 8 + n


def load(path: str) -> dict[str, np.ndarray]:
  """All tensors of one file as read-only memory-mapped numpy arrays."""
  header, start = read_header(path)
  out = {}
  if not header:
    return out
  mm = np.memmap(path, dtype=np.uint8, mode="r")
  for name, entry in header.items():
    begin, end = entry["data_offsets"]
    dtype = _DTYPES[entry["dtype"]]
    out[name] = mm[start + begin:start + end].view(dtype).reshape(entry["shape"])
  return out


def save(path: str, tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str] | None = None):
  """Writes tensors (C-contiguous, in name order) to ``path`` atomically."""
  header, offset, arrays = {}, 0, []
  for name in sorted(tensors):
    arr = np.ascontiguousarray(np.asarray(tensors[name]))
    if arr.dtype not in _NAMES:
      raise SafetensorsError(f"tensor {name!r}: dtype {arr.dtype} is not supported by safetensors")
    header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape),
                    "data_offsets": [offset, offset + arr.nbytes]}
    offset += arr.nbytes
    arrays.append(arr)
  header["__metadata__"] = dict(metadata or {"format": "pt"})
  blob = json.dumps(header, separators=(",", ":")).encode()
  blob += b" " * (-len(blob) % 8)  # keep tensor data 8-byte aligned
  tmp = path + ".tmp"
  with open(tmp, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for arr in arrays:
      f.write(arr.tobytes())
  os.replace(tmp, path)
