"""`PromptDataset`: loaded rows in a seeded order with a cursor that checkpoints save and resume restores.

    ds = PromptDataset(rows, encoder, seed=1234)
    for step, batch in zip(range(num_steps), ds.batches(8)):   # batch: list[PromptSample], endless over epochs
        ...
        state = ds.state_dict()                                # {"epoch": e, "position": p, ...} in the checkpoint
    ds.load_state_dict(state)                                  # the next batch is the one that would have come

Order: epoch `e` visits every row once, in `torch.randperm(n)` drawn from a generator seeded by (seed, e) (or in
load order with `shuffle=False`). A batch that reaches the end of an epoch continues into the next one. The cursor
(epoch, position) is all the state there is, so a resumed run reproduces the data order exactly.

`prefetch(n)` encodes the batch the next `next_batch(n)` returns in a background thread (the driver: step N+1's
prompts while step N trains); the order, the cursor and the errors are those of a dataset without it.

`split_train_eval` holds out a seeded `eval_fraction` of the rows when there is no separate eval file.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from miles_vl.data.prompt import PromptEncoder
from miles_vl.data.records import PromptRow, PromptSample


class PromptDataset:
    """Validated rows + the encoder that turns them into `PromptSample`s + a resumable (epoch, position) cursor."""

    def __init__(self, rows: Sequence[PromptRow], encoder: PromptEncoder, *, seed: int = 0, shuffle: bool = True):
        """
        Args:
            rows: the kept rows of one or more loads (`loading.load_prompt_file`).
            encoder: encodes a row when it is served (pixels are processed on demand, not held).
            seed: seeds every epoch's order.
            shuffle: False serves rows in load order every epoch.
        """
        self.rows = list(rows)
        self.encoder = encoder
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # rows of `order(epoch)` already served
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None  # `prefetch`'s thread, made when first used
        self._ahead: tuple[tuple[int, int, int], concurrent.futures.Future] | None = None  # (cursor, size), batch

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> PromptSample:
        """The `i`-th row in load order, encoded (does not move the cursor)."""
        return self.encoder.encode(self.rows[i])

    def order(self, epoch: int) -> list[int]:
        """Row positions (into `rows`) in the order epoch `epoch` serves them."""
        n = len(self.rows)
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
        return torch.randperm(n, generator=g).tolist()

    def next_batch(self, batch_size: int) -> list[PromptSample]:
        """The next `batch_size` prompts in order; moves the cursor, crossing into the next epoch when needed. When
        `prefetch` began exactly this batch, its result (or its error) is taken.

        Raises:
            ValueError: batch_size < 1, or the dataset is empty (every row was dropped: see the load report).
            DataError, ...: what encoding a row raised, here, for the batch it belongs to.
        """
        key = (self.epoch, self.position, batch_size)
        picked, self.epoch, self.position = self._pick(batch_size)
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == key:
            return ahead[1].result()  # a row's error is raised here, as an encode in this thread would raise it
        return self._encode(picked)

    def prefetch(self, batch_size: int) -> None:
        """Start encoding (images loaded and processed) the batch that the next `next_batch(batch_size)` returns, in a
        background thread; the cursor does not move, and `state_dict` is unchanged. One batch ahead at most: a batch
        prefetched earlier and not taken is dropped. A `next_batch` of another size, or from another cursor, encodes
        its own batch as without prefetch. Nothing is started when `next_batch` would raise (it raises itself)."""
        self._ahead = None
        if batch_size < 1 or not self.rows:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="data-prefetch")
        picked, _, _ = self._pick(batch_size)
        self._ahead = ((self.epoch, self.position, batch_size), self._pool.submit(self._encode, picked))

    def wait_prefetch(self) -> None:
        """Wait until the prefetched batch is encoded (its error, if any, stays for its `next_batch`): after this the
        processor is not in use by the prefetch thread."""
        if self._ahead is not None:
            concurrent.futures.wait([self._ahead[1]])

    def _pick(self, batch_size: int) -> tuple[list[int], int, int]:
        """The rows of the next batch and the cursor (epoch, position) after it; moves nothing."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, found {batch_size}")
        if not self.rows:
            raise ValueError("the dataset is empty: every row was dropped at load time (see the load report)")
        picked: list[int] = []
        epoch, position = self.epoch, self.position
        order = self.order(epoch)
        while len(picked) < batch_size:
            if position == len(order):
                epoch, position = epoch + 1, 0
                order = self.order(epoch)
            take = min(batch_size - len(picked), len(order) - position)
            picked += order[position : position + take]
            position += take
        return picked, epoch, position

    def _encode(self, picked: list[int]) -> list[PromptSample]:
        return [self.encoder.encode(self.rows[i]) for i in picked]

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (Ray, multiprocessing): without the prefetch thread and its batch."""
        return self.__dict__ | {"_pool": None, "_ahead": None}

    def batches(self, batch_size: int) -> Iterator[list[PromptSample]]:
        """Endless `next_batch(batch_size)`; the cursor moves as batches are taken, so `state_dict` stays exact."""
        while True:
            yield self.next_batch(batch_size)

    def ordered_batches(self, batch_size: int, max_prompts: int | None = None) -> Iterator[list[PromptSample]]:
        """One pass in load order (evaluation); the cursor does not move.

        Args:
            batch_size: prompts per batch (the last one may be shorter).
            max_prompts: stop after this many prompts; None for all.
        """
        n = len(self.rows) if max_prompts is None else min(max_prompts, len(self.rows))
        for start in range(0, n, batch_size):
            yield [self.encoder.encode(r) for r in self.rows[start : min(start + batch_size, n)]]

    def state_dict(self) -> dict[str, Any]:
        """The cursor and what it is valid for: {"epoch", "position", "seed", "shuffle", "num_rows"}."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self.rows),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a cursor saved by `state_dict`.

        Raises:
            ValueError: the state was saved for a different dataset (row count), seed or shuffle setting, or its
                position is out of range; resuming would silently change the data order.
        """
        expected = {"seed": self.seed, "shuffle": self.shuffle, "num_rows": len(self.rows)}
        found = {k: state.get(k) for k in expected}
        if found != expected:
            raise ValueError(
                f"the saved data cursor was made for {found}, this dataset is {expected}; resume with the same data, "
                "data.max_prompt_len, pixel range and seed, or start a fresh run"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= len(self.rows):
            raise ValueError(f"saved data cursor out of range: epoch {epoch}, position {position} of {len(self.rows)}")
        self.epoch, self.position = epoch, position
        self._ahead = None


def split_train_eval(
    rows: Sequence[PromptRow], eval_fraction: float, seed: int
) -> tuple[list[PromptRow], list[PromptRow]]:
    """Hold out `eval_fraction` of the rows for evaluation, chosen by a seeded permutation.

    Args:
        rows: the loaded rows.
        eval_fraction: in [0, 1); the held-out count is round(fraction * n), at least 1 when the fraction is
            positive and there are 2 or more rows, and never all rows.
        seed: the same seed and rows give the same split.

    Returns:
        (train rows, eval rows), each in load order.

    Raises:
        ValueError: a fraction outside [0, 1).
    """
    if not 0.0 <= eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in [0, 1), found {eval_fraction}; fix data.eval_fraction")
    n = len(rows)
    n_eval = 0 if eval_fraction == 0 or n < 2 else min(max(round(eval_fraction * n), 1), n - 1)
    g = torch.Generator().manual_seed(seed % (2**63))
    held = set(torch.randperm(n, generator=g)[:n_eval].tolist())
    train = [r for i, r in enumerate(rows) if i not in held]
    evals = [r for i, r in enumerate(rows) if i in held]
    return train, evals
