"""Contract: the provider gets calculate_per_token_loss under CP, rope fusion off and vision_dp_when_cp as asked,
every change is reported, and the field names are the ones megatron-bridge's real Qwen3VLModelProvider has."""

import dataclasses

import pytest

from miles_vl.patches.provider import configure_provider
from tests.patches.harness import runner


@dataclasses.dataclass
class FakeProvider:
    context_parallel_size: int = 1
    calculate_per_token_loss: bool = False
    apply_rope_fusion: bool = True
    vision_dp_when_cp: bool = False


def test_cp_settings_and_reported_changes():
    p = FakeProvider()
    changes = configure_provider(p, cp_size=2, vision_dp_when_cp=True)
    assert (p.context_parallel_size, p.calculate_per_token_loss, p.apply_rope_fusion, p.vision_dp_when_cp) == (
        2,
        True,
        False,
        True,
    )
    assert changes == {
        "context_parallel_size": (1, 2),
        "apply_rope_fusion": (True, False),
        "calculate_per_token_loss": (False, True),
        "vision_dp_when_cp": (False, True),
    }
    assert configure_provider(p, cp_size=2, vision_dp_when_cp=True) == {}  # idempotent


def test_vision_dp_needs_a_release_with_it():
    @dataclasses.dataclass
    class Old:
        context_parallel_size: int = 1
        calculate_per_token_loss: bool = False
        apply_rope_fusion: bool = False

    assert configure_provider(Old(), cp_size=2) == {
        "context_parallel_size": (1, 2),
        "calculate_per_token_loss": (False, True),
    }
    with pytest.raises(ValueError, match=r"vision_dp_when_cp \(on by default\) needs megatron-bridge >= 0.6 under CP; "
                       "set train.vision_dp_when_cp=false"):  # fmt: skip
        configure_provider(Old(), cp_size=2, vision_dp_when_cp=True)
    # Issue 32.5: on by default, but megatron-bridge reads it only under CP: a CP=1 job is not refused on 0.5.x
    assert configure_provider(Old(), cp_size=1, vision_dp_when_cp=True) == {}


def job_real_provider(ctx):
    from megatron.bridge.models.qwen_vl.qwen3_vl_provider import Qwen3VLModelProvider

    names = {f.name for f in dataclasses.fields(Qwen3VLModelProvider)}
    return sorted(
        n
        for n in ("context_parallel_size", "calculate_per_token_loss", "apply_rope_fusion", "vision_dp_when_cp")
        if n in names
    )


def test_field_names_exist_on_the_real_provider():
    (names,) = runner.run_cp(job_real_provider, 1, version="0.6.2")
    assert names == ["apply_rope_fusion", "calculate_per_token_loss", "context_parallel_size", "vision_dp_when_cp"]
