"""Small images, rows and files for the data tests (PNG bytes from PIL, parquet and jsonl written in tmp dirs)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw

# Pixel range of the test processor: small images -> few vision tokens -> fast tests.
MIN_PIXELS = 32 * 32
MAX_PIXELS = 128 * 128


def png_bytes(width: int = 64, height: int = 48, seed: int = 0) -> bytes:
    """A PNG with a few shapes on it (different `seed` -> different picture)."""
    img = Image.new("RGB", (width, height), "white")
    draw = ImageDraw.Draw(img)
    draw.line([(seed % width, 0), (width - 1, height - 1)], fill="black", width=2)
    draw.ellipse([width // 4, height // 4, width // 2, height // 2], outline=(200, 30, seed * 7 % 256), width=2)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def write_png(path: Path, **kw: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(png_bytes(**kw))
    return path


def write_jsonl(path: Path, records: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_geometry3k_parquet(path: Path, records: list[dict[str, Any]]) -> Path:
    """Records in hiyouga/geometry3k's schema: images list<struct<bytes, path>>, problem, answer."""
    schema = pa.schema(
        [
            ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
            ("problem", pa.string()),
            ("answer", pa.string()),
        ]
    )
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    return path


# verl's geo3k preprocessing output (verl examples/data_preprocess/geo3k.py, written by `datasets.to_parquet`): chat
# messages, the images as HF Image structs, the answer nested in `reward_model`, the rest as metadata or extra info.
VERL_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))),
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("ground_truth", pa.string()), ("style", pa.string())])),
        (
            "extra_info",
            pa.struct(
                [("answer", pa.string()), ("index", pa.int64()), ("question", pa.string()), ("split", pa.string())]
            ),
        ),
    ]
)


def verl_record(index: int, problem: str, answer: str, n_images: int = 1, role: str = "user") -> dict[str, Any]:
    """One row as verl's geo3k preprocessing writes it (its instruction appended to the problem)."""
    return {
        "data_source": "hiyouga/geometry3k",
        "prompt": [{"role": role, "content": problem + " You FIRST think about the reasoning process."}],
        "images": [{"bytes": png_bytes(seed=index + k), "path": None} for k in range(n_images)],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": answer},
        "extra_info": {"split": "train", "index": index, "answer": answer, "question": problem},
    }


def write_verl_parquet(path: Path, records: list[dict[str, Any]], schema: pa.Schema = VERL_SCHEMA) -> Path:
    pq.write_table(pa.Table.from_pylist(records, schema=schema), path)
    return path
