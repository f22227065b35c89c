"""Contract: `PromptDataset` serves every row once per epoch in a seeded order, crosses epochs inside a batch, and
a cursor restored with `load_state_dict` continues with exactly the batches an uninterrupted run would have served;
a cursor from another dataset is refused. `split_train_eval` is a seeded, disjoint, covering hold-out."""

import pytest

from miles_vl.data import LoadOptions, PromptDataset, load_prompt_records, split_train_eval, synth_records


@pytest.fixture(scope="module")
def rows(encoder):
    rows, _ = load_prompt_records(
        synth_records(10, seed=0), encoder, LoadOptions(max_prompt_len=512), source="synthetic"
    )
    return rows


def indices(batch):
    return [s.index for s in batch]


def test_each_epoch_is_a_seeded_permutation(rows, encoder):
    ds = PromptDataset(rows, encoder, seed=7)
    assert len(ds) == 10
    for epoch in range(3):
        assert sorted(ds.order(epoch)) == list(range(10))
    assert ds.order(0) != ds.order(1)  # a new order each epoch
    assert ds.order(0) == PromptDataset(rows, encoder, seed=7).order(0)
    assert ds.order(0) != PromptDataset(rows, encoder, seed=8).order(0)
    assert PromptDataset(rows, encoder, seed=7, shuffle=False).order(5) == list(range(10))


def test_batches_cross_epochs(rows, encoder):
    ds = PromptDataset(rows, encoder, seed=3)
    served = [i for _, batch in zip(range(5), ds.batches(4), strict=False) for i in indices(batch)]  # 20 = 2 epochs
    first, second = ds.order(0), ds.order(1)
    assert served == [rows[i].index for i in first + second]
    assert ds.state_dict()["epoch"] == 1 and ds.state_dict()["position"] == 10
    assert indices(ds.next_batch(3)) == [rows[i].index for i in ds.order(2)[:3]]


def test_resume_reproduces_the_order(rows, encoder):
    run = PromptDataset(rows, encoder, seed=11)
    for _ in range(3):
        run.next_batch(4)  # 12 rows: into epoch 1
    state = run.state_dict()
    expected = [indices(run.next_batch(4)) for _ in range(4)]

    resumed = PromptDataset(rows, encoder, seed=11)
    resumed.load_state_dict(state)
    assert [indices(resumed.next_batch(4)) for _ in range(4)] == expected
    assert resumed.state_dict() == run.state_dict()


def test_foreign_cursor_is_refused(rows, encoder):
    state = PromptDataset(rows, encoder, seed=1).state_dict()
    with pytest.raises(ValueError, match="resume with the same data"):
        PromptDataset(rows[:-1], encoder, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="resume with the same data"):
        PromptDataset(rows, encoder, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match="out of range"):
        PromptDataset(rows, encoder, seed=1).load_state_dict({**state, "position": 11})


def test_ordered_batches_and_getitem(rows, encoder):
    ds = PromptDataset(rows, encoder, seed=0)
    batches = list(ds.ordered_batches(4))
    assert [indices(b) for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [indices(b) for b in ds.ordered_batches(4, max_prompts=5)] == [[0, 1, 2, 3], [4]]
    assert ds.state_dict()["position"] == 0  # evaluation does not move the cursor
    sample = ds[3]
    assert sample.index == 3 and sample.label == rows[3].label and sample.prompt_len == rows[3].prompt_len


def test_empty_dataset_and_bad_batch(encoder):
    with pytest.raises(ValueError, match="every row was dropped"):
        PromptDataset([], encoder).next_batch(2)
    with pytest.raises(ValueError, match="batch_size"):
        PromptDataset([], encoder).next_batch(0)


def test_split_train_eval(rows):
    train, evals = split_train_eval(rows, 0.3, seed=5)
    assert len(evals) == 3 and len(train) == 7
    assert sorted(r.index for r in train + evals) == list(range(10))
    assert [r.index for r in train] == sorted(r.index for r in train)  # load order kept
    assert split_train_eval(rows, 0.3, seed=5) == (train, evals)
    assert split_train_eval(rows, 0.3, seed=6)[1] != evals
    assert split_train_eval(rows, 0.0, seed=5) == (list(rows), [])
    assert len(split_train_eval(rows, 0.01, seed=5)[1]) == 1  # a positive fraction holds out at least one row
    assert len(split_train_eval(rows[:2], 0.99, seed=5)[0]) == 1  # and never all of them
    with pytest.raises(ValueError, match="data.eval_fraction"):
        split_train_eval(rows, 1.0, seed=5)
