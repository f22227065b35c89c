"""A custom reward, used from a config as `reward.name: examples.custom_reward:concise_exact`.

A reward function takes one `miles_vl.reward.RewardSample` (response text, label, metadata) and returns a
float, a `RewardResult`, or a mapping with `overall` (and optionally `accuracy`, `format`); it may be `async`.
It runs with the time limit `reward.timeout_s`; if it raises or times out the response scores 0 and the failure is
counted in the step metrics (`reward/errors`, `reward/timeouts`).

    miles-vl train examples/custom_task.yaml
"""

from miles_vl.reward import RewardResult, RewardSample, answers_match, extract_last_boxed


def concise_exact(sample: RewardSample, max_words: int = 200) -> RewardResult:
    """1 for a correct last \\boxed{} answer, minus a length penalty beyond `max_words` words (floored at 0)."""
    accuracy = float(answers_match(extract_last_boxed(sample.response), sample.label))
    words = len(sample.response.split())
    penalty = max(0, words - max_words) / max_words
    return RewardResult(overall=max(accuracy - penalty, 0.0), accuracy=accuracy)
