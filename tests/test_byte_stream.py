"""The train byte stream: lanes, epochs, exact resume; the eval window."""

import numpy as np
import torch

from dormouse.data.byte_stream import StreamState, TrainStream, eval_window


def shards(tmp_path, sizes):
    paths, start = [], 0
    for i, n in enumerate(sizes):
        p = tmp_path / f"s{i}.bin"
        (np.arange(start, start + n) % 251).astype(np.uint8).tofile(p)  # recognisable, position-dependent bytes
        paths.append(p)
        start += n
    return paths


def test_rows_come_from_distant_lanes_and_targets_shift_by_one(tmp_path):
    s = TrainStream(shards(tmp_path, [1000, 1000]), batch_size=4, seq_len=16, seed=0)
    x, y = s.next_batch()
    assert x.shape == y.shape == (4, 16)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert len({int(r[0]) for r in x}) == 4  # four different starting bytes: four lanes
    assert s.state == StreamState(0, 16)


def test_epoch_changes_shard_order_and_resume_is_exact(tmp_path):
    paths = shards(tmp_path, [700, 500, 300, 900])
    a = TrainStream(paths, batch_size=3, seq_len=32, seed=7)
    seen = [a.next_batch() for _ in range(40)]  # several epochs (lane = 800 bytes -> 24 batches/epoch)
    assert a.state.epoch >= 1
    b = TrainStream(paths, batch_size=3, seq_len=32, seed=7)
    for _ in range(17):
        b.next_batch()
    c = TrainStream(paths, batch_size=3, seq_len=32, seed=7, state=StreamState(**b.state.to_dict()))
    for i in range(17, 40):
        x, y = c.next_batch()
        assert torch.equal(x, seen[i][0]) and torch.equal(y, seen[i][1])
    first = [a._order(0)[i][0] for i in range(4)]
    second = [a._order(1)[i][0] for i in range(4)]
    assert sorted(first) == sorted(second)


def test_eval_window_is_fixed_and_counts_its_bytes(tmp_path):
    p = tmp_path / "eval.bin"
    np.frombuffer(bytes(range(256)) * 10, dtype=np.uint8).tofile(p)
    x1, y1, n = eval_window(p, 1000, 64)
    x2, y2, _ = eval_window(p, 1000, 64)
    assert n == 15 * 64 and torch.equal(x1, x2) and torch.equal(y1[:, :-1], x1[:, 1:])


def test_empty_shards_are_skipped_and_epochs_count_only_read_bytes(tmp_path):
    paths = shards(tmp_path, [8000])
    (tmp_path / "empty.bin").write_bytes(b"")
    s = TrainStream([tmp_path / "empty.bin", *paths], batch_size=8, seq_len=256, seed=0)
    for _ in range(4):
        s.next_batch()
    assert s.bytes_seen() == 4 * 8 * 256  # lane = 1000 bytes: 3 steps per epoch, the tails unread
