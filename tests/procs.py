"""Killing for tests that kill and wait: whether a process is gone, and a Ray actor killed and seen dead.

A zombie (exited, not yet reaped by its parent or init) counts as gone, which `os.kill(pid, 0)` does not see.
`ray.kill` returns before the actor is gone: a call made at once can still be answered (the suite once counted a
killed engine's 7), so a test that kills an actor to see what the code does next waits until a call fails."""

import time

import ray


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # the state follows the parenthesized command name
    except FileNotFoundError:
        return True


def gone_within(pid: int, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Whether the process is gone (`process_gone`) by `timeout_s` from now, polling every `poll_s`."""
    deadline = time.monotonic() + timeout_s
    while not process_gone(pid) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return process_gone(pid)


def kill_actor(actor, timeout_s: float = 60) -> None:
    """`ray.kill(actor, no_restart=True)`, then return once a call to it fails with its death."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_call__.remote(lambda _: None), timeout=10)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:  # no answer yet, on a busy machine: ask again
            continue
        time.sleep(0.1)
    raise AssertionError(f"the killed actor still answers after {timeout_s:.0f} s")
