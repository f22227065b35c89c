"""Images from the values datasets hold: bytes, `{bytes, path}` structs, local paths, `file://` and data URLs.

    ref = image_ref({"bytes": b"\\x89PNG...", "path": "a.png"})    # geometry3k's parquet struct -> the bytes
    ref = image_ref("images/12.png", base_dir=Path("data"))       # relative to the dataset file's folder
    img = open_image(ref)                                         # decoded, RGB

Remote URLs (http, https, ftp, s3, gs) are rejected: training never downloads. An image with more pixels than
`max_pixels` is refused from its header, before it is decoded (a 100-megapixel PNG would take 300 MB and more to
decode; PIL only warns below 179 megapixels). Every failure is an `ImageError` carrying the `DropReason` the loader
counts the row under (corrupt, missing, remote or too large).
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from PIL import Image

from miles_vl.data.records import DropReason, ImageRef

REMOTE_PREFIXES = ("http://", "https://", "ftp://", "s3://", "gs://")


class ImageError(ValueError):
    """An image value that cannot be used; `reason` is the drop reason its row is counted under."""

    def __init__(self, reason: DropReason, detail: str):
        super().__init__(detail)
        self.reason = reason


def image_ref(value: Any, base_dir: Path | None = None) -> ImageRef:
    """Turn one image value of a dataset row into encoded bytes or an existing local path (nothing is decoded).

    Args:
        value: bytes; a PIL image; a `{"bytes": ..., "path": ...}` struct (HF datasets' Image feature; `bytes` wins,
            and may be base64 text in JSON); `{"image"|"url"|"image_url": ...}`; a string that is a data URL
            (`data:image/png;base64,...`), a `file://` URL, or a local path.
        base_dir: folder relative paths are looked up in first (the dataset file's folder); then the working dir.

    Returns:
        The image's encoded bytes, or the `Path` of an existing file.

    Raises:
        ImageError: REMOTE_IMAGE for http(s)/ftp/s3/gs URLs, MISSING_IMAGE for a path that does not exist,
            CORRUPT_IMAGE for a malformed data URL or base64, or a value of another type.
    """
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, Image.Image):
        buf = io.BytesIO()
        value.save(buf, format="PNG")
        return buf.getvalue()
    if isinstance(value, dict):
        if value.get("bytes"):
            data = value["bytes"]
            return _b64decode(data, "the 'bytes' field") if isinstance(data, str) else image_ref(data, base_dir)
        for key in ("path", "image", "url", "image_url"):
            inner = value.get(key)
            if isinstance(inner, dict) and key == "image_url":  # OpenAI style {"image_url": {"url": ...}}
                inner = inner.get("url")
            if inner:
                return image_ref(inner, base_dir)
        raise ImageError(DropReason.CORRUPT_IMAGE, f"image struct with no bytes and no path: keys {sorted(value)}")
    if isinstance(value, str):
        return _ref_from_string(value, base_dir)
    raise ImageError(DropReason.CORRUPT_IMAGE, f"unsupported image value of type {type(value).__name__}")


def open_image(ref: ImageRef, max_pixels: int | None = None) -> Image.Image:
    """Decode an image completely (truncated data fails here, not later) and convert it to RGB.

    Args:
        ref: encoded bytes or a local path, as returned by `image_ref`.
        max_pixels: refuse an image with more pixels (width * height, from its header) before decoding it; None
            leaves only PIL's own bound (179 megapixels).

    Returns:
        A loaded RGB `PIL.Image.Image`.

    Raises:
        ImageError: MISSING_IMAGE when the file is gone, IMAGE_TOO_LARGE above `max_pixels` (or PIL's bound),
            CORRUPT_IMAGE when the data does not decode.
    """
    with _header(ref, max_pixels) as img:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img.load()
        return img.convert("RGB")


def image_size(ref: ImageRef, max_pixels: int | None = None) -> tuple[int, int]:
    """(width, height) of an image from its header, without decoding it (video frames are budgeted from these).

    Raises:
        ImageError: as `open_image`, for what the header shows (a missing file, no image header, too many pixels).
    """
    with _header(ref, max_pixels) as img:
        return img.size


@contextlib.contextmanager
def _header(ref: ImageRef, max_pixels: int | None) -> Iterator[Image.Image]:
    """The image opened (its header read, nothing decoded) and checked against `max_pixels`; errors in the body, e.g.
    while decoding, become `ImageError`s too."""
    where = f"{len(ref)} bytes" if isinstance(ref, bytes) else str(ref)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the size is checked here instead
            img = Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref)
        with img:
            width, height = img.size
            if max_pixels is not None and width * height > max_pixels:
                raise ImageError(
                    DropReason.IMAGE_TOO_LARGE,
                    f"image of {width}x{height} = {width * height / 1e6:.1f} megapixels ({where}) is above "
                    f"data.max_image_pixels={max_pixels}; downscale it or raise the limit",
                )
            yield img
    except ImageError:
        raise
    except FileNotFoundError as err:
        raise ImageError(DropReason.MISSING_IMAGE, f"image file not found: {ref}") from err
    except Image.DecompressionBombError as err:
        raise ImageError(DropReason.IMAGE_TOO_LARGE, f"image above PIL's pixel bound ({where}): {err}") from err
    except (OSError, ValueError, SyntaxError) as err:
        raise ImageError(DropReason.CORRUPT_IMAGE, f"cannot decode image ({where}): {err}") from err


def _ref_from_string(value: str, base_dir: Path | None) -> ImageRef:
    text = value.strip()
    if text.lower().startswith(REMOTE_PREFIXES):
        raise ImageError(
            DropReason.REMOTE_IMAGE,
            f"remote image URL {text[:120]!r}: miles_vl does not download; fetch the images and point the dataset "
            "at local paths or embedded bytes",
        )
    if text.startswith("data:"):
        header, sep, payload = text.partition(",")
        if not sep or not header.endswith(";base64"):
            raise ImageError(DropReason.CORRUPT_IMAGE, f"data URL without a base64 payload: {text[:60]!r}")
        return _b64decode(payload, "the data URL")
    found, name, tried = find_local_file(text, base_dir)
    if found is None:
        raise ImageError(DropReason.MISSING_IMAGE, f"image file not found: {name!r} (looked at {tried})")
    return found


def find_local_file(text: str, base_dir: Path | None) -> tuple[Path | None, str, str]:
    """A local path or `file://` URL, looked up under `base_dir` (the dataset file's folder) first, then as given.

    Returns:
        (the first existing file or None, the path text without `file://`, the places looked at, for a message).
    """
    if text.startswith("file://"):
        text = text[len("file://") :]
    path = Path(text).expanduser()
    candidates = [path] if path.is_absolute() or base_dir is None else [base_dir / path, path]
    found = next((c for c in candidates if c.is_file()), None)
    return found, text, ", ".join(str(c) for c in candidates)


def _b64decode(payload: str, what: str) -> bytes:
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ImageError(DropReason.CORRUPT_IMAGE, f"{what} is not valid base64: {err}") from err
