"""The GPU stack's pins for an image or a fresh environment, read from the two lists that define it (no third list).

    python3 scripts/cluster/stack_pins.py requirements [--only A,B | --except A,B]   # stack_requirements.txt's wheels
    python3 scripts/cluster/stack_pins.py constraints                                # both lists' pins, one per name

`requirements` prints `name==version` for every wheel of scripts/gpu/stack_requirements.txt (the closure the GPU
machine installs; in an image nothing is already there, so both policies install). `constraints` prints the union of
constraints.txt (the CPU environment's exact versions: torch, numpy, ...) and the stack list, for `pip install -c`.
A name the two lists pin at different versions is an error (exit 2, one line naming both): the stack must not drift
from the environment the tests run in. Standard library only; run from anywhere (paths are the checkout's).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STACK = REPO / "scripts" / "gpu" / "stack_requirements.txt"
CONSTRAINTS = REPO / "constraints.txt"


def norm(name: str) -> str:
    """A distribution name as pip compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, tuple[str, str]]:
    """normalised name -> (name as written, version) of every `name==version` line (a trailing policy word allowed)."""
    pins: dict[str, tuple[str, str]] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec = line.split()[0]
        if "==" not in spec:
            raise ValueError(f"{path}:{number}: expected `name==version`, found {line!r}")
        name, version = spec.split("==", 1)
        pins[norm(name)] = (name, version)
    return pins


def merged(stack: dict[str, tuple[str, str]], constraints: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """Both lists' pins; raises ValueError naming every name pinned twice at different versions."""
    clashes = [
        f"{stack[k][0]}=={stack[k][1]} in {STACK.name} but =={constraints[k][1]} in {CONSTRAINTS.name}"
        for k in sorted(stack.keys() & constraints.keys())
        if stack[k][1] != constraints[k][1]
    ]
    if clashes:
        raise ValueError("the two lists disagree: " + "; ".join(clashes) + " (make them equal)")
    return {**constraints, **stack}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["requirements", "constraints"])
    group = p.add_mutually_exclusive_group()
    group.add_argument("--only", default="", help="comma-separated names: only these (requirements)")
    group.add_argument("--except", dest="skip", default="", help="comma-separated names: all but these")
    p.add_argument("--stack", type=Path, default=STACK, help=argparse.SUPPRESS)
    p.add_argument("--constraints", type=Path, default=CONSTRAINTS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    try:
        stack = read_pins(args.stack)
        pins = stack if args.what == "requirements" else merged(stack, read_pins(args.constraints))
    except ValueError as e:
        print(f"stack_pins: {e}", file=sys.stderr)
        return 2
    only = {norm(n) for n in args.only.split(",") if n}
    skip = {norm(n) for n in args.skip.split(",") if n}
    unknown = sorted((only | skip) - stack.keys())
    if unknown:
        print(
            f"stack_pins: {', '.join(unknown)} not in {args.stack.name}: names of its wheels expected", file=sys.stderr
        )
        return 2
    for key, (name, version) in pins.items():
        if (not only or key in only) and key not in skip:
            print(f"{name}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
