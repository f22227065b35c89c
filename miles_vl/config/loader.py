"""YAML + `key.sub=value` overrides -> a validated `JobConfig`, or one `ConfigError` listing every problem.

OmegaConf loads, merges and resolves (`${...}` interpolations work); pydantic validates. Each problem names
the dotted key, where it came from (the YAML file or the command line), what was expected and what was
found, with a did-you-mean for misspelt keys. A key given twice in one mapping of the file is an error (YAML
would keep the second silently), as is a file that is not UTF-8 text (the message gives the line). YAML aliases may
add at most `MAX_ALIAS_NODES` nodes to the file or to an override's value, and an alias inside its own anchor is
refused: a "billion laughs" file is refused while it is parsed, before anything is expanded; interpolations of
sections may add no more when resolved. The value of a secret field (`schema.secret_field`) is never repeated in a
message.

    cfg = load_config("configs/geo3k_tiny_cpu.yaml", ["rollout.n_samples_per_prompt=8"])
"""

from __future__ import annotations

import copy
import difflib
import re
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

from miles_vl.config.schema import REDACTED, JobConfig, cross_field_errors, secret_keys

# How many nodes YAML aliases may add to one document (the config file, or the value of one override): the nodes the
# document would have with every alias written out, less those it has. An alias stands for the whole node of its
# anchor, and aliases of aliases multiply: nine lines, each nine aliases of the line before (the "billion laughs"),
# stand for 9^9 = 387 million strings, which OmegaConf copies one by one (it kept `miles-vl check` busy for over 5
# minutes at 3.2 GB). The shipped configs use no alias and have 57 to 111 nodes; a complete config, every key of the
# schema written out, has 312, so reusing a section, or even a whole config, a few times adds hundreds. OmegaConf
# builds a node in about 150 us (measured: 59,049 aliased strings took 9 s), so 10,000 keeps the worst accepted file
# near 1.5 s. The same bound holds for the nodes that `${...}` interpolations of sections add when resolved.
MAX_ALIAS_NODES = 10_000

# Keys that configs of earlier releases may still set: what became of each and the fix. An unknown key that is here
# gets this message instead of a did-you-mean.
REMOVED_KEYS = {
    "train.packing": "train.packing was removed: training always packs samples into THD rows (the only layout; "
    "nothing read the key); delete it from the config",
    "rollout.sglang.share_copy_pixels": "rollout.sglang.share_copy_pixels was replaced by rollout.sglang.launcher "
    "(SGLang's server now takes miles_vl's patches as a plugin): write launcher: miles_vl for true, launcher: sglang "
    "for false",
}


class ConfigError(ValueError):
    """All problems of one config, collected. `problems` holds one line each."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        self.source = source
        head = f"invalid config {source}" if source else "invalid config"
        super().__init__(
            f"{head} ({len(problems)} problem{'s' if len(problems) != 1 else ''}):\n  - " + "\n  - ".join(problems)
        )


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> JobConfig:
    """Load `path`, apply `overrides` (`a.b=value`, YAML-typed values), validate.

    Raises:
        ConfigError: missing or malformed file, malformed override, unknown key, wrong type, inconsistent values.
    """
    raw = load_raw(path, overrides)
    return validate(raw, source=str(path), override_keys=_override_keys(overrides))


def load_run_config(path: str | Path) -> JobConfig:
    """A finished or stopped run's own `config.yaml`, for reading it (`miles-vl export`): every key checked as in
    `load_config`, the rules over several keys not, since the run started under them, or under an earlier release's
    (a rule added since, such as checkpoint.save_hf.steps <= num_steps, must not lock its checkpoints away).

    Raises:
        ConfigError: missing or malformed file, unknown key, wrong type.
    """
    return validate(load_raw(path), source=str(path), cross_checks=False)


def load_raw(path: str | Path, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The merged, resolved config as plain containers, before validation."""
    path = Path(path)
    if not path.is_file():
        hint = ""
        if path.parent.is_dir():
            near = difflib.get_close_matches(path.name, [p.name for p in path.parent.glob("*.yaml")], n=1)
            hint = f"; did you mean {path.parent / near[0]}?" if near else ""
        raise ConfigError([f"config file not found: {path}{hint}"])
    try:
        text = decode_utf8(path.read_bytes(), path)
    except OSError as e:
        raise ConfigError([f"cannot read the config file: {e.strerror or e}"], str(path)) from None
    except ValueError as e:
        raise ConfigError([str(e)], str(path)) from None
    try:
        # yaml first for a precise line/column on syntax errors; OmegaConf then owns merging and interpolation.
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except AliasExpansionError as e:
        raise ConfigError([str(e)], str(path)) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"malformed YAML{where}: {getattr(e, 'problem', None) or e}"], str(path)) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"the top level must be a mapping of sections, found {type(data).__name__}"], str(path))
    problems = [
        f"malformed override {redact_overrides([o])[0][0]!r}: expected key.sub=value"
        for o in overrides
        if not is_override(o)
    ]
    alias_problems = _alias_problems(overrides)
    problems += alias_problems
    if not alias_problems:  # OmegaConf's parse of a value would expand an alias bomb
        problems += [problem for o in overrides if is_override(o) and (problem := _unparseable(o))]
    if problems:
        raise ConfigError(problems, str(path))
    try:
        merged = OmegaConf.merge(OmegaConf.create(data), OmegaConf.from_dotlist(list(overrides)))
        if _interpolations_overflow(merged):
            raise ConfigError(
                [
                    f"interpolations (`${{...}}` of a section, and of those) would add more than {MAX_ALIAS_NODES} "
                    "nodes when resolved (a config needs at most a few hundred): write the repeated parts out, or "
                    "refer to a section fewer times"
                ],
                str(path),
            )
        resolved = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError([f"cannot merge or resolve: {e}".splitlines()[0]], str(path)) from None
    assert isinstance(resolved, dict)
    return resolved


def validate(
    raw: dict[str, Any], source: str | None = None, override_keys: set[str] | None = None, cross_checks: bool = True
) -> JobConfig:
    """Validate plain containers into a `JobConfig`, or raise one `ConfigError` with every problem. `cross_checks`:
    also the rules over several keys (`cross_field_errors`)."""
    try:
        return JobConfig.model_validate(raw, context=None if cross_checks else {"skip_cross_checks": True})
    except ValidationError as e:
        errors = e.errors()
    problems = [line for err in errors for line in _describe(err, source, override_keys or set()).splitlines()]
    bad = [tuple(map(str, err["loc"])) for err in errors]
    if cross_checks and all(bad):  # no top-level error: the cross-field validator has not run yet
        problems += _cross_field_problems_without(raw, bad, source, override_keys or set())
    raise ConfigError(problems, source)


def _cross_field_problems_without(
    raw: dict[str, Any], bad: list[tuple[str, ...]], source: str | None, override_keys: set[str]
) -> list[str]:
    """Cross-field problems among the keys that are individually valid, so that one run reports everything.

    Pydantic skips the cross-field validator when any field fails; here the failing keys are removed (their
    defaults stand in) and the rest is checked again. Messages that mention a removed key are left out.
    """
    pruned = copy.deepcopy(raw)
    for loc in bad:
        node: Any = pruned
        for part in loc[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(loc[-1], None)
    try:
        cfg = JobConfig.model_validate(pruned, context={"skip_cross_checks": True})
    except ValidationError:
        return []
    removed = {".".join(loc) for loc in bad}
    problems = [p for p in cross_field_errors(cfg) if not any(k and k in p for k in removed)]
    return [f"{p}{_cross_origin(p, source, override_keys)}" for p in problems]


# ---------------------------------------------------------------------------------------------------------------------


def decode_utf8(data: bytes, path: str | Path) -> str:
    """`data` as UTF-8 text.

    Raises:
        ValueError: not UTF-8; the message names the file, the line and the byte.
    """
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}: not UTF-8 text (byte 0x{data[e.start]:02x} at line {line}); save the file as UTF-8"
        ) from None


class AliasExpansionError(yaml.YAMLError):
    """YAML aliases that would add more than `MAX_ALIAS_NODES` nodes to a document, or an alias inside its anchor."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml's safe loader, refusing a key given twice in one mapping (merge keys `<<` still override) and aliases that
    expand a document past `MAX_ALIAS_NODES` (or never end).

    The composer returns an alias as its anchor's node itself (shared, not copied), so while composing nothing has
    been expanded yet; the count refuses a document before construction (which repeats merge keys, `<<: [*a, *a]`) and
    OmegaConf (which copies every shared node) expand it. `_sizes` holds the expanded size of every finished node (one
    plus its children's); the node of an anchor has none while it is being composed, so an alias to it is inside it.
    """

    def compose_document(self) -> yaml.Node | None:
        self._sizes: dict[yaml.Node, int] = {}
        self._alias_nodes = 0  # per document, like an anchor's scope
        return super().compose_document()

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            node = self.anchors.get(event.anchor)
            if node is not None:  # else yaml's own error: an undefined alias
                where = f"the alias *{event.anchor} at line {event.start_mark.line + 1}"
                if node not in self._sizes:
                    raise AliasExpansionError(
                        f"{where} is inside its own anchor, a structure that never ends; write the part out instead"
                    )
                self._alias_nodes += self._sizes[node]
                if self._alias_nodes > MAX_ALIAS_NODES:
                    raise AliasExpansionError(
                        f"YAML aliases would add more than {MAX_ALIAS_NODES} nodes ({where} brings them to "
                        f"{self._alias_nodes}; a config needs at most a few hundred): write the repeated parts out, or "
                        "use fewer aliases"
                    )
            return super().compose_node(parent, index)
        node = super().compose_node(parent, index)
        if isinstance(node, yaml.SequenceNode):
            children: list[yaml.Node] = node.value
        elif isinstance(node, yaml.MappingNode):
            children = [n for pair in node.value for n in pair]
        else:
            children = []
        self._sizes[node] = 1 + sum(self._sizes[c] for c in children)
        return node


def _construct_unique_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); YAML would keep only the "
                "second: merge them into one",
                key_node.start_mark,
            )
        seen[key] = line
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)


def _alias_problems(overrides: Sequence[str]) -> list[str]:
    """The overrides whose value holds aliases past `MAX_ALIAS_NODES` (OmegaConf parses each value as YAML itself,
    with a bound of its own only from OmegaConf 2.4 on, and one that an environment variable turns off)."""
    problems = []
    for o in overrides:
        key, _, value = o.partition("=")
        try:
            yaml.compose(value, Loader=_UniqueKeyLoader)
        except AliasExpansionError as e:
            problems.append(f"the command-line override {key}=...: {e}")
        except yaml.YAMLError:
            pass  # a malformed value: OmegaConf reports it, as it always has
    return problems


def _interpolations_overflow(cfg: DictConfig) -> bool:
    """Whether resolving `cfg` would add more than `MAX_ALIAS_NODES` nodes to it.

    An interpolation of a section (`b: [${a}, ${a}]`) stands for all of it, and interpolations of those multiply like
    aliases do: six lines of nine took `to_container(resolve=True)` 8 s, each line more nine times that. Resolved here
    node by node (an interpolation of a section gives the section's node, nothing is copied), counting, and stopping
    at the bound, so the check costs at most that many lookups; the nodes as written are counted without resolving.
    Missing values (`???`) are left alone, as `to_container` leaves them.
    """
    limit = _count_nodes(OmegaConf.to_container(cfg, resolve=False)) + MAX_ALIAS_NODES
    count, stack = 0, [cfg]
    while stack:
        node = stack.pop()
        for key in node.keys() if isinstance(node, DictConfig) else range(len(node)):
            count += 1
            if count > limit:
                return True
            if not OmegaConf.is_missing(node, key) and isinstance(value := node[key], DictConfig | ListConfig):
                stack.append(value)
    return False


def _count_nodes(value: Any) -> int:
    """Values in plain nested containers, the containers included (the root not)."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return sum(1 + _count_nodes(child) for child in children)


def is_override(text: str) -> bool:
    """Whether `text` has the form of an override, `key.sub=value`."""
    key, sep, _ = text.partition("=")
    return bool(sep) and bool(key) and all(part.isidentifier() for part in key.split("."))


def redact_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """`overrides` with each one that gives a secret field (`schema.secret_field`) a value written as `key=<redacted>`,
    and the secret keys given one.

    Every spelling the loader takes counts: `rollout.sglang.api_key=...`, and a mapping that holds the key
    (`rollout.sglang={api_key: ...}`: the whole value is redacted). A value taken from elsewhere (only `${oc.env:VAR}`
    or `${other.key}`) is no secret on the command line and stays; a value that does not parse is redacted whole.
    """
    out, given = [], []
    for text in overrides:
        key, sep, value = text.partition("=")
        key = key.strip()
        found = [s for s in secret_keys() if sep and (s == key or s.startswith(key + ".")) and _sets(key, value, s)]
        out.append(f"{key}={REDACTED}" if found else text)
        given += found
    return out, list(dict.fromkeys(given))


# `${oc.env:VAR}` or `${a.key}`: a value that names where the secret is, not the secret
_REFERENCE = re.compile(r"\$\{(oc\.env:)?[A-Za-z_][\w.]*\}")


def _sets(key: str, value: str, secret: str) -> bool:
    """Whether the override `key=value` gives `secret` (a dotted key at or under `key`) a literal value."""
    try:
        yaml.compose(value, Loader=_UniqueKeyLoader)  # bounded: OmegaConf's own parse would expand an alias bomb
    except (AliasExpansionError, yaml.YAMLError):  # the loader reports it; the text may hold the secret
        return True
    try:
        node: Any = OmegaConf.to_container(OmegaConf.from_dotlist([f"{key}={value}"]), resolve=False)
    except Exception:  # unparseable: the loader reports it, and the text may hold the secret
        return True
    for part in secret.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node is not None and not (isinstance(node, str) and not _REFERENCE.sub("", node))


def _unparseable(override: str) -> str | None:
    """Why the value of `override` is not YAML (OmegaConf parses it with yaml, which would raise from the merge), or
    None. A secret's value is not repeated."""
    try:
        OmegaConf.from_dotlist([override])
    except yaml.YAMLError as e:
        return (
            f"override {redact_overrides([override])[0][0]!r}: the value is not valid YAML "
            f"({getattr(e, 'problem', None) or e}); quote it (key='...') if it is text"
        )
    except OmegaConfBaseException:  # the merge reports it with the rest
        pass
    return None


def _override_keys(overrides: Sequence[str]) -> set[str]:
    return {o.partition("=")[0] for o in overrides}


def _describe(err: dict[str, Any], source: str | None, override_keys: set[str]) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc)
    origin = _origin(key, source, override_keys)
    kind = err["type"]
    if kind == "extra_forbidden" and key in REMOVED_KEYS:
        return f"{REMOVED_KEYS[key]}{origin}"
    if kind == "extra_forbidden":
        known = _known_fields(loc[:-1])
        near = difflib.get_close_matches(loc[-1], known, n=1, cutoff=0.6)
        hint = f"; did you mean '{'.'.join([*loc[:-1], near[0]])}'?" if near else ""
        section = ".".join(loc[:-1]) or "the top level"
        return f"unknown key '{key}'{origin}{hint} (known keys of {section}: {', '.join(known)})"
    if kind == "missing":
        return f"missing required key '{key}'{origin}"
    msg = err["msg"]
    if key in secret_keys():
        return f"'{key}'{origin}: {msg} (value {REDACTED})"
    if kind == "value_error":
        msg = msg.removeprefix("Value error, ")
        if not key:  # cross-field rules: one line each
            return "\n".join(f"{line}{_cross_origin(line, source, override_keys)}" for line in msg.splitlines())
        return f"'{key}': {msg}{origin}"
    found = err.get("input")
    return f"'{key}'{origin}: {msg}, found {found!r}"


def _origin(key: str, source: str | None, override_keys: set[str]) -> str:
    for ok in override_keys:
        if key == ok or key.startswith(ok + ".") or ok.startswith(key + ".") and key:
            return f" (from the command-line override {ok}=...)"
    return f" in {source}" if source else ""


def _cross_origin(line: str, source: str | None, override_keys: set[str]) -> str:
    """Where the keys of a rule over several keys were set: the command-line overrides the line names, the rest in
    `source` (a fix made in the file would not win over an override)."""
    given = sorted(k for k in override_keys if re.search(rf"(?<![\w])(?<![\w]\.){re.escape(k)}(?![\w])", line))
    if not given:
        return f" in {source}" if source else ""
    rest = f"; the others in {source}" if source else ""
    return f" ({', '.join(given)} from the command line{rest})"


def _known_fields(loc: list[str]) -> list[str]:
    model: type[BaseModel] = JobConfig
    for part in loc:
        field = model.model_fields.get(part)
        sub = _model_of(field.annotation) if field else None
        if sub is None:
            return []
        model = sub
    return list(model.model_fields)


def _model_of(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        for arg in typing.get_args(annotation):
            if (m := _model_of(arg)) is not None:
                return m
    return None
