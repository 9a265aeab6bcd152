"""The ``posttrain`` command line."""

from __future__ import annotations

import argparse

from posttrain import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="posttrain",
        description="Post-training for language models: SFT, reward models, DPO, RLHF-PPO and GRPO.",
    )
    parser.add_argument("--version", action="version", version=f"posttrain {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
