"""``python -m sglang_sim.tool_catalogue --tokenizer DIR --family FAMILY --out FILE``: write a tool catalogue.

The command-line form of :func:`sglang_sim.tools.write_catalogue` (what ``sglang-sim --tool-catalogue`` reads), for
a process that imports nothing of the simulator: the demo's agentic sample (``python -m demo
--agentic``) runs it before it starts the simulator.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from sglang_sim.tools import CATALOGUE_FAMILIES, write_catalogue


def main(argv: Sequence[str] | None = None) -> None:
    from thinkfleet.template import load_tokenizer

    parser = argparse.ArgumentParser(
        prog="python -m sglang_sim.tool_catalogue", description="Write a catalogue for sglang-sim --tool-catalogue."
    )
    parser.add_argument("--tokenizer", required=True, help="The job's tokenizer directory (its own code never runs).")
    parser.add_argument("--family", required=True, choices=CATALOGUE_FAMILIES, help="The model family's call form.")
    parser.add_argument("--out", required=True, help="The catalogue's JSON file.")
    args = parser.parse_args(argv)
    print(write_catalogue(args.out, load_tokenizer(args.tokenizer, trust_remote_code=False), args.family))


if __name__ == "__main__":
    main()
