"""Contract (issue 15 items 15 and 17): a dataset file that cannot be read is one `DataError` naming the file (and
the line for jsonl), never a bare traceback: not UTF-8, a truncated or corrupt parquet, a text file named .parquet,
missing columns, a custom mapper that fails. An image with more pixels than `data.max_image_pixels` is dropped and
counted (`image_too_large`) from its header, without decoding it and without PIL's DecompressionBombWarning."""

import io
import struct
import warnings
import zlib

import pytest
from PIL import Image

from miles_vl.data import DataError, DropReason, ImageError, LoadOptions, load_prompt_file, open_image, read_records
from tests.data.helpers import png_bytes, write_geometry3k_parquet, write_jsonl


def huge_png(width: int = 10_000, height: int = 10_000) -> bytes:
    """A valid PNG header announcing width x height pixels (100 MP by default), with one row of data: 109 bytes that
    a decoder would expand to 300 MB (or refuse as truncated)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    idat = zlib.compress(b"\x00" + b"\x00" * 3 * width)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_a_jsonl_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"problem": "a", "answer": "1"}\n{"problem": "caf\xe9", "answer": "2"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: not UTF-8 text \(byte 0xe9 at column 17\)"):
        read_records(path)


def test_a_utf8_bom_is_not_an_error(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"problem": "a", "answer": "1"}\n')
    assert read_records(path) == [{"problem": "a", "answer": "1"}]


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 2],  # truncated mid-file
        lambda b: b[:-10],  # footer torn off
        lambda b: b"",  # empty
        lambda b: b"problem,answer\nfind x,3\n",  # a CSV named .parquet
        lambda b: b[:100] + bytes(len(b) - 200) + b[-100:],  # zeroed middle, footer intact
    ],
    ids=["truncated", "no-footer", "empty", "text", "corrupt-middle"],
)
def test_a_broken_parquet_file_is_named_once(tmp_path, damage):
    records = [
        {"images": [{"bytes": png_bytes(seed=i), "path": f"{i}.png"}], "problem": "<image>x", "answer": "1"}
        for i in range(20)
    ]
    path = write_geometry3k_parquet(tmp_path / "train.parquet", records)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(DataError, match=f"{path}: cannot read it as parquet .*truncated, corrupt or not parquet"):
        read_records(path)


def test_wrong_columns_name_the_file(tmp_path, encoder):
    path = write_jsonl(tmp_path / "q.jsonl", [{"question": "2+2?", "solution": "4"}])
    with pytest.raises(DataError, match=f"{path}: no prompt column 'problem'.*'question'"):
        load_prompt_file(path, encoder, LoadOptions(max_prompt_len=512))


def test_a_failing_dataset_fn_names_the_file_and_row(tmp_path, encoder):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"q": "a"}, {"q": None}])

    def mapper(record):
        return {"problem": record["q"].upper(), "answer": "1"}

    with pytest.raises(DataError, match=f"{path}: row 1: dataset_fn failed: AttributeError"):
        load_prompt_file(path, encoder, LoadOptions(max_prompt_len=512, dataset_fn=mapper))


def test_a_100_megapixel_image_is_refused_from_its_header(monkeypatch):
    """Issue 15.17: a 100 MP image was kept (1.3 GB resident, a DecompressionBombWarning)."""
    loaded = []
    monkeypatch.setattr(Image.Image, "load", lambda self: loaded.append(self.size))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning (PIL's DecompressionBombWarning) fails the test
        with pytest.raises(ImageError, match=r"10000x10000 = 100.0 megapixels .* above data.max_image_pixels") as info:
            open_image(huge_png(), max_pixels=50_000_000)
    assert info.value.reason == DropReason.IMAGE_TOO_LARGE
    assert loaded == []  # refused before decoding


def test_rows_with_a_huge_image_are_dropped_and_counted(tmp_path, encoder):
    records = [
        {"images": [{"bytes": png_bytes(seed=1), "path": "a.png"}], "problem": "<image>small", "answer": "1"},
        {"images": [{"bytes": huge_png(), "path": "b.png"}], "problem": "<image>huge", "answer": "2"},
    ]
    path = write_geometry3k_parquet(tmp_path / "g.parquet", records)
    rows, report = load_prompt_file(path, encoder, LoadOptions(max_prompt_len=512, max_image_pixels=50_000_000))
    assert [r.index for r in rows] == [0]
    assert report.dropped == {DropReason.IMAGE_TOO_LARGE: 1}
    assert "image_too_large=1" in report.summary()


def test_images_within_the_limit_still_decode():
    img = open_image(png_bytes(64, 48), max_pixels=64 * 48)  # exactly at the limit
    assert img.size == (64, 48) and img.mode == "RGB"
    assert isinstance(Image.open(io.BytesIO(png_bytes())), Image.Image)
