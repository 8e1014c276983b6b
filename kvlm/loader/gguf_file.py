"""A GGUF file opened for reading: metadata as plain Python values, tensor descriptions, and the file's
bytes memory-mapped (nothing read until a tensor is used). Long arrays (the tokenizer's vocabulary and
merges) are `LazyArray`s: length-checked here, decoded only when a tokenizer is built from them.

The `gguf` package's `GGUFReader` builds a numpy view for every metadata array element, which takes
seconds on a model with a 49k-token vocabulary; this parser reads the same layout in one pass with
`struct` and `numpy.frombuffer` (numeric arrays in one call, strings in a plain loop). Every count and
length is checked against the file size before it is used, so a corrupt header raises `ValueError` (one
sentence naming the field and byte) instead of allocating or looping for ever; this is the only GGUF
header parser. It knows nothing about models: `loader.gguf` interprets it.

Layout (GGUF v2/v3, little-endian): magic, version u32, tensor count u64, metadata count u64; metadata
(key string, type u32, value); tensor infos (name string, n_dims u32, dims u64 x n_dims fastest-first,
type u32, offset u64); padding to `general.alignment` (default 32); tensor data.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from kvlm.kernels.ggml_types import GGML_QUANT_SIZES, GGMLQuantizationType

# GGUF metadata value types -> (struct format, numpy dtype) for the fixed-size ones.
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9
# Arrays at least this long (a tokenizer's tokens, merges, types, scores) are decoded on first use:
# ~100k Python strings, ~10 MB and ~50 ms, that a start with a cached tokenizer never needs.
LAZY_ARRAY_MIN = 1024
_MAX_DIMS = 4  # GGML_MAX_DIMS


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
        magic = bytes(self._take(4, "magic"))
        if magic != b"GGUF":
            raise ValueError(f"bad magic {magic!r}")
        version, n_tensors, n_kv = self._unpack("<IQQ", 20, "header")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        # Each key/value and each tensor info takes at least ~24 bytes: absurd counts fail before any loop.
        if 24 * (n_tensors + n_kv) > self._size:
            raise ValueError(f"corrupt GGUF header ({n_tensors} tensors, {n_kv} metadata keys)")
        # GGUFReader's pseudo-fields, so both readers give the same dictionary.
        self.fields: dict[str, Any] = {"GGUF.version": version, "GGUF.tensor_count": n_tensors, "GGUF.kv_count": n_kv}
        for i in range(n_kv):
            key = self._string(f"metadata key {i}")
            self.fields[key] = self._value(self._unpack("<I", 4, f"type of {key[:64]!r}")[0], repr(key[:64]))
        self.tensors: list[GGUFTensorInfo] = []
        infos = []
        for i in range(n_tensors):
            name = self._string(f"name of tensor {i}")
            (n_dims,) = self._unpack("<I", 4, f"dimension count of {name[:64]!r}")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ValueError(f"tensor {name[:64]!r} has {n_dims} dimensions")
            dims = np.array(self._unpack(f"<{n_dims}Q", 8 * n_dims, f"shape of {name[:64]!r}"), dtype=np.uint64)
            ttype, offset = self._unpack("<IQ", 12, f"type of {name[:64]!r}")
            try:
                infos.append((name, dims, GGMLQuantizationType(ttype), offset))
            except ValueError:
                raise ValueError(f"tensor {name[:64]!r} has unknown type {ttype}") from None
        align = self.fields.get("general.alignment", 32)
        if not isinstance(align, int) or not 1 <= align <= 1 << 16 or align & (align - 1):
            raise ValueError(f"general.alignment {align!r} is not a power of two")
        start = -(-self._pos // align) * align
        for name, dims, ttype, offset in infos:
            elems, block_bytes = GGML_QUANT_SIZES[ttype]
            count = math.prod(int(d) for d in dims)
            if int(dims[0]) % elems:
                raise ValueError(f"tensor {name[:64]!r}: rows of {int(dims[0])} are not whole {elems}-element blocks")
            n_bytes = count // elems * block_bytes
            if start + offset + n_bytes > self._size:
                raise ValueError(f"truncated: tensor {name[:64]!r} ({n_bytes} bytes at offset {offset}) runs past "
                                 f"the end of the {self._size}-byte file")
            self.tensors.append(GGUFTensorInfo(name, ttype, dims, start + int(offset), n_bytes, self))

    # -- reading primitives (bounds-checked; `what` names the field in the error) -----------------------
    def _take(self, n: int, what: str) -> memoryview:
        if n < 0 or self._pos + n > self._size:
            raise ValueError(f"truncated: {what} (byte {self._pos}) runs past the end of the {self._size}-byte file")
        view = self._buf[self._pos : self._pos + n]
        self._pos += n
        return view

    def _unpack(self, fmt: str, n: int, what: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self._take(n, what))

    def _string(self, what: str) -> str:
        (n,) = self._unpack("<Q", 8, f"length of {what}")
        return bytes(self._take(n, what)).decode("utf-8", errors="replace")

    def _value(self, vtype: int, what: str, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            fmt, _ = _SCALARS[vtype]
            return self._unpack(fmt, struct.calcsize(fmt), what)[0]
        if vtype == _STRING:
            return self._string(what)
        if vtype != _ARRAY or depth > 1:
            raise ValueError(f"unknown value type {vtype} in {what}")
        etype, count = self._unpack("<IQ", 12, f"element type and length of {what}")
        if count > self._size - self._pos:  # every element takes at least one byte
            raise ValueError(f"truncated: {what} claims {count} elements, more than the file holds")
        start = self._pos
        if etype in _SCALARS:
            dt = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            raw = self._take(count * dt.itemsize, what)
            if count >= LAZY_ARRAY_MIN:
                return LazyArray(self._buf, start, count, etype)
            return np.frombuffer(raw, dtype=dt).tolist()
        if etype == _STRING:
            lazy = count >= LAZY_ARRAY_MIN
            buf, pos, size, out = self._buf, self._pos, self._size, []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):  # the hot loop of a vocabulary: no method calls per element
                if pos + 8 > size:
                    raise ValueError(f"truncated: {what} runs past the end of the {size}-byte file")
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > size:
                    raise ValueError(f"truncated: {what} runs past the end of the {size}-byte file")
                if not lazy:
                    out.append(str(buf[pos : pos + n], "utf-8", "replace"))
                pos += n
            self._pos = pos
            return LazyArray(buf, start, count, etype) if lazy else out
        return [self._value(etype, what, depth + 1) for _ in range(count)]  # arrays of arrays (rare)
