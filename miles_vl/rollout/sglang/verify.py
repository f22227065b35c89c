"""Did a colocated weight sync land? What SGLang 0.5.16 lets us check for Qwen3-VL, and the check itself.

SGLang 0.5.16's `load_weights` for Qwen3-VL (`srt/models/qwen3_vl.py:1449-1532`) maps HF names onto its own
parameters and silently skips a name it does not know (`if name in params_dict ... else: continue`): a trainer that
exports other names than the checkpoint's would train a policy the server never runs. Reading the tensors back is not
possible there: `/get_weights_by_name` (`srt/entrypoints/http_server.py:1403`, body `GetWeightsByNameReqInput(name,
truncate_size=100)`, `srt/managers/io_struct.py:1723`) calls the model's own `get_weights_by_name`
(`srt/model_executor/model_runner_components/weight_exporter.py:142`), which only llama, opt, granite and exaone4
implement; for `Qwen3VLForConditionalGeneration` the AttributeError is logged and the route answers HTTP 400
`{"error": {"message": "Get parameter by name failed"}}` (where it works, it returns the first `truncate_size` rows of
TP rank 0's shard as float32 lists). What 0.5.16 does offer for every model is `/weights_checker`
(`http_server.py:1443`, `CheckWeightsReqInput(action="checksum")`): per TP rank, a hash of every parameter under
SGLang's own names (`WeightChecker._compute_checksum`, `srt/utils/weight_checker.py`; fused q/k/v and gate/up).

So after every colocated sync the engine checks two things (`SyncVerifier`):

1. names: every tensor sent is named as in the checkpoint the server loaded at start (`checkpoint_names`; plus
   `lm_head.weight` when the config ties it to the embedding, which `load_weights` loads into the shared tensor).
   SGLang loaded exactly those names at start, so they load; any other name would be skipped silently. Checked per
   bucket, before it is sent.
2. values: for a few small probe tensors (the last small one of the first and of the last bucket, the first of the
   vision tower, and those of the last sync when they are sent again) whose values changed since the last completed
   sync (compared in bf16), the server's hash of the parameter they load into must change across the sync
   (`/weights_checker` before the first bucket and after the flush). Probes are tensors that load 1:1 into a
   parameter the server reports under the plain renames of `load_weights`
   (`model.language_model.` -> `model.`, `model.visual.` -> `visual.`, `attn.qkv.` -> `attn.qkv_proj.`); fused or
   tied tensors are never probes. The server's memory before the sync is either the last synced values or, after a
   release without CPU backup, undefined: in both cases a changed tensor that landed changes the hash, and one that
   was skipped leaves it as it was.

Cost per checked sync: two `/weights_checker` calls (the server hashes its weights on the GPU) and a CPU hash of a
handful of tensors of at most `PROBE_MAX_NUMEL` elements. The colocated IPC sync (weights.py, `ColocatedWeightSender`)
checks values only on some syncs (`weight_sync.verify_due`: the first after its group opened, then every
`rollout.sglang.verify_weights_every`-th); the others cost the names check and the probes' CPU hash only
(`begin(values=False)`), so that the next checked sync knows what the server held before it. If the server cannot
answer `/weights_checker`, the value check is turned off for that engine with a warning; the name check needs no server
call.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from miles_vl.models.hub import cached_model_dir
from miles_vl.models.qwen3_vl import HF_VISION_PREFIX, SGLANG_RENAMES
from miles_vl.rollout.sglang.client import SGLangClient, SGLangError, SGLangRequestError, SGLangResponseError

log = logging.getLogger(__name__)

PROBE_MAX_NUMEL = 1 << 20  # probes are small tensors: their fingerprint is a CPU hash of their bytes
VISION_PREFIX = HF_VISION_PREFIX
RENAMES = SGLANG_RENAMES


class WeightSyncError(SGLangError):
    """A weight sync would not land or did not land: a name SGLang does not load, or a tensor sent with new values
    whose server copy did not change."""


def checkpoint_names(model_path: str | Path) -> frozenset[str] | None:
    """The tensor names an SGLang server loads from `model_path`: those of its safetensors files, plus
    `lm_head.weight` when `config.json` ties it to the embedding (`tie_word_embeddings`, top level or `text_config`).

    Returns:
        The names, or None when `model_path` is neither a local directory nor a cached hub id with safetensors
        files: then sent names cannot be checked.
    """
    path = cached_model_dir(model_path) or Path(model_path)  # a hub id: its snapshot in the local cache
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        return None
    from safetensors import safe_open

    names: set[str] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update(handle.keys())
    config = path / "config.json"
    if config.exists():
        cfg = json.loads(config.read_text())
        tied = cfg.get("tie_word_embeddings", (cfg.get("text_config") or {}).get("tie_word_embeddings", False))
        if tied:
            names.add("lm_head.weight")
    return frozenset(names)


def fingerprint(tensor: Tensor) -> str:
    """A hash of the tensor's shape and values, floating-point ones rounded to bf16 first: a change the server (bf16
    or wider) cannot show is no change, and the same values sent as fp32 once and bf16 later are the same."""
    t = tensor.detach()
    if t.is_floating_point():
        t = t.to(torch.bfloat16)
    t = t.contiguous().cpu()
    h = hashlib.sha256(str(tuple(t.shape)).encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def server_name(name: str, server_names: Collection[str]) -> str | None:
    """The server parameter an HF-named tensor loads into 1:1, when the plain renames of `load_weights` give a name
    the server reports; None otherwise (fused q/k/v or gate/up, experts, tied or unknown tensors)."""
    for old, new in RENAMES:
        name = name.replace(old, new)
    return name if name in server_names else None


def parse_checksums(body: Any, where: str) -> dict[str, tuple[str, ...]]:
    """`/weights_checker` (action "checksum") answer -> {server parameter name: (hash on TP rank 0, rank 1, ...)}."""
    ranks = body.get("ranks") if isinstance(body, dict) else None
    if not isinstance(ranks, list) or not ranks or not all(isinstance((r or {}).get("checksums"), dict) for r in ranks):
        raise SGLangResponseError(f"{where}: /weights_checker answered {str(body)[:200]!r}; expected ranks[].checksums")
    ranks = sorted(ranks, key=lambda r: (r.get("parallelism_info") or {}).get("tp_rank", 0))
    names = set(ranks[0]["checksums"])
    return {n: tuple(str(r["checksums"].get(n)) for r in ranks) for n in names}


@dataclass
class _Probe:
    name: str  # as sent (HF)
    server: str  # the server parameter it loads into
    fingerprint: str


@dataclass
class SyncVerifier:
    """The checks of one engine's colocated syncs (module docstring). Call `begin`, `bucket` per bucket, `finish`.

    Args:
        client: the server's client.
        known_names: `checkpoint_names(model_path)`; None: names are not checked.
        check_values: run the value check (turned off by itself when the server cannot answer `/weights_checker`).
    """

    client: SGLangClient
    known_names: frozenset[str] | None
    check_values: bool = True
    # probe name -> fingerprint of what the last completed syncs sent: the server holds it (or, after a release
    # without CPU backup, undefined memory). The probes of the last sync are probed again when they are sent again,
    # so a sync in another order still finds what it can check.
    last_sent: dict[str, str] = field(default_factory=dict)
    _before: dict[str, tuple[str, ...]] | None = None
    # the parameter names the server reported at its first `/weights_checker`: probes are picked on every sync, also
    # on those that skip the value check (`begin(values=False)`), so the next checked sync knows what the server holds
    _server_names: frozenset[str] | None = None
    _roles: dict[str, str] = field(default_factory=dict)  # "first" | "last" | "vision" -> probe name
    _probes: dict[str, _Probe] = field(default_factory=dict)  # name -> probe
    _buckets: int = 0
    _open: bool = False

    def begin(self, values: bool = True) -> None:
        """Before the first bucket: the server's hashes (the state the sync must change).

        Args:
            values: run the value check on this sync (`weight_sync.verify_due`); False still checks names and records
                the probes sent, at the cost of no server call.
        """
        if self._open:  # a sync that did not finish may have changed the server's copies: they are unknown now
            self.last_sent.clear()
        self._open, self._roles, self._probes, self._buckets = True, {}, {}, 0
        self._before = self._checksums() if self.check_values and values else None
        if self._before is not None:
            self._server_names = frozenset(self._before)

    def bucket(self, named_tensors: Sequence[tuple[str, Tensor]]) -> None:
        """Check a bucket's names (raises before anything is sent) and pick its probes.

        Raises:
            WeightSyncError: a name the server's checkpoint does not have.
        """
        if self.known_names is not None:
            unknown = [n for n, _ in named_tensors if n not in self.known_names]
            if unknown:
                raise WeightSyncError(
                    f"{len(unknown)} tensor(s) of this weight sync are not named as in the checkpoint the SGLang "
                    f"server loaded, e.g. {unknown[:3]}; SGLang 0.5.16's load_weights would skip them silently "
                    "(srt/models/qwen3_vl.py:1522-1525), so the server would not run the trained policy. Export the "
                    "weights with the HF names of that checkpoint (model.language_model.*, model.visual.*, lm_head.*)"
                )
        self._buckets += 1
        if not self.check_values or self._server_names is None:
            return
        mapped = {
            n: (t, s)
            for n, t in named_tensors
            if t.numel() <= PROBE_MAX_NUMEL and (s := server_name(n, self._server_names)) is not None
        }
        if not mapped:
            return
        last = list(mapped)[-1]
        if self._buckets == 1:
            self._roles["first"] = last
        self._roles["last"] = last
        vision = next((n for n in mapped if n.startswith(VISION_PREFIX)), None)
        if vision is not None and "vision" not in self._roles:
            self._roles["vision"] = vision
        for n, (t, s) in mapped.items():
            if n in self._roles.values() or n in self.last_sent:
                self._probes[n] = _Probe(n, s, fingerprint(t))
        for n in [n for n in self._probes if n not in self._roles.values() and n not in self.last_sent]:
            del self._probes[n]  # a former "last" of an earlier bucket

    def finish(self) -> list[str]:
        """After the version label and the flush: compare the probes' server hashes with those before the sync.

        Returns:
            The names of the probes that were checked (changed since the last sync and compared).

        Raises:
            WeightSyncError: a probe sent with new values whose server parameter did not change.
        """
        before, self._before, self._open = self._before, None, False
        if before is None:  # no value check this sync: what it sent is what the server holds from now on
            self.last_sent.update({p.name: p.fingerprint for p in self._probes.values()})
            return []
        if not self._probes:
            return []
        after = self._checksums()
        if after is None:
            return []
        checked, failed = [], []
        for p in self._probes.values():
            previous = self.last_sent.get(p.name)
            self.last_sent[p.name] = p.fingerprint
            if previous is None or previous == p.fingerprint:
                continue  # nothing known about the server's copy, or unchanged values: no change expected
            checked.append(p.name)
            if p.server in after and after[p.server] == before.get(p.server):
                failed.append(p)
                del self.last_sent[p.name]  # the server's copy is unknown again
        if failed:
            p = failed[0]
            raise WeightSyncError(
                f"weight sync did not land: {p.name!r} was sent with new values, but the server's parameter "
                f"{p.server!r} is unchanged (/weights_checker hash {after[p.server][0]})"
                + (f", and so are {[q.name for q in failed[1:]]}" if len(failed) > 1 else "")
                + ". SGLang 0.5.16 skips tensors it does not load without an error; check the server log and the "
                "names and shapes the trainer exports"
            )
        return checked

    def server_restarted(self) -> None:
        """The server reloaded `model_path`: what the last syncs sent is gone."""
        self.last_sent.clear()
        self._server_names = None
        self._before, self._open = None, False

    def _checksums(self) -> dict[str, tuple[str, ...]] | None:
        try:
            return parse_checksums(self.client.check_weights(), self.client.base_url)
        except (SGLangRequestError, SGLangResponseError) as e:
            self.check_values = False
            log.warning(
                "SGLang %s cannot hash its weights (/weights_checker: %s); synced values are not verified on this "
                "engine from now on (sent names still are)",
                self.client.base_url,
                e,
            )
            return None
