"""Redis wire format for many fixed-size rows at once: cluster slots of binary keys,
pipelined ``MSET`` / ``GET`` commands built as numpy arrays, and their replies parsed
without a Python loop per row.

Every row key has the same length (a prefix plus the 8 key bytes) and every value of a
version the same length (one encoded row), so a pipeline of N rows is an
``uint8[N, width]`` array filled column by column (an MSET's header in front of its
slot's rows)::

    GET   *2\\r\\n$3\\r\\nGET\\r\\n$L\\r\\n<key>\\r\\n
    MSET  *<2m+1>\\r\\n$4\\r\\nMSET\\r\\n then m times $L\\r\\n<key>\\r\\n$M\\r\\n<value>\\r\\n
          (the m rows of one cluster slot)
"""

from __future__ import annotations

import numba
import numpy as np

SLOTS = 16384
MSET_KEYS = 64  # rows per MSET at most


def _crc16_table() -> np.ndarray:
    table = np.zeros(256, np.uint16)
    for i in range(256):
        crc = i << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
        table[i] = crc & 0xFFFF
    return table


_TABLE = _crc16_table()
_CRLF = np.frombuffer(b"\r\n", np.uint8)


@numba.njit(nogil=True, cache=True)
def _slots(keys, table, out):
    n, width = keys.shape
    for i in range(n):
        lo, hi = 0, width
        open_at = -1
        for j in range(width):
            if keys[i, j] == 123:  # '{': a hash tag, as Redis Cluster reads it
                open_at = j
                break
        if open_at >= 0:
            for j in range(open_at + 1, width):
                if keys[i, j] == 125:  # '}'
                    if j > open_at + 1:
                        lo, hi = open_at + 1, j
                    break
        crc = 0
        for j in range(lo, hi):
            crc = ((crc << 8) & 0xFFFF) ^ table[((crc >> 8) ^ keys[i, j]) & 0xFF]
        out[i] = crc % 16384


def row_keys(prefix: bytes, keys: np.ndarray) -> np.ndarray:
    """``uint8[n, len(prefix) + 8]``: each Redis key, ``prefix`` + the key's 8 bytes."""
    keys = np.ascontiguousarray(keys, "<i8")
    out = np.empty((len(keys), len(prefix) + 8), np.uint8)
    out[:, :len(prefix)] = np.frombuffer(prefix, np.uint8)
    out[:, len(prefix):] = keys.view(np.uint8).reshape(-1, 8)
    return out


def key_slots(keys: np.ndarray) -> np.ndarray:
    """Cluster slot (int32) of each row of ``uint8[n, width]`` keys."""
    out = np.empty(len(keys), np.int32)
    if len(keys):
        _slots(np.ascontiguousarray(keys), _TABLE, out)
    return out


def _bulk(data: np.ndarray) -> list[np.ndarray]:
    """``$len\\r\\n<data>\\r\\n`` columns for rows of equal-length ``data``."""
    n, width = data.shape
    head = np.frombuffer(f"${width}\r\n".encode(), np.uint8)
    return [np.broadcast_to(head, (n, len(head))), data, np.broadcast_to(_CRLF, (n, 2))]


def _pack(parts: list[np.ndarray]) -> bytes:
    n = parts[0].shape[0]
    width = sum(p.shape[1] for p in parts)
    out = np.empty((n, width), np.uint8)
    col = 0
    for p in parts:
        out[:, col:col + p.shape[1]] = p
        col += p.shape[1]
    return out.tobytes()


def pack_gets(keys: np.ndarray) -> bytes:
    """A pipeline of one ``GET`` per row of ``keys`` (filled in place: this runs for
    every node of every request)."""
    n, width = keys.shape
    if not n:
        return b""
    head = np.frombuffer(f"*2\r\n$3\r\nGET\r\n${width}\r\n".encode(), np.uint8)
    out = np.empty((n, len(head) + width + 2), np.uint8)
    out[:, :len(head)] = head
    out[:, len(head):-2] = keys
    out[:, -2:] = _CRLF
    return out.tobytes()


def mset_starts(slots: np.ndarray, most: int = MSET_KEYS) -> np.ndarray:
    """First row of each ``MSET`` for rows sorted by cluster slot (``slots``): a command
    holds rows of one slot only (Redis Cluster refuses keys of several), at most
    ``most`` of them."""
    n = len(slots)
    if not n:
        return np.empty(0, np.int64)
    new = np.ones(n, np.bool_)
    new[1:] = slots[1:] != slots[:-1]
    run_start = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    return np.flatnonzero(new | ((np.arange(n) - run_start) % most == 0))


def pack_msets(keys: np.ndarray, values: np.ndarray, starts: np.ndarray) -> bytes:
    """A pipeline of ``MSET k1 v1 k2 v2 ...``: command i sets rows ``starts[i]`` up to
    the next start (rows of one slot; ``mset_starts``). ``values``: ``uint8[n, M]``, M
    may be 0 (a tombstone). One command per slot rather than per row: the nodes (master
    and replica) parse, apply and propagate many rows a command, and answer one ``+OK``."""
    n = len(keys)
    if not n:
        return b""
    body = memoryview(_pack([*_bulk(keys), *_bulk(values)]))
    width = len(body) // n
    counts = np.diff(np.append(starts, n))
    heads = {c: f"*{2 * c + 1}\r\n$4\r\nMSET\r\n".encode()
             for c in np.unique(counts).tolist()}
    parts: list[bytes | memoryview] = []
    for start, count in zip(starts.tolist(), counts.tolist(), strict=True):
        parts.append(heads[count])
        parts.append(body[start * width:(start + count) * width])
    return b"".join(parts)


def pack_command(*args: bytes) -> bytes:
    """One command of any arguments."""
    out = [f"*{len(args)}\r\n".encode()]
    for a in args:
        out += [f"${len(a)}\r\n".encode(), a, b"\r\n"]
    return b"".join(out)


class ReplyError(Exception):
    """A node answered a command with an error (``-MOVED``, ``-CLUSTERDOWN``, ...)."""


@numba.njit(nogil=True, cache=True)
def _parse_bulks(buf, start, pos, n, offsets, lengths, state):
    """Parse replies ``start``..``n - 1`` from ``buf`` at byte ``pos``: bulk strings
    (offset, length; -1 for nil), ``+simple`` or ``:integer`` (length -2). Stops at the
    first incomplete reply: ``state`` = (replies parsed, next byte). Returns -1, or the
    byte position of an error reply."""
    size = buf.shape[0]
    i = start
    while i < n:
        if pos >= size:
            break
        kind = buf[pos]
        end = pos + 1  # the line up to \r\n
        while end + 1 < size and not (buf[end] == 13 and buf[end + 1] == 10):
            end += 1
        if end + 1 >= size:
            break
        if kind == 45:  # '-'
            return pos
        if kind == 43 or kind == 58:  # '+' or ':'
            offsets[i] = pos + 1
            lengths[i] = -2
            pos = end + 2
            i += 1
            continue
        if kind != 36:  # not '$': unexpected
            return pos
        neg = False
        value = 0
        for j in range(pos + 1, end):
            c = buf[j]
            if c == 45:
                neg = True
            else:
                value = value * 10 + (c - 48)
        if neg:
            offsets[i] = 0
            lengths[i] = -1
            pos = end + 2
            i += 1
            continue
        if end + 2 + value + 2 > size:
            break
        offsets[i] = end + 2
        lengths[i] = value
        pos = end + 2 + value + 2
        i += 1
    state[0] = i
    state[1] = pos
    return -1


class ReplyParser:
    """Replies of ``n`` pipelined commands, parsed as their bytes arrive (``feed``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.offsets = np.zeros(n, np.int64)
        self.lengths = np.zeros(n, np.int64)
        self._state = np.zeros(2, np.int64)

    @property
    def done(self) -> bool:
        return int(self._state[0]) >= self.n

    @property
    def consumed(self) -> int:
        """Bytes of the replies parsed so far."""
        return int(self._state[1])

    def feed(self, buf: np.ndarray) -> bool:
        """Parse what ``buf`` (every byte received so far) adds; True once all ``n``
        replies are in. Raises ReplyError on an error reply."""
        if self.n:
            at = _parse_bulks(buf, int(self._state[0]), int(self._state[1]), self.n,
                              self.offsets, self.lengths, self._state)
            if at >= 0:
                end = bytes(buf[at:at + 200]).split(b"\r\n", 1)[0]
                raise ReplyError(end.decode(errors="replace").lstrip("-"))
        return self.done


def parse_replies(buf: np.ndarray, n: int) -> tuple[int, np.ndarray, np.ndarray]:
    """(bytes consumed or -1 if incomplete, offsets, lengths) of ``n`` replies in
    ``buf``; raises ReplyError on an error reply."""
    parser = ReplyParser(n)
    complete = parser.feed(buf)
    return (parser.consumed if complete else -1), parser.offsets, parser.lengths


@numba.njit(nogil=True, cache=True)
def _gather(buf, offsets, lengths, width, out, found):
    for i in range(offsets.shape[0]):
        if lengths[i] == width:
            found[i] = True
            for j in range(width):
                out[i, j] = buf[offsets[i] + j]


def gather_values(buf: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
                  width: int) -> tuple[np.ndarray, np.ndarray]:
    """(``uint8[n, width]`` values, found mask): replies of another length (nil, an
    empty tombstone) are not found."""
    out = np.zeros((len(offsets), width), np.uint8)
    found = np.zeros(len(offsets), np.bool_)
    if len(offsets):
        _gather(buf, offsets, lengths, width, out, found)
    return out, found
