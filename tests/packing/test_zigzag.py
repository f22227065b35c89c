"""Contract: `zigzag_index` is Transformer Engine's THD partition (rank r owns chunks r and 2C-1-r of every
segment, chunk = segment length / 2C), `unzigzag` inverts it, and indivisible segments raise."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from miles_vl.packing import detect_layout, unzigzag, zigzag_index


def partition_formula(cu: list[int], cp_size: int, rank: int) -> list[int]:
    """The partition written out: per segment, chunk r then chunk 2C-1-r."""
    out = []
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        c = (end - start) // (2 * cp_size)
        out += list(range(start + rank * c, start + (rank + 1) * c))
        out += list(range(start + (2 * cp_size - 1 - rank) * c, start + (2 * cp_size - rank) * c))
    return out


@st.composite
def rows(draw):
    cp_size = draw(st.integers(1, 8))
    chunks = draw(st.lists(st.integers(0, 6), min_size=1, max_size=8))  # zero-length segments are legal
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + 2 * cp_size * c)
    return cp_size, cu


@settings(max_examples=200, deadline=None)
@given(rows())
def test_zigzag_equals_partition_formula(row):
    cp_size, cu = row
    cu_t = torch.tensor(cu, dtype=torch.int32)
    for rank in range(cp_size):
        assert zigzag_index(cu_t, cp_size, rank).tolist() == partition_formula(cu, cp_size, rank)


@settings(max_examples=100, deadline=None)
@given(rows(), st.integers(1, 3))
def test_unzigzag_inverts(row, width):
    cp_size, cu = row
    cu_t = torch.tensor(cu, dtype=torch.int32)
    full = torch.randn(width, cu[-1])
    parts = [full[:, zigzag_index(cu_t, cp_size, r)] for r in range(cp_size)]
    assert torch.equal(unzigzag(parts, cu_t, cp_size, dim=-1), full)
    assert torch.equal(unzigzag([p.t() for p in parts], cu_t, cp_size, dim=0), full.t())


def test_cp1_is_identity():
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    assert torch.equal(zigzag_index(cu, 1, 0), torch.arange(10))


def test_indivisible_segment_is_named():
    cu = torch.tensor([0, 8, 14], dtype=torch.int32)
    with pytest.raises(ValueError, match="segment 1 has length 6, not divisible by 2\\*cp_size = 4"):
        zigzag_index(cu, 2, 0)


def test_bad_rank_and_bad_parts():
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, 2\)"):
        zigzag_index(cu, 2, 2)
    with pytest.raises(ValueError, match="one local tensor per CP rank: 2 expected, 1 found"):
        unzigzag([torch.zeros(4)], cu, 2)
    with pytest.raises(ValueError, match="local tensor of rank 1 has 3 entries"):
        unzigzag([torch.zeros(4), torch.zeros(3)], cu, 2)


def test_detect_layout():
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    assert detect_layout(16, cu, 2) == "full"
    assert detect_layout(8, cu, 2) == "pre_sharded"
    assert detect_layout(16, cu, 1) == "full"
    with pytest.raises(ValueError, match="neither the full row .* nor a pre-sharded CP rank's part"):
        detect_layout(12, cu, 2)
