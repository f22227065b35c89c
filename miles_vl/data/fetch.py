"""Public datasets fetched from the Hugging Face hub into the files the shipped configs read.

    miles-vl data fetch geo3k /data/geometry3k     # -> train.parquet, validation.parquet, test.parquet
    # then: data.train_path=/data/geometry3k/train.parquet data.eval_path=/data/geometry3k/test.parquet

`fetch_dataset` downloads the dataset's parquet shards with huggingface_hub into the Hugging Face cache (or, where
the hub cannot be reached or `HF_HUB_OFFLINE=1`, finds them there), and `convert_geo3k` writes one file per split in
the geometry3k layout (`layouts`): the columns `problem` (with `<image>`), `answer` and `images` (a list of
{bytes, path}), the shards of a split concatenated in order. Rows are copied as they are: the loader checks them when
a job reads the file (`miles-vl data inspect` shows what it keeps). A file that already exists is never replaced:
the command refuses before it downloads. Each file is written beside its place and renamed into it, so a fetch that
dies leaves no partial file under the final name.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from miles_vl.data.layouts import GEO3K_KEYS, DataError


@dataclass(frozen=True)
class HubDataset:
    """A dataset on the hub: its repository id and the layout its parquet shards (`data/<split>-*.parquet`) hold."""

    repo_id: str
    layout: str


DATASETS = {"geo3k": HubDataset("hiyouga/geometry3k", "geometry3k")}
_SHARD = re.compile(r"(?P<split>[A-Za-z0-9_]+)-\d+-of-\d+\.parquet")  # the hub's parquet shard names


def fetch_dataset(name: str, out_dir: str | Path) -> dict[str, tuple[Path, int]]:
    """Download dataset `name` (a key of DATASETS) and write each of its splits to `out_dir/<split>.parquet`.

    Returns:
        {split: (file written, rows)}.

    Raises:
        DataError: an unknown name; a file of a split that is already there (nothing is written); a dataset that
            is neither cached nor downloadable (names the repository and how to fetch it); shards without the
            layout's columns (`convert_geo3k`).
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of {', '.join(sorted(DATASETS))}")
    dataset = DATASETS[name]
    shards = _download(dataset.repo_id)
    out_dir = Path(out_dir)
    taken = [str(out_dir / f"{split}.parquet") for split in shards if (out_dir / f"{split}.parquet").exists()]
    if taken:
        raise DataError(
            f"{', '.join(taken)} already exist(s); fetch never replaces a file: remove it or choose another OUT_DIR"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    return {
        split: (out_dir / f"{split}.parquet", convert_geo3k(paths, out_dir / f"{split}.parquet"))
        for split, paths in shards.items()
    }


def _download(repo_id: str) -> dict[str, list[Path]]:
    """The parquet shards of the dataset repository `repo_id`, by split, from the cache (downloaded when needed)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        root = Path(snapshot_download(repo_id, repo_type="dataset", allow_patterns=["data/*.parquet"]))
    except LocalEntryNotFoundError as err:
        why = "HF_HUB_OFFLINE is set" if constants.is_offline_mode() else f"the hub cannot be reached ({err})"
        why = why.splitlines()[0]
        raise DataError(
            f"the dataset {repo_id} is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}) and {why}; "
            f"fetch it where the hub is reachable (`hf download {repo_id} --repo-type dataset`, into the cache this "
            "machine reads) and run the command again"
        ) from None
    except (HfHubHTTPError, OSError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise DataError(f"downloading the dataset {repo_id} failed ({first})") from None
    shards: dict[str, list[Path]] = {}
    for path in sorted((root / "data").glob("*.parquet")):
        if match := _SHARD.fullmatch(path.name):
            shards.setdefault(match["split"], []).append(path)
    if not shards:
        raise DataError(f"the dataset {repo_id} has no data/<split>-NNNNN-of-NNNNN.parquet files ({root})")
    return shards


def convert_geo3k(shards: Sequence[str | Path], out: str | Path) -> int:
    """Write the rows of `shards` (the hub's geometry3k parquet files of one split, in order) to `out` in the
    geometry3k layout: `problem`, `answer`, `images` (list of {bytes, path}); other columns are left out.

    Returns:
        The number of rows written.

    Raises:
        DataError: a shard that does not read as parquet or lacks one of the columns (names the shard, the columns
            found and the ones expected), or whose columns have other types than the first shard's.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    tables = []
    for shard in shards:
        try:
            table = pq.read_table(shard)
        except Exception as err:  # pyarrow raises ArrowInvalid, OSError, ... depending on how the file is broken
            raise DataError(f"{shard}: cannot read it as parquet ({str(err).splitlines()[0]})") from None
        missing = [c for c in GEO3K_KEYS if c not in table.column_names]
        if missing:
            raise DataError(
                f"{shard}: no column(s) {missing}; geometry3k's files have {list(GEO3K_KEYS)}, this one "
                f"{table.column_names} (has the dataset changed? read it with data.format=generic and data.*_key)"
            )
        images = table.schema.field("images").type
        if not (pa.types.is_list(images) and pa.types.is_struct(images.value_type)):
            raise DataError(f"{shard}: the column 'images' is {images}, expected a list of {{bytes, path}}")
        tables.append(table.select(["problem", "answer", "images"]))
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowInvalid as err:
        raise DataError(f"the shards {[str(s) for s in shards]} have different column types ({err})") from None
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return table.num_rows
