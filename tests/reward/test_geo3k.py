"""Contract: geo3k overall = (1 - w) * accuracy + w * format with w = 0.1 by default (verl/EasyR1 parity),
format = the whole response matches `<think>...</think>...\\boxed{...}` (or a configured pattern), w = 0 is binary,
and bad options are rejected."""

import pytest

from miles_vl.reward import DEFAULT_FORMAT_PATTERN, RewardSample, format_score, geo3k_reward

GOOD_FORMAT = "<think>\nangle sum is 180\n</think>\nThe answer is \\boxed{%s}."


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("<think>x</think> \\boxed{1}", 1.0),
        ("<think>\nmulti\nline\n</think>\n\nso \\boxed{\\frac{1}{2}} done", 1.0),  # dots match newlines
        ("  <think>x</think>\\boxed{1}\n", 1.0),  # surrounding whitespace is stripped
        ("\\boxed{1}", 0.0),  # no think block
        ("<think>x</think> the answer is 1", 0.0),  # no box
        ("\\boxed{1} <think>x</think>", 0.0),  # box before think
        ("preamble <think>x</think> \\boxed{1}", 0.0),  # the whole response must match
        ("<think>x \\boxed{1}", 0.0),  # unclosed think
    ],
)
def test_default_format(response, expected):
    assert format_score(response) == expected
    assert format_score(response, DEFAULT_FORMAT_PATTERN) == expected


def test_custom_format_pattern():
    assert format_score("Answer: 5", r"Answer: .+") == 1.0
    assert format_score("<think>x</think> \\boxed{5}", r"Answer: .+") == 0.0


@pytest.mark.parametrize(
    ("response", "label", "accuracy", "fmt"),
    [
        (GOOD_FORMAT % "\\frac{1}{2}", "0.5", 1.0, 1.0),
        (GOOD_FORMAT % "3", "4", 0.0, 1.0),
        ("\\boxed{4}", "4", 1.0, 0.0),
        ("<think>x</think> it is 4", "4", 0.0, 0.0),
    ],
)
def test_overall_blends_accuracy_and_format(response, label, accuracy, fmt):
    result = geo3k_reward(RewardSample(response, label))
    assert (result.accuracy, result.format) == (accuracy, fmt)
    assert result.overall == pytest.approx(0.9 * accuracy + 0.1 * fmt)  # default format_weight = 0.1
    assert result.as_dict() == {"overall": result.overall, "accuracy": accuracy, "format": fmt}


@pytest.mark.parametrize("response", [GOOD_FORMAT % "4", GOOD_FORMAT % "5", "\\boxed{4}", "4"])
def test_format_weight_zero_is_binary(response):
    result = geo3k_reward(RewardSample(response, "4"), format_weight=0.0)
    assert result.overall in (0.0, 1.0)
    assert result.overall == result.accuracy


def test_format_weight_one_is_format_only():
    assert geo3k_reward(RewardSample(GOOD_FORMAT % "5", "4"), format_weight=1.0).overall == 1.0


def test_bad_options_raise():
    with pytest.raises(ValueError, match="format_weight must be in \\[0, 1\\], found 1.5"):
        geo3k_reward(RewardSample("x", "1"), format_weight=1.5)
    with pytest.raises(ValueError, match="format_pattern '\\(' is not a valid regular expression"):
        geo3k_reward(RewardSample("x", "1"), format_pattern="(")


@pytest.mark.parametrize(
    ("response", "overall"),
    [
        ("<think></think>\\boxed{5}", 1.0),  # what the tiny job learns to say for a pentagon
        ("<think></think>\\boxed{4}", 0.1),  # well-formatted, wrong count: the format part only
        ("<think>five corners</think>\\boxed{5.0}", 1.0),  # answers compare by value
        ("<think></think>\\boxed{3}\\boxed{5}", 1.0),  # the last box counts
        ("<think></think>\\boxed{5}\\boxed{3}", 0.1),
        ("\\boxed{5}", 0.9),  # right count, no think block
        ("<think></think>5", 0.0),  # no box: no answer
        ("<think></think>\\boxed{pentagon}", 0.1),  # the choices are side counts, not names
    ],
)
def test_polygon_sides_answers(response, overall):
    """The synthetic polygon_sides task (data/synth.py: label "5" for a pentagon) scored by the geo3k reward."""
    assert geo3k_reward(RewardSample(response, "5")).overall == pytest.approx(overall)


@pytest.mark.parametrize(
    ("response", "overall"),
    [
        ("<think></think>\\boxed{B}", 1.0),  # what the tiny job learns to say for a green polygon
        ("<think></think>\\boxed{C}", 0.1),  # well-formatted, wrong letter
        ("<think>green</think> \\boxed{ B }", 1.0),  # whitespace inside the box is ignored
        ("\\boxed{B}", 0.9),  # right letter, no think block
        ("<think></think>\\boxed{green}", 0.1),  # the answer is the letter of the choice
    ],
)
def test_polygon_colour_answers(response, overall):
    """The synthetic polygon_colour task (data/synth.py: label "B" for green) scored by the geo3k reward."""
    assert geo3k_reward(RewardSample(response, "B")).overall == pytest.approx(overall)
