"""A GGUF file's metadata and tensors, read for serving: scalars and numeric arrays as values,
string arrays (the vocabulary, merges) skipped over, tensors as views of a memory map, so a
tensor's bytes are read when it is packed and a 150k-token vocabulary costs ~0.2 s, not the
~10 s that gguf-py's reader spends building an object per string. The tokenizer is read by
transformers, once, and cached (``gguf_model.gguf_tokenizer_dir``).

The container (GGUF v2/v3, little-endian): magic, version, tensor and key counts; each key with
its typed value; each tensor's name, dimensions (innermost first), type and offset; the data,
aligned to ``general.alignment``.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


class GGUFFormatError(ValueError):
    pass


@dataclass(frozen=True)
class StringArray:
    """A string array left unread (``count`` strings)."""

    count: int


@dataclass(frozen=True)
class Tensor:
    name: str
    type: GGMLQuantizationType
    shape: tuple[int, ...]  # PyTorch's order: outermost first
    data: np.ndarray  # typed values for F32/F16, else uint8 ``[*shape[:-1], bytes per row]``


class GGUFFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.fields: dict[str, Any] = {}
        self.tensors: dict[str, Tensor] = {}
        with path.open("rb") as handle:
            if handle.read(4) != b"GGUF":
                raise GGUFFormatError(f"{path.name} is not a GGUF file")
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 4
        try:
            self._parse()
        except GGUFFormatError:
            raise
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            raise GGUFFormatError(f"{path.name} is truncated or malformed: {exc}") from exc
        self.architecture = str(self.fields.get("general.architecture"))

    def _parse(self) -> None:
        version, tensor_count, key_count = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (2 and 3 are read)")
        for _ in range(key_count):
            key = self._string()
            self.fields[key] = self._value(self._read("<I"))
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, dims, GGMLQuantizationType(self._read("<I")), self._read("<Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        self.tensors = {name: self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos}

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        length = self._read("<Q")
        text = self._map[self._pos : self._pos + length].decode("utf-8")
        self._pos += length
        return text

    def _value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self._read(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise GGUFFormatError(f"unknown GGUF value type {kind}")
        item, count = self._read("<I"), self._read("<Q")
        if item in _NUMPY:
            values = np.frombuffer(self._map, dtype=_NUMPY[item], count=count, offset=self._pos)
            self._pos += values.nbytes
            return values.copy()
        if item == _STRING:
            for _ in range(count):
                self._pos += 8 + struct.unpack_from("<Q", self._map, self._pos)[0]
            return StringArray(count)
        return [self._value(item) for _ in range(count)]

    def _tensor(self, name: str, dims: list[int], kind: GGMLQuantizationType, offset: int) -> Tensor:
        shape = tuple(reversed(dims))
        elements = int(np.prod(dims))
        if kind in _PLAIN:
            data = np.frombuffer(self._map, dtype=_PLAIN[kind], count=elements, offset=offset).reshape(shape)
        else:
            block, block_bytes = GGML_QUANT_SIZES[kind]
            rows = elements // dims[0]
            data = np.frombuffer(self._map, dtype=np.uint8, count=elements // block * block_bytes, offset=offset)
            data = data.reshape(*shape[:-1], dims[0] // block * block_bytes) if rows else data
        return Tensor(name, kind, shape, data)

    def value(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)

    def arch_value(self, key: str, default: Any = None) -> Any:
        return self.fields.get(f"{self.architecture}.{key}", default)

    def float_tensor(self, name: str, index: int | None = None) -> torch.Tensor:
        """A tensor (or one expert's slice of a 3-D one) dequantized to float32."""
        from gguf.quants import dequantize

        tensor = self.tensors[name]
        data, shape = (tensor.data, tensor.shape) if index is None else (tensor.data[index], tensor.shape[1:])
        values = dequantize(np.asarray(data), tensor.type)
        return torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
