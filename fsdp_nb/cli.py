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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fsdp-nb", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="start a session, run a collective, shut down")
    p.add_argument("-n", type=int, default=None, help="number of ranks (default: GPUs or 2)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.set_defaults(func=demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
