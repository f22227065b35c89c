"""Contract (issue 35.3): `miles-vl data fetch geo3k OUT_DIR` writes the hub's geometry3k splits as
OUT_DIR/<split>.parquet in the geometry3k layout the shipped configs read, from the Hugging Face cache when the hub
cannot be reached; it never replaces a file, and a dataset it can neither find nor download is one error saying how
to fetch it. The converter is tested on parquet shards written here in the hub's schema; the command as a process
against a dataset cache built here (HF_HUB_CACHE, HF_HUB_OFFLINE=1): no network."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from miles_vl.data import DataError, LoadOptions, convert_geo3k, load_prompt_file
from tests.data.helpers import png_bytes

REPO = Path(__file__).resolve().parents[2]
COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
# hiyouga/geometry3k's parquet schema (datasets' Image feature: a struct of bytes and path), columns in its order
HUB_SCHEMA = pa.schema(
    [
        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))),
        ("problem", pa.string()),
        ("answer", pa.string()),
    ]
)


def hub_shard(path: Path, start: int, n: int) -> Path:
    rows = [
        {
            "images": [{"bytes": png_bytes(seed=i), "path": f"{i}.png"}],
            "problem": f"<image>Find x{i}.",
            "answer": str(i),
        }
        for i in range(start, start + n)
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=HUB_SCHEMA), path)
    return path


def test_convert_concatenates_the_shards_of_a_split_into_the_geometry3k_layout(tmp_path, encoder):
    shards = [hub_shard(tmp_path / "train-00000-of-00002.parquet", 0, 3)]
    # a later shard with a column the layout does not read, and its columns in another order
    extra = pq.read_table(hub_shard(tmp_path / "b.parquet", 3, 2)).append_column("id", pa.array([7, 8]))
    pq.write_table(extra.select(["answer", "id", "images", "problem"]), tmp_path / "train-00001-of-00002.parquet")
    shards.append(tmp_path / "train-00001-of-00002.parquet")
    assert convert_geo3k(shards, tmp_path / "train.parquet") == 5
    table = pq.read_table(tmp_path / "train.parquet")
    assert table.column_names == ["problem", "answer", "images"]
    rows, report = load_prompt_file(tmp_path / "train.parquet", encoder, LoadOptions(max_prompt_len=512))
    assert report.layout == "geometry3k" and report.n_kept == 5
    assert [r.label for r in rows] == ["0", "1", "2", "3", "4"] and rows[4].images == (png_bytes(seed=4),)


def test_convert_refuses_a_shard_without_the_columns(tmp_path):
    pq.write_table(pa.table({"question": ["<image>x"], "answer": ["1"]}), tmp_path / "s.parquet")
    with pytest.raises(DataError, match=r"s.parquet: no column\(s\) \['problem', 'images'\].*'question'"):
        convert_geo3k([tmp_path / "s.parquet"], tmp_path / "out.parquet")
    assert not (tmp_path / "out.parquet").exists() and not list(tmp_path.glob(".out*"))


def fetch(tmp_path: Path, cache: Path, out: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env |= {
        "HF_HUB_CACHE": str(cache),
        "HF_HUB_OFFLINE": "1",
        "HOME": str(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "COLUMNS": "300",
    }
    exe = Path(sys.executable).with_name("miles-vl")
    cmd = [str(exe), "data", "fetch", "geo3k", str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_fetch_geo3k_from_the_cache_writes_each_split_once(tmp_path):
    cache = tmp_path / "cache"
    repo = cache / "datasets--hiyouga--geometry3k"
    data = repo / "snapshots" / COMMIT / "data"
    hub_shard(data / "train-00000-of-00001.parquet", 0, 4)
    hub_shard(data / "test-00000-of-00001.parquet", 10, 2)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    out = tmp_path / "geometry3k"

    proc = fetch(tmp_path, cache, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        f"wrote {out / 'train.parquet'} (4 rows)" in proc.stdout
        and f"wrote {out / 'test.parquet'} (2 rows)" in proc.stdout
    )
    assert f"data.train_path={out / 'train.parquet'} data.eval_path={out / 'test.parquet'}" in proc.stdout
    assert pq.read_table(out / "test.parquet").column("answer").to_pylist() == ["10", "11"]

    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (out / "test.parquet").write_bytes(b"mine")  # a file of the user's under a split's name
    proc = fetch(tmp_path, cache, out)
    assert proc.returncode == 2 and "already exist(s); fetch never replaces a file" in proc.stderr
    assert (out / "test.parquet").read_bytes() == b"mine" and (out / "train.parquet").read_bytes() == before[
        "train.parquet"
    ]

    proc = fetch(tmp_path, tmp_path / "empty_cache", tmp_path / "other")
    err = " ".join(proc.stderr.split())
    assert proc.returncode == 2 and "Traceback" not in err
    assert (
        "the dataset hiyouga/geometry3k is not in the local Hugging Face cache" in err
        and "HF_HUB_OFFLINE is set" in err
    )
    assert "`hf download hiyouga/geometry3k --repo-type dataset`" in err and not (tmp_path / "other").exists()
