"""Bounded decoders for untrusted bytes: JSON and gzip streams.

``json.loads`` recurses once per nesting level (a 100 KB ``[[[[...`` raises
``RecursionError``) and ``gzip`` expands 1 KB into gigabytes; both are fed bytes from
hosts, so both go through these wrappers, which check size and depth first. JSON from
hosts (the metrics file, the metrics attribute of a weights file) is bounded at
:data:`MAX_JSON_DEPTH` levels, the one constant docs/security.md states, and an object
naming a key twice is refused (which value counts would be the parser's choice).
"""

from __future__ import annotations

import gzip
import json
import shutil
import zlib
from pathlib import Path
from typing import Any, BinaryIO

MAX_JSON_BYTES = 1 << 20
#: Nesting levels of JSON from hosts (metrics hold flat objects; 16 leaves room).
MAX_JSON_DEPTH = 16


class BoundExceeded(ValueError):
    """Input over a size or nesting bound (a ``ValueError``: callers treat it as malformed)."""


def json_depth(obj: Any) -> int:
    """Nesting depth of a decoded JSON value (iterative: never recurses)."""
    depth, stack = 0, [(obj, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            depth = max(depth, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v)
                         if isinstance(c, dict | list))
    return depth


class DuplicateKey(ValueError):
    """A JSON object names one key twice."""


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKey(f"JSON object has a duplicate key {k[:40]!r}")
        out[k] = v
    return out


def loads(data: bytes | str, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads`` of untrusted text, bounded in size and nesting depth.

    The size is checked before parsing (the C scanner is linear in it); nesting deeper
    than the interpreter allows stops the scanner with ``RecursionError``, turned here
    into :class:`BoundExceeded` (a ``ValueError``), like nesting over ``max_depth``.
    Malformed JSON raises ``ValueError``; an object with a duplicate key raises
    :class:`DuplicateKey` (a ``ValueError``).
    """
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > max_bytes:
        raise BoundExceeded(f"JSON text of {len(raw)} bytes, over the {max_bytes}-byte bound")
    try:
        obj = json.loads(raw, object_pairs_hook=_unique_pairs)
    except RecursionError:
        raise BoundExceeded(f"JSON nested deeper than the bound of {max_depth}") from None
    depth = json_depth(obj)
    if depth > max_depth:
        raise BoundExceeded(f"JSON nested {depth} deep, over the bound of {max_depth}")
    return obj


def load_file(path: str | Path, max_bytes: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Read and decode a JSON file, refusing one over ``max_bytes`` before reading it."""
    with Path(path).open("rb") as f:
        raw = f.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise BoundExceeded(f"{Path(path).name} is over the {max_bytes}-byte bound")
    return loads(raw, max_bytes, max_depth)


def copy_bounded(src: BinaryIO, dst: BinaryIO, max_bytes: int, chunk: int = 1 << 20) -> int:
    """Copy at most ``max_bytes`` from ``src``; :class:`BoundExceeded` if there is more."""
    n = 0
    while True:
        buf = src.read(min(chunk, max_bytes + 1 - n))
        if not buf:
            return n
        n += len(buf)
        if n > max_bytes:
            raise BoundExceeded(f"more than {max_bytes} bytes")
        dst.write(buf)


def gunzip_bounded(src: str | Path, dst: str | Path, max_bytes: int) -> int:
    """Decompress a gzip file as a stream that stops at ``max_bytes`` of output.

    A gzip bomb costs at most ``max_bytes`` of disk and one chunk of memory before it is
    refused with :class:`BoundExceeded`; a corrupt stream raises ``OSError``/``EOFError``.
    """
    try:
        with gzip.open(src, "rb") as s, Path(dst).open("wb") as d:
            return copy_bounded(s, d, max_bytes)  # type: ignore[arg-type]
    except zlib.error as e:
        raise OSError(f"corrupt gzip stream: {e}") from None


def copy_file_bounded(src: str | Path, dst: str | Path, max_bytes: int) -> int:
    """Copy a plain file, refusing one over ``max_bytes`` (checked before copying)."""
    size = Path(src).stat().st_size
    if size > max_bytes:
        raise BoundExceeded(f"{size} bytes, over the {max_bytes}-byte bound")
    shutil.copyfile(src, dst)
    return size
