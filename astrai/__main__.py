"""`python -m astrai <tool>`: the one home of AstrAI's command-line tools.

verify <checkpoint>            re-hash a checkpoint against its manifest
export-hf <checkpoint> <dest>  write a checkpoint as a Hugging Face model folder (docs/guides/export.md)
plot <output_dir> [-o png]     draw every metric (or --metrics a,b) of metrics.jsonl against the step
config-docs                    print the job config reference (docs/guides/config.md)
cli-docs                       print this command-line reference, every tool's flags (docs/reference/cli.md)
launch --config <job.yaml>     start a job on the nodes of its hostfile (docs/guides/distributed.md)
convert <checkpoint>           a checkpoint's portable form, to resume on another topology (docs/guides/checkpoints.md)
plan --config <job.yaml>       per-rank memory of every engine and whether it fits (docs/guides/memory.md)
"""

from __future__ import annotations

import argparse
import re
import sys


def _plot_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m astrai plot",
        description="Plot every numeric metric against the step; eval/<name> beside the training <name>.",
    )
    parser.add_argument("output_dir", help="a run's output_dir (or a metrics.jsonl file)")
    parser.add_argument("-o", "--output", default=None, help="PNG path (default: <output_dir>/curves.png)")
    parser.add_argument(
        "--metrics", default=None, help="comma-separated metric names to draw, in that order (default: every one)"
    )
    return parser


def _plot(argv: list[str]) -> int:
    args = _plot_parser().parse_args(argv)
    import logging

    from astrai.observability.plot import plot_metrics

    logging.basicConfig(format="astrai plot: %(levelname)s: %(message)s")  # a skipped torn line, say
    try:
        path = plot_metrics(args.output_dir, args.output, args.metrics.split(",") if args.metrics else None)
    except (FileNotFoundError, ValueError) as error:  # MetricsError (a damaged line) is a ValueError
        print(f"astrai plot: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _verify(argv: list[str]) -> int:
    from astrai.checkpoint.cli import verify_main

    return verify_main(argv)


def _config_docs(argv: list[str]) -> int:
    from astrai.config.docs import render_reference

    sys.stdout.write(render_reference())
    return 0


def _cli_docs(argv: list[str]) -> int:
    from astrai.config.cli_docs import render_cli_reference

    sys.stdout.write(render_cli_reference(tool_docs()))
    return 0


def _export_hf(argv: list[str]) -> int:
    from astrai.export.cli import export_main

    return export_main(argv)


def _launch(argv: list[str]) -> int:
    from astrai.launch.multinode import launch_main

    return launch_main(argv)


def _convert(argv: list[str]) -> int:
    from astrai.resume.topology import convert_main

    return convert_main(argv)


def _plan(argv: list[str]) -> int:
    from astrai.launch.memory_plan import plan_main

    return plan_main(argv)


# The tools that load torch, transformers or DeepSpeed's formats: refused (one line) below pyproject.toml's floors.
CHECKS_VERSIONS = {"export-hf", "launch", "convert", "plan"}

TOOLS = {
    "plot": _plot,
    "verify": _verify,
    "export-hf": _export_hf,
    "config-docs": _config_docs,
    "cli-docs": _cli_docs,
    "launch": _launch,
    "convert": _convert,
    "plan": _plan,
}


def tool_parser(tool: str) -> argparse.ArgumentParser | None:
    """The argparse parser a tool parses its arguments with (None: it takes none), imported as lazily as the tool."""
    if tool == "plot":
        return _plot_parser()
    if tool == "verify":
        from astrai.checkpoint.cli import build_parser
    elif tool == "export-hf":
        from astrai.export.cli import build_parser
    elif tool == "launch":
        from astrai.launch.multinode import build_parser
    elif tool == "convert":
        from astrai.resume.topology import build_parser
    elif tool == "plan":
        from astrai.launch.memory_plan import build_parser
    else:
        return None
    return build_parser()


def tool_docs() -> list[tuple[str, str, argparse.ArgumentParser | None]]:
    """(tool, its one-line purpose from this module's docstring, its parser) for every tool, as the help lists
    them: what `cli-docs` renders into docs/reference/cli.md."""
    lines = (re.match(r"(\S+)\s.*?\s{2,}(\S.*)$", line) for line in __doc__.splitlines())
    purposes = {match[1]: match[2] for match in lines if match and match[1] in TOOLS}
    order = [*purposes, *(tool for tool in TOOLS if tool not in purposes)]  # a tool the help forgot: no purpose
    return [(tool, purposes.get(tool, ""), tool_parser(tool)) for tool in order]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in TOOLS:
        print(__doc__.strip(), file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] in CHECKS_VERSIONS:
        from astrai.versions import VersionError, check_versions

        try:
            check_versions()
        except VersionError as error:
            print(f"astrai {argv[0]}: {error}", file=sys.stderr)
            return 1
    return TOOLS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
