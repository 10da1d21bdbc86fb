"""python -m zero8.deepspeed to-universal <input> <output tag dir> [--tag T] [--workers N] [--allow_pickle]

<input>: a DeepSpeed ZeRO-1/2 checkpoint tag directory (zero8's or torch's optimizer states; DeepSpeed's
ds_to_universal does the conversion after zero8's 8-bit states are decoded), or a zero8 engine checkpoint
directory (--tag, default: the one `latest` names) or tag directory. The files are read weights-only unless
--allow_pickle (see zero8.deepspeed.read_checkpoint). Exit 1 with the error, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zero8.deepspeed",
                                 description="DeepSpeed checkpoints and zero8's 8-bit states (docs/DEEPSPEED.md)")
    sub = ap.add_subparsers(dest="command", required=True)
    u = sub.add_parser("to-universal", help="write a DeepSpeed universal checkpoint (loads at any world size)")
    u.add_argument("input", help="DeepSpeed ZeRO checkpoint tag directory, or zero8 engine checkpoint directory")
    u.add_argument("output", help="the universal checkpoint's tag directory (its parent gets latest_universal)")
    u.add_argument("--tag", default=None, help="zero8 engine checkpoint: the tag (default: the one latest names)")
    u.add_argument("--workers", type=int, default=1, help="ds_to_universal's worker processes")
    u.add_argument("--allow_pickle", action="store_true",
                   help="unpickle any object in the input's .pt files (may run code from them: trusted files only)")
    args = ap.parse_args(argv)
    from . import universal
    try:
        out = universal.to_universal(args.input, args.output, tag=args.tag, workers=args.workers,
                                      allow_pickle=args.allow_pickle)
    except (OSError, ValueError, NotImplementedError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"universal checkpoint: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
