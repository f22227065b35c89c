"""Contract: the engine-agnostic weight sync (miles_vl/rollout/weight_sync.py). Weight buckets keep the tensor order and
stay within the byte bound (a larger tensor travels alone); a bucket's deadline is derived from its bytes unless set;
the module imports no engine (an engine's wire lives in its folder: SGLang's is tested in
tests/rollout/sglang/test_weights.py). A bucket packed into one flat byte buffer and unpacked comes back byte for
byte (dtypes, shapes, non-contiguous sources, aligned offsets); the value check of the colocated sync runs on the
first sync of a sender and every N-th (issue 33.1)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_vl.rollout import weight_sync
from miles_vl.rollout.weight_sync import (
    FLAT_ALIGN,
    TensorMeta,
    flat_layout,
    iter_buckets,
    pack_bucket,
    unpack_bucket,
    verify_due,
)


def metas(sizes: list[int]) -> list[TensorMeta]:
    return [TensorMeta(f"t{i}", "uint8", (n,), n) for i, n in enumerate(sizes)]


def buckets_of(sizes: list[int], bound: int) -> list[list[TensorMeta]]:
    """`iter_buckets` over uint8 tensors of these sizes (bytes), as the metas of each bucket."""
    tensors = ((f"t{i}", torch.zeros(n, dtype=torch.uint8)) for i, n in enumerate(sizes))
    return [[TensorMeta.of(n, t) for n, t in b] for b in iter_buckets(tensors, bound)]


def test_buckets_by_example():
    buckets = buckets_of([3, 3, 3, 10, 1, 1], 6)
    assert [[m.nbytes for m in b] for b in buckets] == [[3, 3], [3], [10], [1, 1]]
    assert [[m.name for m in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3"], ["t4", "t5"]]
    assert TensorMeta.of("w", torch.zeros(2, 3, dtype=torch.bfloat16)) == TensorMeta("w", "bfloat16", (2, 3), 12)
    with pytest.raises(ValueError, match="max_bucket_bytes must be > 0"):
        buckets_of([1], 0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 100), max_size=30), st.integers(1, 150))
def test_buckets_are_ordered_bounded_and_greedy(sizes, bound):
    buckets = buckets_of(sizes, bound)
    assert [m for b in buckets for m in b] == metas(sizes)  # nothing lost, nothing reordered
    for k, b in enumerate(buckets):
        total = sum(m.nbytes for m in b)
        assert total <= bound or len(b) == 1  # within the bound, or one tensor larger than it
        if k + 1 < len(buckets):
            assert total + buckets[k + 1][0].nbytes > bound  # closed only when the next tensor would not fit


def test_the_sync_deadline_is_derived_from_the_bytes_unless_set():
    assert weight_sync.bucket_timeout_s(0) == weight_sync.SYNC_FLOOR_S == 60
    assert weight_sync.bucket_timeout_s(512 * 2**20) == pytest.approx(60 + 512 / 50)
    assert weight_sync.bucket_timeout_s(512 * 2**20, 5.0) == 5.0
    with pytest.raises(ValueError, match="sync_timeout_s must be > 0"):
        weight_sync.bucket_timeout_s(1, 0)


def _mixed_bucket() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        ("a", torch.randn(3, 5, generator=g).to(torch.bfloat16)),  # 30 bytes: the next offset must be aligned
        ("b", torch.randn(4, 6, generator=g).t()),  # non-contiguous fp32
        ("c", torch.randint(-(2**40), 2**40, (7,), generator=g)),  # int64
        ("d", torch.tensor([float("nan"), float("-inf"), -0.0]).to(torch.float16)),  # bit patterns, not values
        ("e", torch.zeros(0, 4)),  # empty
        ("f", torch.tensor(2.5, dtype=torch.float64)),  # 0-d
    ]


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_bucket_packed_into_one_flat_buffer_unpacks_byte_for_byte():
    bucket = _mixed_bucket()
    entries, size = flat_layout(bucket)
    assert all(e.start % FLAT_ALIGN == 0 for e in entries)
    assert [e.nbytes for e in entries] == [t.numel() * t.element_size() for _, t in bucket]
    assert all(a.start + a.nbytes <= b.start for a, b in zip(entries, entries[1:], strict=False))  # no overlap
    buffer = torch.full((size + 64,), 0xAB, dtype=torch.uint8)  # larger than needed, and dirty
    assert pack_bucket(bucket, buffer) == entries
    rebuilt = unpack_bucket(buffer, entries)
    assert [n for n, _ in rebuilt] == [n for n, _ in bucket]
    for (_, got), (_, want) in zip(rebuilt, bucket, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape and _bytes(got) == _bytes(want)
    with pytest.raises(ValueError, match=f"needs {size} bytes but the buffer holds {size - 1}"):
        pack_bucket(bucket, torch.empty(size - 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="1-D uint8 buffer"):
        pack_bucket(bucket, torch.empty(size, dtype=torch.float32))


def test_the_value_check_runs_on_a_senders_first_sync_and_every_nth():
    assert [k for k in range(1, 13) if verify_due(k, 4)] == [1, 4, 8, 12]
    assert [k for k in range(1, 13) if verify_due(k, 1)] == list(range(1, 13))
    assert [k for k in range(1, 13) if verify_due(k, 0)] == [1]  # 0: the first only (and after each relaunch)
    with pytest.raises(ValueError, match="sync >= 1 and every >= 0"):
        verify_due(0, 4)
