"""Contract: the engine-agnostic weight sync (miles_vl/rollout/weight_sync.py). Weight buckets keep the tensor order and
stay within the byte bound (a larger tensor travels alone); a bucket's deadline is derived from its bytes unless set;
the module imports no engine (an engine's wire lives in its folder: SGLang's is tested in
tests/rollout/sglang/test_weights.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_vl.rollout import weight_sync
from miles_vl.rollout.weight_sync import TensorMeta, iter_buckets


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
