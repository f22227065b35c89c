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
