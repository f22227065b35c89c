"""Math answers: the last `\\boxed{...}` of a response, graded against a reference with math-verify.

    extract_last_boxed(r"... so \\boxed{2} ... finally \\boxed{\\frac{1}{2}}")  # -> "\\frac{1}{2}"
    answers_match("0.5", "\\frac{1}{2}")                                   # -> True

Grading: an exact match after removing whitespace, else math-verify (`math_verify.parse`/`verify`, sympy-based):
fractions, decimals, radicals, degrees (`30^\\circ` = 30) and trailing units (`5 cm` = 5) compare by value.
mathruler's grader is the other field-standard choice (EasyR1/verl); its import needs `pylatexenc`, which it does
not declare, so we use math-verify and keep the box extraction here (the same rule as mathruler's
`extract_boxed_content`: the LAST `\\boxed{`, braces balanced).

math-verify's own time limits (`signal.alarm`) are off here: rewards run in worker processes that the scorer kills
when a call passes `reward.timeout_s` (`scoring.RewardPool`), which also stops what math-verify's limits cannot
(e.g. sympy expanding `9^{9^{9}}`).
"""

from __future__ import annotations

import logging

from math_verify import parse, verify

from miles_vl.reward.types import RewardResult, RewardSample

_BOX = "\\boxed{"

# math-verify warns "Timeout is disabled" on every call made with its limits off; ours are enforced by the scorer.
for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).setLevel(logging.ERROR)


def extract_last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, stripped; None when there is none or it is not closed.

    Args:
        text: a model response.

    Returns:
        The text between the braces of the last `\\boxed{` (nested braces kept), or None.
    """
    start = text.rfind(_BOX)
    if start < 0:
        return None
    depth = 0
    for i in range(start + len(_BOX), len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            if depth == 0:
                return text[start + len(_BOX) : i].strip()
            depth -= 1
    return None


def _as_latex(answer: str) -> str:
    # math-verify extracts from LaTeX environments; a bare answer is wrapped in $...$ so that it is read whole.
    if "$" in answer or _BOX in answer:
        return answer
    return f"${answer}$"


def answers_match(given: str | None, label: str) -> bool:
    """Whether a given answer equals the reference answer.

    Args:
        given: the model's answer (e.g. from `extract_last_boxed`); None or empty never matches.
        label: the reference answer, bare (`\\frac{1}{2}`) or boxed.

    Returns:
        True when the two are equal as strings (whitespace ignored) or as math (math-verify).
    """
    if given is None or not given.strip():
        return False
    label = str(label)
    boxed_label = extract_last_boxed(label)
    if boxed_label is not None:
        label = boxed_label
    if "".join(given.split()) == "".join(label.split()):
        return True
    gold = parse(_as_latex(label), parsing_timeout=None)
    pred = parse(_as_latex(given), parsing_timeout=None)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def math_reward(sample: RewardSample) -> RewardResult:
    """Registry name `math`: accuracy of the last boxed answer, with no format term.

    Args:
        sample: the response and its reference answer.

    Returns:
        RewardResult with overall = accuracy = 1.0 when the last boxed answer matches `sample.label`, else 0.0.
    """
    accuracy = 1.0 if answers_match(extract_last_boxed(sample.response), sample.label) else 0.0
    return RewardResult(overall=accuracy, accuracy=accuracy)
