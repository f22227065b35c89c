"""Everything a job needs from this machine, checked before anything is created: `miles-vl check` and `miles-vl train`.

    preflight(cfg, "configs/geo3k_qwen3vl_2b.yaml")     # returns, or raises one ConfigError listing every problem

What it checks, each problem one line with its fix:
- the packages of the chosen backends import (`miles_vl.stack`: the core for every job, SGLang for
  `rollout.backend=sglang`, megatron-core/bridge and Transformer Engine for `train.backend=megatron`), and what the
  rollout engine itself cannot do with the config (`check_backends`);
- `reward.name` or each of `reward.functions` resolves (a registry name, or `module:function` that imports, with
  its options);
- `data.dataset_fn` resolves; `data.train_path` / `data.eval_path` open as parquet or jsonl with the columns the
  layout reads (the rows themselves are validated when the job loads them);
- `model.path` is a checkpoint directory (config.json and weights), or a hub id in the local Hugging Face cache,
  when the job loads it (`model.init=pretrained`, or an SGLang rollout); the processor (`model.processor`, else
  `model.path`) loads from local files, unless it is `offline`. A hub id not in the cache is a problem only where
  the hub cannot be reached (`HF_HUB_OFFLINE=1`); else `fetch_hub_models`, which `miles-vl train` runs before this,
  downloads it, and `check` says so (`models.hub`);
- the megatron trainer's logits on one rank stay under the size whose backward fails on CUDA (`train_logits_problems`,
  from the config and the model's vocabulary), so that a job does not learn it after its first rollout;
- `checkpoint.resume`, when it names a checkpoint, is a complete one;
- the run directory (`logging.output_dir`/`logging.run_name`) and the checkpoint directory (`checkpoint.dir`, else
  `<run dir>/checkpoints`) can be created and written: a directory is made and removed there, or in the nearest
  parent that exists;
- a private Ray (no `ray.address`) has room for its unix sockets under its temp folder (`placement`);
- inside `ray job submit`, the job's runtime environment does not contradict the driver's (`placement`).

Nothing is left written: no run directory, no Ray, no model weights read. The driver (`run_job`) runs `check_backends`
again itself, as its callers need not be the CLI; the package check stays here, where tests that stand in for an
engine do not reach.
"""

from __future__ import annotations

import logging
from pathlib import Path

from miles_vl.config import ConfigError, JobConfig
from miles_vl.data import load_processor, video_settings
from miles_vl.data.layouts import DataError, load_dataset_fn, read_records, resolve_layout
from miles_vl.data.processor import OFFLINE
from miles_vl.models.hub import ModelNotFoundError, hub_offline, is_hub_id, local_model_dir
from miles_vl.models.qwen3_vl.shapes import hf_config_dict
from miles_vl.orchestration.checkpoint import DRIVER_STATE, not_a_checkpoint, verify_checkpoint, write_problem
from miles_vl.orchestration.factories import build_rewards
from miles_vl.orchestration.loop import check_backends
from miles_vl.orchestration.placement import driver_runtime_env, job_runtime_env_problem, private_session_problem
from miles_vl.packing import padded_length
from miles_vl.stack import backend_problems, captured_output
from miles_vl.train.megatron.parallel import recompute_layers_problem
from miles_vl.train.megatron.step import train_logits_problem

log = logging.getLogger(__name__)

WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json")


def preflight(cfg: JobConfig, config_path: str | None = None) -> None:
    """Raise one `ConfigError` with every problem `preflight_problems` finds (module docstring); else return."""
    problems = preflight_problems(cfg)
    if problems:
        raise ConfigError(problems, config_path)


def preflight_problems(cfg: JobConfig) -> list[str]:
    """Every problem of the job on this machine, one line each (module docstring)."""
    problems = backend_problems(cfg.rollout.backend, cfg.train.backend)
    try:
        check_backends(cfg)
    except ConfigError as e:
        problems += e.problems
    problems += reward_problems(cfg)
    problems += data_problems(cfg)
    problems += model_problems(cfg)
    problems += train_logits_problems(cfg)
    problems += recompute_layers_problems(cfg)
    problems += resume_problems(cfg)
    problems += output_problems(cfg)
    if problem := private_session_problem(cfg.ray.address):
        problems.append(problem)
    if problem := job_runtime_env_problem(driver_runtime_env()):
        problems.append(problem)
    return problems


def reward_problems(cfg: JobConfig) -> list[str]:
    try:
        build_rewards(cfg)
    except ConfigError as err:
        return err.problems
    except Exception as err:  # RewardResolutionError, or what a user's module raises while it imports
        where = "" if cfg.reward.functions else f"reward.name={cfg.reward.name!r}: "
        return [f"{where}{err}"]
    return []


def data_problems(cfg: JobConfig) -> list[str]:
    d = cfg.data
    problems = []
    if d.dataset_fn:
        try:
            load_dataset_fn(d.dataset_fn)
        except DataError as err:
            problems.append(str(err))
    for key, path in (("data.train_path", d.train_path), ("data.eval_path", d.eval_path)):
        if not path:
            continue
        try:
            records = read_records(path)
            if not d.dataset_fn:  # a dataset_fn maps rows of any shape
                resolve_layout(
                    records,
                    d.format,
                    prompt_key=d.prompt_key,
                    answer_key=d.answer_key,
                    image_key=d.image_key,
                    source=str(path),
                )
        except DataError as err:
            problems.append(f"{key}: {err}")
    return problems


def model_problems(cfg: JobConfig) -> list[str]:
    m = cfg.model
    problems = []
    to_download = [p for p in hub_models(cfg) if not _cached(p) and not hub_offline()]
    for path in to_download:
        log.info("%s is a hub id not in the local Hugging Face cache: `miles-vl train` downloads it first", path)
    loads_path = m.path and (m.init == "pretrained" or cfg.rollout.backend == "sglang")
    path_problem = checkpoint_dir_problem(m.path) if loads_path and m.path not in to_download else None
    if path_problem:
        problems.append(path_problem)
    processor = m.processor or m.path
    checkable = processor not in to_download and not (path_problem and processor == m.path)
    if processor and processor != OFFLINE and checkable:
        with captured_output():
            try:
                load_processor(processor, cfg.data.min_pixels, cfg.data.max_pixels, video_settings(cfg.data))
            except (DataError, ImportError) as err:
                problems.append(f"model.processor={processor!r}: {err}")
    return problems


def train_logits_problems(cfg: JobConfig) -> list[str]:
    """The megatron trainer's logits on one rank at their largest must stay under `MAX_TRAIN_LOGITS_ELEMENTS`
    (`train.megatron.step.train_logits_problem`, which the train step applies again to the rows it forms). A rank's rows
    are at most `train.micro_batch_max_tokens / train.cp`. With `train.logits_only_where_loss` they are its loss
    positions, and the train step's micro-batch plan keeps every micro-batch's under the limit (a second budget beside
    the tokens); what no plan can split is one sample, whose loss positions on a rank are at most
    `rollout.max_response_len`, and at most its padded row's share on one of `train.cp` ranks. The vocabulary is the
    model's (`model.path`'s config.json, the cached snapshot of a hub id, or the released shape of that name); where
    none of them is here, nothing is checked (the train step still is)."""
    t = cfg.train
    vocab = _megatron_text_config(cfg).get("vocab_size")
    if not vocab:
        return []
    rows = -(-t.micro_batch_max_tokens // t.cp)
    tokens_from = f"train.micro_batch_max_tokens={t.micro_batch_max_tokens} / train.cp={t.cp}"
    if t.logits_only_where_loss:  # one sample's loss positions on a rank: its response, and its share of its row
        share = padded_length(cfg.data.max_prompt_len + cfg.rollout.max_response_len, t.cp) // t.cp
        one = min(cfg.rollout.max_response_len, share)
        if one < rows:
            rows = one
            tokens_from = f"one sample's at most: rollout.max_response_len={cfg.rollout.max_response_len}" + (
                f", its row of data.max_prompt_len + max_response_len on one of train.cp={t.cp} ranks"
                if share < cfg.rollout.max_response_len
                else ""
            )
    problem = train_logits_problem(
        rows, vocab, t.tp, logits_only_where_loss=t.logits_only_where_loss, tokens_from=tokens_from
    )
    return [problem] if problem else []


def recompute_layers_problems(cfg: JobConfig) -> list[str]:
    """`train.recompute_layers` may be at most the decoder layers of a pipeline stage (the model's layers / train.pp);
    the model's shape as `train_logits_problems` finds it (none found: unchecked here; `build_provider` refuses it
    when the trainer builds)."""
    t = cfg.train
    layers = _megatron_text_config(cfg).get("num_hidden_layers") if t.recompute_layers is not None else None
    problem = layers and recompute_layers_problem(t.recompute_layers, layers, t.pp, cfg.model.path)
    return [problem] if problem else []


def _megatron_text_config(cfg: JobConfig) -> dict:
    """The language model's config of a megatron job's model (`model.path`'s config.json, the cached snapshot of a
    hub id, or the released shape of that name); {} for another backend or where none of them is here."""
    if cfg.train.backend != "megatron" or not cfg.model.path:
        return {}
    try:
        where = str(local_model_dir(cfg.model.path))
    except ModelNotFoundError:  # model_problems says so; a released shape may still give the shape
        where = cfg.model.path
    config, _ = hf_config_dict(where)
    return (config or {}).get("text_config", config or {})


def hub_models(cfg: JobConfig) -> list[str]:
    """The hub ids among `model.path` (when the job loads it) and `model.processor`, in that order, each once."""
    m = cfg.model
    loads_path = m.path and (m.init == "pretrained" or cfg.rollout.backend == "sglang")
    candidates = ([m.path] if loads_path else []) + [m.processor or m.path]
    return list(dict.fromkeys(p for p in candidates if p and p != OFFLINE and is_hub_id(p)))


def fetch_hub_models(cfg: JobConfig, config_path: str | None = None) -> None:
    """Download the hub ids the job loads (`hub_models`) into the Hugging Face cache, or find them there when the hub
    cannot be reached; `miles-vl train` runs it before `preflight`, which then checks the cached files.

    Raises:
        ConfigError: an id that is neither cached nor downloadable (each message names the id and how to fetch it).
    """
    problems = []
    for path in hub_models(cfg):
        key = "model.path" if path == cfg.model.path else "model.processor"
        log.info("%s=%s: resolving the hub id (downloading into the Hugging Face cache what it lacks)", key, path)
        try:
            log.info("%s=%s: using %s", key, path, local_model_dir(path, download=True, key=key))
        except ModelNotFoundError as err:
            problems.append(str(err))
    if problems:
        raise ConfigError(problems, config_path)


def _cached(path: str) -> bool:
    try:
        local_model_dir(path)
    except ModelNotFoundError:
        return False
    return True


def checkpoint_dir_problem(path: str) -> str | None:
    """What keeps `path` (a directory, or a hub id in the local Hugging Face cache) from loading as an HF checkpoint."""
    try:
        directory = local_model_dir(path)
    except ModelNotFoundError as err:
        return str(err)
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any(next(directory.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if missing:
        return (
            f"model.path={path!r}: {directory} has no {' and no '.join(missing)}; point model.path at the directory "
            "of a Hugging Face checkpoint"
        )
    return None


def resume_problems(cfg: JobConfig) -> list[str]:
    resume = cfg.checkpoint.resume
    if resume in ("auto", "never"):  # `auto` finds (and sets aside) broken ones when the job starts
        return []
    if not (Path(resume) / DRIVER_STATE).is_file():  # a mistyped name, e.g. step_4 for step_00000004
        return [not_a_checkpoint(resume, Path(resume).parent)]
    problems = verify_checkpoint(resume)
    return [f"checkpoint.resume={resume}: {p}" for p in problems]


def output_problems(cfg: JobConfig) -> list[str]:
    """The run directory and the checkpoint directory must be writable (probed, nothing left behind). Without a
    run_name the run directory is a new one under output_dir, so output_dir is what is probed."""
    run_dir = Path(cfg.logging.output_dir) / (cfg.logging.run_name or "")
    places = [("logging.output_dir", run_dir, "logging.output_dir (or logging.run_name)")]
    if cfg.checkpoint.dir:
        places.append(("checkpoint.dir", Path(cfg.checkpoint.dir), "checkpoint.dir"))
    else:
        places.append(("logging.output_dir", run_dir / "checkpoints", "logging.output_dir, or checkpoint.dir"))
    problems = []
    for key, path, fix in places:
        if (problem := write_problem(path)) and not any(problem in p for p in problems):
            problems.append(f"{key}: the job writes {path}, but {problem}; point {fix} at a writable place")
    return problems
