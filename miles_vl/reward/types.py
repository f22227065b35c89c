"""What a reward function receives and returns, and the one contract every reward function follows.

A reward function takes one `RewardSample` and returns a `RewardResult`, a plain number, or a mapping with the
keys of `RewardResult` (EasyR1-style `{"overall": ..., "accuracy": ..., "format": ...}`). It may be a plain
function or an `async def`; `miles_vl.reward.scoring.score_batch` runs both kinds, with a time limit per sample.

    def my_reward(sample: RewardSample) -> float: ...
    async def my_reward(sample: RewardSample) -> RewardResult: ...

A sample carries the response, the label (ground truth), the prompt text and the row's metadata; its images only
for a reward marked `@reward_function(images=True)` (they are copied to the reward workers for every response).
A reward marked `@reward_function(batched=True)` takes TRL's shape instead: lists of the whole batch, as keywords,
and returns one score per completion (a list; a length that differs fails every sample of the call, counted):

    @reward_function(batched=True)
    def my_rewards(prompts, completions, label, metadata, **kwargs) -> list[float]: ...
    # keywords: prompts, completions, label (= ground_truth), metadata, and images with images=True

Scores must be finite and within +-`MAX_ABS_REWARD` (1e6): a larger one (e.g. 1e39, finite in float64 but inf in
the float32 advantages) is refused like any other bad return value: that sample scores 0 and counts in
`reward/errors`, with a message that names the value. Rescale such a reward. The weights of several functions must
keep the total within +-`MAX_ABS_TOTAL_REWARD` (1e12) too: sum |weight| <= 1e6 (`total_reward_bound`).
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardSample:
    """One response to score."""

    response: str  # the decoded response text (no prompt)
    label: str  # the dataset's reference answer (the ground truth)
    metadata: Mapping[str, Any] = field(default_factory=dict)  # anything else from the dataset row (e.g. its index)
    prompt: str = ""  # the chat-templated prompt text, before image-token expansion
    images: tuple[Any, ...] = ()  # the prompt's PIL images, in order; only for a reward marked images=True

    @property
    def ground_truth(self) -> str:
        """TRL's and verl's name for `label`."""
        return self.label


@dataclass(frozen=True)
class RewardResult:
    """The score of one response.

    `overall` is the reward the advantages are computed from. `accuracy` and `format` are its parts when the reward
    function reports them (None otherwise). `error` is set when the function raised or timed out; `overall` is then 0.
    `by_function` holds each function's own `overall` when several are summed (`scoring.WeightedRewards`), by label.
    """

    overall: float
    accuracy: float | None = None
    format: float | None = None
    error: str | None = None
    by_function: Mapping[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, float]:
        """The reported scores as a flat dict for logging (parts that are None are left out)."""
        out = {"overall": self.overall}
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        if self.format is not None:
            out["format"] = self.format
        return out


RewardValue = RewardResult | float | int | bool | Mapping[str, float]
RewardFn = Callable[[RewardSample], RewardValue | Awaitable[RewardValue]]

_RESULT_KEYS = ("overall", "accuracy", "format")
MAX_ABS_REWARD = 1e6  # far beyond any sane reward scale, far inside float32 (advantages square rewards)
# The bound on a sample's total reward, the weighted sum of its functions' scores (`reward.functions`, each score
# within +-MAX_ABS_REWARD): the weights must keep sum |weight| * MAX_ABS_REWARD within it (`total_reward_bound`).
# Derived from the float32 advantages (algo/advantages.py), which square centred rewards. With every total in [-B, B],
# a reward less its group mean is within +-2B; reinforce_pp_baseline's whitening subtracts the batch mean of those
# (also within +-2B), squares (at most 16 B^2) and sums over the batch weighted by token counts, T in all. 16 B^2 T
# stays below float32's largest value, 3.4e38, for B = 1e12 up to T = 2e13 tokens in a batch (no batch holds a
# thousandth of that); GRPO's group std squares n terms of at most 2B (4 B^2 n) and Dr.GRPO's advantages are the
# centred totals themselves (2e12), both far inside too. A weight of 1e39 makes a total of 1e39: inf in float32.
MAX_ABS_TOTAL_REWARD = 1e12


def total_reward_bound(weights: Sequence[float]) -> float:
    """The largest |total reward| a weighted sum of reward functions can reach: sum |weight| * MAX_ABS_REWARD.

    Weights whose bound exceeds `MAX_ABS_TOTAL_REWARD` can overflow the float32 advantages; the config refuses them.
    """
    return math.fsum(abs(w) for w in weights) * MAX_ABS_REWARD


def to_reward_result(value: object) -> RewardResult:
    """Turn whatever a reward function returned into a `RewardResult`.

    Args:
        value: a `RewardResult`, a real number (bool and numpy scalars included), or a mapping with key
            `overall` and optionally `accuracy` and `format`.

    Returns:
        RewardResult with finite float fields.

    Raises:
        TypeError: a value of another type, or a mapping with unknown keys or without `overall`.
        ValueError: a score that is NaN, infinite or beyond +-MAX_ABS_REWARD.
    """
    if isinstance(value, RewardResult):
        result = value
    elif isinstance(value, numbers.Real):  # bool, int, float and numpy scalars
        result = RewardResult(overall=float(value))
    elif isinstance(value, Mapping):
        unknown = sorted(set(value) - set(_RESULT_KEYS))
        if unknown or "overall" not in value:
            raise TypeError(
                f"a reward mapping needs the key 'overall' and may have 'accuracy' and 'format'; found keys "
                f"{sorted(value)}: return a RewardResult or a float instead"
            )
        result = RewardResult(**{k: None if value.get(k) is None else float(value[k]) for k in _RESULT_KEYS})
    else:
        raise TypeError(
            f"a reward function must return a RewardResult, a float or a mapping with 'overall'; found "
            f"{type(value).__name__}: {value!r:.80}"
        )
    for name in _RESULT_KEYS:
        score = getattr(result, name)
        if score is not None and not math.isfinite(score):
            raise ValueError(f"reward {name}={score} is not finite; a reward function must return finite scores")
        if score is not None and abs(score) > MAX_ABS_REWARD:
            raise ValueError(
                f"reward {name}={score:g} is outside [-{MAX_ABS_REWARD:g}, {MAX_ABS_REWARD:g}]; rescale the reward "
                "(advantages are computed in float32)"
            )
    return result


def is_async_reward(fn: object) -> bool:
    """Whether `fn` (or the function a `functools.partial` wraps, or its `__call__`) is an `async def`."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def reward_name(fn: object) -> str:
    """A readable name of a reward callable (the wrapped function's for a `functools.partial`)."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__qualname__", None) or repr(fn)


@dataclass(frozen=True)
class RewardTraits:
    """How a reward function wants to be called (set by `reward_function`; the defaults otherwise)."""

    batched: bool = False  # takes the batch as lists (TRL's shape), returns a list of scores
    images: bool = False  # wants the prompt's images (copied to the workers for every response)


_TRAITS_ATTR = "__miles_reward_traits__"


def reward_function(*, batched: bool = False, images: bool = False) -> Callable[[Callable], Callable]:
    """Mark a reward function as batched and/or wanting images (module docstring); returns it unchanged otherwise."""

    def mark(fn: Callable) -> Callable:
        setattr(fn, _TRAITS_ATTR, RewardTraits(batched=batched, images=images))
        return fn

    return mark


def reward_traits(fn: object) -> RewardTraits:
    """The traits `fn` (or the function a `functools.partial` wraps) was marked with."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, _TRAITS_ATTR, None) or RewardTraits()


def batch_arguments(samples: Sequence[RewardSample], *, images: bool) -> dict[str, list]:
    """The keyword arguments of a batched reward for `samples` (one entry per sample in every list)."""
    out: dict[str, list] = {
        "prompts": [s.prompt for s in samples],
        "completions": [s.response for s in samples],
        "label": [s.label for s in samples],
        "metadata": [dict(s.metadata) for s in samples],
    }
    if images:
        out["images"] = [list(s.images) for s in samples]
    return out


def to_batch_results(name: str, value: object, n: int) -> list[RewardResult | Exception]:
    """What a batched reward returned for `n` samples: one result (or the error of that item) per sample.

    Raises:
        TypeError: `value` is not a list or tuple (a str, a dict or a generator are not scores).
        ValueError: its length is not `n`; the message names the reward.
    """
    if not isinstance(value, list | tuple) and not (hasattr(value, "tolist") and hasattr(value, "__len__")):
        raise TypeError(
            f"batched reward {name} must return a list with one score per completion, found {type(value).__name__}"
        )
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    if len(values) != n:
        raise ValueError(
            f"batched reward {name} returned {len(values)} scores for {n} completions; return one score per "
            "completion, in order"
        )
    out: list[RewardResult | Exception] = []
    for v in values:
        try:
            out.append(to_reward_result(v))
        except (TypeError, ValueError) as err:
            out.append(err)
    return out
