"""The ``fsdp-nb`` command line: ``demo``, ``inspect PATH``, ``consolidate PATH OUT``, ``export PATH OUT``."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["build_parser", "main"]


def demo(args: argparse.Namespace) -> int:
    """Start a session, show who is where, run a collective, wrap and train a small
    model with FSDP2, save a sharded checkpoint, inspect it offline, shut down."""
    import tempfile

    import torch

    from .formats.inspect import inspect
    from .session import Session

    t0 = time.perf_counter()
    with Session(args.n, backend=args.backend, activate=False) as sess:
        print(f"session ready in {time.perf_counter() - t0:.1f} s")
        print(sess)
        total = sess.all_reduce_check()
        expect = sum(range(sess.world_size))
        print(f"all_reduce(sum of ranks) = {total:g} (expected {expect})")
        if total != expect:
            print("collective gave a wrong answer", file=sys.stderr)
            return 1
        model = sess.wrap(
            torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)),
            name="model",
        )
        print(model)
        losses = sess.run(_demo_train, args.steps)
        print(f"trained {args.steps} steps: loss {losses[0][0]:.4f} -> {losses[0][-1]:.4f}")
        with tempfile.TemporaryDirectory(prefix="fsdp_nb_demo_") as tmp:
            path = f"{tmp}/step{args.steps}"
            sess.save(path, model, optimizer="optimizer", extra={"step": args.steps})
            info = inspect(path)
            print(f"saved and inspected offline: {info}")
    print("session shut down cleanly")
    return 0


def _demo_train(steps: int) -> list[float]:
    """Runs on every rank: train the bound ``model`` on a fixed regression task."""
    import torch
    import torch.distributed as dist

    from .engine.namespace import rank_device, user_ns

    ns = user_ns()
    model = ns["model"]
    ns["optimizer"] = opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(dist.get_rank())
    x = torch.randn(32, 64, device=rank_device())
    y = x.roll(1, dims=1)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def inspect_cmd(args: argparse.Namespace) -> int:
    """Describe a checkpoint offline; exit status 2 when it is not valid."""
    from .formats.inspect import inspect

    info = inspect(args.path, verify=args.verify, weights_only=not args.trust_pickles)
    if args.json:
        import dataclasses
        import json

        print(json.dumps(dataclasses.asdict(info), indent=1, default=str))
    else:
        print(info.summary())
    return 0 if info.valid else 2


def consolidate_cmd(args: argparse.Namespace) -> int:
    """Convert sharded -> one .pt/.safetensors file, or full -> sharded folder."""
    from .checkpoints.consolidate import consolidate

    info = consolidate(args.path, args.out, overwrite=args.overwrite, weights_only=not args.trust_pickles,
                       model=args.model)
    print(repr(info))
    return 0


def export_cmd(args: argparse.Namespace) -> int:
    """Model weights of a checkpoint -> safetensors in Hugging Face's layout."""
    from .checkpoints.export import export_safetensors

    for f in export_safetensors(args.path, args.out, dtype=args.dtype, max_shard_size=args.max_shard_size,
                                overwrite=args.overwrite, weights_only=not args.trust_pickles, model=args.model):
        print(f)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``fsdp-nb`` command line: its subcommands and their options (the docs'
    reference is drawn from it)."""
    parser = argparse.ArgumentParser(prog="fsdp-nb", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("demo", help="start a session, run a collective, wrap, train, checkpoint, shut down")
    p.add_argument("-n", type=int, default=None, help="number of ranks (default: GPUs or 2)")
    p.add_argument("--backend", choices=["gloo", "nccl"], default=None)
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.set_defaults(func=demo)
    p = sub.add_parser("inspect", help="describe a checkpoint offline (no cluster)")
    p.add_argument("path", help="checkpoint folder, .pt / .safetensors file, or fsspec URL")
    p.add_argument("--verify", action="store_true", help="also read every file and check its checksums")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=inspect_cmd)
    p = sub.add_parser("consolidate", help="sharded checkpoint -> one file, or full -> sharded")
    p.add_argument("path", help="source checkpoint")
    p.add_argument("out", help="a .pt / .safetensors file (from sharded) or a folder (from full)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=consolidate_cmd)
    p = sub.add_parser("export", help="model weights -> model.safetensors (+ index.json when sharded)")
    p.add_argument("path", help="source checkpoint (sharded folder, full file, or plain DCP folder)")
    p.add_argument("out", help="output folder (must not exist unless --overwrite)")
    p.add_argument("--dtype", default=None, help="cast floating weights, e.g. bfloat16")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file (default 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(func=export_cmd)
    for name in ("consolidate", "export"):
        sub.choices[name].add_argument(
            "--model", default=None, help="of a checkpoint holding several models, the one to write")
    for name in ("inspect", "consolidate", "export"):
        sub.choices[name].add_argument(
            "--trust-pickles", action="store_true",
            help="unpickle the checkpoint's pickles as plain torch.load does: this can run "
                 "arbitrary code; only for checkpoints from someone you trust")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``fsdp-nb`` with ``argv`` (default: the process's arguments); its exit status."""
    args = build_parser().parse_args(argv)
    from .errors import CheckpointError

    if args.cmd == "demo":
        return args.func(args)
    try:  # the offline commands: a bad path or checkpoint is one clear line, status 2
        return args.func(args)
    except (CheckpointError, FileNotFoundError, FileExistsError, ValueError, TypeError) as exc:
        print(f"fsdp-nb {args.cmd}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
