"""What the model does, for a person to read: a step's samples as a file, a few on the console, a wandb table; and
the two warnings that say a step cannot teach anything.

Every `logging.samples_interval` steps the driver writes `<run dir>/rollouts/step_N.jsonl`, one JSON object per
sample the step generated (every round of dynamic sampling, kept or not, so that its mean reward is the step's
`reward/mean`):

    {"step": 10, "group": 0, "index": 17, "prompt": "...", "response": "...", "answer": "B", "reward": 1.0,
     "accuracy": 1.0, "format": 1.0, "advantage": 0.71, "kept": true, "response_len": 12, "truncated": false}

`accuracy` and `format` are there when the reward function reports them, `by_function` (each function's reward, by
label) when several are summed, `error` when the function failed. `advantage` is null for a group that was not
trained on (`kept: false`). Every eval writes
`rollouts/eval_step_N.jsonl` the same way (no advantage). Prompt and response are decoded with the processor's
tokenizer, special tokens skipped (the response is what the reward function sees); in the prompt each image or video
(its run of pad tokens) shows as one `<image>` or `<video>`.

A file is written atomically (temp file + rename) and replaces only a file of the same step: a resume that computes
step N again writes the same samples (rollouts are seeded per step), so the run directory holds one file per step,
never a torn or a duplicated one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from miles_vl.metrics.sinks import replace_text
from miles_vl.rollout.collect import GeneratedGroup

log = logging.getLogger(__name__)

ROLLOUTS_DIR = "rollouts"
SHOWN_CHARS = 300  # of each text shown on the console


def sample_records(
    step: int,
    generated: Sequence[GeneratedGroup],
    decode: Callable[..., str],
    *,
    media: dict[int, str],
    advantages: dict[int, list[float]] | None = None,
) -> list[dict[str, Any]]:
    """One record per generation of `generated` (module docstring). `decode`: the tokenizer's; `media`: the image
    and video pad token ids and their placeholders; `advantages`: by `id()` of a group's generations list, the
    advantages of the groups trained on."""
    advantages = advantages or {}
    records = []
    for g, group in enumerate(generated):
        adv = advantages.get(id(group.generations))
        prompt = decode_prompt(group.prompt_ids.tolist(), decode, media)
        for j, (gen, reward) in enumerate(zip(group.generations, group.rewards, strict=True)):
            records.append(
                {
                    "step": step,
                    "group": g,
                    "index": group.index,
                    "prompt": prompt,
                    "response": decode(gen.response_ids, skip_special_tokens=True),
                    "answer": group.label,
                    "reward": reward.overall,
                    **{k: v for k, v in reward.as_dict().items() if k != "overall"},
                    **({"by_function": dict(reward.by_function)} if reward.by_function else {}),
                    **({"error": reward.error} if reward.error else {}),
                    "advantage": adv[j] if adv is not None else None,
                    "kept": adv is not None,
                    "response_len": int(gen.response_ids.numel()),
                    "truncated": gen.finish_reason == "length",
                }
            )
    return records


def decode_prompt(ids: list[int], decode: Callable[..., str], media: dict[int, str]) -> str:
    """`ids` as text without special tokens, each run of one media pad token as its placeholder (`<image>`)."""
    parts, text_ids = [], []
    for i, token in enumerate(ids):
        if token not in media:
            text_ids.append(token)
        elif i == 0 or ids[i - 1] != token:  # the first pad of a run
            parts += [decode(text_ids, skip_special_tokens=True), media[token]]
            text_ids = []
    return "".join([*parts, decode(text_ids, skip_special_tokens=True)])


def write_samples(run_dir: Path, name: str, records: Sequence[dict[str, Any]]) -> Path:
    """`<run_dir>/rollouts/<name>.jsonl`, written atomically; replaces only a file of that name (module docstring)."""
    path = run_dir / ROLLOUTS_DIR / f"{name}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_text(path, "".join(json.dumps(r) + "\n" for r in records))
    return path


def show_samples(title: str, records: Sequence[dict[str, Any]], shown: int, path: Path) -> None:
    """The first `shown` records on the console (the driver's log), each text cut to a few lines."""
    if not shown or not records:
        return
    lines = [f"{title}: {min(shown, len(records))} of {len(records)} samples (all in {path})"]
    for r in records[:shown]:
        adv = "" if r.get("advantage") is None else f"  advantage {r['advantage']:.3g}"
        lines += [
            f"  [group {r['group']}] reward {r['reward']:.3g}{adv}  len {r['response_len']}"
            + ("  (truncated)" if r["truncated"] else "")
            + f"  answer {r['answer']!r}",
            f"    prompt:   {_short(r['prompt'], tail=True)}",
            f"    response: {_short(r['response'])}",
        ]
    log.info("\n".join(lines))


def _short(text: str, tail: bool = False) -> str:
    """`text` on one line, cut to SHOWN_CHARS: its tail (a prompt: the question follows the system text) or head."""
    text = " ".join(text.split())
    if len(text) <= SHOWN_CHARS:
        return text
    return "... " + text[-SHOWN_CHARS:] if tail else text[:SHOWN_CHARS] + " ..."


def warn_if_stuck(step: int, metrics: dict[str, float], max_response_len: int) -> None:
    """A warning when every group of the step has zero advantage (nothing to learn) and one when most responses
    hit `rollout.max_response_len`."""
    if metrics.get("rollout/zero_adv_group_fraction") == 1.0:
        log.warning(
            "step %d: every group has zero advantage (all samples of each prompt got the same reward), so this step "
            "learns nothing; if it repeats, check the reward function on rollouts/step_N.jsonl, raise "
            "rollout.n_samples_per_prompt or rollout.temperature, or use rollout.dynamic_sampling",
            step,
        )
    truncated = metrics.get("rollout/truncated_fraction", 0.0)
    if truncated > 0.5:
        log.warning(
            "step %d: %.0f%% of the responses hit rollout.max_response_len=%d and were cut off (a cut answer usually "
            "scores 0); raise rollout.max_response_len or ask for shorter answers in the prompt",
            step,
            100 * truncated,
            max_response_len,
        )
