"""Craft HDF5 metadata the way a hostile host would: edit bytes, then fix the checksums.

HDF5 checksums its version-2 object headers and fractal-heap direct blocks with Bob
Jenkins' lookup3 (``H5_checksum_metadata``), which anyone can recompute: a checksum
proves nothing about who wrote a file. :func:`set_vlen_length` rewrites the length a
variable-length string attribute declares (its 16-byte descriptor) and re-seals the
object header or heap block holding it.
"""

from __future__ import annotations

import struct
from pathlib import Path

_M = 0xFFFFFFFF


def _rot(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _M


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    a = (a - c) & _M; a ^= _rot(c, 4); c = (c + b) & _M  # noqa: E702
    b = (b - a) & _M; b ^= _rot(a, 6); a = (a + c) & _M  # noqa: E702
    c = (c - b) & _M; c ^= _rot(b, 8); b = (b + a) & _M  # noqa: E702
    a = (a - c) & _M; a ^= _rot(c, 16); c = (c + b) & _M  # noqa: E702
    b = (b - a) & _M; b ^= _rot(a, 19); a = (a + c) & _M  # noqa: E702
    c = (c - b) & _M; c ^= _rot(b, 4); b = (b + a) & _M  # noqa: E702
    return a, b, c


def _final(a: int, b: int, c: int) -> int:
    c ^= b; c = (c - _rot(b, 14)) & _M  # noqa: E702
    a ^= c; a = (a - _rot(c, 11)) & _M  # noqa: E702
    b ^= a; b = (b - _rot(a, 25)) & _M  # noqa: E702
    c ^= b; c = (c - _rot(b, 16)) & _M  # noqa: E702
    a ^= c; a = (a - _rot(c, 4)) & _M  # noqa: E702
    b ^= a; b = (b - _rot(a, 14)) & _M  # noqa: E702
    c ^= b; c = (c - _rot(b, 24)) & _M  # noqa: E702
    return c


def lookup3(data: bytes, init: int = 0) -> int:
    """Bob Jenkins' ``hashlittle`` (lookup3), HDF5's metadata checksum."""
    n = len(data)
    a = b = c = (0xDEADBEEF + n + init) & _M
    i = 0
    while n > 12:
        a = (a + int.from_bytes(data[i:i + 4], "little")) & _M
        b = (b + int.from_bytes(data[i + 4:i + 8], "little")) & _M
        c = (c + int.from_bytes(data[i + 8:i + 12], "little")) & _M
        a, b, c = _mix(a, b, c)
        n -= 12
        i += 12
    if n == 0:
        return c
    tail = data[i:] + bytes(12 - n)
    a = (a + int.from_bytes(tail[0:4], "little")) & _M
    b = (b + int.from_bytes(tail[4:8], "little")) & _M
    c = (c + int.from_bytes(tail[8:12], "little")) & _M
    return _final(a, b, c)


def _reseal_ohdr(raw: bytearray, start: int) -> None:
    """Recompute the checksum of the version-2 object header (chunk 0) at ``start``."""
    flags = raw[start + 5]
    p = start + 6 + (16 if flags & 0x20 else 0) + (4 if flags & 0x10 else 0)
    width = 1 << (flags & 3)
    end = p + width + int.from_bytes(raw[p:p + width], "little")
    raw[end:end + 4] = lookup3(bytes(raw[start:end])).to_bytes(4, "little")


def _reseal_fhdb(raw: bytearray, start: int) -> None:
    """Recompute the checksum of the fractal-heap direct block at ``start`` (a heap whose
    root is one direct block, as a few attributes make)."""
    hdr = struct.unpack_from("<Q", raw, start + 5)[0]
    if raw[hdr:hdr + 4] != b"FRHP":
        raise ValueError("direct block without its heap header")
    if not raw[hdr + 9] & 0x02:
        return  # blocks not checksummed
    size = struct.unpack_from("<Q", raw, hdr + 112)[0]
    max_heap_bits = struct.unpack_from("<H", raw, hdr + 128)[0]
    csum = start + 4 + 1 + 8 + (max_heap_bits + 7) // 8
    raw[csum:csum + 4] = bytes(4)
    raw[csum:csum + 4] = lookup3(bytes(raw[start:start + size])).to_bytes(4, "little")


def set_vlen_length(path: Path, attr: str, length: int) -> None:
    """Make the variable-length string attribute ``attr`` declare ``length`` bytes (its heap
    object unchanged), then fix the checksum of the block holding its message."""
    raw = bytearray(path.read_bytes())
    needle = attr.encode() + b"\0"
    i = raw.find(needle)
    while i >= 0 and not (raw[i - 9] == 3 and int.from_bytes(raw[i - 7:i - 5], "little") == len(needle)):
        i = raw.find(needle, i + 1)
    if i < 0:
        raise ValueError(f"no version-3 message of attribute {attr!r}")
    dt_size, ds_size = struct.unpack_from("<HH", raw, i - 5)
    data = i + len(needle) + dt_size + ds_size
    raw[data:data + 4] = struct.pack("<I", length)
    block = max(raw.rfind(b"OHDR", 0, i), raw.rfind(b"FHDB", 0, i))
    if raw[block:block + 4] == b"OHDR":
        _reseal_ohdr(raw, block)
    else:
        _reseal_fhdb(raw, block)
    path.write_bytes(bytes(raw))


def grow_global_heap(path: Path, extra: int) -> None:
    """Make the file's first global heap collection declare that it runs to the end of the
    file, ``extra`` zero bytes appended, so that every address stays within the file:
    its objects are untouched, and reading any of them loads the whole collection. The
    superblock's end-of-file address and checksum follow."""
    raw = bytearray(path.read_bytes())
    at = raw.find(b"GCOL")
    if at < 0:
        raise ValueError("no global heap collection")
    raw += bytes(extra)
    struct.pack_into("<Q", raw, at + 8, len(raw) - at)
    struct.pack_into("<Q", raw, 28, len(raw))  # superblock v2/3: end-of-file address
    raw[44:48] = lookup3(bytes(raw[:44])).to_bytes(4, "little")
    path.write_bytes(bytes(raw))
