"""The wire format both ends of a miles_vl SGLang server share: pixel values handed over as files.

The engine and its server always run on one node (the engine's host starts the server as its own child), so instead of
images for SGLang to decode and process again, the engine writes each prompt's own `pixel_values` (and
`pixel_values_videos`) as raw bytes into a private directory (`PIXEL_DIR_ENV`, set by the host in the server's
environment) and sends, in SGLang's `processor_output` image format, a small reference to the file with its dtype and
shape (`write_tensor`); the server's tokenizer reads it back (`resolve_media`, `read_tensor`) before SGLang tokenizes
the request. The files are 0600 in a 0700 directory, and the server reads only its own: a plain name, directly in that
directory, which must be this user's alone, naming a regular file of this user that no one else can read (another
user's file, a path, `..` or a symbolic link is a 400); the engine deletes them when the request is answered.

Imported by the engine (miles_vl/rollout/sglang/) and by the plugin; it never imports SGLang.
"""

from __future__ import annotations

import math
import os
import stat
import uuid

PIXEL_DIR_ENV = "MILES_VL_SGLANG_PIXEL_DIR"  # where the engine writes pixel values for this server (set by its host)
FILE_KEY = "miles_vl_file"  # a processor_output value given as {FILE_KEY: name, "dtype": ..., "shape": [...]}
WIRE_DTYPES = ("float32", "bfloat16", "float16")
FEATURE_GRIDS = {"pixel_values": "image_grid_thw", "pixel_values_videos": "video_grid_thw"}
LINKED_FILE = "_miles_vl_file"  # set on a tensor that `read_tensor` mapped from a pixel file: that file's path


def write_tensor(directory: str, tensor) -> dict:
    """Engine side: `tensor`'s raw bytes as a new file in `directory`; returns the reference that stands for it in a
    `processor_output` item (`resolve_media` reads it back). The caller deletes the file (`os.path.join(directory,
    ref[FILE_KEY])`) once the request is answered."""
    import torch

    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"pixel values go to the server as one of {WIRE_DTYPES}, found {tensor.dtype}")
    data = tensor.detach().to("cpu").contiguous()
    name = f"{uuid.uuid4().hex}.bin"
    # 0600 from its creation (never readable by another user, not even while it is written); a new name only
    fd = os.open(
        os.path.join(directory, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    with open(fd, "wb") as f:
        f.write(memoryview(data.reshape(-1).view(torch.uint8).numpy()))
    return {FILE_KEY: name, "dtype": dtype, "shape": list(data.shape)}


def _why_not_private(st, kind: str) -> str | None:
    """Why `st` (an `os.lstat` result) is not a `kind` ("directory" or "file") of this user alone, or None."""
    if not (stat.S_ISDIR if kind == "directory" else stat.S_ISREG)(st.st_mode):
        return f"it is not a {kind} but {stat.filemode(st.st_mode)} (a symbolic link is not followed)"
    if st.st_uid != os.geteuid():
        return f"it belongs to uid {st.st_uid}, not to this server's user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"its mode {stat.filemode(st.st_mode)} lets other users reach it"
    return None


def private_directory_problem(directory: str | os.PathLike) -> str | None:
    """Why `directory` is not a private directory of this user (0700 or stricter, not a symbolic link), or None."""
    try:
        return _why_not_private(os.lstat(directory), "directory")
    except OSError as e:
        return str(e)


def check_pixel_directory(directory: str) -> None:
    """Raise unless `directory` is a private directory of this user (0700 or stricter, not a symbolic link), as the
    engine's host makes it (`pixel_directory`): a directory others can write to (/dev/shm itself) could hold their
    files under any name.

    Raises:
        ValueError: naming the directory, what is wrong and the fix.
    """
    problem = private_directory_problem(directory)
    if problem:
        raise ValueError(
            f"{PIXEL_DIR_ENV}={directory} is not a private pixel directory: {problem}. The server reads pixel files "
            "only from a 0700 directory of its own user: start it through miles_vl's SGLang host, which makes one"
        )


def read_tensor(ref: dict, directory: str | None):
    """Server side: the tensor of a `write_tensor` reference, mapping the file (its pages, not a copy of them; the
    engine never writes a file again, and its deleting the name leaves the mapping whole), tagged with the file's path
    and inode for `link_pixel_files`.

    Only the server's own files are read: a plain name (no path), in a directory of this user that no one else can
    reach (`check_pixel_directory`), naming a regular file (not a symbolic link) of this user with no access for
    others, as `write_tensor` makes them. The name is checked, then mapped: only this user can change what it names
    in between.

    Raises:
        ValueError: no pixel directory, or one that is not private; a name that is not a plain file name in it, a
            missing file, a file that is not private to this user, an unknown dtype or a shape that does not match the
            file's size (SGLang answers a ValueError with HTTP 400).
    """
    import torch

    name, dtype, shape = ref.get(FILE_KEY), ref.get("dtype"), ref.get("shape")
    if not directory:
        raise ValueError(
            f"a request refers to pixel values in a file, but this server has no {PIXEL_DIR_ENV}: start it through "
            "miles_vl's SGLang host (rollout.sglang.send_pixel_values), which sets it"
        )
    if not isinstance(name, str) or not name or name != os.path.basename(name) or name.startswith("."):
        raise ValueError(f"{FILE_KEY}={name!r} is not a file name in {PIXEL_DIR_ENV}")
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"pixel values of dtype {dtype!r}: expected one of {WIRE_DTYPES}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ValueError(f"pixel values of shape {shape!r}: expected a list of non-negative ints")
    check_pixel_directory(directory)
    path = os.path.join(directory, name)
    numel = math.prod(shape)
    nbytes = numel * getattr(torch, dtype).itemsize
    try:
        st = os.lstat(path)  # the name itself: a symbolic link is refused below, never followed
    except OSError as e:
        raise ValueError(f"pixel values {name} not found in {directory}: {e}") from e
    if problem := _why_not_private(st, "file"):
        raise ValueError(
            f"pixel values {name} in {directory} refused: {problem}. The server reads only the 0600 files its engine "
            "wrote into its own pixel directory"
        )
    if st.st_size != nbytes:
        raise ValueError(f"pixel values {name}: {st.st_size} bytes for shape {shape} of {dtype} ({nbytes} expected)")
    if numel == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    # mapped, not read (the file's pages, which `link_pixel_files` hands on); private: opened read-only, and a file the
    # engine removed meanwhile is an error (shared=True would open it read-write and make a new zero-filled one)
    try:
        tensor = torch.from_file(path, shared=False, size=numel, dtype=getattr(torch, dtype)).reshape(shape)
    except RuntimeError as e:
        raise ValueError(f"pixel values {name} could not be mapped from {directory}: {e}") from e
    setattr(tensor, LINKED_FILE, (path, st.st_ino))
    return tensor


def _is_file_ref(value) -> bool:
    return isinstance(value, dict) and FILE_KEY in value


def resolve_item(item: dict, model_dtype, directory: str | None) -> dict:
    """One `processor_output` item with its file references read: pixel values as tensors in `model_dtype` (from
    float32 or that dtype; anything else is a ValueError), grids as int64 tensors [n, 3] whose patches add up to the
    pixel rows."""
    import torch

    out = dict(item)
    for key, value in item.items():
        if _is_file_ref(value):
            out[key] = read_tensor(value, directory)
    for key, grid_key in FEATURE_GRIDS.items():
        if key not in out:
            continue
        pixels = out[key]
        if not isinstance(pixels, torch.Tensor) or pixels.ndim != 2:
            raise ValueError(f"{key} must be a 2-D tensor [patches, dim], found {type(pixels).__name__}")
        if pixels.dtype != model_dtype:
            if pixels.dtype != torch.float32:
                raise ValueError(
                    f"{key} arrived as {pixels.dtype} but the model runs {model_dtype}: casting would lose precision "
                    "the model's own cast keeps; send float32 or the model's dtype"
                )
            pixels = out[key] = pixels.to(model_dtype)  # what get_image_feature's .type(visual.dtype) would do
        grid = torch.as_tensor(out.get(grid_key), dtype=torch.long) if out.get(grid_key) is not None else None
        if grid is None or grid.ndim != 2 or grid.shape[-1] != 3:
            raise ValueError(f"{key} needs {grid_key} as rows [t, h, w], found {out.get(grid_key)!r}")
        if int(grid.prod(dim=-1).sum()) != pixels.shape[0]:
            raise ValueError(
                f"{grid_key} {grid.tolist()} covers {int(grid.prod(dim=-1).sum())} patches but {key} has "
                f"{pixels.shape[0]} rows"
            )
        out[grid_key] = grid
    return out


def resolve_media(obj, model_dtype, directory: str | None = None) -> int:
    """Read the file references of a request's `processor_output` items in place (`image_data`, `video_data`);
    returns how many items were read. `directory`: default `$MILES_VL_SGLANG_PIXEL_DIR`."""
    if directory is None:
        directory = os.environ.get(PIXEL_DIR_ENV)
    resolved = 0
    for field in ("image_data", "video_data"):
        items = getattr(obj, field, None)
        if isinstance(items, dict):  # 0.5.16 hands a prompt of a batch its one video item unwrapped
            if any(_is_file_ref(v) for v in items.values()):
                setattr(obj, field, resolve_item(items, model_dtype, directory))
                resolved += 1
            continue
        if not isinstance(items, list):
            continue
        for k, item in enumerate(items):  # lists shared with the request's other prompts: read once, in place
            if isinstance(item, dict) and any(_is_file_ref(v) for v in item.values()):
                items[k] = resolve_item(item, model_dtype, directory)
                resolved += 1
    return resolved
