"""A GGUF file opened for reading: metadata as plain Python values, tensor descriptions, and the file's
bytes memory-mapped (nothing read until a tensor is used). Long arrays (the tokenizer's vocabulary and
merges) are `LazyArray`s: length-checked here, decoded only when a tokenizer is built from them.

The `gguf` package's `GGUFReader` builds a numpy view for every metadata array element, which takes
seconds on a model with a 49k-token vocabulary; this parser reads the same layout in one pass with
`struct` and `numpy.frombuffer` (numeric arrays in one call, strings in a plain loop). Every count and
length is checked against the file size before it is used, so a corrupt header raises `ValueError`
instead of allocating or looping for ever. It knows nothing about models: `loader.gguf` interprets it.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64; metadata
(key string, type u32, value); tensor infos (name string, n_dims u32, dims u64 x n_dims fastest-first,
type u32, offset u64); padding to `general.alignment` (default 32); tensor data.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np
from kvlm.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF metadata value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
# Arrays at least this long (a tokenizer's tokens, merges, types, scores) are decoded on first use:
# ~100k Python strings, ~10 MB and ~50 ms, that a start with a cached tokenizer never needs.
LAZY_ARRAY_MIN = 1024


class LazyArray(Sequence):
    """A metadata array whose elements are decoded from the mapped file on first access (then kept).
    Its length is known up front; its bytes were bounds-checked when the header was parsed."""

    def __init__(self, buf: memoryview, pos: int, count: int, etype: int) -> None:
        self._buf, self._pos, self._count, self._etype = buf, pos, count, etype
        self._values: list[Any] | None = None

    def _decode(self) -> list[Any]:
        if self._values is None:
            if self._etype in _SCALARS:
                dt = np.dtype(_SCALARS[self._etype][1]).newbyteorder("<")
                self._values = np.frombuffer(self._buf, dtype=dt, count=self._count, offset=self._pos).tolist()
            else:
                buf, pos, out = self._buf, self._pos, []
                unpack = struct.Struct("<Q").unpack_from
                for _ in range(self._count):
                    (n,) = unpack(buf, pos)
                    out.append(str(buf[pos + 8 : pos + 8 + n], "utf-8", "replace"))
                    pos += 8 + n
                self._values = out
        return self._values

    def __len__(self) -> int:
        return self._count

    @overload
    def __getitem__(self, i: int) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: int | slice) -> Any:
        return self._decode()[i]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._decode())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"LazyArray(len={self._count})"


@dataclass(slots=True)
class GGUFTensorInfo:
    """One tensor's description; `data` is a numpy view of the mapped file in the stored layout."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # dims fastest-first, as GGUF stores them (GGUFReader's convention)
    data_offset: int  # absolute byte offset in the file
    n_bytes: int
    _file: GGUFFile

    @property
    def data(self) -> np.ndarray:
        """float32 / float16 arrays for F32 / F16, else uint8 (rows, row_bytes): GGUFReader's views."""
        dims = [int(d) for d in reversed(self.shape.tolist())]
        raw = self._file.data[self.data_offset : self.data_offset + self.n_bytes]
        if self.tensor_type == GGMLQuantizationType.F32:
            return raw.view(np.float32).reshape(dims)
        if self.tensor_type == GGMLQuantizationType.F16:
            return raw.view(np.float16).reshape(dims)
        elems, block_bytes = GGML_QUANT_SIZES[self.tensor_type]
        return raw.reshape(*dims[:-1], dims[-1] // elems * block_bytes)


class GGUFFile:
    """Parse header, metadata and tensor infos of `path`; map the file read-only."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.data: np.ndarray = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._buf = memoryview(self.data)  # type: ignore[arg-type]
        self._size = len(self._buf)
        self._pos = 0
        magic = bytes(self._take(4))
        if magic != b"GGUF":
            raise ValueError(f"bad magic {magic!r}")
        version, n_tensors, n_kv = self._unpack("<IQQ", 20)
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        # GGUFReader's pseudo-fields, so both readers give the same dictionary.
        self.fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I", 4)[0])
        self.tensors: list[GGUFTensorInfo] = []
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I", 4)
            if n_dims > 8:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = np.array(self._unpack(f"<{n_dims}Q", 8 * n_dims), dtype=np.uint64)
            ttype, offset = self._unpack("<IQ", 12)
            infos.append((name, dims, GGMLQuantizationType(ttype), offset))
        align = int(self.fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"bad alignment {align}")
        start = -(-self._pos // align) * align
        for name, dims, ttype, offset in infos:
            elems, block_bytes = GGML_QUANT_SIZES[ttype]
            count = int(np.prod(dims.astype(np.int64))) if len(dims) else 1
            if dims.size and int(dims[0]) % elems:
                raise ValueError(f"tensor {name}: row of {int(dims[0])} is not a multiple of {elems}")
            self.tensors.append(GGUFTensorInfo(name, ttype, dims, start + int(offset),
                                               count // elems * block_bytes, self))

    # -- reading primitives (bounds-checked) ------------------------------------------------------------
    def _take(self, n: int) -> memoryview:
        if n < 0 or self._pos + n > self._size:
            raise ValueError(f"truncated: needs {n} bytes at offset {self._pos} of {self._size}")
        view = self._buf[self._pos : self._pos + n]
        self._pos += n
        return view

    def _unpack(self, fmt: str, n: int) -> tuple[Any, ...]:
        return struct.unpack(fmt, self._take(n))

    def _string(self) -> str:
        (n,) = self._unpack("<Q", 8)
        return bytes(self._take(n)).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            fmt, _ = _SCALARS[vtype]
            return self._unpack(fmt, struct.calcsize(fmt))[0]
        if vtype == _STRING:
            return self._string()
        if vtype != _ARRAY:
            raise ValueError(f"unknown metadata type {vtype}")
        etype, count = self._unpack("<IQ", 12)
        if count > self._size:  # every element takes at least one byte
            raise ValueError(f"array of {count} elements in a {self._size}-byte file")
        start = self._pos
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            raw = self._take(count * dt.itemsize)
            if count >= LAZY_ARRAY_MIN:
                return LazyArray(self._buf, start, count, etype)
            return np.frombuffer(raw, dtype=dt).tolist()
        if etype == _STRING:
            lazy = count >= LAZY_ARRAY_MIN
            buf, pos, size, out = self._buf, self._pos, self._size, []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):  # the hot loop of a vocabulary: no method calls per element
                if pos + 8 > size:
                    raise ValueError("truncated string array")
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    raise ValueError("truncated string array")
                if not lazy:
                    out.append(str(buf[pos : pos + n], "utf-8", "replace"))
                pos += n
            self._pos = pos
            return LazyArray(buf, start, count, etype) if lazy else out
        return [self._value(etype) for _ in range(count)]  # arrays of arrays (rare)
