"""The plugin's settings: what the host decided for one server, handed to every server process in one environment
variable (`SETTINGS_ENV`, a JSON object). Without it the plugin does nothing; with it every key must be present and no
other key may be (a setting that drifts between the host and the plugin is an error, never a silent default).

Never imports SGLang (the host writes the variable).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

SETTINGS_ENV = "MILES_VL_SGLANG_PLUGIN"


@dataclass(frozen=True)
class PluginSettings:
    """What the plugin does in one server (docs/sglang.md, "The plugin").

    Args:
        share_copy_pixels: the `n` copies of a prompt travel without pixel values; the scheduler gives them the
            prompt's back by image hash (off by itself under `pixels.sharing_blockers`).
        group_copies: a batch's prefixes are pipelined and its copies leave in one message; False: SGLang's order (a
            benchmark's baseline).
        link_pixels: a mapped pixel file reaches the scheduler by a second name in /dev/shm, not a copy; False: SGLang
            copies it into a new segment (a benchmark's baseline).
        receive_threads: threads copying one receive's pixels out of shared memory; 1: one after another, as SGLang.
        pixel_cache_mb: the scheduler's memory of pixel tensors by image hash (`pixels.PixelMemory`), in MiB.
        vision_graphs: image layouts whose vision-tower CUDA graphs are kept (`vision.VisionGraphs`); 0: eager.
    """

    share_copy_pixels: bool = True
    group_copies: bool = True
    link_pixels: bool = True
    receive_threads: int = 8
    pixel_cache_mb: int = 4096
    vision_graphs: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            want = bool if f.type in ("bool", bool) else int
            if type(value) is not want:
                raise ValueError(
                    f"{SETTINGS_ENV}: {f.name} must be a {want.__name__}, found {value!r}; the host writes this "
                    "variable (miles_vl.rollout.sglang.server.build_server_env): do not set it by hand"
                )
        if self.receive_threads < 1 or self.pixel_cache_mb < 0 or self.vision_graphs < 0:
            raise ValueError(
                f"{SETTINGS_ENV}: receive_threads >= 1, pixel_cache_mb >= 0 and vision_graphs >= 0 expected, found "
                f"{self.receive_threads}, {self.pixel_cache_mb}, {self.vision_graphs}"
            )

    def to_env(self) -> str:
        """The value of `SETTINGS_ENV` (JSON; `from_env` reads it back)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    def patches(self) -> tuple[str, ...]:
        """The patches these settings ask for, by name (what the server's marker must list as live)."""
        return ("tokenizer", "receiver", "marker") + (("vision",) if self.vision_graphs else ())


def from_env(environ: Mapping[str, str]) -> PluginSettings | None:
    """The settings in `environ[SETTINGS_ENV]`, or None when the host did not opt in.

    Raises:
        ValueError: not a JSON object, a key missing or unknown, or a value of the wrong type; the message names it.
    """
    raw = environ.get(SETTINGS_ENV)
    if raw is None:
        return None
    try:
        given = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{SETTINGS_ENV} is not JSON ({e}): {raw[:200]!r}") from e
    if not isinstance(given, dict):
        raise ValueError(f"{SETTINGS_ENV} must be a JSON object, found {type(given).__name__}")
    names = {f.name for f in dataclasses.fields(PluginSettings)}
    missing, unknown = sorted(names - given.keys()), sorted(given.keys() - names)
    if missing or unknown:
        raise ValueError(
            f"{SETTINGS_ENV}: missing keys {missing}, unknown keys {unknown} (expected exactly {sorted(names)}); the "
            "host and the plugin come from different miles_vl installs: reinstall miles_vl on this machine"
        )
    return PluginSettings(**given)
