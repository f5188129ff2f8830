"""The safetensors format, read and written without the ``safetensors`` package: a folder's tensors as memory
maps (strided numpy views, never copies), a header's checks, and a file written from numpy arrays.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np

from jaxpt.hf.families import ConvertError



#: Safetensors dtype names (format spec, ``safetensors`` README) -> numpy dtypes; bfloat16 via ml_dtypes.
_ST_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
              "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _np_dtype(name: str) -> np.dtype:
    if name not in _ST_DTYPES:
        raise ConvertError(f"safetensors dtype {name!r} is not supported")
    if name == "BF16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(_ST_DTYPES[name])


class SafetensorsFolder:
    """The tensors of a folder's ``*.safetensors`` files (one file, or shards named by
    ``model.safetensors.index.json``), each opened as a read-only ``np.memmap`` (no bytes read until indexed).

    Format (``safetensors`` README): 8-byte little-endian header size N, N bytes of JSON
    ``{name: {"dtype", "shape", "data_offsets": [begin, end]}}``, then the data (offsets relative to its start).

    Every file's header is checked as the ``safetensors`` library checks it (:func:`check_header`) before a tensor is
    mapped: a header with bad offsets or sizes would otherwise map the wrong bytes.

    Raises:
      ConvertError: no safetensors file, a malformed header (naming the file and the tensor), or a tensor named twice.
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = str(folder)
        files = sorted(f for f in os.listdir(self.folder) if f.endswith(".safetensors"))
        if not files:
            raise ConvertError(f"{self.folder}: no *.safetensors file (PyTorch .bin checkpoints are not read: "
                               "save the model with safe_serialization=True)")
        self._where: dict[str, tuple[str, dict, int]] = {}
        for f in files:
            path = os.path.join(self.folder, f)
            header, n = read_header(path)
            for name, info in header.items():
                if name in self._where:
                    raise ConvertError(f"{self.folder}: tensor {name!r} is in two files")
                self._where[name] = (path, info, 8 + n)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def names(self) -> list[str]:
        """Every tensor name in the folder's safetensors files, sorted."""
        return sorted(self._where)

    def get(self, name: str) -> np.ndarray:
        """A read-only memory map of tensor ``name`` in its stored dtype and shape.

        Raises:
          ConvertError: no such tensor.
        """
        if name not in self._where:
            raise ConvertError(f"{self.folder}: no tensor {name!r}")
        path, info, base = self._where[name]
        begin, end = info["data_offsets"]
        dtype, shape = _np_dtype(info["dtype"]), tuple(info["shape"])
        if end == begin:
            return np.zeros(shape, dtype)
        return np.memmap(path, dtype=dtype, mode="r", offset=base + begin, shape=shape)


#: The largest header a safetensors file may have (the ``safetensors`` library's limit).
MAX_HEADER_BYTES = 100_000_000


def read_header(path: str) -> tuple[dict[str, dict], int]:
    """``(tensors, header bytes N)`` of a safetensors file, checked by :func:`check_header` (``__metadata__`` left out).

    Raises:
      ConvertError: naming ``path`` and what is wrong.
    """
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        if size < 8:
            raise ConvertError(f"{path}: {size} bytes, too short for a safetensors header")
        n = int.from_bytes(fh.read(8), "little")
        if n > min(MAX_HEADER_BYTES, size - 8):
            raise ConvertError(f"{path}: header of {n} bytes in a file of {size} (or over {MAX_HEADER_BYTES})")
        try:
            header = json.loads(fh.read(n))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConvertError(f"{path}: the header is not JSON ({e})") from None
    return check_header(header, size - 8 - n, path), n


def check_header(header: Any, data_bytes: int, where: str) -> dict[str, dict]:
    """The tensors of a safetensors header, checked as the ``safetensors`` library checks them: a JSON object of
    ``{"dtype": known, "shape": [non-negative ints], "data_offsets": [begin, end]}`` entries (and a string-valued
    ``__metadata__``) whose byte ranges hold exactly their shape's bytes and tile the ``data_bytes`` after the header,
    in order, with no gap or overlap.

    Raises:
      ConvertError: naming ``where``, the tensor and the rule it breaks.
    """
    if not isinstance(header, dict):
        raise ConvertError(f"{where}: the header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise ConvertError(f"{where}: __metadata__ must map strings to strings")
    spans = []
    for name, info in header.items():
        ok = (isinstance(info, dict) and info.get("dtype") in _ST_DTYPES and isinstance(info.get("shape"), list)
              and all(isinstance(d, int) and d >= 0 for d in info["shape"])
              and isinstance(info.get("data_offsets"), list) and len(info["data_offsets"]) == 2
              and all(isinstance(o, int) and o >= 0 for o in info["data_offsets"]))
        if not ok:
            raise ConvertError(f"{where}: tensor {name!r}: a malformed entry {info!r}")
        begin, end = info["data_offsets"]
        expected = math.prod(info["shape"]) * _np_dtype(info["dtype"]).itemsize
        if end - begin != expected:
            raise ConvertError(f"{where}: tensor {name!r}: data_offsets [{begin}, {end}] hold {end - begin} bytes, its "
                               f"dtype and shape {info['shape']} need {expected}")
        spans.append((begin, end, name))
    at = 0
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ConvertError(f"{where}: tensor {name!r} starts at byte {begin} of the data, not {at}: the offsets "
                               "leave a gap or overlap")
        at = end
    if at != data_bytes:
        raise ConvertError(f"{where}: the tensors cover {at} bytes of data, the file holds {data_bytes}")
    return header


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write ``tensors`` (name -> numpy array, C order written) as one safetensors file (format above)."""
    names = sorted(tensors)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    inverse = {np.dtype(v) if k != "BF16" else None: k for k, v in _ST_DTYPES.items()}
    offset = 0
    for name in names:
        a = tensors[name]
        kind = "BF16" if a.dtype.name == "bfloat16" else inverse.get(a.dtype)
        if kind is None:
            raise ValueError(f"write_safetensors: dtype {a.dtype} of {name!r} has no safetensors name")
        header[name] = {"dtype": kind, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in names:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())
