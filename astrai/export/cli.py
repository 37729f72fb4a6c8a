"""`python -m astrai export-hf <checkpoint> <destination>`: arguments, then astrai/export/hf.py.

The one module of the export that parses arguments; stdout carries the destination alone.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys

from astrai.errors import AstraiError
from astrai.export.hf import export_checkpoint
from astrai.export.weights import DTYPES, PARTS, resolve_checkpoint


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m astrai export-hf", description="Export a checkpoint as a Hugging Face model folder."
    )
    parser.add_argument(
        "checkpoint", help="a checkpoint (step_<N>), a checkpoints folder or an output_dir (its newest checkpoint)"
    )
    parser.add_argument("destination", help="folder to create (must be absent or empty unless --overwrite)")
    parser.add_argument(
        "--dtype", choices=sorted(DTYPES), default="fp32", help="dtype of the exported weights (default fp32)"
    )
    parser.add_argument(
        "--part", choices=PARTS, default="policy", help="which model of the checkpoint (default policy)"
    )
    parser.add_argument("--no-verify", action="store_true", help="skip re-hashing the checkpoint against its manifest")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export (atomically); a run folder or a folder holding a checkpoint is refused",
    )
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest safetensors file, e.g. 5GB, 500MB (default 5GB)"
    )
    parser.add_argument("--tokenizer-dir", default=None, help="tokenizer folder (default: the run's own)")
    parser.add_argument(
        "--adapter",
        action="store_true",
        help="a LoRA run: write PEFT's adapter folder (PeftModel.from_pretrained) instead of the merged model",
    )
    parser.add_argument(
        "--best", action="store_true", help="the best checkpoint by the run's checkpoint.keep_best, not the newest"
    )
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def export_main(argv: list[str]) -> int:
    """`python -m astrai export-hf ...`: 0 exported, 1 failed (one line on stderr), 2 bad arguments."""
    try:
        args = parse_args(argv)
    except SystemExit as exit_request:  # argparse exits on bad arguments and --help; return its status
        return int(exit_request.code or 0)
    logging.basicConfig(level=logging.INFO, format="astrai export-hf: %(message)s")
    from astrai.export.best import find_best  # lazily: only --best reads the run's keep_best

    try:
        # stdout carries the destination alone (`dest=$(python -m astrai export-hf ...)`); DeepSpeed prints
        # its consolidation steps and import warnings there, so those go to stderr with the log.
        with contextlib.redirect_stdout(sys.stderr):
            checkpoint = find_best(args.checkpoint) if args.best else resolve_checkpoint(args.checkpoint)
            path = export_checkpoint(
                checkpoint,
                args.destination,
                dtype=args.dtype,
                part=args.part,
                verify=not args.no_verify,
                overwrite=args.overwrite,
                max_shard_size=args.max_shard_size,
                tokenizer_dir=args.tokenizer_dir,
                adapter=args.adapter,
            )
    except (AstraiError, OSError, ValueError) as error:  # the checkpoint's, the tokenizer's, the model's
        message = " ".join(str(error).split())  # one line, whatever the wrapped error looked like
        print(f"astrai export-hf: {message}", file=sys.stderr)
        return 1
    print(path)
    return 0
