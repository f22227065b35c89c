"""The typed job config: every knob, its default, its type and the rules that tie knobs together.

This module is the single home of every default (STYLE §2.3). Code reads typed fields from these models,
never `cfg.get("key", fallback)`. Every model forbids unknown keys; `loader.load_config` turns pydantic's
errors into messages that name the key, the file and a did-you-mean.

Cross-field rules live in `JobConfig._cross_checks` and are reported together with the per-field errors.
Values that are derived (e.g. the data-parallel size) are exposed as properties and printed by
`miles-vl check`, never written back over what the user gave.

Every float must be finite (`inf`/`nan` are refused everywhere). A field made with `secret_field` (e.g.
`rollout.sglang.api_key`) is never written out: `redacted(cfg)` is the config as every file, log, wandb and
`miles-vl check` see it, with each secret that is set replaced by `REDACTED`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

REDACTED = "<redacted>"
# rollout.sglang.prompts_per_request with miles_vl's SGLang plugin: a GRPO rollout batch of up to 16 prompts goes as one
# request; larger rollouts go as several, in flight together, so the first ones decode while the tokenizer works on
# the next.
PLUGIN_PROMPTS_PER_REQUEST = 16


def _one_step_or_a_list(steps: Any) -> Any:
    if isinstance(steps, int) and not isinstance(steps, bool):
        steps = [steps]  # train.profile_steps=3 on the command line: the one step
    if isinstance(steps, list) and any(isinstance(s, bool) for s in steps):
        raise ValueError(f"step numbers, e.g. [3], found {steps}")
    return steps


def _from_step_1(steps: list[int]) -> list[int]:
    if any(s < 1 for s in steps):  # after pydantic made each an int: '0' and -1.0 are checked too
        raise ValueError(f"step numbers (>= 1, as in metrics.jsonl), found {steps}")
    return steps


# steps of a run by number: one number or a list of them, each >= 1 (booleans refused: [true] is not step 1)
StepNumbers = Annotated[list[int], BeforeValidator(_one_step_or_a_list), AfterValidator(_from_step_1)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


# Keys (or sections) a resume may change without `checkpoint.accept_changes`: none changes what a step computes.
RESUME_MAY_CHANGE = (
    "num_steps",
    "logging",
    "checkpoint",
    "eval.interval",
    "ray",
    "train.num_gpus",  # the data-parallel size: a megatron checkpoint reshards it (train.tp/pp/cp/ep: refused)
    "rollout.num_engines",
    "reward.num_workers",
    "reward.async_concurrency",
    "rollout.max_restarts",
    "rollout.sglang.host",
    "rollout.sglang.port",
    "rollout.sglang.api_key",
    "rollout.sglang.startup_timeout_s",
    "rollout.sglang.request_timeout_s",
    "rollout.sglang.sync_timeout_s",
    "rollout.sglang.max_retries",
    # how the weights reach the engines, and how the vision work is split over the CP ranks: neither changes what a
    # step computes beyond the order of a reduction (a checkpoint of the old defaults, tensor and False, resumes)
    "rollout.sglang.colocated_sync",
    "train.vision_dp_when_cp",
    "train.profile_steps",  # which steps run under the profiler: what they compute is the same
)


def secret_field(description: str) -> Any:
    """A `str | None` field whose value is never written out (`redacted`); the schema marks it once, here."""
    return Field(
        None, description=description + " Secret: written out as " + REDACTED + ".", json_schema_extra={"secret": True}
    )


def is_secret(field: Any) -> bool:
    return bool((field.json_schema_extra or {}).get("secret"))


# ---------------------------------------------------------------------------------------------------------------------
# model


class TinyModelConfig(_Section):
    """Architecture of a random-init Qwen3-VL, used when `model.init: random` (tests, CPU demos)."""

    hidden_size: int = Field(64, gt=0)
    intermediate_size: int = Field(128, gt=0)
    num_hidden_layers: int = Field(2, gt=0)
    num_attention_heads: int = Field(4, gt=0)
    num_key_value_heads: int = Field(2, gt=0)
    head_dim: int = Field(16, gt=0)
    vision_depth: int = Field(2, gt=0)
    vision_hidden_size: int = Field(32, gt=0)
    vision_num_heads: int = Field(2, gt=0)
    vision_intermediate_size: int = Field(64, gt=0)
    deepstack_visual_indexes: list[int] = Field(default_factory=lambda: [0])


class ModelConfig(_Section):
    """Which Qwen3-VL to train and how to build its processor."""

    path: str | None = Field(
        None,
        description="HF checkpoint directory, or a hub id (`Qwen/Qwen3-VL-2B-Instruct`): `train` downloads it into "
        "the Hugging Face cache when the hub can be reached, else uses the cached copy (docs/data.md).",
    )
    init: Literal["pretrained", "random"] = "pretrained"
    processor: str | None = Field(
        None, description="Processor directory; defaults to `path`. `offline` uses the built-in offline processor."
    )
    tiny: TinyModelConfig = Field(default_factory=TinyModelConfig)
    dtype: Literal["auto", "bf16", "fp32"] = Field("auto", description="auto: bf16 on GPU, fp32 on CPU.")

    @model_validator(mode="after")
    def _path_or_random(self) -> ModelConfig:
        if self.init == "pretrained" and not self.path:
            raise ValueError("model.init is 'pretrained' but model.path is empty: set model.path or model.init=random")
        if self.init == "random" and self.processor is None and self.path is None:
            raise ValueError("model.init=random needs a processor: set model.processor (e.g. 'offline') or model.path")
        return self


# ---------------------------------------------------------------------------------------------------------------------
# data


class DataConfig(_Section):
    """Datasets and prompt building. Over-long prompts are dropped (never truncated) and counted."""

    train_path: str | None = Field(None, description="parquet or jsonl file; null with `synthetic_n` > 0.")
    eval_path: str | None = None
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="held-out fraction of train when no eval_path.")
    synthetic_n: int = Field(
        0, ge=0, description="generate this many rows of `synthetic_task` instead of reading a file."
    )
    synthetic_task: Literal[
        "geometry", "polygon_colour", "polygon_sides", "background_colour", "motion", "many_images"
    ] = Field(
        "geometry",
        description="what `synthetic_n` generates (data/synth.py, whose TASKS has the same names): `geometry` = "
        "find-x diagrams (angles, sides, circles); `background_colour` = 'What colour is the background? Choices: "
        "A. red, B. green, C. blue, D. black.' (a white polygon on that colour: what configs/vision_tiny_cpu.yaml "
        "learns); `polygon_colour` = 'What colour is the polygon? ...' (the same choices, a coloured polygon on "
        "white); `polygon_sides` = 'How many sides does the polygon have? Choices: 3, 4, 5, 6.'. The three have the "
        "same text for every problem: the answer is in the pixels only. `motion` = a video: 'Which way does the "
        "shape move? Choices: A. left, B. right' over four frames of a moving polygon (`miles-vl data synth --task "
        "motion`). `many_images` = the long-context task: `synthetic_images` numbered 1024x1024 images, 'Which image "
        "has a red background? Answer with its number.' (1024 vision tokens each at max_pixels >= 1048576: 15, 31 "
        "and 62 images make 16K, 32K and 64K-token prompts; docs/long_context.md).",
    )
    synthetic_images: int = Field(
        8, ge=2, description="images per prompt of `synthetic_task: many_images` (other tasks: one image or video)."
    )
    blank_images: bool = Field(
        False,
        description="replace every image and every video frame by a white one of the same size before it is encoded "
        "(rollout and trainer both see the blank): the control run, whose accuracy must stay at chance on a task "
        "whose answer is in the pixels only.",
    )
    in_memory: bool = Field(
        False,
        description="the training rows are given in Python, `run_job(cfg, dataset=[{...}, ...])` (the columns of "
        "`format`); train_path must be null and synthetic_n 0.",
    )
    format: Literal["auto", "geometry3k", "geo3k_imgurl", "verl", "generic"] = Field(
        "auto",
        description="the file's layout (docs/data.md): auto picks geometry3k, geo3k_imgurl or verl by the columns, "
        "else generic.",
    )
    dataset_fn: str | None = Field(None, description="custom row mapper `module:function` (see examples/).")
    prompt_key: str = "problem"
    answer_key: str = "answer"
    image_key: str = "images"
    video_key: str = Field(
        "videos",
        description="column of videos, in every format: one per `<video>` in the prompt, each a list of frames or a "
        "video file path (docs/data.md, Video).",
    )
    system_prompt: str | None = None
    instruction: str | None = Field(
        "Think step by step inside <think></think>, then put the final answer in \\boxed{}.",
        description="appended after the problem text.",
    )
    max_prompt_len: int = Field(2048, gt=0, description="prompts longer than this (in tokens) are dropped.")
    min_pixels: int = Field(256 * 32 * 32, gt=0)
    max_pixels: int = Field(1024 * 32 * 32, gt=0)
    max_image_pixels: int = Field(
        50_000_000,
        gt=0,
        description="source images with more pixels are dropped (counted as image_too_large) before decoding.",
    )
    # 1 GiB: 172 sampled frames of 1080p, 388 of 720p, or all 768 that Qwen3-VL samples at most at 640x360 (531 MB),
    # though the processor then shrinks the frames of a video together to data.video_max_pixels (786,432 pixels, 2.4 MB
    # for Qwen3-VL's own setting); the 800 frames of 1024x1024 (768 sampled: 2.4 GB) are over it. A video is
    # decoded at load time and again when encoded, holding its frames at once (PIL: 4 bytes a pixel, 1.33 GiB here).
    max_video_bytes: int = Field(
        1 << 30,
        gt=0,
        description="videos whose sampled frames take more bytes decoded (frames x width x height x 3, RGB) are "
        "dropped (counted as video_too_large): from the frames' or the container's headers before decoding, and "
        "again frame by frame while decoding (a header can understate). 1 GiB: 172 frames of 1080p.",
    )
    video_fps: float | None = Field(
        None,
        gt=0,
        description="video frames sampled per second of the source (Qwen3-VL's video processor `fps`); null keeps "
        "the checkpoint's (the offline processor's: 2). processor.yaml records the value used.",
    )
    video_min_frames: int | None = Field(
        None, ge=1, description="fewest frames sampled from a video (fewer if it has fewer); null: the checkpoint's."
    )
    video_max_frames: int | None = Field(
        None, ge=1, description="most frames sampled from a video; null: the checkpoint's."
    )
    video_min_pixels: int | None = Field(
        None,
        gt=0,
        description="smallest area of all sampled frames of a video together (t * h * w); null: the checkpoint's.",
    )
    video_max_pixels: int | None = Field(
        None,
        gt=0,
        description="largest area of all sampled frames of a video together (t * h * w); null: the checkpoint's.",
    )
    shuffle: bool = True

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.in_memory and (self.train_path is not None or self.synthetic_n > 0):
            raise ValueError(
                f"data.in_memory=true takes the rows from run_job(dataset=...), but "
                f"data.train_path={self.train_path!r} "
                f"and data.synthetic_n={self.synthetic_n}; set data.train_path=null and data.synthetic_n=0"
            )
        if self.train_path is None and self.synthetic_n == 0 and not self.in_memory:
            raise ValueError(
                "no training data: set data.train_path or data.synthetic_n > 0 (or data.in_memory=true with "
                "run_job(cfg, dataset=...))"
            )
        if self.train_path is not None and self.synthetic_n > 0:
            raise ValueError(
                f"data.train_path={self.train_path!r} and data.synthetic_n={self.synthetic_n} are both set; set "
                "data.synthetic_n=0 to train on the file, or data.train_path=null for generated problems"
            )
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"data.min_pixels ({self.min_pixels}) > data.max_pixels ({self.max_pixels})")
        if None not in (self.video_min_frames, self.video_max_frames) and self.video_min_frames > self.video_max_frames:
            raise ValueError(
                f"data.video_min_frames ({self.video_min_frames}) > data.video_max_frames ({self.video_max_frames})"
            )
        if None not in (self.video_min_pixels, self.video_max_pixels) and self.video_min_pixels > self.video_max_pixels:
            raise ValueError(
                f"data.video_min_pixels ({self.video_min_pixels}) > data.video_max_pixels ({self.video_max_pixels})"
            )
        return self


# ---------------------------------------------------------------------------------------------------------------------
# rollout


class SGLangConfig(_Section):
    host: str = Field("127.0.0.1", description="bind address; anything else requires api_key.")
    port: int | None = Field(
        None,
        gt=0,
        lt=65536,
        description="first port; engine i uses port + i, and a port in use on its node is an error before the server "
        "starts. null = each engine's server takes a free port of the node it runs on, so that jobs sharing a "
        "machine never meet.",
    )
    api_key: str | None = secret_field(
        "bearer token the servers demand; null = each server gets a random key of its own (every server has one, so "
        "that no other local user can call it). Give it as ${oc.env:SGLANG_API_KEY} to keep it off the command line."
    )
    mem_fraction_static: float = Field(0.6, gt=0.0, le=1.0)
    startup_timeout_s: float = Field(600.0, gt=0)
    request_timeout_s: float = Field(600.0, gt=0)
    sync_timeout_s: float | None = Field(
        None,
        gt=0,
        description="deadline of one bucket of the disaggregated NCCL weight sync (its broadcasts and the servers' "
        "answers): a server that refuses the bucket (4xx/5xx), dies or stalls ends the sync with an error naming it "
        "and its message, instead of a trainer waiting in the broadcast. null = 60 s + the bucket's bytes at 50 MiB/s "
        "(70 s for a 512 MiB bucket); forming the group may take 60 s or this, if longer.",
    )
    colocated_sync: Literal["ipc", "tensor"] = Field(
        "ipc",
        description="how a colocated job syncs weights: ipc = each trainer rank that shares a GPU with a server's "
        "TP rank packs each bucket into a persistent buffer on that GPU, and trainer rank 0 hands each TP rank one "
        "CUDA IPC handle of the buffer on its own GPU per bucket (no weight byte through the CPU or Ray's object "
        "store; the 2B shapes on H100s: 4.26 GB in 0.37 s, 11.6 GB/s, where tensor took 7.9 s); tensor = through CPU "
        "copies and Ray's object store, needed when a colocated engine runs on another node than trainer rank 0 (a "
        "CUDA IPC handle opens on its own node only: ipc there is refused once the GPUs are reserved, before any "
        "actor starts).",
    )
    verify_weights_every: int = Field(
        10,
        ge=0,
        description="the colocated ipc sync checks that the values landed (two /weights_checker calls) on its first "
        "sync, on the first after a server relaunch, and every this-many-th; the names are checked on every sync. "
        "0 = only the first and those after a relaunch.",
    )
    max_retries: int = Field(3, ge=0)
    extra_args: list[str] = Field(default_factory=list, description="passed verbatim to the SGLang server.")
    one_request_per_prompt: bool | None = Field(
        None,
        description="send the n samples of a prompt as one request (sampling_params.n): SGLang decodes, processes "
        "and hashes the prompt's images and prefills it once instead of n times. null = on, unless extra_args make "
        "the server deterministic (--enable-deterministic-inference): SGLang gives every sample of a request one "
        "sampling_seed, so the n samples would be identical, and true is refused there.",
    )
    vision_cache_mb: int = Field(
        0,
        ge=0,
        description="SGLang's cache of vision-tower embeddings by image, MiB; 0 = off. It survives weight syncs, so "
        "it needs train.freeze_vision.",
    )
    launcher: Literal["miles_vl", "sglang"] = Field(
        "miles_vl",
        description="miles_vl = SGLang's server with miles_vl's SGLang plugin (miles_vl/sglang_plugin/, "
        "docs/sglang.md): the n samples of a prompt reach SGLang's scheduler without their own copy of the prompt's "
        "pixel values, a request's prompts are prefilled as they are tokenized, pixel values come from the engine; "
        "the server refuses to start on an SGLang release the plugin does not support. sglang = SGLang's own server "
        "without the plugin.",
    )
    prompts_per_request: int | None = Field(
        None,
        ge=1,
        description="prompts (each with its n samples) sent in one request when a prompt's samples go together "
        "(one_request_per_prompt): miles_vl's plugin prefills them as they are tokenized and starts all their "
        f"samples at once. null = resolved to {PLUGIN_PROMPTS_PER_REQUEST} with launcher miles_vl, 1 with sglang, "
        "which prefills a batch's prompts one after another.",
    )
    vision_cuda_graphs: int = Field(
        0,
        ge=0,
        description="image layouts (the patch grids of one vision batch: a request's prompts' images) whose "
        "vision-tower CUDA graphs the server keeps: a layout is captured the second time it is seen and replayed "
        "after that. Pays off only when layouts repeat (images of one size in batches of one size: 40 % less vision "
        "time in docs/benchmarks.md); their memory is not released while the trainer runs. 0 = the vision tower runs "
        "eagerly. Needs launcher miles_vl.",
    )
    send_pixel_values: bool | None = Field(
        None,
        description="send each prompt as the trainer sees it: its ids and its own pixel values (images and videos), "
        "handed to the server through a private shared-memory directory; SGLang then runs neither its image "
        "processor nor its tokenizer on it. Needs launcher miles_vl. null = resolved to true with launcher miles_vl, "
        "false with sglang. false = one pad per image and PNG images, which SGLang decodes and processes again (no "
        "videos).",
    )

    @model_validator(mode="after")
    def _resolve_launcher_defaults(self) -> SGLangConfig:
        # the defaults that follow from the launcher, written into the resolved config (`miles-vl check` shows them)
        plugin = self.launcher == "miles_vl"
        if self.prompts_per_request is None:
            self.prompts_per_request = PLUGIN_PROMPTS_PER_REQUEST if plugin else 1
        if self.send_pixel_values is None:
            self.send_pixel_values = plugin
        return self

    @model_validator(mode="after")
    def _open_needs_key(self) -> SGLangConfig:
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            raise ValueError(f"rollout.sglang.host={self.host!r} opens the server beyond loopback: set an api_key")
        return self


class DynamicSamplingConfig(_Section):
    """DAPO-style: drop groups whose rewards are all equal, over-sample prompts to refill the batch."""

    enabled: bool = False
    max_rounds: int = Field(
        3,
        ge=1,
        description="extra rollout rounds at most before training on what we have: the kept groups in whole "
        "mini-batches (the rest dropped, counted in rollout/short_batch_dropped_groups); fewer than one mini-batch "
        "skips the train phase of the step (train/skipped_steps).",
    )
    over_sampling_factor: float = Field(
        1.0,
        ge=1.0,
        description="each round rolls out ceil(factor * missing prompts) (miles' --over-sampling-batch-size); "
        "groups kept beyond rollout.batch_size are not trained on (rollout/surplus_groups).",
    )


class RolloutConfig(_Section):
    backend: Literal["hf", "sglang"] = "hf"
    batch_size: int = Field(8, gt=0, description="prompts per RL step.")
    n_samples_per_prompt: int = Field(4, gt=0)
    max_response_len: int = Field(512, gt=0)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, description="-1 disables top-k.")
    num_engines: int = Field(1, gt=0)
    gpus_per_engine: int = Field(1, ge=0)
    ban_vision_tokens: bool = Field(True, description="forbid sampling <|image_pad|> and friends.")
    max_restarts: int = Field(2, ge=0, description="restarts of a dead rollout actor per step before failing.")
    max_staleness: int = Field(
        0,
        ge=0,
        description="0 = the synchronous loop. N > 0: the engines generate the batches of the next steps while the "
        "trainer trains (docs/async.md); a batch sampled with the weights after step v is trained at step s only if "
        "s - v <= N. Needs ray.placement=disaggregate and algo.tis.enabled=true (the correction against the "
        "rollout's own logprobs).",
    )
    partial_rollouts: bool = Field(
        False,
        description="with rollout.max_staleness > 0: a weight sync aborts the generations ahead still in flight, "
        "keeps their tokens and logprobs, and continues them under the new weights (docs/async.md); each sample "
        "records the weight version of each token span. Needs rollout.backend=sglang.",
    )
    dynamic_sampling: DynamicSamplingConfig = Field(default_factory=DynamicSamplingConfig)
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)


# ---------------------------------------------------------------------------------------------------------------------
# train


class OptimizerConfig(_Section):
    name: Literal["adamw"] = "adamw"
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(0, ge=0)
    cpu_offload: float = Field(
        0.0,
        ge=0.0,
        le=1.0,
        description="fraction of the Adam state (fp32 main weights, both moments) that megatron keeps and updates on "
        "the CPU; 0 = none (all on the GPU), 1.0 = all (train.backend=megatron only).",
    )

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Adam betas must each be in [0, 1), found {list(betas)}; e.g. [0.9, 0.999]")
        return betas


class TrainConfig(_Section):
    backend: Literal["torch", "megatron"] = "torch"
    num_gpus: int = Field(0, ge=0, description="training world size; 0 = CPU (torch backend only).")
    tp: int = Field(1, gt=0, description="tensor parallel size.")
    pp: int = Field(1, gt=0, description="pipeline parallel size.")
    cp: int = Field(1, gt=0, description="context parallel size.")
    ep: int = Field(1, gt=0, description="expert parallel size (MoE).")
    sp: bool = Field(False, description="sequence parallel (needs tp > 1).")
    micro_batch_max_tokens: int = Field(8192, gt=0, description="token budget of one packed micro-batch per CP group.")
    global_batch_size: int | None = Field(
        None, gt=0, description="samples per optimizer step; null = all samples of the RL step (one update)."
    )
    ppo_epochs: int = Field(1, gt=0)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    freeze_vision: bool = False
    format_warmup_steps: int = Field(
        0,
        ge=0,
        description="supervised steps before the first RL step that teach the answer format only: each target is "
        "`<think></think>\\boxed{a}` with `a` the answer of a random other training row (no information about "
        "the prompt's image), trained by the RL step itself with advantage 1 (plain SFT); then one eval, logged as "
        "step 0. Not repeated on resume.",
    )
    format_warmup_lr: float | None = Field(
        None,
        gt=0,
        description="peak learning rate of the format warm-up steps; null = train.optimizer.lr. RL runs at "
        "train.optimizer.lr after it (same AdamW state).",
    )
    recompute: Literal["none", "selective", "full", "vision", "language"] = Field(
        "none",
        description="activation recompute (megatron): none; selective (megatron's core-attention recompute); full "
        "(every layer, language model and vision tower); vision (full recompute of the vision tower only, the "
        "language model keeps its activations); language (full recompute of the language model only: the vision "
        "tower keeps its activations, those of one micro-batch's images, and skips its layers' second forward).",
    )
    recompute_layers: int | None = Field(
        None,
        ge=1,
        description="with recompute=full or language: recompute only the first this many decoder layers of the "
        "language model (megatron's block method, per pipeline stage); the others keep their activations, which "
        "costs memory and saves their second forward. The vision tower stays as train.recompute says (every layer "
        "with full, none with language). null = every layer. `miles-vl check` estimates the memory of a choice.",
    )
    old_logprobs_from_train_forward: bool = Field(
        False,
        description="when the RL step makes one optimizer update (global_batch_size null or the rollout batch, "
        "ppo_epochs 1), take the old logprobs from the train forward (detached) instead of a separate forward "
        "before it: bit-identical, one forward less; with several updates the separate pass still runs.",
    )
    logits_only_where_loss: bool = Field(
        False,
        description="the train forward's output layer (vocabulary projection) runs on the positions whose label "
        "carries loss only, not on prompt positions: the same loss and gradients, fewer FLOPs and less logit "
        "memory. The micro-batch plan then keeps each micro-batch's loss positions on a rank under what the logits "
        "may hold (2^31 elements at V/TP; 14,134 at Qwen3-VL's vocabulary and TP=1), so micro_batch_max_tokens may "
        "exceed that. Not with sequence parallelism (megatron refuses the combination).",
    )
    pinned_input_copies: bool = Field(
        False,
        description="megatron on CUDA: each micro-batch's inputs and loss inputs go to the GPU through pinned host "
        "memory without waiting for it (non_blocking). A plain copy from pageable memory first waits for every kernel "
        "queued before it (torch synchronizes the stream), about a dozen times a micro-batch; the same values "
        "either way. Measured at the 2B shapes on one H200 (docs/benchmarks.md, 2026-11-27): the pageable copies go "
        "and the host's waits fall (0.20 -> 0.16 s), the train phase does not shorten (6.78 vs 6.73 s).",
    )
    vision_once_per_image: bool = Field(
        False,
        description="run the vision tower once per distinct image (or video) of a micro-batch, not once per sample "
        "(the n samples of a prompt share its images), and read its output at every use: the same embeddings, the "
        "tower's gradient summed over the uses.",
    )
    profile_steps: StepNumbers = Field(
        default_factory=list,
        description="steps (1-based; a list, or one number) whose train phase runs under torch.profiler on every "
        "train rank; the summary "
        "(wall and device-busy seconds, time by kind of kernel: matmul, attention, communication, other; the top "
        "operators) goes to <run dir>/profile/step_N.json, one entry per rank, and a line to the log. A profiled "
        "step's train phase is slower than the others' (the profiler's overhead): compare its parts, not its total; "
        "reading the profiler's events afterwards is timed apart (time/profile_s, seconds per 100K events).",
    )
    vision_dp_when_cp: bool = Field(
        True,
        description="with CP > 1 (megatron), split the vision tower's work (the images) across the CP ranks and "
        "all-gather the embeddings, instead of every CP rank encoding every image. Measured on the 2B shapes with "
        "full recompute and many images: at CP=2 (16K, 32K tokens) 1.47x the tokens/s per GPU at 20-38 % more peak "
        "memory, at CP=4 (16K-64K) 1.75-2.16x at 5-44 % more (docs/long_context.md); turn it off when memory is the "
        "limit. No effect at CP=1.",
    )
    seed: int = 1234


# ---------------------------------------------------------------------------------------------------------------------
# algo


class TISConfig(_Section):
    """Truncated importance sampling against the rollout engine's logprobs."""

    enabled: bool = False
    mode: Literal["clip", "mask"] = "clip"
    cap: float = Field(2.0, gt=0)


class AlgoConfig(_Section):
    estimator: Literal["grpo", "rloo", "reinforce_pp_baseline"] = Field(
        "grpo",
        description="grpo: (r - group mean) / group std; rloo: r_i - mean of the other n-1 rewards of the group "
        "(leave-one-out); reinforce_pp_baseline: r - group mean, whitened over the batch.",
    )
    norm_adv_by_std: bool = Field(
        True,
        description="grpo: divide by the group std. Dr.GRPO as published = false with "
        "loss_reduction=seq_mean_token_sum_norm.",
    )
    policy_loss: Literal["ppo", "gspo"] = Field(
        "ppo",
        description="ppo: token-level ratio and clip; gspo: the sequence-level ratio exp(mean over the response of "
        "logprob - old_logprob) and its clip (GSPO; needs loss_reduction=seq_mean_token_mean).",
    )
    clip_low: float = Field(0.2, gt=0, lt=1)
    clip_high: float = Field(0.28, gt=0)
    dual_clip_c: float | None = Field(None, gt=1, description="dual-clip bound for negative advantages, e.g. 3.0.")
    loss_reduction: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = Field(
        "token_mean",
        description="token_mean: loss summed over tokens / loss tokens of the mini-batch; seq_mean_token_mean: mean "
        "over each response's tokens, then over responses; seq_mean_token_sum_norm: summed over tokens / (samples of "
        "the mini-batch * rollout.max_response_len), Dr.GRPO's constant normaliser.",
    )
    kl_coef: float = Field(0.0, ge=0)
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "low_var_kl"
    entropy_coef: float = Field(0.0, ge=0)
    tis: TISConfig = Field(default_factory=TISConfig)


# ---------------------------------------------------------------------------------------------------------------------
# reward, ray, logging, checkpoint, eval


class RewardFunctionConfig(_Section):
    name: str = Field(description="registry name or `module:function`.")
    weight: float = Field(1.0, description="its factor in the total: reward = sum of weight * the function's overall.")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments bound to this function.")
    label: str | None = Field(
        None, description="its name in the metrics (`reward/<label>/mean`); null = the function's name."
    )

    @property
    def metric_label(self) -> str:
        """`label`, or the last part of `name` (`pkg.mod:Graders.strict` -> `strict`)."""
        return self.label or self.name.rpartition(":")[2].rpartition(".")[2]


class RewardConfig(_Section):
    name: str | None = Field(
        "geo3k",
        description="registry name or `module:function`; the one-function form of `functions`. null with "
        "`functions: []`: the reward is given in Python, `run_job(cfg, reward_fn=...)`.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="keyword arguments bound to the reward function (any reward), e.g. `reward.kwargs.max_len=64`; "
        "for geo3k they win over format_weight/format_pattern.",
    )
    format_weight: float = Field(0.1, ge=0, le=1, description="geo3k: overall = (1-w)*acc + w*format; 0 = binary.")
    format_pattern: str | None = Field(None, description="geo3k: regex the whole response must match; null = default.")
    functions: list[RewardFunctionConfig] = Field(
        default_factory=list,
        description="several weighted rewards, `[{name, weight, kwargs, label}]`: reward = the weighted sum, each "
        "function logged as `reward/<label>/mean`; replaces name/kwargs/format_* (set reward.name=null).",
    )
    timeout_s: float = Field(
        10.0,
        gt=0,
        description="time limit per response (per call for a batched reward); a reward past it is killed with its "
        "worker and scores 0.",
    )
    num_workers: int = Field(
        2, gt=0, description="processes that score responses (one sync call each at a time), per reward function."
    )
    async_concurrency: int = Field(32, gt=0, description="calls of an `async def` reward at once per worker.")

    @field_validator("functions")
    @classmethod
    def _weights_keep_float32_finite(cls, functions: list[RewardFunctionConfig]) -> list[RewardFunctionConfig]:
        if not functions:
            return functions
        # Imported here: the bounds live with the scores they bound, and miles_vl.reward pulls in sympy (math_verify),
        # which a config without weights should not wait for.
        from miles_vl.reward.types import MAX_ABS_REWARD, MAX_ABS_TOTAL_REWARD, total_reward_bound

        weights = [f.weight for f in functions]
        if total_reward_bound(weights) > MAX_ABS_TOTAL_REWARD:
            i = max(range(len(weights)), key=lambda k: abs(weights[k]))
            found, most = sum(abs(w) for w in weights), MAX_ABS_TOTAL_REWARD / MAX_ABS_REWARD
            raise ValueError(
                f"reward.functions.{i}.weight={weights[i]:g}: the weights' magnitudes sum to {found:.7g}, expected at "
                f"most {most:g}: each function scores within +-{MAX_ABS_REWARD:g}, and a total reward beyond "
                f"+-{MAX_ABS_TOTAL_REWARD:g} can overflow the float32 advantages (they square rewards); scale the "
                "weights down"
            )
        return functions

    @model_validator(mode="after")
    def _one_form(self) -> RewardConfig:
        if not self.functions:
            return self
        defaults = {"name": None, "kwargs": {}, "format_weight": 0.1, "format_pattern": None}  # geo3k's own defaults
        given = [k for k, v in defaults.items() if getattr(self, k) != v and k in self.model_fields_set]
        if given:
            raise ValueError(
                f"reward.functions is set together with reward.{', reward.'.join(given)}; use one form: move the "
                "function into reward.functions (options into its kwargs) and set reward.name=null, or drop "
                "reward.functions"
            )
        labels = [f.metric_label for f in self.functions]
        twice = sorted({x for x in labels if labels.count(x) > 1})
        if twice:
            raise ValueError(
                f"reward.functions has two functions labelled {twice}; give them distinct `label`s (the metric names)"
            )
        return self


class RayConfig(_Section):
    address: str | None = Field(
        None,
        description="null = the cluster the RAY_ADDRESS environment variable names (`ray job submit` sets it), else "
        "a private Ray for the job, in a 0700 temp folder of its own (Ray's address file, `ray_current_cluster` in "
        "the world-writable /tmp/ray, is never read); `local` = a private Ray, even with RAY_ADDRESS set; `auto` = "
        "Ray's own discovery (RAY_ADDRESS, else the cluster `ray start` started on this machine), failing if there "
        "is none; else `ray.init(address=...)`.",
    )
    placement: Literal["colocate", "disaggregate"] = "colocate"
    num_cpus: int | None = Field(
        None,
        gt=0,
        description="CPUs for a local Ray; null = all. Must be null when joining a cluster (Ray refuses it).",
    )
    dashboard: bool = Field(False, description="start the dashboard (bound to 127.0.0.1) on a local Ray.")


class WandbConfig(_Section):
    project: str = "miles-vl"
    entity: str | None = None
    mode: Literal["auto", "online", "offline", "disabled"] = Field(
        "auto",
        description="auto: online when wandb has an API key, from WANDB_API_KEY or a `wandb login` (the netrc file "
        "for the wandb host), else offline. A resume continues the run's wandb run (its id is kept in "
        "<run dir>/wandb_run_id); a fresh start begins a new one.",
    )


class LoggingConfig(_Section):
    output_dir: str = "runs"
    run_name: str | None = Field(
        None,
        description="the run directory is output_dir/run_name. null = the config file's stem (`runs/geo3k_tiny_cpu`), "
        "so that the same command resumes it (checkpoint.resume=auto); with checkpoint.resume=never, the stem + "
        "`-<YYYYmmdd-HHMMSS>`, a new directory each start (`-2`, `-3`, ... added when another start took the name).",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        "INFO", description="log level of the `miles-vl` process (the driver); `--log-level` on the command line wins."
    )
    progress: bool = True
    samples_interval: int = Field(
        10,
        ge=0,
        description="every N steps, every sample of the step goes to <run dir>/rollouts/step_N.jsonl (prompt, "
        "response, answer, reward, advantage, length, truncated), a wandb table, and `samples_shown` of them to the "
        "console; every eval writes rollouts/eval_step_N.jsonl the same way. 0 = only at evals.",
    )
    samples_shown: int = Field(2, ge=0, description="how many of those samples the console shows (truncated).")
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    tensorboard: bool = Field(
        False,
        description="also write every step's metrics as TensorBoard scalars to <run dir>/tensorboard "
        "(`tensorboard --logdir runs/<name>/tensorboard`; writing needs no tensorboard package).",
    )


class SaveHFConfig(_Section):
    """Hugging Face model directories written during training, <run dir>/hf/step_N (config.json, safetensors,
    processor and chat template): what transformers' `from_pretrained` and SGLang load. `miles-vl export` writes one
    from any checkpoint afterwards."""

    steps: StepNumbers = Field(
        default_factory=list, description="write one after each of these steps (a list, or one number)."
    )
    interval: int = Field(0, ge=0, description="write one every N steps; 0 = not by interval.")
    final: bool = Field(False, description="write one after the last step.")
    max_shard_bytes: int = Field(
        5_000_000_000, gt=0, description="safetensors above this size are sharded with an index (5 GB)."
    )


class CheckpointConfig(_Section):
    dir: str | None = Field(None, description="null = <run dir>/checkpoints.")
    interval: int = Field(0, ge=0, description="save every N steps; 0 = only at the end.")
    keep_last: int = Field(2, gt=0)
    async_save: bool = Field(
        True,
        description="periodic saves write in the background: the step's state is copied to host memory at once, the "
        "files are written while the next steps run, and the checkpoint appears (renamed into place) only once "
        "complete on every train rank. One save at a time; it is finished before the next weight sync and the next "
        "save; the final save and a stop wait for it. false = the loop waits for every save. Both backends: torch "
        "writes in a thread of the train actor, megatron with megatron-core's async save (a forked writer process "
        "per rank, then a collective finalize).",
    )
    optimizer_state: bool = Field(
        True,
        description="checkpoints hold the optimizer's state (its fp32 main weights and Adam's two moments) beside the "
        "weights, the counters, the LR schedule and the data cursor. false = every checkpoint of the run leaves the "
        "optimizer's state out: about 1/7 of the size with bf16 weights (2 of the 14 bytes a parameter), for a model "
        "whose whole checkpoints the host or the disk cannot hold. A resume from such a checkpoint starts the "
        "optimizer afresh from the loaded weights (Adam's moments zero, the fp32 main weights the checkpoint's "
        "weights), so the steps after it differ from a straight run's; it is refused unless the resuming run also "
        "sets false. A run saved with true may resume with false (its later checkpoints leave the optimizer's state "
        "out).",
    )
    resume: str = Field(
        "auto",
        description="auto (newest in dir), never, or a checkpoint path: of this run only its newest (an older one "
        "would drop the later steps' records; branch from it with a new logging.run_name), or another run's, which "
        "starts a branch in this run directory (one without metrics).",
    )
    save_hf: SaveHFConfig = Field(default_factory=SaveHFConfig)
    accept_changes: list[str] = Field(
        default_factory=list,
        description="dotted keys (or sections) whose change from the checkpoint's recorded config a resume of this "
        "run accepts, e.g. `[train.optimizer.lr]`. A resume whose resolved config differs on any other key is refused "
        "before Ray, listing the changed keys (old -> new): resume it with those keys here, or start a new run "
        "(another logging.run_name). These may change on a resume without being listed: "
        + ", ".join(f"`{k}`" for k in RESUME_MAY_CHANGE)
        + " (how long, what is logged, where and how often it is saved, the cluster, the number of train GPUs and "
        "engines, the servers' limits, how the weights reach the engines and how the vision work is split over the CP "
        "ranks: none changes what a step computes; other train GPUs and the vision split change only the order of a "
        "reduction).",
    )


class EvalConfig(_Section):
    interval: int = Field(0, ge=0, description="evaluate every N steps; 0 = never.")
    max_prompts: int | None = Field(None, gt=0)
    n_samples_per_prompt: int = Field(1, gt=0)
    temperature: float = Field(0.0, ge=0.0)


# ---------------------------------------------------------------------------------------------------------------------
# the job


class JobConfig(_Section):
    num_steps: int = Field(1, gt=0, description="RL steps (rollout -> train -> sync).")
    seed: int = 1234
    model: ModelConfig
    data: DataConfig
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    reward: RewardConfig = Field(default_factory=RewardConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    # Derived values, printed by `miles-vl check`.
    @property
    def model_parallel_size(self) -> int:
        return self.train.tp * self.train.pp * self.train.cp

    @property
    def dp_size(self) -> int:
        if self.train.num_gpus == 0:  # CPU: one process
            return 1
        return max(self.train.num_gpus // self.model_parallel_size, 1)

    @property
    def samples_per_step(self) -> int:
        return self.rollout.batch_size * self.rollout.n_samples_per_prompt

    @property
    def effective_global_batch_size(self) -> int:
        return self.train.global_batch_size or self.samples_per_step

    def derived(self) -> dict[str, int]:
        return {
            "dp_size": self.dp_size,
            "samples_per_step": self.samples_per_step,
            "global_batch_size": self.effective_global_batch_size,
            "optimizer_steps_per_rl_step": self.samples_per_step
            // self.effective_global_batch_size
            * self.train.ppo_epochs,
        }

    @model_validator(mode="after")
    def _cross_checks(self, info: ValidationInfo) -> JobConfig:
        if info.context and info.context.get("skip_cross_checks"):
            return self
        errors = cross_field_errors(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self


def cross_field_errors(cfg: JobConfig) -> list[str]:
    """Every inconsistency between sections, as one message each (key, found, expected, fix)."""
    t, r, a = cfg.train, cfg.rollout, cfg.algo
    errors: list[str] = []
    if t.backend == "torch":
        for key in ("tp", "pp", "cp", "ep"):
            if getattr(t, key) > 1:
                errors.append(
                    f"train.{key}={getattr(t, key)} needs a backend with model parallelism, but train.backend=torch; "
                    "set train.backend=megatron or train." + key + "=1"
                )
        if t.num_gpus > 1:
            errors.append(
                f"train.num_gpus={t.num_gpus} with train.backend=torch: the embedded backend trains on one device; "
                "set train.backend=megatron for several GPUs"
            )
    if t.backend == "torch" and t.optimizer.cpu_offload > 0:
        errors.append(
            f"train.optimizer.cpu_offload={t.optimizer.cpu_offload} offloads megatron's distributed optimizer, but "
            "train.backend=torch; set train.optimizer.cpu_offload=0 or train.backend=megatron"
        )
    if t.backend == "torch" and t.pinned_input_copies:
        errors.append(
            "train.pinned_input_copies=true changes how the megatron backend copies micro-batches to the GPU, but "
            "train.backend=torch; set train.pinned_input_copies=false or train.backend=megatron"
        )
    if t.backend == "megatron" and t.num_gpus == 0:
        errors.append("train.backend=megatron needs GPUs: set train.num_gpus (e.g. 8)")
    if t.backend == "megatron" and cfg.model.init != "pretrained":
        errors.append(
            "train.backend=megatron loads the HF checkpoint at model.path with megatron-bridge's AutoBridge, but "
            "model.init=random; set model.init=pretrained and model.path (a random model needs train.backend=torch)"
        )
    engine_gpus = r.num_engines * r.gpus_per_engine
    if cfg.ray.placement == "colocate" and t.num_gpus > 0 and engine_gpus > t.num_gpus:
        errors.append(
            f"ray.placement=colocate puts the rollout engines on the trainer's GPUs, but rollout.num_engines * "
            f"rollout.gpus_per_engine = {engine_gpus} > train.num_gpus={t.num_gpus}; lower the engine count or set "
            "ray.placement=disaggregate"
        )
    if past := [s for s in t.profile_steps if s > cfg.num_steps]:
        errors.append(
            f"train.profile_steps {past} are past the run's last step (num_steps={cfg.num_steps}): they would never "
            "be profiled; pick steps in 1..num_steps"
        )
    if past := [s for s in cfg.checkpoint.save_hf.steps if s > cfg.num_steps]:
        errors.append(
            f"checkpoint.save_hf.steps {past} are past the run's last step (num_steps={cfg.num_steps}): no Hugging "
            "Face directory would be written for them; pick steps in 1..num_steps (or checkpoint.save_hf.final=true "
            "for the last)"
        )
    if t.sp and t.tp == 1:
        errors.append("train.sp=true needs train.tp > 1; set train.tp or train.sp=false")
    if t.recompute_layers is not None and t.recompute not in ("full", "language"):
        errors.append(
            f"train.recompute_layers={t.recompute_layers} needs train.recompute=full or language (found "
            f"{t.recompute!r}): it says how many language-model layers full recompute covers; set train.recompute=full "
            "(or language) or train.recompute_layers=null"
        )
    if t.sp and t.logits_only_where_loss:  # the output layer's input is one TP rank's part of the row
        errors.append("train.logits_only_where_loss=true is not supported with train.sp=true; set one of them to false")
    if t.num_gpus > 0 and t.num_gpus % cfg.model_parallel_size:
        errors.append(
            f"train.num_gpus={t.num_gpus} is not divisible by train.tp * train.pp * train.cp = "
            f"{t.tp} * {t.pp} * {t.cp} = {cfg.model_parallel_size}; change the GPU count or the parallel sizes"
        )
    elif cfg.effective_global_batch_size % cfg.dp_size:
        errors.append(
            f"train.global_batch_size={cfg.effective_global_batch_size} is not divisible by the data-parallel size "
            f"{cfg.dp_size} (train.num_gpus / (train.tp * train.pp * train.cp)); pick a multiple of {cfg.dp_size}"
        )
    if cfg.samples_per_step % cfg.effective_global_batch_size:
        errors.append(
            f"rollout.batch_size * rollout.n_samples_per_prompt = {cfg.samples_per_step} samples per step is not "
            f"divisible by train.global_batch_size={t.global_batch_size}; pick a divisor"
        )
    if a.estimator in ("grpo", "rloo") and r.n_samples_per_prompt < 2:
        errors.append(
            f"algo.estimator={a.estimator} compares responses within a group, but rollout.n_samples_per_prompt=1 makes "
            "every advantage zero; set rollout.n_samples_per_prompt >= 2"
        )
    if a.policy_loss == "gspo" and a.loss_reduction != "seq_mean_token_mean":
        errors.append(
            f"algo.policy_loss=gspo averages each response's sequence-level loss over responses (the GSPO objective), "
            f"but algo.loss_reduction={a.loss_reduction}; set algo.loss_reduction=seq_mean_token_mean"
        )
    longest = cfg.data.max_prompt_len + r.max_response_len
    unit = 2 * t.cp  # a sample takes ceil(L / 2cp) * 2cp tokens of its packed row (packing/thd.py, padded_length)
    padded = -(-longest // unit) * unit
    if padded > t.micro_batch_max_tokens:
        errors.append(
            f"train.micro_batch_max_tokens={t.micro_batch_max_tokens} cannot hold one sample of data.max_prompt_len "
            f"({cfg.data.max_prompt_len}) + rollout.max_response_len ({r.max_response_len}) = {longest} tokens, "
            f"padded to {padded} (a multiple of 2 * train.cp = {unit}) in its packed row; raise the budget to "
            f">= {padded}"
        )
    if r.sglang.vision_cache_mb > 0 and not t.freeze_vision:
        errors.append(
            f"rollout.sglang.vision_cache_mb={r.sglang.vision_cache_mb} keeps vision embeddings across weight syncs, "
            "which is only right when the vision tower does not train; set train.freeze_vision=true or "
            "rollout.sglang.vision_cache_mb=0"
        )
    if r.sglang.send_pixel_values and r.sglang.launcher != "miles_vl":
        errors.append(
            "rollout.sglang.send_pixel_values=true needs miles_vl's SGLang plugin, which reads the pixel values, but "
            "rollout.sglang.launcher=sglang starts SGLang's own server; set launcher=miles_vl or "
            "send_pixel_values=false (or null)"
        )
    if r.sglang.vision_cuda_graphs and r.sglang.launcher != "miles_vl":
        errors.append(
            f"rollout.sglang.vision_cuda_graphs={r.sglang.vision_cuda_graphs} needs miles_vl's SGLang plugin, which "
            "makes the vision tower's graphs, but rollout.sglang.launcher=sglang starts SGLang's own server; set "
            "launcher=miles_vl or vision_cuda_graphs=0"
        )
    if r.backend == "sglang" and cfg.data.synthetic_task == "motion" and not r.sglang.send_pixel_values:
        errors.append(
            "data.synthetic_task=motion makes video prompts, which rollout.backend=sglang sends only as pixel values "
            "(SGLang 0.5.16 re-samples and re-times videos it processes itself: docs/sglang.md, section 4); set "
            "rollout.sglang.send_pixel_values to null or true (with launcher=miles_vl), or rollout.backend=hf"
        )
    if r.backend == "sglang" and r.gpus_per_engine == 0:
        errors.append(
            "rollout.backend=sglang needs rollout.gpus_per_engine >= 1 (an SGLang server runs on GPUs); set it, or "
            "rollout.backend=hf"
        )
    if r.max_staleness > 0 and cfg.ray.placement != "disaggregate":
        errors.append(
            f"rollout.max_staleness={r.max_staleness} generates the next steps' batches while the trainer trains, on "
            f"engines of their own, but ray.placement={cfg.ray.placement} shares the devices between them; set "
            "ray.placement=disaggregate or rollout.max_staleness=0"
        )
    if r.partial_rollouts and r.max_staleness == 0:
        errors.append(
            "rollout.partial_rollouts=true continues the generations ahead of training across a weight sync, but "
            "rollout.max_staleness=0 generates none ahead (the synchronous loop); set rollout.max_staleness >= 1 "
            "(with ray.placement=disaggregate) or rollout.partial_rollouts=false"
        )
    if r.partial_rollouts and r.backend != "sglang":
        errors.append(
            "rollout.partial_rollouts=true aborts requests in flight on an SGLang server (/abort_request), but "
            f"rollout.backend={r.backend} has no such call; set rollout.backend=sglang or "
            "rollout.partial_rollouts=false"
        )
    if r.max_staleness > 0 and not a.tis.enabled:
        errors.append(
            f"rollout.max_staleness={r.max_staleness} trains on batches sampled with older weights, which the loss "
            "corrects by importance sampling against the rollout's own logprobs, but algo.tis.enabled=false; set "
            "algo.tis.enabled=true or rollout.max_staleness=0"
        )
    if a.tis.enabled and r.temperature == 0:
        errors.append(
            "algo.tis.enabled reweights tokens by the rollout's sampling distribution, but rollout.temperature=0 "
            "(greedy) samples from none; set rollout.temperature > 0 or algo.tis.enabled=false"
        )
    return errors


# ---------------------------------------------------------------------------------------------------------------------
# secrets


def secret_keys(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """Dotted keys of every secret field (`secret_field`) under `model`."""
    keys = []
    for name, field in model.model_fields.items():
        sub = (
            field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else None
        )
        if sub is not None:
            keys += secret_keys(sub, f"{prefix}{name}.")
        elif is_secret(field):
            keys.append(f"{prefix}{name}")
    return keys


def redacted(cfg: BaseModel) -> dict[str, Any]:
    """`cfg.model_dump(mode="json")` with every secret that is set replaced by `REDACTED` (None stays None, so
    that the dump still says whether a secret was given)."""
    data = cfg.model_dump(mode="json")
    for key in secret_keys(type(cfg)):
        *parents, leaf = key.split(".")
        node = data
        for part in parents:
            node = node[part]
        if node.get(leaf) is not None:
            node[leaf] = REDACTED
    return data
