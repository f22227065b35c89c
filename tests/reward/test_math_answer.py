"""Contract: the LAST `\\boxed{...}` is the answer (nested braces kept, unclosed = none), and answers compare by
value (fractions, decimals, radicals, degrees, units) as math-verify grades them; wrong values never match."""

import pytest

from miles_vl.reward import answers_match, extract_last_boxed, math_reward
from miles_vl.reward.types import RewardSample


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so \boxed{5}", "5"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"first \boxed{3} then \boxed{ 4 }", "4"),  # several boxes: the last counts, stripped
        (r"\boxed{\sqrt{\frac{3}{4}}} end", r"\sqrt{\frac{3}{4}}"),
        ("no box here", None),
        (r"\boxed{7} and an unclosed \boxed{8", None),  # the last box is unclosed: no answer
        ("", None),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


# (given, label, expected): one row per kind of answer geo3k produces.
ANSWER_TABLE = [
    (r"\frac{1}{2}", "0.5", True),  # fraction vs decimal
    ("0.5", r"\frac{1}{2}", True),
    ("1/2", r"\frac{1}{2}", True),  # slash fraction
    (r"\dfrac{3}{4}", "3/4", True),
    (r"\frac{2}{4}", r"\frac{1}{2}", True),  # unreduced fraction has the same value
    ("2.5", "5/2", True),
    ("0.333", r"\frac{1}{3}", False),  # rounded decimal is not the fraction
    (r"2\sqrt{3}", r"\sqrt{12}", True),  # radicals
    (r"24\sqrt{3}", r"24 \sqrt 3", True),
    (r"\frac{\sqrt{3}}{2}", r"\frac{1}{2}\sqrt{3}", True),
    ("7", r"7\sqrt{2}", False),
    (r"2\sqrt{3}", "3.4641", False),  # a decimal approximation of a radical is not equal
    ("12", "12.0", True),  # decimals
    ("10.0", "10", True),
    ("1,000", "1000", True),
    (r"30^\circ", "30", True),  # degrees
    (r"30^{\circ}", "30", True),
    ("45°", "45", True),
    ("60", r"60^\circ", True),
    ("5 cm", "5", True),  # units
    (r"5\text{ cm}", "5", True),
    (r"8\pi", r"8 \pi", True),
    ("25.13", r"8\pi", False),
    ("4", "5", False),
    ("B", "A", False),
    ("A", "A", True),
    (None, "3", False),  # no answer
    ("", "3", False),
    ("3", r"\boxed{3}", True),  # a boxed label is unboxed first
]


@pytest.mark.parametrize(("given", "label", "expected"), ANSWER_TABLE)
def test_answers_match_table(given, label, expected):
    assert answers_match(given, label) is expected


def test_math_reward_uses_last_box_only():
    assert math_reward(RewardSample(r"\boxed{3} no wait \boxed{4}", "4")).overall == 1.0
    assert math_reward(RewardSample(r"\boxed{4} no wait \boxed{3}", "4")).overall == 0.0
    result = math_reward(RewardSample("the answer is 4", "4"))  # missing box
    assert (result.overall, result.accuracy, result.format) == (0.0, 0.0, None)
