"""`miles-vl data ...`: generate a synthetic file, fetch a public one, or inspect a dataset the way training loads it.

    miles-vl data synth data/synth.parquet --n 256 --seed 0
    miles-vl data synth data/motion.parquet --n 256 --task motion             # the video task
    miles-vl data fetch geo3k data/geometry3k                                 # the hub's geometry3k, by split
    miles-vl data inspect data/synth.parquet                                  # offline processor, default settings
    miles-vl data inspect geo3k/train.parquet --config configs/geo3k_tiny_cpu.yaml data.max_prompt_len=1024
    miles-vl data inspect --config configs/geo3k_tiny_cpu.yaml data.max_prompt_len=1024 geo3k/train.parquet

`inspect` prints (stdout) the layout it read the file as (recognised from the columns, or as `data.format` named it),
row counts, images per row, every drop reason with examples, the first rows, and the first rendered prompt with its
token count (runs of `<|image_pad|>` shown as `<|image_pad|>×N`). With `--config` it uses that job's data settings
and processor; without, the schema defaults and the offline processor. Heavy imports (torch, transformers) happen
inside the commands, so `miles-vl --help` stays fast.
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from collections import Counter
from collections.abc import Sequence

from miles_vl.config.schema import DataConfig


def configure(parser: argparse.ArgumentParser, parents: Sequence[argparse.ArgumentParser] = ()) -> None:
    """Add the `synth`, `fetch` and `inspect` subcommands to the `data` parser (`parents`: options every command
    takes)."""
    sub = parser.add_subparsers(dest="data_command", metavar="DATA_COMMAND", required=True)
    synth = sub.add_parser(
        "synth",
        help="write N generated problems (geometry, polygon questions, or the motion video task) to a parquet file",
        parents=list(parents),
    )
    synth.add_argument("out", help="output .parquet path")
    synth.add_argument("--n", type=int, default=256, help="number of problems (default 256)")
    task = DataConfig.model_fields["synthetic_task"]  # the task names and default of `data.synthetic_task`
    synth.add_argument(
        "--task",
        choices=typing.get_args(task.annotation),
        default=task.default,
        help="one of %(choices)s (default %(default)s): the tasks of `data.synthetic_task` (docs/configs.md); "
        "motion: 4-frame videos of a shape moving left or right, many_images: --images numbered images, the others "
        "one image each",
    )
    synth.add_argument(
        "--images",
        type=int,
        default=DataConfig.model_fields["synthetic_images"].default,
        help="images per problem of --task many_images (default %(default)s; `data.synthetic_images`)",
    )
    synth.add_argument("--seed", type=int, default=0, help="the same seed gives the same file (default 0)")
    synth.set_defaults(data_handler=cmd_synth)

    fetch = sub.add_parser(
        "fetch",
        help="download a public dataset from the Hugging Face hub into the files the shipped configs read",
        parents=list(parents),
    )
    fetch.add_argument("name", choices=["geo3k"], help="geo3k: hiyouga/geometry3k (train, validation, test)")
    fetch.add_argument("out_dir", metavar="OUT_DIR", help="folder for <split>.parquet (existing files are refused)")
    fetch.set_defaults(data_handler=cmd_fetch)

    inspect = sub.add_parser(
        "inspect", help="load a dataset as training would and print what it holds", parents=list(parents)
    )
    # The file may come before or after `--config CONFIG key=value ...` (which takes every word after it).
    inspect.add_argument("path", nargs="?", help=".parquet or .jsonl dataset file")
    inspect.add_argument(
        "--config",
        nargs="+",
        metavar=("CONFIG", "key.sub=value"),
        help="job config whose data settings and processor to use, then its overrides (before or after the file)",
    )
    inspect.add_argument("--processor", help="processor dir or 'offline' (default: the config's, else offline)")
    inspect.add_argument("--rows", type=int, default=3, help="rows to print (default 3)")
    inspect.set_defaults(data_handler=cmd_inspect)


def cmd_data(args: argparse.Namespace) -> int:
    """Dispatch `miles-vl data <command>`."""
    return args.data_handler(args)


def cmd_synth(args: argparse.Namespace) -> int:
    """Write `--n` problems of `--task` to OUT (geometry3k layout plus `kind` and `params` columns, and `videos`)."""
    from miles_vl.data.synth import write_synth_parquet

    if args.n < 1:
        sys.stderr.write(f"error: --n must be >= 1, found {args.n}\n")
        return 2
    if args.task == "many_images" and args.images < 2:
        sys.stderr.write(f"error: --images must be >= 2 for --task many_images, found {args.images}\n")
        return 2
    path = write_synth_parquet(args.out, args.n, args.seed, args.task, args.images)
    sys.stdout.write(f"wrote {args.n} problems ({args.task}, seed {args.seed}) to {path}\n")
    return 0


def cmd_fetch(args: argparse.Namespace) -> int:
    """Download dataset NAME into the HF cache and write OUT_DIR/<split>.parquet in the layout the configs read."""
    from miles_vl.data.fetch import fetch_dataset

    written = fetch_dataset(args.name, args.out_dir)
    for path, rows in written.values():
        sys.stdout.write(f"wrote {path} ({rows} rows)\n")
    train, test = written.get("train"), written.get("test")
    if train and test:
        sys.stdout.write(f"use them with: data.train_path={train[0]} data.eval_path={test[0]}\n")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """Load PATH with the job's (or default) data settings and print rows, drops and the first prompt."""
    from miles_vl.data.builder import load_options, video_settings
    from miles_vl.data.loading import load_prompt_file
    from miles_vl.data.processor import OFFLINE, load_processor, processor_metadata
    from miles_vl.data.prompt import PromptEncoder

    try:
        path, config, overrides = inspect_operands(args.path, args.config)
    except ValueError as e:
        sys.stderr.write(f"error: {e}\n")
        return 2
    if config:
        from miles_vl.config import load_config
        from miles_vl.logs import setup_logging

        job = load_config(config, overrides)
        if args.log_level is None:
            setup_logging(job.logging.level)
        data, processor_spec = job.data, args.processor or job.model.processor or job.model.path or OFFLINE
    else:
        data, processor_spec = DataConfig(train_path=path), args.processor or OFFLINE
    processor = load_processor(processor_spec, data.min_pixels, data.max_pixels, video_settings(data))
    encoder = PromptEncoder(processor, system_prompt=data.system_prompt, instruction=data.instruction)
    rows, report = load_prompt_file(path, encoder, load_options(data))
    out = sys.stdout.write
    meta = processor_metadata(processor)
    out(f"file: {path}\n")
    how = f"data.dataset_fn={data.dataset_fn}" if data.dataset_fn else f"data.format={data.format}"
    if data.format == "auto" and not data.dataset_fn:
        how = "recognised from its columns (data.format=auto)"
    out(f"layout: {report.layout}, {how}\n")
    out(f"rows: {report.n_rows}  kept: {report.n_kept}  dropped: {report.n_dropped}\n")
    for reason, count in sorted(report.dropped.items()):
        out(f"  {reason.value}: {count}\n")
        for ex in (e for e in report.examples if e.reason == reason):
            out(f"    row {ex.index}: {ex.detail}\n")
    images_per_row = dict(sorted(Counter(len(r.images) for r in rows).items()))
    out(f"images per row (kept rows): {images_per_row}\n")
    if any(r.videos for r in rows):
        videos_per_row = dict(sorted(Counter(len(r.videos) for r in rows).items()))
        out(
            f"videos per row (kept rows): {videos_per_row}; sampled at {meta['video_fps']} fps, "
            f"{meta['video_min_frames']}..{meta['video_max_frames']} frames, "
            f"pixels {meta['video_min_pixels']}..{meta['video_max_pixels']}\n"
        )
    out(
        f"processor: {processor_spec} ({meta['processor_class']}, patch {meta['patch_size']}, merge "
        f"{meta['merge_size']}, pixels {meta['min_pixels']}..{meta['max_pixels']}, {meta['tokenizer_size']} tokens); "
        f"max_prompt_len {data.max_prompt_len}\n"
    )
    for row in rows[: args.rows]:
        videos = f", {len(row.videos)} video(s) of {[len(v.indices) for v in row.videos]} frames" if row.videos else ""
        out(f"row {row.index}: {len(row.images)} image(s){videos}, {row.prompt_len} tokens, answer {row.label!r}: ")
        out(f"{row.problem[:120]!r}\n")
    if not rows:
        out("no usable rows\n")
        return 1
    sample = encoder.encode(rows[0])
    ids = sample.prompt_ids
    n_image_tokens = int((ids == processor.image_token_id).sum())
    grid = sample.image_grid_thw.tolist() if sample.image_grid_thw is not None else []
    videos = ""
    if sample.video_grid_thw is not None:
        n_video_tokens = int((ids == processor.video_token_id).sum())
        videos = f", {n_video_tokens} video tokens, video_grid_thw {sample.video_grid_thw.tolist()}"
    out(
        f"first prompt (row {sample.index}): {sample.prompt_len} tokens, {n_image_tokens} image tokens, "
        f"image_grid_thw {grid}{videos}\n"
    )
    text = processor.tokenizer.decode(ids.tolist(), skip_special_tokens=False)
    out(collapse_image_tokens(collapse_image_tokens(text, processor.image_token), processor.video_token) + "\n")
    return 0


def inspect_operands(path: str | None, config: Sequence[str] | None) -> tuple[str, str | None, list[str]]:
    """(dataset file, config, overrides) from the positional file and the words after `--config`, in either order:
    `--config CFG FILE k=v` leaves FILE among the config's words, where it is the one that is not `key=value`.

    Raises:
        ValueError: no dataset file, or more than one.
    """
    from miles_vl.config.loader import is_override

    config_path, words = (config[0], list(config[1:])) if config else (None, [])
    files = ([path] if path else []) + [w for w in words if not is_override(w)]
    if len(files) != 1:
        found = f"found {len(files)}: {' '.join(files)}" if files else "found none"
        raise ValueError(
            f"data inspect takes one dataset file ({found}); e.g. miles-vl data inspect FILE --config CONFIG key=value"
        )
    return files[0], config_path, [w for w in words if is_override(w)]


def collapse_image_tokens(text: str, image_token: str = "<|image_pad|>") -> str:
    """Show each run of image tokens as `<|image_pad|>×N`."""
    pattern = re.compile(f"(?:{re.escape(image_token)})+")
    return pattern.sub(lambda m: f"{image_token}×{len(m.group(0)) // len(image_token)}", text)
