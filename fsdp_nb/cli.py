"""The ``fsdp-nb`` command line: ``demo``, ``inspect PATH``, ``consolidate PATH OUT``."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]


def demo(args: argparse.Namespace) -> int:
    """Start a session, show who is where, run a collective, shut down."""
    from .session import Session

    t0 = time.perf_counter()
    with Session(args.n, backend=args.backend, activate=False) as sess:
        ready = time.perf_counter() - t0
        print(f"session ready in {ready:.1f} s")
        print(sess)
        total = sess.all_reduce_check()
        expect = sum(range(sess.world_size))
        print(f"all_reduce(sum of ranks) = {total:g} (expected {expect})")
        if total != expect:
            print("collective gave a wrong answer", file=sys.stderr)
            return 1
    print("session shut down cleanly")
    return 0


def inspect_cmd(args: argparse.Namespace) -> int:
    """Describe a checkpoint offline; exit status 2 when it is not valid."""
    from .checkpoint import inspect

    info = inspect(args.path, verify=args.verify)
    if args.json:
        import dataclasses
        import json

        print(json.dumps(dataclasses.asdict(info), indent=1, default=str))
    else:
        print(info.summary())
    return 0 if info.valid else 2


def consolidate_cmd(args: argparse.Namespace) -> int:
    """Convert sharded -> one .pt/.safetensors file, or full -> sharded folder."""
    from .checkpoint import consolidate

    info = consolidate(args.path, args.out, overwrite=args.overwrite)
    print(repr(info))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-nb", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="start a session, run a collective, shut down")
    p.add_argument("-n", type=int, default=None, help="number of ranks (default: GPUs or 2)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.set_defaults(func=demo)
    p = sub.add_parser("inspect", help="describe a checkpoint offline (no cluster)")
    p.add_argument("path", help="checkpoint folder, .pt / .safetensors file, or fsspec URL")
    p.add_argument("--verify", action="store_true", help="also check every file's CRC-32")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=inspect_cmd)
    p = sub.add_parser("consolidate", help="sharded checkpoint -> one file, or full -> sharded")
    p.add_argument("path", help="source checkpoint")
    p.add_argument("out", help="a .pt / .safetensors file (from sharded) or a folder (from full)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=consolidate_cmd)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
