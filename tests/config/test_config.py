"""Contract: a YAML job config + `key=value` overrides validate into `JobConfig`, or fail with one
`ConfigError` whose lines name the key, where it came from, and the fix (DESIGN §6)."""

import re
from pathlib import Path

import pytest

from miles_vl.config import ConfigError, JobConfig, load_config

REPO = Path(__file__).resolve().parents[2]

MINIMAL = """\
model:
  init: random
  processor: offline
data:
  synthetic_n: 8
"""


def write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def problems(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    return info.value.problems


def test_minimal_config_gets_schema_defaults(tmp_path):
    cfg = load_config(write(tmp_path, MINIMAL))
    assert isinstance(cfg, JobConfig)
    assert cfg.train.backend == "torch" and cfg.train.cp == 1
    assert cfg.reward.format_weight == 0.1
    assert cfg.samples_per_step == cfg.rollout.batch_size * cfg.rollout.n_samples_per_prompt


def test_overrides_merge_with_yaml_types(tmp_path):
    cfg = load_config(
        write(tmp_path, MINIMAL),
        [
            "rollout.n_samples_per_prompt=8",
            "train.optimizer.lr=3e-6",
            "data.system_prompt=null",
            "algo.tis.enabled=true",
        ],
    )
    assert cfg.rollout.n_samples_per_prompt == 8
    assert cfg.train.optimizer.lr == pytest.approx(3e-6)
    assert cfg.data.system_prompt is None
    assert cfg.algo.tis.enabled is True


def test_interpolation_resolves(tmp_path):
    cfg = load_config(
        write(tmp_path, MINIMAL + "logging:\n  output_dir: /tmp/x\ncheckpoint:\n  dir: ${logging.output_dir}/ckpt\n")
    )
    assert cfg.checkpoint.dir == "/tmp/x/ckpt"


def test_unknown_key_in_file_names_file_and_suggests(tmp_path):
    path = write(tmp_path, MINIMAL + "rollout:\n  n_sample_per_prompt: 4\n")
    (msg,) = problems(path)
    assert "unknown key 'rollout.n_sample_per_prompt'" in msg
    assert str(path) in msg
    assert "did you mean 'rollout.n_samples_per_prompt'?" in msg


def test_unknown_key_from_override_names_the_override(tmp_path):
    (msg,) = problems(write(tmp_path, MINIMAL), ["train.optimzer.lr=1e-5"])
    assert "unknown key 'train.optimzer'" in msg
    assert "command-line override train.optimzer.lr" in msg
    assert "did you mean 'train.optimizer'?" in msg


def test_a_rule_over_several_keys_says_which_of_them_the_command_line_set(tmp_path):
    """A fix in the file would not win over an override: the message names the overrides among the rule's keys."""
    path = write(tmp_path, MINIMAL)
    (msg,) = problems(path, ["num_steps=4", "train.profile_steps=[5]"])
    assert msg.endswith(f"(num_steps, train.profile_steps from the command line; the others in {path})"), msg
    (msg,) = problems(path, ["train.profile_steps=[500]"])  # num_steps is the file's
    assert msg.endswith(f"(train.profile_steps from the command line; the others in {path})"), msg
    path = write(tmp_path, MINIMAL + "train:\n  profile_steps: [500]\n")
    (msg,) = problems(path, ["seed=3"])  # an override the rule does not name
    assert msg.endswith(f"pick steps in 1..num_steps in {path}"), msg


def test_unknown_top_level_section(tmp_path):
    (msg,) = problems(write(tmp_path, MINIMAL + "rolout:\n  batch_size: 2\n"))
    assert "unknown key 'rolout'" in msg and "did you mean 'rollout'?" in msg


def test_wrong_type_names_key_and_value(tmp_path):
    (msg,) = problems(write(tmp_path, MINIMAL), ["rollout.batch_size=many"])
    assert "'rollout.batch_size'" in msg and "'many'" in msg and "integer" in msg


def test_every_problem_is_reported_at_once(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["rollout.batch_size=-1", "train.tp=zero", "algo.clip_lo=0.1"])
    assert len(found) == 3, found


def test_cp_needs_a_backend_with_cp(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["train.cp=2"])
    assert any(
        "train.cp=2 needs a backend with model parallelism" in p and "train.backend=megatron" in p for p in found
    )


def test_removed_train_packing_names_the_fix(tmp_path):
    """Issue 16: `train.packing` was in the schema but nothing read it (training always packs THD rows); it is gone,
    and an old config that still sets it is told so, by name, with the fix, from the file or the command line."""
    old = MINIMAL + "train:\n  packing: thd\n"
    found = problems(write(tmp_path, old), [])
    assert len(found) == 1, found
    assert "train.packing was removed" in found[0] and "delete it from the config" in found[0], found
    assert "job.yaml" in found[0], found
    found = problems(write(tmp_path, MINIMAL), ["train.packing=padded"])
    assert "train.packing was removed" in found[0] and "command-line override train.packing" in found[0], found


def test_share_copy_pixels_names_its_successor_and_the_launchers_defaults_are_resolved(tmp_path):
    """Issue 31: `rollout.sglang.share_copy_pixels` became `rollout.sglang.launcher` (SGLang's server takes miles_vl's
    patches as a plugin); an old config that sets it is told the new key and both values. The defaults that follow
    from the launcher are written into the resolved config (`miles-vl check` shows them): prompts_per_request 16 and
    send_pixel_values true with the plugin, 1 and false without; a value the user gave is kept."""
    for value, new in (("true", "launcher: miles_vl"), ("false", "launcher: sglang")):
        found = problems(write(tmp_path, MINIMAL), [f"rollout.sglang.share_copy_pixels={value}"])
        assert len(found) == 1 and "replaced by rollout.sglang.launcher" in found[0] and new in found[0], found
    plugin = load_config(write(tmp_path, MINIMAL)).rollout.sglang
    assert (plugin.launcher, plugin.prompts_per_request, plugin.send_pixel_values) == ("miles_vl", 16, True)
    stock = load_config(write(tmp_path, MINIMAL), ["rollout.sglang.launcher=sglang"]).rollout.sglang
    assert (stock.prompts_per_request, stock.send_pixel_values) == (1, False)
    given = load_config(write(tmp_path, MINIMAL), ["rollout.sglang.prompts_per_request=4"]).rollout.sglang
    assert given.prompts_per_request == 4


def test_gpus_not_divisible_by_model_parallel(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["train.backend=megatron", "train.num_gpus=6", "train.tp=4"])
    (msg,) = [p for p in found if "train.num_gpus=6 is not divisible" in p]
    assert "by train.tp * train.pp * train.cp = 4 * 1 * 1 = 4;" in msg, msg
    assert "(train.num_gpus, train.tp from the command line; the others in" in msg, msg  # full key names: attributed


def test_global_batch_not_divisible_by_dp(tmp_path):
    # 8 GPUs / (tp 2 * cp 1) = dp 4; global batch 6 is not a multiple of 4.
    found = problems(
        write(tmp_path, MINIMAL),
        [
            "train.backend=megatron",
            "train.num_gpus=8",
            "train.tp=2",
            "rollout.batch_size=3",
            "rollout.n_samples_per_prompt=2",
            "train.global_batch_size=6",
        ],
    )
    assert any("not divisible by the data-parallel size 4" in p for p in found), found


def test_step_samples_not_divisible_by_global_batch(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["train.global_batch_size=5"])
    assert any("32 samples per step is not divisible by train.global_batch_size=5" in p for p in found), found


def test_sp_needs_tp(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["train.backend=megatron", "train.num_gpus=1", "train.sp=true"])
    assert any("train.sp=true needs train.tp > 1" in p for p in found), found


def test_recompute_layers_needs_full_recompute_and_a_positive_count(tmp_path):
    megatron = ["train.backend=megatron", "train.num_gpus=1"]
    for mode in ("none", "selective", "vision"):
        found = problems(write(tmp_path, MINIMAL), [*megatron, f"train.recompute={mode}", "train.recompute_layers=4"])
        want = f"train.recompute_layers=4 needs train.recompute=full or language (found '{mode}')"
        assert any(want in p for p in found), found
    for mode in ("full", "language"):
        fine = problems(write(tmp_path, MINIMAL), [*megatron, f"train.recompute={mode}", "train.recompute_layers=4"])
        assert not [p for p in fine if "needs train.recompute=full" in p], (mode, fine)
    found = problems(write(tmp_path, MINIMAL), [*megatron, "train.recompute=full", "train.recompute_layers=0"])
    assert any("recompute_layers" in p and "greater than or equal to 1" in p for p in found), found


def test_logits_only_where_loss_refuses_sequence_parallel(tmp_path):
    overrides = ["train.backend=megatron", "train.num_gpus=2", "train.tp=2", "train.sp=true"]
    found = problems(write(tmp_path, MINIMAL), [*overrides, "train.logits_only_where_loss=true"])
    refusal = "train.logits_only_where_loss=true is not supported with train.sp=true"
    assert any(refusal in p for p in found), found
    assert not any(refusal in p for p in problems(write(tmp_path, MINIMAL), overrides))


def test_grpo_needs_groups(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["rollout.n_samples_per_prompt=1"])
    assert any("n_samples_per_prompt >= 2" in p for p in found), found


def test_sglang_open_host_needs_api_key(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["rollout.sglang.host=0.0.0.0"])
    assert any("set an api_key" in p for p in found), found


def test_micro_batch_budget_must_hold_one_sample(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["train.micro_batch_max_tokens=100"])
    assert any("cannot hold one sample" in p for p in found), found


def test_micro_batch_budget_counts_the_cp_padding(tmp_path):
    """Issue 32.3: a budget equal to max_prompt_len + max_response_len is refused when a sample of that length pads
    past it (to a multiple of 2 * cp), as plan_micro_batches would refuse it only after the first rollout."""
    base = ["data.max_prompt_len=65404", "rollout.max_response_len=128", "train.micro_batch_max_tokens=65532"]
    load_config(write(tmp_path, MINIMAL), base)  # cp 1: the sample pads to 65532, which fits
    megatron = ["train.backend=megatron", "train.num_gpus=4", "train.cp=4", "model.init=pretrained", "model.path=x"]
    found = [p for p in problems(write(tmp_path, MINIMAL), [*base, *megatron]) if "cannot hold" in p]
    assert found and "= 65532 tokens, padded to 65536 (a multiple of 2 * train.cp = 8)" in found[0], found
    assert "raise the budget to >= 65536" in found[0]


def test_missing_file_suggests_neighbour(tmp_path):
    write(tmp_path, MINIMAL, "geo3k_tiny.yaml")
    (msg,) = problems(tmp_path / "geo3k_tinny.yaml")
    assert "config file not found" in msg and "geo3k_tiny.yaml" in msg


def test_malformed_yaml_gives_line(tmp_path):
    (msg,) = problems(write(tmp_path, "model:\n  init: random\n data: [\n"))
    assert "malformed YAML at line" in msg


def test_top_level_must_be_mapping(tmp_path):
    (msg,) = problems(write(tmp_path, "- a\n- b\n"))
    assert "top level must be a mapping" in msg and "list" in msg


def test_malformed_override(tmp_path):
    (msg,) = problems(write(tmp_path, MINIMAL), ["rollout.batch_size"])
    assert "malformed override 'rollout.batch_size'" in msg


def test_missing_required_section(tmp_path):
    found = problems(write(tmp_path, "model:\n  init: random\n  processor: offline\n"))
    assert any("missing required key 'data'" in p for p in found), found


def test_pretrained_without_path(tmp_path):
    found = problems(write(tmp_path, "model: {}\ndata:\n  synthetic_n: 4\n"))
    assert any("model.path is empty" in p for p in found), found


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    load_config(path)


def has_run_line(text: str) -> str:
    """The header comment's `# Has run:` entry, its continuation lines (`#   ...`) joined, or ""."""
    header = []
    for line in text.splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    for i, line in enumerate(header):
        if line.startswith("# Has run:"):
            entry = [line.removeprefix("# Has run:")]
            for rest in header[i + 1 :]:
                if not rest.startswith("#   "):
                    break
                entry.append(rest.removeprefix("#"))
            return " ".join(part.strip() for part in entry)
    return ""


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_says_whether_it_has_run(path):
    """Issue 35.4: every shipped config's header says whether it has run, where and when, so that an untried layout
    is not taken for a tested one: a `# Has run:` entry that says "not run" or names the record of the run (a GPU
    run's folder under docs/gpu-runs/, the test or document that runs it), every path it names existing; a GPU job's
    entry that does not say "not run" names a docs/gpu-runs/ folder and a date."""
    entry = has_run_line(path.read_text())
    assert entry, f"{path.name}: no '# Has run:' line in its header comment"
    named = re.findall(r"(?:docs/gpu-runs/[\w.-]*[\w-]|tests/[\w/]+\.py|README\.md|configs/[\w.]+\.yaml)", entry)
    missing = [name for name in named if not (REPO / name).exists()]
    assert not missing, f"{path.name}: '# Has run:' names {missing}, which do not exist"
    cfg = load_config(path)
    on_gpus = cfg.train.backend == "megatron" or cfg.rollout.backend == "sglang"
    if "not run" not in entry:
        assert named, f"{path.name}: '# Has run: {entry}' names no record of the run"
        if on_gpus:
            assert any(n.startswith("docs/gpu-runs/") for n in named) and re.search(r"20\d\d-\d\d-\d\d", entry), entry


def test_several_cross_field_problems_are_separate_lines(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["train.cp=2", "train.tp=2", "rollout.n_samples_per_prompt=1"])
    assert sum("needs a backend with model parallelism" in p for p in found) == 2
    assert any("n_samples_per_prompt >= 2" in p for p in found)
    assert all("\n" not in p for p in found)


def test_field_and_cross_field_problems_reported_together(tmp_path):
    found = problems(write(tmp_path, MINIMAL), ["rollout.temprature=0.5", "train.cp=2"])
    assert any("did you mean 'rollout.temperature'" in p for p in found)
    assert any("train.cp=2 needs a backend" in p for p in found)


def test_config_reference_doc_is_up_to_date():
    from miles_vl.config.reference import render

    doc = (REPO / "docs" / "configs.md").read_text()
    assert doc == render(), "docs/configs.md is stale: run `python -m miles_vl.config.reference > docs/configs.md`"


DOC = (REPO / "docs" / "configs.md").read_text()


@pytest.mark.parametrize(
    "overrides, error, documented",
    [
        (
            ["rollout.sglang.vision_cache_mb=64"],
            "rollout.sglang.vision_cache_mb=64 keeps vision embeddings across weight syncs",
            "`rollout.sglang.vision_cache_mb > 0` needs `train.freeze_vision: true`",
        ),
        (
            ["rollout.backend=sglang", "rollout.gpus_per_engine=0"],
            "rollout.backend=sglang needs rollout.gpus_per_engine >= 1",
            "`rollout.backend: sglang` needs `rollout.gpus_per_engine >= 1`",
        ),
        (
            ["algo.tis.enabled=true", "rollout.temperature=0"],
            "algo.tis.enabled reweights tokens by the rollout's sampling distribution, but rollout.temperature=0",
            "`algo.tis.enabled` refuses greedy rollouts (`rollout.temperature: 0`)",
        ),
        (  # greedy has no sampling distribution whatever the engine (the rule used to hold for hf only)
            ["algo.tis.enabled=true", "rollout.temperature=0", "rollout.backend=sglang"],
            "but rollout.temperature=0 (greedy) samples from none",
            "`algo.tis.enabled` refuses greedy rollouts",
        ),
        (  # issue 34: bounded staleness needs engines of their own and the importance-sampling correction
            ["rollout.max_staleness=1"],
            "rollout.max_staleness=1 generates the next steps' batches while the trainer trains, on engines of their "
            "own, but ray.placement=colocate",
            "`rollout.max_staleness > 0` needs `ray.placement: disaggregate` and `algo.tis.enabled: true`",
        ),
        (
            ["rollout.max_staleness=2", "ray.placement=disaggregate"],
            "rollout.max_staleness=2 trains on batches sampled with older weights, which the loss corrects by "
            "importance sampling against the rollout's own logprobs, but algo.tis.enabled=false",
            "`rollout.max_staleness > 0` needs `ray.placement: disaggregate` and `algo.tis.enabled: true`",
        ),
        (  # issue 34 item 2: partial rollouts continue generations ahead, on SGLang servers (/abort_request)
            ["rollout.partial_rollouts=true", "rollout.backend=sglang"],
            "rollout.partial_rollouts=true continues the generations ahead of training across a weight sync, but "
            "rollout.max_staleness=0 generates none ahead",
            "`rollout.partial_rollouts: true` needs `rollout.max_staleness > 0` and `rollout.backend: sglang`",
        ),
        (
            [
                "rollout.partial_rollouts=true",
                "rollout.max_staleness=1",
                "ray.placement=disaggregate",
                "algo.tis.enabled=true",
            ],  # fmt: skip
            "rollout.partial_rollouts=true aborts requests in flight on an SGLang server (/abort_request), but "
            "rollout.backend=hf has no such call; set rollout.backend=sglang or rollout.partial_rollouts=false",
            "`rollout.partial_rollouts: true` needs `rollout.max_staleness > 0` and `rollout.backend: sglang`",
        ),
        (
            ["rollout.sglang.send_pixel_values=true", "rollout.sglang.launcher=sglang"],
            "rollout.sglang.send_pixel_values=true needs miles_vl's SGLang plugin",
            "`rollout.sglang.send_pixel_values: true` needs `rollout.sglang.launcher: miles_vl`",
        ),
        (
            ["rollout.sglang.vision_cuda_graphs=2", "rollout.sglang.launcher=sglang"],
            "rollout.sglang.vision_cuda_graphs=2 needs miles_vl's SGLang plugin",
            "`rollout.sglang.vision_cuda_graphs > 0` needs `rollout.sglang.launcher: miles_vl`",
        ),
        (
            ["rollout.backend=sglang", "data.synthetic_task=motion", "rollout.sglang.send_pixel_values=false"],
            "data.synthetic_task=motion makes video prompts, which rollout.backend=sglang sends only as pixel values",
            "video prompts (`data.synthetic_task: motion`) through `rollout.backend: sglang` need pixel values",
        ),
        (
            ["train.optimizer.cpu_offload=1.0"],
            "train.optimizer.cpu_offload=1.0 offloads megatron's distributed optimizer, but train.backend=torch",
            "`train.optimizer.cpu_offload > 0` needs `train.backend: megatron`",
        ),
        (
            ["train.pinned_input_copies=true"],
            "train.pinned_input_copies=true changes how the megatron backend copies micro-batches to the GPU, but "
            "train.backend=torch",
            "`train.pinned_input_copies: true` needs `train.backend: megatron`",
        ),
        (
            ["train.profile_steps=[2,9]", "num_steps=4"],
            "train.profile_steps [9] are past the run's last step (num_steps=4)",
            "`train.profile_steps` lie in `1..num_steps`",
        ),
        (
            ["checkpoint.save_hf.steps=[4,5]", "num_steps=4"],
            "checkpoint.save_hf.steps [5] are past the run's last step (num_steps=4)",
            "`checkpoint.save_hf.steps` lie in `1..num_steps`",
        ),
        (
            ["data.train_path=rows.parquet"],
            "data.train_path='rows.parquet' and data.synthetic_n=8 are both set",
            "`data.train_path` or `data.synthetic_n > 0`, not both",
        ),
    ],
)
def test_cross_field_rules_are_enforced_and_documented(tmp_path, overrides, error, documented):
    """Issue 16: docs/configs.md lacked rules the validator enforces; each is refused with its fix and listed."""
    found = problems(write(tmp_path, MINIMAL), overrides)
    assert any(error in p for p in found), found
    assert documented in DOC


@pytest.mark.parametrize("key", ["train.profile_steps", "checkpoint.save_hf.steps"])
def test_step_numbers_are_one_number_or_a_list_of_them_and_no_booleans(tmp_path, key):
    """A new user wrote train.profile_steps=2 ('Input should be a valid list') and [true] (taken as step 1); the
    steps of a Hugging Face export are read the same way."""
    path = write(tmp_path, MINIMAL)
    section, field = key.rsplit(".", 1)

    def steps(override: str) -> list[int]:
        node = load_config(path, ["num_steps=4", override])
        for part in section.split("."):
            node = getattr(node, part)
        return getattr(node, field)

    assert steps(f"{key}=2") == [2]
    assert steps(f"{key}=[1,3]") == [1, 3]
    for bad, says in [
        ("[true]", "step numbers, e.g. [3], found [True]"),
        ("[0]", "(>= 1, as in metrics.jsonl)"),
        ("[-1.0]", "(>= 1, as in metrics.jsonl)"),  # converted to an int first: still checked
        ("['0']", "(>= 1, as in metrics.jsonl)"),
    ]:
        (msg,) = problems(path, [f"{key}={bad}"])
        assert key in msg and says in msg, msg


def test_run_name_default_is_the_config_stem_and_timestamped_only_for_fresh_starts(tmp_path):
    """What docs/configs.md says of `logging.run_name` is what the driver does."""
    from miles_vl.orchestration.loop import choose_run_dir

    path = write(tmp_path, MINIMAL, "my_job.yaml")
    out = f"logging.output_dir={tmp_path / 'runs'}"
    assert choose_run_dir(load_config(path, [out]), str(path)) == tmp_path / "runs" / "my_job"
    fresh = choose_run_dir(load_config(path, [out, "checkpoint.resume=never"]), str(path))
    assert fresh.parent == tmp_path / "runs" and fresh.name.startswith("my_job-20") and len(fresh.name) == 22
    named = choose_run_dir(load_config(path, [out, "checkpoint.resume=never", "logging.run_name=x"]), str(path))
    assert named == tmp_path / "runs" / "x"
    assert "null = the config file's stem" in DOC and "with checkpoint.resume=never, the stem +" in DOC
