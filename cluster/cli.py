"""The `sevendb` command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sevendb", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from sevendb.cluster.demo import run_demo

        return run_demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
