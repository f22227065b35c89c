"""The geo3k reward: accuracy of the last boxed answer plus a format check, as in verl's and EasyR1's geo3k.

    overall = (1 - format_weight) * accuracy + format_weight * format

`accuracy` is 1.0 when the last `\\boxed{...}` of the response equals the label (`math_answer.answers_match`),
`format` is 1.0 when the whole response (leading/trailing whitespace stripped) matches `format_pattern`
(default: `<think>...</think>` then a `\\boxed{...}`, dots matching newlines). `format_weight` defaults to 0.1
(verl/EasyR1 parity); 0 gives binary rewards.

In a config: `reward.name: geo3k`, with `reward.format_weight` and `reward.format_pattern` passed as options by
`resolve_reward("geo3k", format_weight=..., format_pattern=...)`.
"""

from __future__ import annotations

import re
from functools import lru_cache

from miles_vl.reward.math_answer import answers_match, extract_last_boxed
from miles_vl.reward.types import RewardResult, RewardSample

DEFAULT_FORMAT_PATTERN = r"<think>.*</think>.*\\boxed\{.*\}.*"  # verl/EasyR1's geo3k format_reward


@lru_cache(maxsize=16)
def compile_format_pattern(pattern: str | None) -> re.Pattern[str]:
    """The compiled format regex (DOTALL); None gives `DEFAULT_FORMAT_PATTERN`.

    Raises:
        ValueError: the pattern is not a valid regular expression (names it and where it breaks).
    """
    pattern = DEFAULT_FORMAT_PATTERN if pattern is None else pattern
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ValueError(
            f"format_pattern {pattern!r} is not a valid regular expression: {err}; fix reward.format_pattern"
        ) from err


def format_score(response: str, pattern: str | None = None) -> float:
    """Whether the response has the required shape.

    Args:
        response: the response text; leading and trailing whitespace is ignored.
        pattern: regex the whole response must match (DOTALL); None = `DEFAULT_FORMAT_PATTERN`.

    Returns:
        1.0 on a full match, else 0.0.

    Raises:
        ValueError: an invalid pattern.
    """
    return 1.0 if compile_format_pattern(pattern).fullmatch(response.strip()) else 0.0


def check_geo3k_options(format_weight: float = 0.1, format_pattern: str | None = None) -> None:
    """Validate geo3k's options before any sample is scored (called by `resolve_reward`).

    Raises:
        ValueError: format_weight outside [0, 1] or an invalid format_pattern.
    """
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], found {format_weight}; fix reward.format_weight")
    compile_format_pattern(format_pattern)


def geo3k_reward(
    sample: RewardSample, *, format_weight: float = 0.1, format_pattern: str | None = None
) -> RewardResult:
    """Registry name `geo3k`: boxed-answer accuracy blended with a format check.

    Args:
        sample: the response and its reference answer.
        format_weight: weight w of the format term, in [0, 1]; overall = (1 - w) * accuracy + w * format.
        format_pattern: regex the whole response must match; None = `DEFAULT_FORMAT_PATTERN`.

    Returns:
        RewardResult(overall, accuracy, format), each in [0, 1].

    Raises:
        ValueError: format_weight outside [0, 1] or an invalid format_pattern.
    """
    check_geo3k_options(format_weight, format_pattern)
    fmt = format_score(sample.response, format_pattern)
    accuracy = 1.0 if answers_match(extract_last_boxed(sample.response), sample.label) else 0.0
    return RewardResult(overall=(1.0 - format_weight) * accuracy + format_weight * fmt, accuracy=accuracy, format=fmt)
