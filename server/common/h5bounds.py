"""Bounded HDF5 input: what HDF5 may read and allocate for an untrusted file.

HDF5 sizes its reads and allocations from the file's own metadata, so a crafted file
can make it spend what the file declares, not what it holds. Two measured cases:

* a variable-length string attribute occupies a 16-byte descriptor (length, global
  heap address, index) wherever HDF5's size queries look (``H5Aget_storage_size``),
  and there is no ``H5Dvlen_get_buf_size`` for attributes. Reading one zero-fills a
  buffer of the *declared* length before it reads the heap object
  (``H5T__conv_vlen``): a 1 KB file declaring 4 GB made the reader touch 3.8 GB
  before HDF5 noticed the heap object was 16 bytes; a real 400 MB string cost
  2.2 GB and 7 s for a 427 KB gzip'd upload;
* a global heap collection is read whole whatever the object wanted from it.

:class:`BoundedSource` is the file object HDF5 reads through (h5py's ``fileobj``
driver): it records what HDF5 read, refuses any single read over ``max_read`` bytes
and any total over ``max_total`` while the file's structure is being checked, and
refuses a global heap collection that declares more than ``max_read`` bytes when its
header comes in (before HDF5 allocates it). :func:`vlen_bytes` finds an attribute's
message in the metadata HDF5 has read (the bytes it decodes the message from) and
returns the lengths its variable-length descriptors declare, so the attribute bound
applies to the bytes the attribute will occupy once read, before it is read.
"""

from __future__ import annotations

import contextlib
import io
import math
import struct
from collections.abc import Iterator
from typing import BinaryIO

#: HDF5 structures whose header this module reads (global heap collection, fractal heap).
GCOL = b"GCOL"
FRHP = b"FRHP"
_VLEN = 9  # HDF5 datatype class of variable-length sequences and strings


class BoundedReadError(OSError):
    """HDF5 asked for more than the bounds allow (raised inside its read callback)."""


class BoundedSource(io.RawIOBase):
    """A read-only file object for h5py's ``fileobj`` driver that bounds and records reads.

    While :attr:`limited` (the default) each read is at most ``max_read`` bytes, their
    total at most ``max_total``, and a global heap collection may declare at most
    ``max_read`` bytes. :meth:`unlimited` lifts the bounds for data whose size has been
    checked. :attr:`refused` says why the last read was refused (HDF5 reports only
    that its read failed).
    """

    def __init__(self, fh: BinaryIO, size: int, max_read: int, max_total: int):
        super().__init__()
        self._fh, self._size = fh, size
        self.max_read, self.max_total = max_read, max_total
        self.limited = True
        self.total = 0
        self.refused = ""
        self._pos = 0
        self._regions: list[tuple[int, int]] = []

    # ---- io.RawIOBase ------------------------------------------------------------------
    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf: memoryview | bytearray) -> int:  # type: ignore[override]
        n = len(buf)
        if self.limited:
            if n > self.max_read:
                self._refuse(f"HDF5 asked for {n} bytes at offset {self._pos} in one read "
                             f"(bound {self.max_read})")
            if self.total + n > self.max_total:
                self._refuse(f"HDF5 asked for over {self.max_total} bytes of metadata in all")
        self._fh.seek(self._pos)
        got = self._fh.readinto(buf)
        if self.limited:
            self.total += got
            view = memoryview(buf)
            if got >= 16 and view[:4] == GCOL:
                declared = int.from_bytes(view[8:16], "little")
                if declared > self.max_read:
                    self._refuse(f"a global heap collection at offset {self._pos} declares {declared} bytes "
                                 f"(bound {self.max_read})")
                # Attribute values, never attribute messages: not searched, not kept.
            else:
                self._regions.append((self._pos, got))
        self._pos += got
        return got

    def write(self, b: object) -> int:  # HDF5 opens the file read-only; never called
        raise io.UnsupportedOperation("read-only")

    # ---- bounds ---------------------------------------------------------------------------
    def _refuse(self, why: str) -> None:
        self.refused = why
        raise BoundedReadError(why)

    @contextlib.contextmanager
    def unlimited(self) -> Iterator[None]:
        """Lift the bounds (for data reads whose size has been checked), then restore them."""
        before, self.limited = self.limited, False
        try:
            yield
        finally:
            self.limited = before

    def metadata(self) -> bytearray:
        """The metadata HDF5 has read so far under the bounds (global heap collections,
        which hold attribute values, left out), as contiguous runs joined by a zero gap,
        which no structure searched here can span. At most ``max_total`` bytes."""
        runs: list[list[int]] = []
        for off, n in sorted(self._regions):
            if runs and off <= runs[-1][1]:
                runs[-1][1] = max(runs[-1][1], off + n)
            else:
                runs.append([off, off + n])
        out = bytearray()
        for start, end in runs:
            self._fh.seek(start)
            out += self._fh.read(end - start)
            out += b"\0"
        return out


# ---- attribute messages ---------------------------------------------------------------------

class UncheckableAttribute(ValueError):
    """An attribute's message was found but cannot be checked (shared parts, truncated,
    an unknown encoding): a file boinc-dl never writes."""


def _u16(b: bytes, i: int) -> int:
    return int.from_bytes(b[i:i + 2], "little")


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def _candidates(meta: bytes, name: bytes) -> Iterator[tuple[int, int, int, int, int, int]]:
    """Attribute messages of ``name`` in ``meta``: (version, flags, name start, name size,
    datatype size, dataspace size) for every place whose header bytes fit the name.

    Versions 1 and 2 start 8 bytes before the name (version, flags or reserved, three
    16-bit sizes); version 3 adds a character-set byte.
    """
    needle = name + b"\0"
    size = len(needle)
    i = meta.find(needle)
    while i >= 0:
        if i >= 9 and meta[i - 9] == 3 and _u16(meta, i - 7) == size:
            yield 3, meta[i - 8], i, size, _u16(meta, i - 5), _u16(meta, i - 3)
        if i >= 8 and meta[i - 8] in (1, 2) and _u16(meta, i - 6) == size:
            yield meta[i - 8], meta[i - 7], i, size, _u16(meta, i - 4), _u16(meta, i - 2)
        i = meta.find(needle, i + 1)


def _elements(ds: bytes) -> int:
    """Elements of an encoded dataspace message (versions 1 and 2, 8-byte lengths)."""
    if len(ds) < 4 or ds[0] not in (1, 2):
        raise UncheckableAttribute("dataspace message of an unknown version")
    rank = ds[1]
    if ds[0] == 2 and ds[3] == 2:
        return 0  # null dataspace
    start = 8 if ds[0] == 1 else 4
    if len(ds) < start + 8 * rank:
        raise UncheckableAttribute("truncated dataspace message")
    return math.prod(struct.unpack_from(f"<{rank}Q", ds, start)) if rank else 1


def vlen_bytes(meta: bytes, name: str, offset_size: int = 8) -> int:
    """Bytes the variable-length elements of attribute ``name`` declare, from its message
    in ``meta`` (what HDF5 read): the largest total over every message of that name found.

    Every candidate counts (a decoy cannot hide the real message, which HDF5 decoded from
    these very bytes); one that cannot be checked, or finding none, raises
    :class:`UncheckableAttribute`.
    """
    worst = -1
    for version, flags, at, name_size, dt_size, ds_size in _candidates(meta, name.encode()):
        if version > 1 and flags & 0x03:
            raise UncheckableAttribute("its datatype or dataspace is a shared message")
        p = at + (_pad8(name_size) if version == 1 else name_size)
        dt = meta[p:p + dt_size]
        p += _pad8(dt_size) if version == 1 else dt_size
        ds = meta[p:p + ds_size]
        p += _pad8(ds_size) if version == 1 else ds_size
        if len(dt) < 8 or len(ds) < ds_size:
            raise UncheckableAttribute("truncated attribute message")
        if dt[0] & 0x0F != _VLEN:
            continue  # not variable-length: its storage size is its size
        if dt[1] & 0x0F != 1:
            raise UncheckableAttribute("a variable-length sequence, not a string")
        n = _elements(ds)
        item = 4 + offset_size + 4  # length, global heap collection address, object index
        data = meta[p:p + n * item]
        if len(data) < n * item:
            raise UncheckableAttribute("truncated attribute data")
        total = sum(int.from_bytes(data[k * item:k * item + 4], "little") for k in range(n))
        worst = max(worst, total)
    if worst < 0:
        raise UncheckableAttribute("its variable-length message is not among the bytes HDF5 read")
    return worst


def filtered_heaps(meta: bytes) -> bool:
    """True if a fractal heap header in ``meta`` declares I/O filters: its blocks would be
    decompressed, so the messages HDF5 decodes would not be the bytes it read."""
    i = meta.find(FRHP)
    while i >= 0:
        if len(meta) >= i + 9 and _u16(meta, i + 7) != 0:
            return True
        i = meta.find(FRHP, i + 1)
    return False
