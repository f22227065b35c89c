"""Contract: `build_datasets` turns a `DataConfig` into train/eval datasets: synthetic or file data, a seeded
eval hold-out or an eval file, prompts within `max_prompt_len`; contradictory or unusable data is an error."""

import pytest

from miles_vl.config.schema import DataConfig
from miles_vl.data import build_datasets, write_synth_parquet
from miles_vl.models.qwen3_vl.tokens import special_tokens
from tests.data.helpers import MAX_PIXELS, MIN_PIXELS

SMALL = dict(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, max_prompt_len=256)


def test_synthetic_with_eval_fraction(processor):
    cfg = DataConfig(synthetic_n=16, eval_fraction=0.25, **SMALL)
    splits = build_datasets(cfg, processor, seed=3)
    assert (len(splits.train), len(splits.eval)) == (12, 4)
    train_ids = {r.index for r in splits.train.rows}
    assert train_ids.isdisjoint(r.index for r in splits.eval.rows)
    assert splits.reports[0].source == "synthetic(n=16, seed=3, task=geometry)" and splits.reports[0].n_kept == 16
    again = build_datasets(cfg, processor, seed=3)
    assert [s.index for s in again.train.next_batch(5)] == [s.index for s in splits.train.next_batch(5)]
    batch = splits.train.next_batch(3)
    tokens = special_tokens(processor)
    for sample in batch:
        assert sample.prompt_len <= cfg.max_prompt_len
        assert int((sample.prompt_ids == tokens.image_token_id).sum()) == int(sample.image_grid_thw.prod()) // 4
        assert "Think step by step" in sample.prompt_text  # the config's default instruction
    assert [s.index for s in next(splits.eval.ordered_batches(8))] == sorted(r.index for r in splits.eval.rows)


def test_files_with_eval_path(tmp_path, processor):
    train = write_synth_parquet(tmp_path / "train.parquet", 6, seed=0)
    evals = write_synth_parquet(tmp_path / "eval.parquet", 3, seed=1)
    cfg = DataConfig(train_path=str(train), eval_path=str(evals), system_prompt="Be brief.", **SMALL)
    splits = build_datasets(cfg, processor, seed=0)
    assert (len(splits.train), len(splits.eval)) == (6, 3)
    assert [r.layout for r in splits.reports] == ["geometry3k", "geometry3k"]
    assert splits.train[0].prompt_text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert build_datasets(DataConfig(train_path=str(train), **SMALL), processor, seed=0).eval is None


def test_errors(tmp_path, processor):
    train = write_synth_parquet(tmp_path / "t.parquet", 2)
    with pytest.raises(ValueError, match="both set"):
        build_datasets(DataConfig(train_path=str(train), synthetic_n=4, **SMALL), processor, seed=0)
    tight = {**SMALL, "max_prompt_len": 8}
    with pytest.raises(ValueError, match=r"no usable training rows.*prompt_too_long=2"):
        build_datasets(DataConfig(train_path=str(train), **tight), processor, seed=0)
