"""Contract: a colocated weight sync is verified as far as SGLang 0.5.16 allows for Qwen3-VL (verify.py).

- names: a tensor not named as in the checkpoint the server loaded is refused before anything of its bucket is sent,
  in whichever bucket it is (0.5.16's `load_weights` would skip it without an error, as the stand-ins now do: they
  log and report it);
- values: a probe tensor sent with new values whose server copy did not change (here: a server told to ignore what it
  is sent) fails the sync by name, and generate refuses until a sync lands; probes are the small tensors of the first
  and last buckets and one of the vision tower, and only tensors that load 1:1 into a parameter the server reports;
- what cannot be checked is not guessed: no value check on the first sync or after a restart (the server's copy is
  unknown), nor for unchanged values; a server that cannot answer `/weights_checker` turns the value check off.
Expected names and hashes come from the stand-in's `/weights_checker` and the test's own literals.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from miles_vl.rollout.sglang import (
    EngineStateError,
    SGLangRolloutEngine,
    WeightSyncError,
    checkpoint_names,
)
from miles_vl.rollout.sglang.verify import server_name
from miles_vl.rollout.types import SamplingParams
from tests.rollout.sglang.conftest import make_engine, make_prompt, quick_client
from tests.rollout.sglang.fake_server import value_hash

LM, VIS = "model.language_model.", "model.visual."
NAMES = [  # a Qwen3-VL checkpoint in miniature, in export order
    LM + "embed_tokens.weight",
    LM + "layers.0.input_layernorm.weight",
    LM + "layers.0.self_attn.q_proj.weight",
    LM + "layers.0.self_attn.k_proj.weight",
    LM + "layers.0.self_attn.v_proj.weight",
    LM + "layers.0.mlp.gate_proj.weight",
    LM + "layers.0.mlp.up_proj.weight",
    LM + "norm.weight",
    VIS + "blocks.0.norm1.weight",
    VIS + "blocks.0.attn.qkv.weight",
    VIS + "merger.linear_fc1.weight",
    "lm_head.weight",
]


def weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(4, 4, generator=g)) for n in NAMES]  # 64 B each


@pytest.fixture
def server(fake):
    fake.state.param_names = set(NAMES)
    return fake


def engine(fake, **kwargs) -> SGLangRolloutEngine:
    kwargs.setdefault("known_names", frozenset(NAMES))
    return make_engine(
        quick_client(fake.url), weight_version="base", weight_device=None, weight_bucket_bytes=256, **kwargs
    )


def test_checkpoint_names_are_the_safetensors_names_plus_a_tied_head(tmp_path):
    save_file({"a.weight": torch.ones(1), "b.bias": torch.ones(1)}, tmp_path / "model-00001-of-00002.safetensors")
    save_file({"lm_head.weight": torch.ones(1)}, tmp_path / "model-00002-of-00002.safetensors")
    assert checkpoint_names(tmp_path) == {"a.weight", "b.bias", "lm_head.weight"}
    tied = tmp_path / "tied"
    tied.mkdir()
    save_file({"model.language_model.embed_tokens.weight": torch.ones(1)}, tied / "model.safetensors")
    (tied / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": True}}))
    assert checkpoint_names(tied) == {"model.language_model.embed_tokens.weight", "lm_head.weight"}
    assert checkpoint_names(tmp_path / "missing") is None and checkpoint_names("Qwen/Qwen3-VL-2B-Instruct") is None


def test_probes_load_one_to_one_under_the_plain_renames():
    server = {
        "model.norm.weight",
        "visual.blocks.0.attn.qkv_proj.weight",
        "lm_head.weight",
        "model.embed_tokens.weight",
    }
    assert server_name(LM + "norm.weight", server) == "model.norm.weight"
    assert server_name(VIS + "blocks.0.attn.qkv.weight", server) == "visual.blocks.0.attn.qkv_proj.weight"
    assert server_name("lm_head.weight", server) == "lm_head.weight"
    assert server_name(LM + "layers.0.self_attn.q_proj.weight", server) is None  # fused into qkv_proj
    assert server_name("lm_head.weight", {"model.embed_tokens.weight"}) is None  # tied: no lm_head parameter


def test_names_the_checkpoint_does_not_have_are_refused_before_sending(server):
    eng = engine(server)
    bad = [*weights(0)[:2], ("model.language_model.layers.0.attn.q.weight", torch.ones(2))]  # a megatron-style slip
    with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) .* not named as in the checkpoint.*layers\.0\.attn\.q"):
        eng.load_weights(bad)
    assert "/update_weights_from_tensor" not in server.paths()
    with pytest.raises(EngineStateError, match="did not complete"):
        eng.generate([make_prompt([1])], SamplingParams(max_new_tokens=2))


def test_a_misnamed_tensor_in_a_later_bucket_is_refused_too(server):
    """Issue 31.5: a check of the first bucket only passed every test. Here the first two buckets are well named and
    the third carries a name the server's checkpoint lacks: the sync stops before that bucket is sent (the server
    never sees the name, so it cannot skip it unseen), and generate refuses the server's mix of old and new weights."""
    eng = engine(server)
    sent = weights(0)  # 12 tensors of 64 B in buckets of 256 B: [0:4], [4:8], [8:12]
    slip = "model.visual.blocks.0.attn.qkv_proj.weight"  # SGLang's own name of the fused tensor, not the HF one
    sent[9] = (slip, sent[9][1])
    with pytest.raises(WeightSyncError, match=r"1 tensor\(s\) .* not named as in the checkpoint.*qkv_proj"):
        eng.load_weights(sent)
    assert server.paths().count("/update_weights_from_tensor") == 2  # the first two buckets, not the third
    assert server.state.skipped == [] and slip not in server.state.params
    with pytest.raises(EngineStateError, match="did not complete"):
        eng.generate([make_prompt([1])], SamplingParams(max_new_tokens=2))


def test_the_stand_in_skips_unknown_names_silently_as_0_5_16_does(server):
    """Without the engine's name check the HTTP call succeeds and the name is only in the server's log."""
    eng = engine(server, known_names=None, verify_weights=False)
    eng.load_weights([*weights(0), ("model.visual.deepstack.0.weight", torch.ones(3))])
    assert server.state.skipped == ["model.visual.deepstack.0.weight"]
    assert quick_client(server.url).get_json("/_fake/skipped") == ["model.visual.deepstack.0.weight"]
    assert any("skipped 1 tensor(s)" in line for line in server.state.log)
    assert value_hash(weights(0)[0][1]) == server.state.params[NAMES[0]]  # the known ones were loaded


def test_changed_values_must_change_on_the_server(server):
    eng = engine(server)
    first = eng.load_weights(weights(0), weight_version="step-1")
    assert first.buckets == 3 and first.verified == ()  # nothing known yet about the server's copy
    paths = server.paths()
    assert paths[0] == "/weights_checker" and paths[-1] == "/weights_checker"  # before the buckets, after the flush
    assert paths[1:-1] == ["/update_weights_from_tensor"] * 3 + ["/update_weight_version", "/flush_cache"]

    second = eng.load_weights(weights(1), weight_version="step-2")
    # probes: the last small 1:1 tensor of the first bucket (input_layernorm; q/k/v are fused), of the last bucket
    # (lm_head), and the first of the vision tower (norm1)
    assert set(second.verified) == {
        LM + "layers.0.input_layernorm.weight",
        "lm_head.weight",
        VIS + "blocks.0.norm1.weight",
    }
    assert eng.load_weights(weights(1), weight_version="step-3").verified == ()  # same values: no change expected
    # sent in another order (other positional probes), the last sync's probes are still checked
    assert set(second.verified) <= set(eng.load_weights(weights(9)[::-1], weight_version="step-3b").verified)
    assert eng.load_weights([(n, t.double()) for n, t in weights(9)]).verified == ()  # same values in bf16

    server.inject("/update_weights_from_tensor", "ignore", times=3)  # answers success, loads nothing
    with pytest.raises(WeightSyncError, match=r"did not land: '.*' was sent with new values, but the server's param"):
        eng.load_weights(weights(2), weight_version="step-4")
    with pytest.raises(EngineStateError, match="the last weight sync did not land"):
        eng.generate([make_prompt([1])], SamplingParams(max_new_tokens=2))
    # Sent again, it lands; the server's copy was unknown after the failure, so this sync checks nothing, the next does.
    assert eng.load_weights(weights(2), weight_version="step-4").verified == ()
    assert len(eng.generate([make_prompt([1])], SamplingParams(max_new_tokens=2))[0]) == 1
    assert len(eng.load_weights(weights(3), weight_version="step-5").verified) == 3


def test_no_value_check_where_the_servers_copy_is_unknown(server, caplog):
    """After a restart the server holds model_path's weights again: the values of the last sync say nothing about
    them, so sending model_path's own values (no change on the server) is not an error."""
    eng = engine(server)
    eng.load_weights(weights(0))
    checkpoint = weights(7)
    server.state.params = {n: value_hash(t) for n, t in checkpoint}  # relaunched with model_path's weights
    eng.server_restarted()
    assert eng.load_weights(checkpoint).verified == ()

    server.inject("/weights_checker", "status", 400)  # a server that cannot hash its weights
    with caplog.at_level("WARNING", logger="miles_vl.rollout.sglang.verify"):
        eng.load_weights(weights(3))
    assert "not verified on this engine from now on" in caplog.text and not eng.verifier.check_values
    calls = len(server.paths())
    server.inject("/update_weights_from_tensor", "ignore", times=3)
    eng.load_weights(weights(4))  # unverifiable now: no /weights_checker call at all
    assert "/weights_checker" not in server.paths()[calls:]


def test_get_weights_by_name_is_refused_for_qwen3_vl_as_in_0_5_16(server):
    """The route exists but Qwen3-VL's model has no `get_weights_by_name`: HTTP 400, reason in the log only."""
    client = quick_client(server.url)
    with pytest.raises(Exception, match="HTTP 400: Get parameter by name failed"):
        client.post_json("/get_weights_by_name", {"name": "lm_head.weight", "truncate_size": 2})
    assert "has no attribute 'get_weights_by_name'" in server.state.log[-1]
