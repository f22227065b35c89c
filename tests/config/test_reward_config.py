"""Contract: `reward.functions` and the one-function form (`reward.name` + kwargs) are never mixed silently, labels
(the metric names) are distinct, and rows in memory are declared (`data.in_memory`) rather than guessed."""

import pytest

from miles_vl.config import ConfigError, load_config
from tests.orchestration.jobs import REPO

TINY = REPO / "configs" / "geo3k_tiny_cpu.yaml"
TWO = "reward.functions=[{name: geo3k}, {name: 'pkg.mod:Graders.strict', weight: 0.5}]"


def test_functions_with_labels():
    cfg = load_config(TINY, ["reward.name=null", TWO])
    assert [(f.metric_label, f.weight) for f in cfg.reward.functions] == [("geo3k", 1.0), ("strict", 0.5)]


@pytest.mark.parametrize(
    "overrides, message",
    [
        ([TWO], "reward.functions is set together with reward.name; use one form"),
        (["reward.name=null", "reward.kwargs.x=1", TWO], "together with reward.kwargs"),
        (["reward.name=null", "reward.functions=[{name: geo3k}, {name: 'a:geo3k'}]"], "labelled \\['geo3k'\\]"),
        (["data.in_memory=true"], "data.in_memory=true takes the rows from run_job"),
    ],
)
def test_mixed_forms_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(TINY, overrides)
