"""What a resume says of steps it has passed (orchestration/loop.py `passed_step_notes`): the checkpoint.save_hf
steps due by list or by interval whose HF directory the run lacks, never the final one (the resume reaches it), in
a list cut to its first 8. The resume that prints it: tests/orchestration/test_loop.py."""

from miles_vl.orchestration.checkpoint import step_dir_name
from miles_vl.orchestration.loop import passed_step_notes
from tests.orchestration.jobs import tiny_job


def test_interval_steps_are_named_the_final_one_is_not_and_a_long_list_is_cut(tmp_path):
    cfg = tiny_job(tmp_path, "r", "num_steps=30", "checkpoint.save_hf.interval=2", "checkpoint.save_hf.final=true")
    run_dir = tmp_path / "run"
    (run_dir / "hf" / step_dir_name(4)).mkdir(parents=True)  # written by the first run: not named
    note = passed_step_notes(cfg, 20, run_dir)["save_hf"]
    assert note.startswith("checkpoint.save_hf asks for steps [2, 6, 8, 10, 12, 14, 16, 18, ... (9 steps)], at or "
                           "before step 20"), note  # fmt: skip
    assert "profile_steps" not in passed_step_notes(cfg, 20, run_dir)
    cfg = tiny_job(tmp_path, "s", "num_steps=3", "checkpoint.save_hf.final=true")
    assert passed_step_notes(cfg, 2, run_dir) == {}  # the final step is ahead of any resume that has work left
