"""The sparse tier's wire format: cluster slots as Redis computes them (hash tags
included), pipelines built as arrays, replies parsed as they arrive."""

from __future__ import annotations

import time

import numpy as np
import pytest
from redis.crc import key_slot

from terarec.sparsetier import wire


def test_slots_match_redis_including_accidental_hash_tags():
    keys = np.random.default_rng(0).integers(-2**63, 2**63 - 1, 5000)
    # key bytes holding '{' and '}' (0x7b, 0x7d) in every order, and an empty tag
    keys[:6] = [0x7b, 0x7d7b, 0x7d00007b, 0x7d117b, 0x7b7d, 0x7d447b]
    rows = wire.row_keys(b"ns/v000001/", keys)
    assert rows.shape == (5000, 19)
    np.testing.assert_array_equal(wire.key_slots(rows),
                                  [key_slot(bytes(r)) for r in rows])


def test_pipelines_are_the_commands_redis_expects():
    keys = wire.row_keys(b"p/", np.array([1, 2]))
    values = np.array([[1, 2], [3, 4]], np.uint8)
    k1 = bytes(keys[0])
    assert wire.pack_gets(keys[:1]) == b"*2\r\n$3\r\nGET\r\n$10\r\n" + k1 + b"\r\n"
    k2 = bytes(keys[1])
    assert wire.pack_msets(keys, values, np.array([0, 1])) == (
        b"*3\r\n$4\r\nMSET\r\n$10\r\n" + k1 + b"\r\n$2\r\n\x01\x02\r\n"
        b"*3\r\n$4\r\nMSET\r\n$10\r\n" + k2 + b"\r\n$2\r\n\x03\x04\r\n")
    assert wire.pack_msets(keys, values, np.array([0])) == (
        b"*5\r\n$4\r\nMSET\r\n$10\r\n" + k1 + b"\r\n$2\r\n\x01\x02\r\n$10\r\n" + k2
        + b"\r\n$2\r\n\x03\x04\r\n")
    tombstone = wire.pack_msets(keys[:1], np.zeros((1, 0), np.uint8), np.array([0]))
    assert tombstone.endswith(b"$0\r\n\r\n")
    # one command per run of a slot, at most `most` rows each
    np.testing.assert_array_equal(wire.mset_starts(np.array([3, 3, 3, 3, 3, 5, 9, 9]), 2),
                                  [0, 2, 4, 5, 6])
    assert wire.pack_command(b"READONLY") == b"*1\r\n$8\r\nREADONLY\r\n"


def test_replies_parse_in_pieces_and_errors_are_raised():
    raw = b"$2\r\n\x01\x02\r\n$-1\r\n+OK\r\n$0\r\n\r\n:7\r\n$2\r\n\r\n\r\n"
    parser = wire.ReplyParser(6)
    for end in range(1, len(raw)):
        assert not parser.feed(np.frombuffer(raw[:end], np.uint8))
    buf = np.frombuffer(raw, np.uint8)
    assert parser.feed(buf)
    values, found = wire.gather_values(buf, parser.offsets, parser.lengths, 2)
    np.testing.assert_array_equal(found, [True, False, False, False, False, True])
    np.testing.assert_array_equal(values[0], [1, 2])
    np.testing.assert_array_equal(values[5], [13, 10])  # value bytes that look like CRLF
    with pytest.raises(wire.ReplyError, match="MOVED 3999 127.0.0.1:7001"):
        wire.parse_replies(np.frombuffer(b"+OK\r\n-MOVED 3999 127.0.0.1:7001\r\n", np.uint8),
                           2)


def test_chunks_written_two_in_flight_and_read_back(redis_cluster):
    """Writes keep further pipelines in flight while the oldest one's replies are read
    (replies of several pipelines can arrive in one recv); every row reads back, also
    when many rows share a slot (MSETs of several rows)."""
    from terarec.sparsetier.tier import NodeConn, SparseTier

    tier = SparseTier(redis_cluster.url, hedge=False)
    try:
        keys = wire.row_keys(b"wire/v000001/", np.arange(40_000, dtype=np.int64) * 31)
        values = np.random.default_rng(0).integers(0, 256, (40_000, 24), dtype=np.uint8)
        assert np.bincount(wire.key_slots(keys)).max() > 1
        tier.write(keys, values, chunk=7)
        for _ in range(2):  # the second time on the pooled connections
            got, found, failed = tier.read(keys, 24, 5.0)
            assert found.all() and not failed.any()
            np.testing.assert_array_equal(got, values)
        shard = tier.topology.shards[0]  # a replica answers once READONLY went first
        mine = keys[tier.topology.slot_shard[wire.key_slots(keys)] == 0]
        time.sleep(0.2)  # replication is asynchronous
        for readonly, replies in ((False, "MOVED"), (True, None)):
            conn = NodeConn(shard.replicas[0], readonly, 5.0)
            try:
                if replies:
                    with pytest.raises(wire.ReplyError, match=replies):
                        conn.call(wire.pack_gets(mine), len(mine))
                else:
                    buf, offsets, lengths = conn.call(wire.pack_gets(mine), len(mine))
                    assert len(offsets) == len(mine) and (lengths == 24).all()
            finally:
                conn.close()
        missing = wire.row_keys(b"wire/v000001/", np.array([-1, -2], np.int64))
        got, found, failed = tier.read(missing, 24, 5.0)
        assert not found.any() and not failed.any() and not got.any()
    finally:
        tier.close()
