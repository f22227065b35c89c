"""Contract: the README and docs/ point only at files a user of the repository has (issue 16): no paths of the
machine they were written on, no files outside the repository, and every relative link resolves."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "docs" / "gpu-runs" / "README.md"]
OUTSIDE = re.compile(r"\.\./shared|/work/|\.library|DESIGN(\.md| §)|STYLE\.md")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_docs_point_only_at_files_in_the_repository(doc):
    text = doc.read_text()
    assert not [m.group(0) for m in OUTSIDE.finditer(text)], doc
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"[a-z]+://", target):
            assert (doc.parent / target).exists(), f"{doc.name}: link to {target}"


# ---------------------------------------------------------------------------------------------------------------------
# Issue 35.6: the commands and config keys the docs show are the CLI's and the schema's.


def doc_commands(text: str) -> list[tuple[str, bool]]:
    """The `miles-vl ...` commands of a markdown text: (command, whole). Whole: a line of a code block or an indented
    block (continued with a trailing backslash); else an inline `miles-vl ...` span, which may name a command
    without its operands (prose)."""
    commands = []
    lines = iter(text.splitlines())
    for line in lines:
        stripped = line.strip().removeprefix("$ ")
        if stripped.startswith("miles-vl "):
            while stripped.endswith("\\"):
                stripped = stripped[:-1] + " " + next(lines, "").strip()
            commands.append((stripped, True))
    commands += [(span, False) for span in re.findall(r"`(miles-vl [^`]*)`", text)]
    return commands


def schema_key_problem(key: str) -> str | None:
    """None when `key` (`section.field.sub`) names a field of the job schema, else why not."""
    import typing

    from pydantic import BaseModel

    from miles_vl.config.schema import JobConfig

    model: type[BaseModel] | None = JobConfig
    for depth, part in enumerate(key.split(".")):
        if model is None:  # below a dict or a plain value: any sub-key is the user's
            return None
        if part not in model.model_fields:
            return f"no key {'.'.join(key.split('.')[: depth + 1])!r} in the schema"
        annotation = model.model_fields[part].annotation
        candidates = [annotation, *typing.get_args(annotation)]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
    return None


def command_problem(command: str, whole: bool) -> str | None:
    """Why `command` would not run as written (argparse's own error, an unknown override key, a shipped config that
    does not exist), or None. Commands with placeholders (`[...]`, `...`, `<...>`) are checked no further than
    they can be: skipped."""
    import argparse
    import shlex

    from miles_vl.cli import build_parser
    from miles_vl.config.loader import is_override

    if re.search(r"\[|\.\.\.|<[^>]*>", command):
        return None
    argv = shlex.split(command, comments=True)[1:]

    class Refused(Exception):
        pass

    def error(self, message):
        raise Refused(message)

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error  # every subparser reports instead of exiting
    try:
        args, extra = build_parser().parse_known_args(argv)
        if extra and not (hasattr(args, "overrides") and all(is_override(e) for e in extra)):
            raise Refused(f"unrecognized arguments: {' '.join(extra)}")
    except Refused as refused:
        if not whole and "the following arguments are required" in str(refused):
            return None  # prose names a command without its operands
        return f"{command!r}: {refused}"
    finally:
        argparse.ArgumentParser.error = original
    overrides = [*(getattr(args, "overrides", None) or []), *extra]
    for override in overrides:
        if problem := schema_key_problem(override.partition("=")[0]):
            return f"{command!r}: {problem}"
    config = getattr(args, "config", None)
    if isinstance(config, str) and config.startswith("configs/") and not (REPO / config).is_file():
        return f"{command!r}: {config} is not a shipped config"
    return None


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_in_the_docs_parses_with_the_cli(doc):
    """Every `miles-vl ...` line of a code block, and every inline `miles-vl ...` span, parses with the real argparse
    parser; its overrides name keys of the schema; a `configs/...` file it names ships."""
    problems = [p for command, whole in doc_commands(doc.read_text()) if (p := command_problem(command, whole))]
    assert not problems, problems


def test_a_wrong_command_in_a_doc_is_caught():
    """The check above fails on a misspelt subcommand, an unknown option, a misspelt override key, a config that
    does not ship and a command without its operands; and passes the right ones."""
    text = """
    miles-vl trian configs/geo3k_tiny_cpu.yaml
    miles-vl check configs/geo3k_tiny_cpu.yaml --fast
    miles-vl check configs/geo3k_tiny_cpu.yaml rollout.temprature=0.5
    miles-vl export RUN_DIR
    miles-vl check configs/geo3k_tiny.yaml
Run `miles-vl data fetch geo4k OUT` or `miles-vl doctor --verbose`.
    miles-vl check configs/geo3k_tiny_cpu.yaml rollout.temperature=0.5 train.optimizer.lr=1e-5   # the right one
    miles-vl train configs/geo3k_tiny_cpu.yaml \\
        data.system_prompt=null
Prose may name `miles-vl export` or `miles-vl data inspect FILE [--config CONFIG key=value ...]`.
"""
    problems = [command_problem(command, whole) for command, whole in doc_commands(text)]
    # the block lines first (five wrong, two right), then the inline spans (two wrong, two right)
    assert [p is not None for p in problems] == [True] * 5 + [False] * 2 + [True] * 2 + [False] * 2, problems
    assert "invalid choice: 'trian'" in problems[0] and "no key 'rollout.temprature'" in problems[2]
    assert "the following arguments are required: OUT_DIR" in problems[3] and "not a shipped config" in problems[4]
    assert "invalid choice: 'geo4k'" in problems[7] and "unrecognized arguments: --verbose" in problems[8]


def test_every_module_that_imports_ray_is_named_in_the_architecture():
    """docs/architecture.md lists where Ray is imported (the import direction's one exception); issue 35.6 found two
    modules missing (rollout/sglang/host.py, reward/scoring.py). Every module outside orchestration/ that imports Ray
    is named there."""
    text = " ".join((REPO / "docs" / "architecture.md").read_text().split())
    paragraph = text[text.index("Ray is imported by") :].split("```")[0]
    package = REPO / "miles_vl"
    importers = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if re.search(r"^\s*(import ray\b|from ray\b)", path.read_text(), re.M)
    ]
    assert importers, "no module imports Ray: the check would prove nothing"
    unnamed = [m for m in importers if not m.startswith("orchestration/") and m not in paragraph]
    assert not unnamed, f"docs/architecture.md does not name these Ray importers: {unnamed}"
    assert "`orchestration`" in paragraph


SECTION_REFERENCE = re.compile(r'(docs/[\w/.-]+\.md), "([^"]+)"')


def test_section_references_in_configs_name_headings_that_exist():
    """A shipped config's header that sends the reader to `docs/X.md, "Heading"` names a heading of that file (issue
    35.6: geo3k_qwen3vl_1gpu.yaml pointed at a "One GPU" section docs/cluster.md does not have)."""
    files = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "examples").rglob("*.yaml"))
    problems = []
    for path in files:
        for doc, heading in SECTION_REFERENCE.findall(path.read_text()):
            target = REPO / doc
            headings = [re.sub(r"^#+\s*(\d+\.\s*)?", "", h) for h in re.findall(r"^#+ .*", target.read_text(), re.M)]
            if not target.is_file() or not any(h.startswith(heading) for h in headings):
                problems.append(f"{path.name}: {doc}, {heading!r}")
    assert not problems, problems


def help_commands() -> list[tuple[str, str]]:
    """(where, command) for every `miles-vl ...` example of `miles-vl --help` and of the CLI modules' docstrings
    (an example's own description starts after a run of spaces or a `#`)."""
    import miles_vl.cli as cli
    import miles_vl.data.cli as data_cli
    import miles_vl.orchestration.export as export

    sources = {"miles-vl --help": cli.build_parser().format_help(), "cli.py": cli.__doc__}
    sources |= {"data/cli.py": data_cli.__doc__, "orchestration/export.py": export.__doc__}
    found = []
    for where, text in sources.items():
        for line in text.splitlines():
            stripped = line.strip()
            if stripped.startswith("miles-vl "):
                found.append((where, re.split(r"\s{3,}|\s#", stripped)[0]))
    return found


def test_the_cli_help_examples_parse_and_export_a_run_where_runs_go():
    """Issue 35.6: `miles-vl --help` and docs/export.md exported `outputs/geo3k_tiny_cpu` while runs go to
    `runs/<config stem>`. Every example of the help and the CLI docstrings parses; every `miles-vl export RUN_DIR`
    of the help and the docs names a run directory where runs go (`logging.output_dir`'s default, then a shipped
    config's stem) or a placeholder."""
    from miles_vl.config.schema import LoggingConfig

    examples = help_commands()
    assert len(examples) > 10 and any(c.startswith("miles-vl export ") for _, c in examples)
    problems = [f"{where}: {p}" for where, command in examples if (p := command_problem(command, True))]
    stems = {p.stem for p in (REPO / "configs").glob("*.yaml")}
    exports = [(w, c) for w, c in examples if c.startswith("miles-vl export ")]
    exports += [(d.name, c) for d in DOCS for c, _ in doc_commands(d.read_text()) if c.startswith("miles-vl export ")]
    for where, command in exports:
        run_dir = command.split()[2]
        if run_dir.isupper() or run_dir.startswith("<"):
            continue  # a placeholder: RUN_DIR
        head, _, stem = run_dir.partition("/")
        if head != LoggingConfig().output_dir or stem not in stems:
            problems.append(f"{where}: {command!r} exports {run_dir}, not a run directory <output_dir>/<config stem>")
    assert not problems, problems
