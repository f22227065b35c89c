"""Reward functions by name: the built-in registry, or a `module:function` import path from the config.

    fn = resolve_reward("geo3k", format_weight=0.1)          # built-in
    fn = resolve_reward("my_pkg.rewards:exact_match")       # any importable function
    fn = resolve_reward("my_pkg.rewards:Graders.strict")    # dotted attributes after the colon work too

`resolve_reward` runs while the config is validated, before Ray starts, so that a typo fails in seconds with a
message that names the path and what went wrong: module not found, import failed, attribute missing, not callable,
or a signature that cannot take one sample. The contract every reward function follows is in
`miles_vl.reward.types`: one positional argument (a `RewardSample`), sync or `async def`.

Options (`reward.kwargs` in the config, for any reward; geo3k also takes `reward.format_weight` and
`reward.format_pattern`) are bound as keyword arguments; an option the function does not take is an error, never
silently dropped. For registered rewards with an option check (geo3k) the option
values are validated here too. Rewards run in worker processes (`scoring.RewardPool`), so the resolved function
must pickle (by reference, or by value with cloudpickle: `scoring.to_payload`); one that cannot is refused here.
A callable given in memory (`run_job(cfg, reward_fn=...)`) goes through the same checks: `check_reward`.
A batched reward (`types.reward_function(batched=True)`) is checked against its keywords (`prompts`,
`completions`, `label`, `metadata`, and `images` if it asked for them) instead of one sample.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from miles_vl.import_path import shadowing_problem
from miles_vl.reward.geo3k import check_geo3k_options, geo3k_reward
from miles_vl.reward.math_answer import math_reward
from miles_vl.reward.scoring import to_payload
from miles_vl.reward.types import RewardFn, batch_arguments, reward_traits

REWARD_REGISTRY: dict[str, RewardFn] = {
    "geo3k": geo3k_reward,
    "math": math_reward,
}

# Validators of registered rewards' option values, run at resolution time so bad values fail early.
REWARD_OPTION_CHECKS: dict[str, Callable[..., None]] = {
    "geo3k": check_geo3k_options,
}

# Options a registered reward takes from keys of its own in the config's `reward` section (every reward takes
# `reward.kwargs`): the driver binds them only for that reward.
REWARD_CONFIG_KEYS: dict[str, tuple[str, ...]] = {
    "geo3k": ("format_weight", "format_pattern"),
}


class RewardResolutionError(ValueError):
    """A reward name or `module:function` path that cannot be turned into a usable reward function."""


def resolve_reward(name: str, **options: Any) -> RewardFn:
    """The reward function for a registry name or a `module:function` path, with `options` bound.

    Args:
        name: a key of `REWARD_REGISTRY` (e.g. "geo3k") or "package.module:function" (the part after the colon may
            be a dotted attribute path).
        **options: keyword arguments bound to the function (functools.partial).

    Returns:
        A callable taking one `RewardSample` (sync or async, as the target is).

    Raises:
        RewardResolutionError: unknown name, malformed path, module not found or failing to import, attribute
            missing, target not callable, option not accepted or invalid, or a signature that cannot be called with
            exactly one sample, or a function that cannot be sent to a worker process (does not pickle). The message
            names `name` and the fix.
    """
    if ":" in name:
        fn = _import_path(name)
    elif name in REWARD_REGISTRY:
        fn = REWARD_REGISTRY[name]
    else:
        raise RewardResolutionError(
            f"unknown reward {name!r}: registered rewards are {sorted(REWARD_REGISTRY)}; "
            "or give an import path 'package.module:function'"
        )
    if not callable(fn):
        raise RewardResolutionError(
            f"reward {name!r} resolves to {type(fn).__name__} {fn!r:.80}, which is not callable; point it at a function"
        )
    if options and name in REWARD_OPTION_CHECKS:
        _check_signature(name, fn, options)
        try:
            REWARD_OPTION_CHECKS[name](**options)
        except (TypeError, ValueError) as err:
            raise RewardResolutionError(f"reward {name!r}: bad option: {err}") from err
    return check_reward(fn, name, **options)


def check_reward(fn: Callable[..., Any], name: str, **options: Any) -> RewardFn:
    """`fn` with `options` bound, checked as `resolve_reward` checks a resolved function (signature, pickling).

    Raises:
        RewardResolutionError: not callable, an option it does not take, a signature that cannot take one sample (or
            the batch keywords, for a batched reward), or it cannot be sent to a worker process.
    """
    if not callable(fn):
        raise RewardResolutionError(
            f"reward {name!r} is {type(fn).__name__} {fn!r:.80}, which is not callable; give a function"
        )
    _check_signature(name, fn, options)
    resolved = functools.partial(fn, **options) if options else fn
    try:
        to_payload(resolved)
    except TypeError as err:
        raise RewardResolutionError(f"reward {name!r}: {err}") from err
    return resolved


def _import_path(path: str) -> Any:
    module_name, _, attr_path = path.partition(":")
    if not module_name or not attr_path or ":" in attr_path:
        raise RewardResolutionError(
            f"reward path {path!r} is malformed: expected exactly one colon between a module and a function, "
            "like 'my_pkg.rewards:score'"
        )
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is not None and (module_name == err.name or module_name.startswith(err.name + ".")):
            raise RewardResolutionError(
                f"reward path {path!r}: module {module_name!r} not found ({err}); check the spelling and that it is "
                "importable from where the job runs (installed, or its folder on PYTHONPATH)"
            ) from err
        raise RewardResolutionError(
            f"reward path {path!r}: importing module {module_name!r} failed because it imports a missing module "
            f"({err}); install that dependency"
        ) from err
    except Exception as err:
        raise RewardResolutionError(
            f"reward path {path!r}: importing module {module_name!r} raised {type(err).__name__}: {err}"
        ) from err
    if problem := shadowing_problem(module_name, module):
        raise RewardResolutionError(f"reward path {path!r}: {problem}")
    target: Any = module
    walked = module_name
    for part in attr_path.split("."):
        if not hasattr(target, part):
            public = sorted(n for n in dir(target) if not n.startswith("_") and callable(getattr(target, n, None)))
            raise RewardResolutionError(
                f"reward path {path!r}: {walked!r} has no attribute {part!r}; callables it defines: {public[:20]}"
            )
        target = getattr(target, part)
        walked = f"{walked}.{part}"
    return target


def _check_signature(name: str, fn: Callable[..., Any], options: dict[str, Any]) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins and C callables have no signature; they are checked when called
        return
    params = sig.parameters
    takes_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for key in options:
        p = params.get(key)
        if not takes_kwargs and (p is None or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)):
            accepted = [n for n, q in params.items() if q.kind in (q.POSITIONAL_OR_KEYWORD, q.KEYWORD_ONLY)]
            raise RewardResolutionError(
                f"reward {name!r} does not take the option {key!r} (its keyword parameters: {accepted}); "
                "remove the option or add the parameter to the function"
            )
    traits = reward_traits(fn)
    if traits.batched:
        keywords = dict.fromkeys(batch_arguments([], images=traits.images), [])
        try:
            sig.bind(**keywords, **options)
        except TypeError as err:
            raise RewardResolutionError(
                f"batched reward {name!r} has the signature {sig}, which cannot take the keywords {sorted(keywords)} "
                f"({err}); take them by name or add **kwargs, e.g. `def score(prompts, completions, **kwargs): ...`"
            ) from err
        return
    try:
        sig.bind(object(), **options)
    except TypeError as err:
        raise RewardResolutionError(
            f"reward {name!r} has the signature {sig}, which cannot be called with one sample ({err}); a reward "
            "function takes exactly one positional argument, the RewardSample, e.g. `def score(sample): ...`; mark "
            "one that takes lists with `@reward_function(batched=True)`"
        ) from err
