"""A custom dataset mapping, used from a config as `data.dataset_fn: examples.custom_dataset:from_qa_rows`.

The mapper receives each raw record of the file (a dict of its columns) and returns the geometry3k shape:
`{"problem": str with one <image> per image, "answer": str, "images": [...], "metadata": {...}}`, or None to skip
the record (skips are counted and reported at load time). Images may be bytes, local paths or data URLs.

This one reads rows like `{"question": ..., "figure": "data:image/png;base64,...", "solution": ..., "id": ...}`
(examples/data/qa_rows.jsonl) and keeps only rows that have a solution.
"""

from typing import Any


def from_qa_rows(record: dict[str, Any]) -> dict[str, Any] | None:
    if not record.get("solution"):
        return None
    return {
        "problem": "<image>" + record["question"],
        "answer": str(record["solution"]),
        "images": [record["figure"]],
        "metadata": {"id": record.get("id")},
    }
