"""megatron-bridge 0.5.1 as shipped (no miles_vl patches): what it does with pre-sharded THD input under CP.

These pin the upstream behaviour that `miles_vl.patches` must fix (DESIGN §5), each with the line that causes it
(paths under megatron/bridge/models/qwen_vl/modelling_qwen3_vl/ of 0.5.1):
- model.py:390 `position_ids = None`: explicit positions are discarded; model.py:600 `get_rope_index(...)` computes
  them over the whole input row as ONE sequence. At CP=1 that is a per-segment constant shift (invisible to RoPE
  up to float noise); on a rank-local zigzag row it is wrong.
- model.py:509/531/543/613 `preprocess_packed_seqs(...)` (utils.py:684) re-pads and zigzag-splits the already
  sharded row again: the language model gets T/C^2 tokens (the double split).
- model.py:501 `combined_embeddings[vision_mask] = vision_embeds`: all images' rows are scattered into the local
  row without CP-local selection -> shape mismatch.
- model.py:482/488 `AllGatherVisionEmbeddings.apply(..., cp_group=...)`: autograd `Function.apply` takes no
  keyword arguments -> TypeError whenever `vision_dp_when_cp` is on with CP > 1.
When the patches land, tests of the patched model replace the "fails" assertions here.
"""

from __future__ import annotations

import pytest
import torch

from tests.patches.harness import probes, runner, tiny
from tests.patches.harness.shims import bridge_available

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _require_051():
    reason = bridge_available("0.5.1")
    if reason:
        pytest.fail(f"harness cannot load megatron-bridge 0.5.1: {reason}")


@pytest.fixture(scope="module")
def samples():
    return tiny.default_samples(seed=0)


@pytest.fixture(scope="module")
def cp1(samples):
    return runner.run_packed(samples, cp_size=1, version="0.5.1", with_reference=True)


@pytest.fixture(scope="module")
def cp2(samples):
    text_only = [samples[0], samples[0]]
    cases = {"text": text_only, "images": samples, "images_vision_dp": (samples, {"vision_dp_when_cp": True})}
    return probes.run_probes(cases, cp_size=2, version="0.5.1")


def test_versions(cp1):
    assert cp1[2]["versions"] == {"megatron-bridge": "0.5.1", "megatron-core": "0.18.2"}


def test_unpacked_and_cp1_packed_work(cp1):
    """Unpacked it is right; packed at CP=1 it uses whole-row positions, which RoPE only sees as float noise."""
    batch, runs, extras = cp1
    run = runs["data"]
    diffs = runner.max_diff_per_sample(batch, run.logits, extras["unpacked"])
    assert max(diffs) < 1e-4, diffs
    assert not torch.equal(run.lm_position_ids, batch.position_ids)  # the data-side positions were discarded
    # ... and replaced by one arange-like pass over the row: each segment shifted by a constant.
    for i in range(batch.num_samples):
        a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i]) + int(batch.seq_lens[i])
        shift = run.lm_position_ids[:, a:b] - batch.position_ids[:, a:b]
        assert (shift == shift[0, 0]).all()
        assert (i == 0) == (int(shift[0, 0]) == 0)


def test_presharded_text_is_split_twice(cp2):
    """A rank-local row of T/C tokens reaches the language model as T/C^2 tokens."""
    for rank in cp2["text"]:
        assert rank["seen"]["input_ids"].shape[1] == rank["local_len"] // 2
        assert "error" in rank  # the reference attention then rejects cu_seqlens (T) vs 2 * local tokens


def test_presharded_images_are_not_selected(cp2):
    for rank in cp2["images"]:
        exc_type, message, where, _ = rank["error"]
        assert exc_type == "RuntimeError" and "shape mismatch" in message and "[12, 64]" in message
        assert where.endswith("model.py:501 in forward"), where


def test_vision_dp_when_cp_keyword_typeerror(cp2):
    for rank in cp2["images_vision_dp"]:
        exc_type, message, where, _ = rank["error"]
        assert (exc_type, message) == ("TypeError", "apply() takes no keyword arguments")
        assert where.endswith("model.py:482 in forward"), where
