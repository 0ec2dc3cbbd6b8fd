"""qkv.KVCache from several Python threads at once (the binding releases the GIL in append
and attend): four threads appending to their own sequences of one paged cache, with
resets, while a fifth attends, keep the pool's books (blocks held + free == pool, no
block held twice) and every sequence reads back exactly its own keys."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import qkv

THREADS, CAPACITY, DIM = 4, 4096, 32


def keys_of(seq: int) -> np.ndarray:
    """[1, Hkv = 1, CAPACITY, DIM] keys of sequence `seq`, every value telling (seq, pos)."""
    pos = np.arange(CAPACITY, dtype=np.float32)[:, None]
    column = np.arange(DIM, dtype=np.float32)[None, :] * 0.25
    return (seq * 4096 + pos + column)[None, None].astype(np.float32)


def fill(cache, seq: int, start: threading.Barrier, errors: list):
    keys = keys_of(seq)
    try:
        start.wait()
        for target in (CAPACITY // 2, CAPACITY):  # half, reset (blocks back), then full
            length = 0
            step = 0
            while length < target:
                # 1..64 tokens: long enough appends (GIL released) that they overlap.
                tokens = min(1 + (step * 7 + seq * 13) % 64, target - length)
                chunk = keys[:, :, length:length + tokens]
                cache.append(chunk, chunk, seq=seq)
                length += tokens
                step += 1
            if target < CAPACITY:
                cache.reset(seq)
    except Exception as error:  # reported by the main thread
        errors.append(error)


def attend_until(cache, done: threading.Event, errors: list):
    q = np.ones((THREADS, 1, 1, DIM), np.float32)
    try:
        while not done.is_set():
            cache.attend(q, causal=None)
            _ = cache.free_blocks
    except Exception as error:
        errors.append(error)


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "contiguous"])
def test_four_threads_append_to_their_own_sequences(paged):
    cache = qkv.KVCache(THREADS, CAPACITY, 1, DIM, paged=paged, block_size=1)
    for _ in range(4):
        errors: list = []
        start, done = threading.Barrier(THREADS), threading.Event()
        reader = threading.Thread(target=attend_until, args=(cache, done, errors))
        writers = [threading.Thread(target=fill, args=(cache, s, start, errors)) for s in range(THREADS)]
        reader.start()
        for t in writers:
            t.start()
        for t in writers:
            t.join()
        done.set()
        reader.join()
        assert not errors, errors
        assert cache.lengths == [CAPACITY] * THREADS
        keys, values = cache.storage()
        if paged:
            table = np.array(cache.block_table())
            held = table[table >= 0]
            assert np.unique(held).size == held.size, "a block is held by two sequences"
            assert held.size + cache.free_blocks == THREADS * CAPACITY  # block_size 1: one block a key
            keys, values = keys[table][:, :, 0], values[table][:, :, 0]  # [B, CAPACITY, Hkv, d]
        for seq in range(THREADS):
            expected = keys_of(seq)[0].transpose(1, 0, 2)  # [CAPACITY, Hkv, d]
            np.testing.assert_array_equal(keys[seq], expected, err_msg=f"keys of sequence {seq}")
            np.testing.assert_array_equal(values[seq], expected, err_msg=f"values of sequence {seq}")
        cache.reset()
        if paged:
            assert cache.free_blocks == THREADS * CAPACITY
