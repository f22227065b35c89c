"""Whether a process is gone, for tests that kill one and wait: a zombie (exited, not yet reaped by its parent or
init) counts as gone, which `os.kill(pid, 0)` does not see."""


def process_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # the state follows the parenthesized command name
    except FileNotFoundError:
        return True
