"""`model.path` as a local directory: a checkpoint directory as it is, or a Hugging Face hub id through the cache.

    local_model_dir("/ckpt/Qwen3-VL-2B-Instruct")                 # the directory itself
    local_model_dir("Qwen/Qwen3-VL-2B-Instruct")                  # its snapshot in the HF cache, else an error
    local_model_dir("Qwen/Qwen3-VL-2B-Instruct", download=True)   # downloads into the cache first when online

The cache is huggingface_hub's (`HF_HUB_CACHE`, else `HF_HOME/hub`, else `~/.cache/huggingface/hub`). With
`download=True` the hub is asked for the newest snapshot (and the missing files are downloaded); when it cannot be
reached, or `HF_HUB_OFFLINE=1`, the cached snapshot is used. `miles-vl train` downloads once, before Ray starts;
everything after it (processor, trainer, engines) loads the id from the cache with local files only. A hub id that is
not cached where the hub cannot be reached is one `ModelNotFoundError` naming the id and the command that fetches it.
"""

from __future__ import annotations

import re
from pathlib import Path

# owner/name as the hub spells repository ids (letters, digits, `-`, `_`, `.`); not a path that starts with `.`/`~`
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


class ModelNotFoundError(ValueError):
    """`model.path` is neither a directory nor a hub id that can be loaded here; the message says how to fetch it."""


def is_hub_id(path: str) -> bool:
    """True when `path` is not an existing path and has the shape of a hub repository id (`owner/name`)."""
    return not Path(path).exists() and _HUB_ID.fullmatch(path) is not None


def hub_offline() -> bool:
    """Whether huggingface_hub is set never to reach the hub (`HF_HUB_OFFLINE=1`)."""
    from huggingface_hub import constants

    return constants.is_offline_mode()


def cached_model_dir(path: str | Path) -> Path | None:
    """The local directory `path` names (a directory, or a hub id's cached snapshot), or None; no network, no error.
    For readers of a checkpoint's files (its config.json, its tensor names) that work with a hub id too."""
    try:
        return local_model_dir(str(path))
    except ModelNotFoundError:
        return None


def local_model_dir(path: str, *, download: bool = False, key: str = "model.path") -> Path:
    """The local directory `path` names: an existing directory, or the cached snapshot of the hub id `path`.

    Args:
        path: a checkpoint directory, or a hub id such as `Qwen/Qwen3-VL-2B-Instruct`.
        download: ask the hub for the newest snapshot and download what the cache lacks (the cached snapshot is used
            when the hub cannot be reached or `HF_HUB_OFFLINE=1`); False: the cache only, no network.
        key: the config key `path` came from, for messages.

    Returns:
        The directory (for a hub id: `<cache>/models--owner--name/snapshots/<commit>`).

    Raises:
        ModelNotFoundError: no such directory and not a hub id; a hub id not in the cache where it cannot be
            downloaded (the message names the id and `hf download <id>`); an id the hub does not have or refuses.
    """
    if Path(path).is_dir():
        return Path(path)
    if not is_hub_id(path):
        name = Path(path).name
        if name.lower().startswith("qwen"):  # the directory is named after the hub repository: say how to fill it
            fix = (
                f"download it there (`hf download Qwen/{name} --local-dir {path}`), or set {key}=Qwen/{name} (a hub "
                "id: `miles-vl train` downloads it into the Hugging Face cache)"
            )
        else:
            fix = f"set {key} to the directory of a Hugging Face checkpoint, or to a hub id (owner/name)"
        raise ModelNotFoundError(f"{key}={path!r}: no such directory, and not a hub id (owner/name); {fix}")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(path, local_files_only=not download))
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{key}={path!r}: the hub refuses the download (a gated repository); accept its terms on "
            f"https://huggingface.co/{path} and log in (`hf auth login`), or set {key} to a local checkpoint directory"
        ) from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{key}={path!r}: the hub has no such repository (or it is private: `hf auth login`); check the id, or "
            f"set {key} to a local checkpoint directory"
        ) from None
    except LocalEntryNotFoundError as err:
        if hub_offline():
            why = "HF_HUB_OFFLINE is set"
        elif not download:
            why = "this command does not download (`miles-vl train` does, when the hub can be reached)"
        else:
            why = f"the hub cannot be reached ({str(err).splitlines()[0]})"
        raise ModelNotFoundError(
            f"{key}={path!r} is a hub id that is not in the local Hugging Face cache ({constants.HF_HUB_CACHE}), and "
            f"{why}; fetch it where the hub is reachable with `hf download {path}` (into the cache this machine "
            f"reads: the same HF_HUB_CACHE or HF_HOME), or set {key} to a local checkpoint directory"
        ) from None
    except (HfHubHTTPError, OSError) as err:  # a server error, a full disk or an unwritable cache mid-download
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ModelNotFoundError(
            f"{key}={path!r}: downloading it from the hub failed ({first}); run `hf download {path}` to see why, or "
            f"set {key} to a local checkpoint directory"
        ) from None
