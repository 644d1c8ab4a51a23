"""Reproduce the README's benchmark figures in one command (CPU, tiny model).

Runs ``kvpage bench compare`` with its defaults (real engine on the tiny
random Llama plus the simulator) and writes the two PNGs to benches/plots/.

    PYTHONPATH=python python benches/readme_figures.py [--json /tmp/compare.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpage.cli import main as kvpage_main

PLOTS = Path(__file__).resolve().parent / "plots"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", default=None, help="also write compare's results here")
    args = parser.parse_args()
    argv = ["bench", "compare", "--plot-dir", str(PLOTS)]
    if args.json:
        argv += ["--json", args.json]
    return kvpage_main(argv)


if __name__ == "__main__":
    sys.exit(main())
