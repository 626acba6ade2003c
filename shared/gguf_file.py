"""A GGUF file's metadata and tensor table, read in one pass with struct (numpy only, no torch).

What the gateway (model info), the tokenizer and the loader read from a GGUF file: the key/value
metadata as plain Python values, and every tensor's name, ggml type, dims and a read-only
memory-mapped view of its bytes. The values equal those of the `gguf` package's GGUFReader
(tests/shared/test_gguf_file.py compares them on the shipped model and on files that package
writes), which this replaces on the start-up path: GGUFReader builds a numpy view per element of
every metadata array, about 4 s for a 49k-token vocabulary, paid by each process that opens the
file (gateway, worker, offline engine), where this takes a fraction of a second.

Format (GGUF v2 and v3, little-endian): magic "GGUF", version u32, tensor count u64, key/value
count u64; each key a string (u64 length + UTF-8 bytes), a value type u32 and the value (arrays:
element type u32, count u64, elements); then per tensor its name, dims count u32, dims u64 each
(innermost first), ggml type u32 and data offset u64 relative to the data section, which starts
at the next multiple of general.alignment (default 32). A big-endian file is refused with a clear
error (no such file is in use; the loader's dequantization assumes little-endian blocks).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# value type code -> (struct format, size) for the scalar types; 8 = string, 9 = array
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8",
          11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader can read (named, with the reason)."""


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of the file. shape: dims as the file lists them (innermost first, like
    GGUFReader's); tensor_type: gguf's GGMLQuantizationType; data: a read-only view of its bytes,
    typed and shaped as GGUFReader's (float types as floats in reversed dims, block formats as
    uint8 rows of blocks)."""

    name: str
    tensor_type: Any
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GgufFile:
    """path -> .version, .fields (key -> value: str, int, float, bool or a list of them),
    .tensors (list of GgufTensor, in file order), .alignment, .data_offset. Raises
    GgufFormatError for a file that is not GGUF, is truncated, or is big-endian."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._mm = np.memmap(self.path, mode="r")
        buf = self._mm
        self._buf, self._size = buf, buf.shape[0]
        if self._size < 24 or bytes(buf[:4]) != MAGIC:
            raise GgufFormatError(f"{self.path}: not a GGUF file (no GGUF magic)")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version & 0xFFFF == 0:
            raise GgufFormatError(f"{self.path}: a big-endian GGUF file; only little-endian files are supported")
        if version not in (2, 3):
            raise GgufFormatError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        self.version = version
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._off = 24
        try:
            self.fields: dict[str, Any] = {}
            for _ in range(n_kv):
                key = self._string()
                (vtype,) = self._unpack("<I", 4)
                self.fields[key] = self._value(vtype)
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                (n_dims,) = self._unpack("<I", 4)
                dims = self._unpack(f"<{n_dims}Q", 8 * n_dims)
                ttype, offset = self._unpack("<IQ", 12)
                infos.append((name, tuple(int(d) for d in dims), ttype, offset))
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise GgufFormatError(f"{self.path}: truncated or corrupt GGUF metadata ({e})") from None
        align = self.fields.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or align <= 0 or align & (align - 1):
            raise GgufFormatError(f"{self.path}: invalid general.alignment {align!r}")
        self.alignment = align
        self.data_offset = -(-self._off // align) * align
        self.tensors = [self._tensor(*info) for info in infos]

    # -- parsing ------------------------------------------------------------------------------
    def _unpack(self, fmt: str, size: int) -> tuple:
        if self._off + size > self._size:
            raise struct.error(f"need {size} bytes at offset {self._off}, file has {self._size}")
        out = struct.unpack_from(fmt, self._buf, self._off)
        self._off += size
        return out

    def _string(self) -> str:
        (n,) = self._unpack("<Q", 8)
        if self._off + n > self._size:
            raise struct.error(f"string of {n} bytes at offset {self._off} runs past the end")
        s = bytes(self._buf[self._off:self._off + n]).decode("utf-8")
        self._off += n
        return s

    def _value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            fmt, size = _SCALARS[vtype]
            return self._unpack(fmt, size)[0]
        if vtype == STRING:
            return self._string()
        if vtype == ARRAY:
            etype, count = self._unpack("<IQ", 12)
            if etype in _NUMPY:
                size = _SCALARS[etype][1] * count
                if self._off + size > self._size:
                    raise struct.error(f"array of {count} runs past the end")
                arr = np.frombuffer(self._buf, dtype=_NUMPY[etype], count=count, offset=self._off)
                self._off += size
                return arr.tolist()
            if etype == STRING:
                return self._strings(count)
            return [self._value(etype) for _ in range(count)]
        raise GgufFormatError(f"{self.path}: unknown GGUF value type {vtype} at offset {self._off}")

    def _strings(self, count: int) -> list[str]:
        """count length-prefixed strings: the vocabulary and merges (tens of thousands)."""
        raw, off, size, out = memoryview(self._mm)[self._off:], 0, self._size - self._off, []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            (n,) = unpack(raw, off)
            off += 8
            if off + n > size:
                raise struct.error(f"string of {n} bytes runs past the end")
            out.append(str(raw[off:off + n], "utf-8"))
            off += n
        self._off += off
        return out

    def _tensor(self, name: str, dims: tuple[int, ...], ttype: int, offset: int) -> GgufTensor:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        try:
            qtype = GGMLQuantizationType(ttype)
        except ValueError:
            raise GgufFormatError(f"{self.path}: tensor {name!r} has unknown ggml type {ttype}") from None
        n_elems = int(np.prod(dims)) if dims else 1
        block, type_size = GGML_QUANT_SIZES[qtype]
        n_bytes = n_elems * type_size // block
        start = self.data_offset + offset
        if start + n_bytes > self._size:
            raise GgufFormatError(f"{self.path}: tensor {name!r} runs past the end of the file (truncated?)")
        np_dims = tuple(reversed(dims))
        floats = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}
        if qtype.name in floats:
            dtype = np.dtype(floats[qtype.name]).newbyteorder("<")
            data = np.frombuffer(self._mm, dtype=dtype, count=n_elems, offset=start).reshape(np_dims)
        else:
            data = np.frombuffer(self._mm, dtype=np.uint8, count=n_bytes, offset=start).reshape(
                quant_shape_to_byte_shape(np_dims, qtype))
        return GgufTensor(name, qtype, dims, n_elems, n_bytes, start, data)
