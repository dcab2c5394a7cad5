"""A GGUF file's metadata and tensor table, read in a fraction of a second.

`gguf.GGUFReader` builds a numpy view for every part of every metadata value. A vocabulary is an array
of one string per token, so Gemma 3's 262k-token file took 17 s to open and SmolLM2's 49k-token one
4.4 s: most of the time `sieve serve` took to start. This reader walks the header with `struct` over
one memory map, keeps arrays of strings undecoded until asked, and gives each tensor the same numpy
view of its data `gguf.GGUFReader` does (shape reversed to row-major; quantized types as rows of bytes),
so `gguf.quants.dequantize` takes it unchanged. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
(versions 2 and 3, little-endian; a big-endian file is refused by name).
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF value types: struct format of the scalars, and the numpy dtype of arrays of them
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9
_PLAIN_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


class StringArray:
    """An array of GGUF strings, decoded (UTF-8) one at a time when read."""

    def __init__(self, buf: mmap.mmap, offsets: list[int], lengths: list[int]):
        self._buf, self._offsets, self._lengths = buf, offsets, lengths

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, i: int) -> str:
        start = self._offsets[i]
        return self._buf[start: start + self._lengths[i]].decode("utf-8", "replace")

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def tolist(self) -> list[str]:
        return list(self)


@dataclass
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order: the innermost (contiguous) dimension first
    tensor_type: GGMLQuantizationType
    n_bytes: int
    data_offset: int
    data: np.ndarray  # row-major view of the bytes in the file (outermost dimension first)


class GGUFFile:
    """`fields`: key -> value (int, float, bool, str; a numpy array for arrays of numbers, a StringArray
    for arrays of strings, a list for arrays of arrays); `tensors`: TensorInfo in file order."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ValueError(f"the file is {size} bytes, shorter than a GGUF header")
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        if self._take(4) != MAGIC:
            raise ValueError("GGUF magic invalid")
        (version,) = self._unpack("<I")
        if version & 0xFFFF == 0:
            raise ValueError("the file is big-endian GGUF, which sieve does not read")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        n_tensors, n_fields = self._unpack("<QQ")
        self.version = version
        self.fields: dict[str, object] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            if key in self.fields:
                raise ValueError(f"metadata key {key} appears twice")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            if not 1 <= n_dims <= 8:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), kind, offset))
        alignment = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment!r} is not a power of two")
        self.data_offset = -(-self._pos // alignment) * alignment
        self._data = np.frombuffer(self._buf, dtype=np.uint8)  # the tensors' views, on the same map
        self.tensors = [self._tensor(*info, size) for info in infos]
        if len({t.name for t in self.tensors}) != len(self.tensors):
            raise ValueError("two tensors have the same name")

    # ---- the header, in order --------------------------------------------------------------
    def _take(self, n: int) -> bytes:
        end = self._pos + n
        if end > len(self._buf):
            raise ValueError(f"the header runs past the end of the file (at byte {self._pos})")
        out = self._buf[self._pos: end]
        self._pos = end
        return out

    def _unpack(self, fmt: str) -> tuple:
        n = struct.calcsize(fmt)
        if self._pos + n > len(self._buf):
            raise ValueError(f"the header runs past the end of the file (at byte {self._pos})")
        out = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += n
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q")
        return self._take(n).decode("utf-8")

    def _value(self, kind: int):
        if kind in _SCALARS:
            (v,) = self._unpack(_SCALARS[kind])
            return v
        if kind == STRING:
            return self._string()
        if kind != ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at byte {self._pos}")
        item, count = self._unpack("<IQ")
        if item in _NUMPY:
            dtype = np.dtype(_NUMPY[item])
            raw = self._take(count * dtype.itemsize)
            values = np.frombuffer(raw, dtype=dtype)
            return values.astype(bool) if item == 7 else values
        if item == STRING:
            if count > (len(self._buf) - self._pos) // 8:  # each string takes at least its 8-byte length
                raise ValueError(f"an array of {count} strings runs past the end of the file")
            offsets, lengths = [0] * count, [0] * count
            pos, buf, end, unpack = self._pos, self._buf, len(self._buf), struct.Struct("<Q").unpack_from
            for i in range(count):
                if pos + 8 > end:
                    raise ValueError("an array of strings runs past the end of the file")
                (n,) = unpack(buf, pos)
                offsets[i], lengths[i] = pos + 8, n
                pos += 8 + n
            if pos > end:
                raise ValueError("an array of strings runs past the end of the file")
            self._pos = pos
            return StringArray(buf, offsets, lengths)
        if item == ARRAY:
            out = []
            for _ in range(count):
                out.append(self._value(ARRAY))
            return out
        raise ValueError(f"unknown array item type {item} at byte {self._pos}")

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, offset: int, size: int) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"tensor {name} has unknown type {kind}") from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_elems = int(np.prod(dims))
        if dims[0] % block:
            raise ValueError(f"tensor {name}: rows of {dims[0]} are not whole {qtype.name} blocks of {block}")
        n_bytes = n_elems // block * type_size
        start = self.data_offset + offset
        if start + n_bytes > size:
            raise ValueError(f"tensor {name}'s data runs past the end of the file")
        shape = tuple(reversed(dims))
        if qtype in _PLAIN_TENSORS:
            data = self._data[start: start + n_bytes].view(_PLAIN_TENSORS[qtype]).reshape(shape)
        else:
            data = self._data[start: start + n_bytes].reshape(*shape[:-1], shape[-1] // block * type_size)
        return TensorInfo(name, dims, qtype, n_bytes, start, data)
