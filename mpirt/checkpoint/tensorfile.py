"""safetensors files read box by box, straight into the caller's array.

A safetensors file is an 8-byte little-endian header length, a JSON header (per tensor its dtype,
shape and byte range) and the raw little-endian data. :class:`SafetensorsFile` parses the header
once and maps the file read-only: :meth:`SafetensorsFile.array` is a NumPy view of one stored tensor
(no bytes read yet), so ``out[...] = f.array(key)[box]`` reads only the pages of the box and writes
them into ``out``, converting the dtype on the way, with no intermediate copy of the box. The pages
are the file's (the page cache, shared and reclaimable), not the process's heap. BF16 tensors are
viewed as ml_dtypes' bfloat16 (exact when widened to float32). Used by the checkpoint reader
(:class:`mpirt.checkpoint.store.CheckpointReader`) and the Hugging Face reader (``mpirt.models.hf``).
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct
from pathlib import Path

import numpy as np

import mpirt.core.precision  # noqa: F401  (registers np.dtype("bfloat16") through ml_dtypes)

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "bfloat16", "I64": "<i8", "I32": "<i4",
          "I16": "<i2", "I8": "i1", "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}
MAX_HEADER = 100 << 20  # the format's own limit on the JSON header


class TensorFileError(ValueError):
    """A file that is not a well-formed safetensors file (the message names the file)."""


class SafetensorsFile:
    """One safetensors file: its tensors' dtypes and shapes (from the header), and read-only views
    of their data over a memory map of the file."""

    def __init__(self, path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            if len(raw) < 8:
                raise TensorFileError(f"{self.path}: not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, MAX_HEADER):
                raise TensorFileError(f"{self.path}: not a safetensors file (header of {n} bytes in a file of {size})")
            try:
                header = json.loads(f.read(n))
            except (ValueError, UnicodeDecodeError) as err:
                raise TensorFileError(f"{self.path}: not a safetensors file (header: {err})") from None
        if not isinstance(header, dict):
            raise TensorFileError(f"{self.path}: not a safetensors file (the header is not a JSON object)")
        self.metadata = header.pop("__metadata__", None)
        self._base, data = 8 + n, size - 8 - n
        self._entries: dict = {}
        for key, info in header.items():
            try:
                dtype = np.dtype(DTYPES[info["dtype"]])
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise TensorFileError(f"{self.path}: tensor {key!r} has a malformed header entry {info!r}") from None
            nbytes = math.prod(shape) * dtype.itemsize
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= data or end - begin != nbytes:
                raise TensorFileError(f"{self.path}: tensor {key!r} ({info['dtype']} {list(shape)}) does not fit its "
                                      f"bytes {begin}..{end} of the {data} data bytes")
            self._entries[key] = (info["dtype"], dtype, shape, begin)
        self._map = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def _entry(self, key):
        try:
            return self._entries[key]
        except KeyError:
            raise TensorFileError(f"{self.path}: no tensor {key!r}") from None

    def dtype_code(self, key) -> str:
        """The stored dtype as safetensors spells it (``F32``, ``BF16``, ...)."""
        return self._entry(key)[0]

    def dtype(self, key) -> np.dtype:
        return self._entry(key)[1]

    def shape(self, key) -> tuple:
        return self._entry(key)[2]

    def array(self, key) -> np.ndarray:
        """A read-only view of the stored tensor over the file's memory map (reads nothing yet)."""
        _, dtype, shape, begin = self._entry(key)
        count = math.prod(shape)
        if count == 0:
            return np.empty(shape, dtype=dtype)
        if self._map is None:
            with open(self.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=self._base + begin).reshape(shape)

    def read(self, key, out: np.ndarray | None = None, box=None) -> np.ndarray:
        """``out[...] = tensor[box]`` (``box``: a tuple of slices, default all), converted to
        ``out``'s dtype; a new array of the stored dtype when ``out`` is None."""
        src = self.array(key)
        if box is not None:
            src = src[tuple(box)]
        if out is None:
            out = np.array(src)
        else:
            out[...] = src
        self._release(key)
        return out

    def _release(self, key) -> None:
        """Drop the tensor's pages from this process's mapping (they stay in the page cache): a
        strided box touches pages across the whole stored tensor, which would otherwise count in
        the reader's resident set until the file is closed."""
        if self._map is None or not hasattr(self._map, "madvise"):
            return
        _, dtype, shape, begin = self._entry(key)
        lo = (self._base + begin) // mmap.PAGESIZE * mmap.PAGESIZE
        hi = self._base + begin + math.prod(shape) * np.dtype(dtype).itemsize
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
