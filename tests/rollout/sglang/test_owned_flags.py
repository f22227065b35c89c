"""Contract (issue 15.12): `rollout.sglang.extra_args` cannot set a flag miles_vl owns (`OWNED_FLAGS`: host, port,
API key, ...) under any spelling SGLang's argparse accepts, abbreviations included (`--hos 0.0.0.0`, `--api-ke x`).
The reference is argparse itself, configured as SGLang's parser is (`allow_abbrev=True`, the default)."""

import argparse

import pytest

from miles_vl.rollout.sglang.server import OWNED_FLAGS, ServerSpec

# A few of SGLang's other flags, so that the reference parser has neighbours as the real one does.
OTHER_FLAGS = ("--log-level", "--context-length", "--dp-size", "--chunked-prefill-size", "--enable-metrics")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # raise instead of exiting
        raise argparse.ArgumentError(None, message)


def reference_dest(arg: str) -> str | None:
    """The flag argparse (allow_abbrev=True, as SGLang) sets for `arg value`; "ambiguous" if it refuses the prefix,
    None if it sets no flag."""
    parser = _Parser(allow_abbrev=True, add_help=False)
    for flag in (*OWNED_FLAGS, *OTHER_FLAGS):
        parser.add_argument(flag, dest=flag)
    try:
        ns, _ = parser.parse_known_args([arg, "v"])
    except argparse.ArgumentError:  # an ambiguous prefix, which SGLang refuses too
        return "ambiguous"
    set_flags = [flag for flag, value in vars(ns).items() if value is not None]
    return set_flags[0] if set_flags else None


def candidates() -> list[str]:
    """Every prefix of every owned flag (from `--x` on), and the other flags whole."""
    return sorted({flag[:n] for flag in OWNED_FLAGS for n in range(3, len(flag) + 1)} | set(OTHER_FLAGS))


def test_every_spelling_that_reaches_an_owned_flag_is_refused():
    refused = []
    for arg in candidates():
        dest = reference_dest(arg)
        reaches_owned = dest in OWNED_FLAGS or dest == "ambiguous"
        for spelling in ((arg, "v"), (f"{arg}=v",)):
            if reaches_owned:
                with pytest.raises(ValueError, match="which miles_vl sets itself from"):
                    ServerSpec(model_path="m", port=1, extra_args=spelling)
                refused.append(arg)
            else:
                ServerSpec(model_path="m", port=1, extra_args=spelling)  # accepted
    assert {"--hos", "--api-ke", "--po", "--mem-frac", "--enable-memory-sav"} <= set(refused)


def test_the_message_names_the_flag_it_abbreviates():
    with pytest.raises(ValueError, match=r"sets --hos \(a prefix of --host.*\), .*rollout\.sglang\.host"):
        ServerSpec(model_path="m", port=1, extra_args=("--hos", "0.0.0.0"))
    with pytest.raises(ValueError, match=r"sets --api-ke \(a prefix of --api-key.*rollout\.sglang\.api_key"):
        ServerSpec(model_path="m", port=1, extra_args=("--api-ke=x",))


def test_flags_that_would_take_the_keys_protection_away_are_refused():
    """Issue 30.4: every server has an API key. `--admin-api-key` would put a second key on the command line, one
    0.5.16 then demands instead of the API key on the routes miles_vl calls; more than one tokenizer worker runs no
    key check in 0.5.16 and refuses to start with a key. Refused under any spelling; one tokenizer worker is fine."""
    for args in (("--admin-api-key", "x"), ("--admin-api-key=x",), ("--admin-api", "x")):
        with pytest.raises(ValueError, match=r"sets --admin-api.*second key on the command line"):
            ServerSpec(model_path="m", port=1, extra_args=args)
    for args in (("--tokenizer-worker-num", "2"), ("--tokenizer-worker-num=4",), ("--tokenizer-worker", "2")):
        with pytest.raises(ValueError, match=r"sets --tokenizer-worker.* [24]: .*checks no API key"):
            ServerSpec(model_path="m", port=1, extra_args=args)
    ServerSpec(model_path="m", port=1, extra_args=("--tokenizer-worker-num", "1"))
