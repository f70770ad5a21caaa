"""Console entry point: `kvpos demo` runs the main job on the embedded default model."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpos", description="Positions as data in the KV cache of RoPE models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("demo", help="show PositionedCache == DynamicCache, exact re-positioning, and chunk reuse TTFT")
    args = p.parse_args(argv)
    if args.cmd == "demo":
        from kvpos.integrations.demo import main as demo

        demo()
    return 0


if __name__ == "__main__":
    sys.exit(main())
