"""The config reference (docs/configs.md) generated from the schema, so that the docs cannot drift from it.

python -m miles_vl.config.reference > docs/configs.md     # tests/config checks it is up to date
"""

from __future__ import annotations

import json
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from miles_vl.config.schema import JobConfig

HEADER = """# Config reference

A job is one YAML file plus `key.sub=value` overrides on the command line:

    miles-vl check configs/geo3k_tiny_cpu.yaml rollout.n_samples_per_prompt=8 train.optimizer.lr=1e-6

Unknown keys, wrong types and inconsistent settings are reported together, each naming the key, the file (or the
override) and a fix. `miles-vl check` then checks this machine for the job (the backends' packages import, the data
files open, the reward and `data.dataset_fn` resolve, the model and processor are there, a checkpoint to resume is
whole), reports every problem at once and creates nothing; it prints the resolved config with the derived values
(data-parallel size, samples per step). `miles-vl check --config-only` stops after the config. `miles-vl train` runs
the same checks first. This page is generated from `miles_vl/config/schema.py` by
`python -m miles_vl.config.reference`; a test keeps it in sync.

Cross-field rules (`JobConfig` and its sections; checked together with the field types):
- `model.init: pretrained` needs `model.path`; `model.init: random` needs `model.processor` (e.g. `offline`) or
  `model.path`.
- `data.train_path` or `data.synthetic_n > 0`, not both; `data.min_pixels <= data.max_pixels`.
- `train.backend: torch` trains on one device: `train.tp/pp/cp/ep` must be 1 and `train.num_gpus` 0 or 1.
- `train.backend: megatron` needs `train.num_gpus > 0` and `model.init: pretrained` (AutoBridge loads `model.path`).
- `train.optimizer.cpu_offload > 0` needs `train.backend: megatron` (megatron's optimizer offload).
- `train.pinned_input_copies: true` needs `train.backend: megatron` (the megatron backend's copies).
- `train.profile_steps` lie in `1..num_steps` (a step past the run's last would never be profiled).
- `checkpoint.save_hf.steps` lie in `1..num_steps` (a step past the run's last would never be written).
- `ray.placement: colocate` with GPUs: `rollout.num_engines * rollout.gpus_per_engine <= train.num_gpus`.
- `train.sp` needs `train.tp > 1`, and refuses `train.logits_only_where_loss`.
- `train.num_gpus` must be divisible by `tp * pp * cp`; `train.global_batch_size` by the data-parallel size,
  and the samples of one step (`rollout.batch_size * rollout.n_samples_per_prompt`) by `train.global_batch_size`.
- `algo.estimator: grpo` needs `rollout.n_samples_per_prompt >= 2`.
- `train.micro_batch_max_tokens` must hold one sample of `data.max_prompt_len + rollout.max_response_len`, padded
  to a multiple of `2 * train.cp` (a sample's room in its packed row).
- `rollout.sglang.vision_cache_mb > 0` needs `train.freeze_vision: true` (the cache outlives weight syncs).
- `rollout.backend: sglang` needs `rollout.gpus_per_engine >= 1`.
- `rollout.sglang.send_pixel_values: true` needs `rollout.sglang.launcher: miles_vl` (miles_vl's SGLang plugin reads
  them); video prompts (`data.synthetic_task: motion`) through `rollout.backend: sglang` need pixel values.
- `rollout.sglang.vision_cuda_graphs > 0` needs `rollout.sglang.launcher: miles_vl` (miles_vl's SGLang plugin makes
  the graphs).
- `algo.tis.enabled` refuses greedy rollouts (`rollout.temperature: 0`): TIS reweights by a sampling distribution.
- `rollout.max_staleness > 0` needs `ray.placement: disaggregate` and `algo.tis.enabled: true` (docs/async.md).
- `rollout.partial_rollouts: true` needs `rollout.max_staleness > 0` and `rollout.backend: sglang` (docs/async.md).
- `rollout.sglang.host` beyond loopback needs `rollout.sglang.api_key`.
- `reward.functions`: the weights' magnitudes sum to at most 1e6 (each function scores within ±1e6, and a total
  reward beyond ±1e12 could overflow the float32 advantages).

Checked by `miles-vl check` and `train` (not by `--config-only`): `rollout.backend: sglang` needs
`model.init: pretrained` (the server loads `model.path`), and `rollout.sglang.one_request_per_prompt: true` refuses a
deterministic server (`--enable-deterministic-inference` in `extra_args`). `rollout.sglang.extra_args` may not set a
flag miles_vl sets itself (`--host`, `--port`, `--api-key`, `--config`, ..., or any prefix argparse reads as one),
nor `--admin-api-key` or `--tokenizer-worker-num` above 1, which would undo the server's API key. A config key that
was removed (`train.packing`: training always packs THD rows) is named with the fix.

Every float must be finite (`inf` and `nan` are refused), Adam's betas lie in [0, 1), a key given twice in one
mapping of the YAML file is an error, and the file must be UTF-8. YAML aliases may add at most 10,000 nodes to the
file (or to the value of one override), and so may `${...}` interpolations of sections when resolved; an alias inside
its own anchor is refused. Secret fields (marked "Secret" below) are written as `<redacted>` in config.yaml, every
checkpoint's driver.json, the wandb config and `miles-vl check`.
"""


def render() -> str:
    lines = [HEADER]
    _section(JobConfig, "", lines)
    return "\n".join(lines) + "\n"


def _section(model: type[BaseModel], prefix: str, lines: list[str]) -> None:
    rows, subs = [], []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = _model(field.annotation)
        if sub is not None:
            subs.append((sub, key))
            continue
        default = (
            "required"
            if field.default is PydanticUndefined and field.default_factory is None
            else (json.dumps(field.default_factory() if field.default_factory else field.default))
        )
        cells = [f"`{key}`", f"`{_type(field.annotation)}`", f"`{default}`", field.description or ""]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    if rows:
        lines += [
            f"\n## `{prefix.rstrip('.') or 'top level'}`\n",
            "| key | type | default | meaning |",
            "|---|---|---|---|",
            *rows,
        ]
    for sub, key in subs:
        _section(sub, key + ".", lines)


def _model(annotation) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _type(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation)).replace("'", "")
    return getattr(annotation, "__name__", str(annotation)).replace("typing.", "")


if __name__ == "__main__":
    print(render(), end="")
