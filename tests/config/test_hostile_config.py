"""Contract (issue 15 items 10, 14, 15, 16; issue 30 item 13): a config file that YAML or Python would accept with a
silent surprise is refused with one message naming the file and line: a key given twice, bytes that are not UTF-8,
`inf`/`nan` in any float, Adam betas outside [0, 1), aliases that expand past `MAX_ALIAS_NODES` or never end.
Secret fields are marked once in the schema and never written out (`redacted`), not even in an error message about
them."""

import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from miles_vl.config import ConfigError, JobConfig, load_config, redact_overrides
from miles_vl.config.loader import MAX_ALIAS_NODES
from miles_vl.config.schema import REDACTED, redacted, secret_keys

MINIMAL = "model:\n  init: random\n  processor: offline\ndata:\n  synthetic_n: 8\n"


def problems(path: Path, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides or [])
    return info.value.problems


def write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "job.yaml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


def test_a_section_given_twice_is_refused_with_both_lines(tmp_path):
    """Issue 15.14: the second `rollout:` silently replaced the first (batch_size 2 was lost)."""
    path = write(tmp_path, MINIMAL + "rollout:\n  batch_size: 2\nrollout:\n  temperature: 0.5\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"invalid config {path}" in str(info.value)
    (msg,) = info.value.problems
    assert "at line 8" in msg and "key 'rollout' appears twice in one mapping (lines 6 and 8)" in msg


def test_a_nested_key_given_twice_is_refused(tmp_path):
    (msg,) = problems(write(tmp_path, MINIMAL + "train:\n  optimizer:\n    lr: 1.0\n    lr: 2.0\n"))
    assert "key 'lr' appears twice in one mapping (lines 8 and 9)" in msg


def test_yaml_merge_keys_still_override(tmp_path):
    """`<<: *anchor` then a key of the anchor is YAML's way to override, not a duplicate."""
    text = MINIMAL + "rollout: &r\n  temperature: 0.5\n  top_p: 0.9\neval:\n  <<: *r\n  temperature: 0.0\n"
    with pytest.raises(ConfigError) as info:  # the merge happened (eval got top_p), and no duplicate was reported
        load_config(write(tmp_path, text))
    assert [p.split(" (known")[0] for p in info.value.problems] == [
        f"unknown key 'eval.top_p' in {tmp_path / 'job.yaml'}"
    ]


def test_a_file_that_is_not_utf8_names_the_file_and_line(tmp_path):
    """Issue 15.15: a Latin-1 byte gave a UnicodeDecodeError that named no file."""
    path = write(tmp_path, (MINIMAL + "# caf\xe9\n").encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert f"{path}: not UTF-8 text (byte 0xe9 at line 6)" in str(info.value)


def float_keys(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """Every key of the schema whose type holds a float (found by walking the annotations, not from a list)."""
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += float_keys(ann, f"{prefix}{name}.")
        elif ann is float or float in typing.get_args(ann):
            keys.append(f"{prefix}{name}")
    return keys


@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_no_float_takes_inf_or_nan(tmp_path, value):
    """Issue 15.16: inf/nan passed for lr, temperature, grad_clip, kl_coef, clip_high (and failed after Ray started)."""
    keys = float_keys()
    assert {"train.optimizer.lr", "rollout.temperature", "train.optimizer.grad_clip", "algo.kl_coef"} <= set(keys)
    for key in keys:
        found = problems(write(tmp_path, MINIMAL), [f"{key}={value}"])
        assert any(key in p for p in found), (key, found)


@pytest.mark.parametrize("betas", ["[0.9,1.0]", "[-0.1,0.999]", "[0.9,1.5]"])
def test_adam_betas_must_lie_in_0_1(tmp_path, betas):
    (msg,) = problems(write(tmp_path, MINIMAL), [f"train.optimizer.betas={betas}"])
    assert "'train.optimizer.betas': Adam betas must each be in [0, 1)" in msg


def test_betas_at_the_edges_are_fine(tmp_path):
    assert load_config(write(tmp_path, MINIMAL), ["train.optimizer.betas=[0.0,0.999]"]).train.optimizer.betas[0] == 0


def test_secrets_are_marked_once_and_redacted_generically(tmp_path):
    """Issue 15.10: rollout.sglang.api_key was written in plain text. Every field marked secret is redacted by one
    function that walks the schema, so a future secret field needs only the mark."""
    assert secret_keys() == ["rollout.sglang.api_key"]
    cfg = load_config(write(tmp_path, MINIMAL), ["rollout.sglang.api_key=s3cret-value"])
    assert cfg.rollout.sglang.api_key == "s3cret-value"  # the job itself still has it
    out = redacted(cfg)
    assert out["rollout"]["sglang"]["api_key"] == REDACTED
    assert "s3cret-value" not in repr(out)
    assert redacted(load_config(write(tmp_path, MINIMAL)))["rollout"]["sglang"]["api_key"] is None  # unset stays unset


def test_an_error_about_a_secret_does_not_repeat_it(tmp_path):
    (msg,) = problems(write(tmp_path, MINIMAL + "rollout:\n  sglang:\n    api_key: [s3cret, value]\n"))
    assert "'rollout.sglang.api_key'" in msg and "s3cret" not in msg and REDACTED in msg


def nested_aliases(levels: int, width: int, indent: str = "") -> str:
    """`levels` lists, each `width` aliases of the one before (the first `width` strings): a list at level k stands
    for width^(k+1) strings, and all of them add sum_{k=1}^{levels-1} (width^k * (width + 1)) nodes to the file."""
    lines = [f"{indent}a0: &a0 [{', '.join(['lol'] * width)}]"]
    lines += [f"{indent}a{k}: &a{k} [{', '.join([f'*a{k - 1}'] * width)}]" for k in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_ordinary_anchors_still_load(tmp_path):
    """Anchors for a value used twice, a list shared by two reward functions, and a merge key: the aliases add a few
    nodes, far below the bound."""
    text = MINIMAL + (
        "seed: &seed 7\n"
        "rollout: &sampling\n  temperature: 0.7\n  n_samples_per_prompt: &n 4\n"
        "eval:\n  <<: *sampling\n  n_samples_per_prompt: *n\n"
        "reward:\n  name: null\n  functions:\n"
        "    - {name: geo3k, kwargs: {format_pattern: &pattern '.*'}}\n"
        "    - {name: geo3k, label: strict, weight: *seed, kwargs: {format_pattern: *pattern, format_weight: 0.5}}\n"
    )
    cfg = load_config(write(tmp_path, text))
    assert (cfg.eval.temperature, cfg.eval.n_samples_per_prompt, cfg.rollout.n_samples_per_prompt) == (0.7, 4, 4)
    assert [(f.weight, f.kwargs["format_pattern"]) for f in cfg.reward.functions] == [(1.0, ".*"), (7.0, ".*")]


def test_aliases_may_add_up_to_the_bound_and_no_more(tmp_path):
    """The bound counts the nodes aliases add: a 99-item list (100 nodes with the list itself) aliased 100 times adds
    exactly MAX_ALIAS_NODES = 10,000 and loads; the 101st alias is refused, naming its line and the bound."""
    assert MAX_ALIAS_NODES == 100 * 100
    anchor = f"    base: &base [{', '.join(['1'] * 99)}]\n"
    at_bound = MINIMAL + "reward:\n  kwargs:\n" + anchor + f"    copies: [{', '.join(['*base'] * 100)}]\n"
    cfg = load_config(write(tmp_path, at_bound))
    assert len(cfg.reward.kwargs["copies"]) == 100 and cfg.reward.kwargs["copies"][99] == [1] * 99
    (msg,) = problems(write(tmp_path, at_bound + "    more: *base\n"))
    assert msg.startswith(
        "YAML aliases would add more than 10000 nodes (the alias *base at line 10 brings them to 10100"
    )


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    """`&r [*r]` is a list that contains itself: OmegaConf recursed until Python's limit (a RecursionError)."""
    (msg,) = problems(write(tmp_path, MINIMAL + "reward:\n  kwargs:\n    r: &r [1, *r]\n"))
    assert msg.startswith("the alias *r at line 8 is inside its own anchor")


def test_an_alias_bomb_in_an_override_is_refused(tmp_path, monkeypatch):
    """OmegaConf parses each override's value as YAML itself, with its own loader: its bound (OmegaConf 2.4 on) is
    turned off here, as an environment variable can, to show that ours holds regardless. 4 levels of 10 add 11,110."""
    monkeypatch.setenv("OMEGACONF_MAX_YAML_EXPANDED_NODES", "none")
    value = "{" + nested_aliases(4, 10).strip().replace("\n", ", ") + "}"
    (msg,) = problems(write(tmp_path, MINIMAL), [f"reward.kwargs={value}"])
    assert msg.startswith("the command-line override reward.kwargs=...: YAML aliases would add more than 10000 nodes")


def test_interpolations_of_sections_may_add_no_more_than_aliases(tmp_path):
    """The same amplification through OmegaConf's `${...}`: five lines, each nine interpolations of the line before,
    stand for 9^5 = 59,049 values, past the bound; resolving them is refused (six lines took 8 s, each line more nine
    times that). A section interpolated a few times, and interpolated scalars, still resolve."""
    lines = ["    a0: [" + ", ".join(["1"] * 9) + "]"]
    lines += [f"    a{k}: [" + ", ".join([f'"${{reward.kwargs.a{k - 1}}}"'] * 9) + "]" for k in range(1, 5)]
    (msg,) = problems(write(tmp_path, MINIMAL + "reward:\n  kwargs:\n" + "\n".join(lines) + "\n"))
    assert msg.startswith("interpolations (`${...}` of a section, and of those) would add more than 10000 nodes")
    text = MINIMAL + (
        "logging: {output_dir: /tmp/x}\ncheckpoint: {dir: '${logging.output_dir}/ckpt'}\n"
        "reward:\n  kwargs: {base: [1, 2, 3], copies: ['${reward.kwargs.base}', '${reward.kwargs.base}']}\n"
    )
    cfg = load_config(write(tmp_path, text))
    assert cfg.checkpoint.dir == "/tmp/x/ckpt" and cfg.reward.kwargs["copies"] == [[1, 2, 3], [1, 2, 3]]


def test_secret_overrides_are_redacted_in_every_spelling_the_loader_takes(tmp_path):
    """Issue 30.8: a secret given on the command line reached wandb's files through sys.argv. `redact_overrides`
    finds it in every spelling that sets it (the key itself, a mapping that holds it, a value that does not parse) by
    the schema's mark; a value that only names where the secret is (`${oc.env:VAR}`) is no secret and stays."""
    given = [
        "rollout.sglang.api_key=s3cret",
        'rollout.sglang.api_key="s3cret"',
        "rollout.sglang={api_key: s3cret, port: 30001}",
        "rollout={sglang: {api_key: s3cret}}",
        "rollout.sglang.api_key=[s3cret",  # does not parse: the loader reports it
        "rollout.sglang.api_key=${oc.env:X,s3cret}",  # a default is a literal
        "rollout.sglang.api_key =s3cret",
    ]
    kept = ["rollout.sglang.api_key=${oc.env:SGLANG_API_KEY}", "rollout.sglang={port: 30001}", "num_steps=3", "-x"]
    out, keys = redact_overrides([*given, *kept])
    assert keys == ["rollout.sglang.api_key"]
    assert not [o for o in out if "s3cret" in o]
    assert out[len(given) :] == kept
    assert out[:3] == [
        "rollout.sglang.api_key=<redacted>",
        "rollout.sglang.api_key=<redacted>",
        "rollout.sglang=<redacted>",
    ]
    for override in given:  # the loader still takes (or refuses) the real value
        with pytest.raises(ConfigError) as info:
            load_config(write(tmp_path, MINIMAL), [override, "train.cp=3"])
        assert "s3cret" not in str(info.value)
    assert redact_overrides(["rollout.sglang.api_key="]) == (["rollout.sglang.api_key="], [])  # null: nothing given
