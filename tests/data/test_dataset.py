"""Contract: `PromptDataset` serves every row once per epoch in a seeded order, crosses epochs inside a batch, and
a cursor restored with `load_state_dict` continues with exactly the batches an uninterrupted run would have served;
a cursor from another dataset is refused. `split_train_eval` is a seeded, disjoint, covering hold-out."""

import threading

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


class _FailsOn:
    """The encoder, except that encoding row `bad` raises (an image that cannot be read when the batch is served);
    records the thread each row was encoded in."""

    def __init__(self, encoder, bad: int | None = None):
        self.encoder, self.bad, self.threads = encoder, bad, {}

    def encode(self, row):
        self.threads[row.index] = threading.current_thread().name
        if row.index == self.bad:
            raise ValueError(f"row {row.index}: image unreadable")
        return self.encoder.encode(row)


def test_prefetch_serves_the_same_batches_and_moves_no_cursor(rows, encoder):
    """Issue 33.3: step N+1's batch is encoded while step N trains. The batches, across epochs and when a prefetch
    is not taken (another size), are those of a dataset without prefetch; the cursor (what a checkpoint saves) moves
    only when the batch is taken, and a prefetched batch is encoded in the prefetch thread."""
    plain = PromptDataset(rows, encoder, seed=5)
    expected = [indices(plain.next_batch(n)) for n in (4, 4, 3, 4, 4, 4)]
    stub = _FailsOn(encoder)
    ds = PromptDataset(rows, stub, seed=5)
    served = []
    for n, ahead in ((4, 4), (4, 4), (3, 3), (4, 2), (4, 4), (4, 4)):
        cursor = ds.state_dict()
        ds.prefetch(ahead)
        assert ds.state_dict() == cursor
        ds.wait_prefetch()
        batch = ds.next_batch(n)
        served.append(indices(batch))
        threads = {stub.threads[i] for i in indices(batch)}
        assert threads == ({"data-prefetch_0"} if n == ahead else {threading.current_thread().name}), (n, ahead)
    assert served == expected
    assert ds.state_dict() == plain.state_dict()


def test_a_prefetched_batchs_error_is_raised_when_the_batch_is_taken(rows, encoder):
    """A row that fails to encode fails the `next_batch` it belongs to, with its own message, not the prefetch; a
    failing batch prefetched but not taken raises nothing."""
    plain = PromptDataset(rows, encoder, seed=5)
    first, second = indices(plain.next_batch(4)), indices(plain.next_batch(4))
    ds = PromptDataset(rows, _FailsOn(encoder, bad=second[1]), seed=5)
    ds.prefetch(4)
    assert indices(ds.next_batch(4)) == first
    ds.prefetch(4)  # the failing batch
    ds.wait_prefetch()  # nothing raised here
    with pytest.raises(ValueError, match=rf"^row {second[1]}: image unreadable$"):
        ds.next_batch(4)
    other = PromptDataset(rows, _FailsOn(encoder, bad=second[1]), seed=5)
    other.next_batch(4)
    other.prefetch(4)
    other.wait_prefetch()
    other.load_state_dict(PromptDataset(rows, encoder, seed=5).state_dict())  # back to the start: not taken
    assert indices(other.next_batch(4)) == first
