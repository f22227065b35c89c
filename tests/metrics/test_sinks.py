"""Contract of metrics.jsonl (issue 15.4): a torn last line (a writer killed mid-line) is skipped with a warning that
names the file, by every reader (`read_metrics`, a resume's `JsonlSink`, `miles-vl report`); any other bad line is
an error naming the file and line; a resume rewrites the file atomically, keeping exactly the steps before it."""

import json
import logging

import pytest

from miles_vl.cli import main
from miles_vl.metrics import JsonlSink, read_metrics
from miles_vl.metrics.sinks import wandb_mode

RECORDS = [{"step": s, "reward/mean": s / 10} for s in (1, 2, 3)]


def write(path, text: str):
    path.write_text(text)
    return path


def lines(records) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    path = write(tmp_path / "metrics.jsonl", lines(RECORDS) + '{"step": 4, "rew')
    with caplog.at_level(logging.WARNING, logger="miles_vl.metrics.sinks"):
        assert read_metrics(tmp_path) == RECORDS
    assert f"{path}:4: skipped a torn last line" in caplog.text


@pytest.mark.parametrize("text", [lines(RECORDS[:1]) + "{oops\n" + lines(RECORDS[1:]), lines(RECORDS) + "[1, 2]\n"])
def test_other_bad_lines_are_errors_naming_the_line(tmp_path, text):
    path = write(tmp_path / "metrics.jsonl", text)
    with pytest.raises(ValueError, match=rf"{path}:(2: not a JSON record|4: expected a JSON object)"):
        read_metrics(path)


def test_a_resume_keeps_the_steps_before_it_and_drops_the_torn_line(tmp_path):
    write(tmp_path / "metrics.jsonl", lines(RECORDS) + '{"step": 4, "rew')
    sink = JsonlSink(tmp_path, resume_step=3)  # resuming from the checkpoint of step 2
    sink.log({"step": 3, "reward/mean": 0.7})
    assert read_metrics(tmp_path) == [*RECORDS[:2], {"step": 3, "reward/mean": 0.7}]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # no temp file left


def test_report_plots_a_run_with_a_torn_last_line(tmp_path, capsys):
    write(tmp_path / "metrics.jsonl", lines(RECORDS) + '{"step": 4, "rew')
    assert main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "plots" / "reward.png").is_file()


def test_wandb_auto_is_online_with_a_wandb_login_and_offline_without(tmp_path, monkeypatch, caplog):
    """Issue 35.5: `auto` looked at WANDB_API_KEY only, so a user who ran `wandb login` logged offline. The key that
    login stores (the netrc entry of the wandb host) now counts; another host's entry does not, and a netrc that does
    not parse is named in a warning."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_BASE_URL", raising=False)
    netrc_file = tmp_path / "netrc"
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert wandb_mode("auto")[0] == "offline"  # no file
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    assert wandb_mode("auto") == ("online", f"auto: the `wandb login` for api.wandb.ai in {netrc_file}")
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.org")
    assert wandb_mode("auto")[0] == "offline"  # a login for another host
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)
    assert wandb_mode("auto") == ("online", "auto: WANDB_API_KEY is set")
    assert wandb_mode("offline") == ("offline", "logging.wandb.mode=offline")
    monkeypatch.delenv("WANDB_API_KEY")
    netrc_file.write_text("garbage here\n")
    with caplog.at_level(logging.WARNING):
        assert wandb_mode("auto")[0] == "offline"
    assert f"{netrc_file} cannot be read" in caplog.text
