"""miles_vl as a library: a reward callable and the training rows given in Python, no files or import paths.

    PYTHONPATH=. python examples/library.py          # the tiny CPU job, 2 steps (about a minute)

`run_job(cfg, reward_fn=..., dataset=...)`: the reward may be a lambda or a closure defined here (in `__main__`);
it runs in the reward worker processes, sent there by value with Ray's cloudpickle. The rows are dicts in the
columns of `data.format` (geometry3k here: problem with one `<image>` per image, answer, images as PIL images,
paths, or {bytes, path}). The config names neither: `reward.name=null`, `data.in_memory=true`.
"""

from pathlib import Path

from PIL import Image

from miles_vl.config import load_config
from miles_vl.orchestration import run_job

REPO = Path(__file__).resolve().parents[1]


def make_rows(n: int) -> list[dict]:
    """Count-the-squares problems: one image each, the answer a number."""
    rows = []
    for i in range(n):
        image = Image.new("RGB", (56, 56), (40 * (i % 5), 90, 160))
        rows.append(
            {"problem": f"<image>How many squares are there? Row {i}.", "answer": str(i % 4), "images": [image]}
        )
    return rows


def main(output_dir: str = "runs", num_steps: int = 2) -> Path:
    budget = 12  # characters: a closure over a local, sent by value

    def concise(sample) -> float:
        """1 for the right answer in the response, less for every character past `budget`."""
        right = sample.ground_truth in sample.response
        return float(right) - 0.01 * max(len(sample.response) - budget, 0)

    cfg = load_config(
        REPO / "configs" / "geo3k_tiny_cpu.yaml",
        [
            "reward.name=null",
            "data.synthetic_n=0",
            "data.in_memory=true",
            "data.format=geometry3k",
            f"num_steps={num_steps}",
            f"logging.output_dir={output_dir}",
            "logging.run_name=library",
            "logging.progress=false",
            "logging.wandb.mode=disabled",
        ],
    )
    return run_job(cfg, reward_fn=concise, dataset=make_rows(16))


if __name__ == "__main__":
    print(main())
