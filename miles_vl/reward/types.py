"""What a reward function receives and returns, and the one contract every reward function follows.

A reward function takes one `RewardSample` and returns a `RewardResult`, a plain number, or a mapping with the
keys of `RewardResult` (EasyR1-style `{"overall": ..., "accuracy": ..., "format": ...}`). It may be a plain
function or an `async def`; `miles_vl.reward.scoring.score_batch` runs both kinds, with a time limit per sample.

    def my_reward(sample: RewardSample) -> float: ...
    async def my_reward(sample: RewardSample) -> RewardResult: ...

Scores must be finite and within +-`MAX_ABS_REWARD` (1e6): a larger one (e.g. 1e39, finite in float64 but inf in
the float32 advantages) is refused like any other bad return value: that sample scores 0 and counts in
`reward/errors`, with a message that names the value. Rescale such a reward.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RewardSample:
    """One response to score."""

    response: str  # the decoded response text (no prompt)
    label: str  # the dataset's reference answer
    metadata: Mapping[str, Any] = field(default_factory=dict)  # anything else from the dataset row (e.g. its index)


@dataclass(frozen=True)
class RewardResult:
    """The score of one response.

    `overall` is the reward the advantages are computed from. `accuracy` and `format` are its parts when the reward
    function reports them (None otherwise). `error` is set when the function raised or timed out; `overall` is then 0.
    """

    overall: float
    accuracy: float | None = None
    format: float | None = None
    error: str | None = None

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
