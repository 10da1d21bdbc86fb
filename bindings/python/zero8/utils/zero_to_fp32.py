"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` functions over zero8 engine checkpoints: the module's whole
state_dict with the trained weights in fp32 from the masters of all shards, as a dict, loaded into a model,
or written to a safetensors file. ``zero8-checkpoint to-fp32`` in Python; the export is
``_C.checkpoint_export_fp32`` (docs/CHECKPOINT.md, "zero8-checkpoint"). As a script, like DeepSpeed's
``zero_to_fp32.py``: ``python -m zero8.utils.zero_to_fp32 <checkpoint_dir> <output.safetensors> [-t TAG]``.

Differences from DeepSpeed (docs/CHECKPOINT.md lists them): frozen parameters and 16-bit buffers come back
fp32 (DeepSpeed keeps frozen ones 16-bit) and integer buffers stay integers (DeepSpeed makes them float);
a tied weight is one tensor per name, not one shared tensor; the output file is one safetensors file.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch
from safetensors.torch import load_file

from .. import _C

__all__ = [
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "convert_zero_checkpoint_to_fp32_state_dict",
]


def _tag_dir(checkpoint_dir, tag) -> str:
    # DeepSpeed's layout: checkpoint_dir holds `latest` and one directory per tag. Both readers raise
    # Zero8IOError (an OSError) naming the missing file or tag and the directory.
    checkpoint_dir = os.fspath(checkpoint_dir)
    if tag is None:
        tag = _C.latest_read(checkpoint_dir)
    return _C.checkpoint_tag_path(checkpoint_dir, str(tag))


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None) -> dict:
    """The module's state_dict saved in tag ``tag`` of ``checkpoint_dir`` (None: the tag ``latest``
    names), on the CPU: trained parameters fp32 from the masters, frozen parameters and buffers as saved
    with 16-bit floats widened to fp32, every key in state_dict order. A checkpoint saved before zero8
    recorded the state_dict gives the trained parameters only.

    The export is written to a temporary file in ``checkpoint_dir`` (the checkpoint's file system has
    room for it; /tmp may not) or, if that directory cannot be written, in the system's temporary
    directory, and removed once read. Raises Zero8IOError naming the file when the directory, ``latest``,
    the tag or a file of it is missing or corrupt (every checksum is checked)."""
    tag_dir = _tag_dir(checkpoint_dir, tag)
    try:
        tmp = tempfile.mkdtemp(prefix=".zero8-to-fp32-", dir=os.fspath(checkpoint_dir))
    except OSError:
        tmp = tempfile.mkdtemp(prefix="zero8-to-fp32-")
    try:
        out = os.path.join(tmp, "model_fp32.safetensors")
        _C.checkpoint_export_fp32(tag_dir, out, True)
        return load_file(out, device="cpu")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None,
                                         strict: bool = False) -> torch.nn.Module:
    """Moves ``model`` to the CPU, loads get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    into it and returns it. ``strict`` is False by default, as DeepSpeed loads; the export of a
    checkpoint that recorded the state_dict has every key, so ``strict=True`` works and checks that the
    model is the one saved. A model that an engine wraps must be given to a new engine afterwards."""
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state_dict, strict=strict)
    return model


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_file, tag=None) -> None:
    """Writes get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag) to the safetensors file
    ``output_file`` without holding it in memory. The file appears whole or not at all (it is written
    to a temporary name beside it, synced and renamed); load it with ``safetensors.torch.load_file``.
    DeepSpeed writes a torch.save file here (newer versions: a directory of shards); this is always one
    safetensors file."""
    output_file = os.fspath(output_file)
    if os.path.isdir(output_file):
        raise _C.Zero8ValueError(f"{output_file}: is a directory; convert_zero_checkpoint_to_fp32_state_dict "
                                 "writes one safetensors file (give its path)")
    _C.checkpoint_export_fp32(_tag_dir(checkpoint_dir, tag), output_file, True)


def main(argv=None) -> int:
    """The command line: convert_zero_checkpoint_to_fp32_state_dict with DeepSpeed's script arguments
    (checkpoint_dir, output_file, -t/--tag). Exit 0 with a summary, 1 with the error, 2 on bad usage."""
    ap = argparse.ArgumentParser(
        prog="python -m zero8.utils.zero_to_fp32",
        description="Write a zero8 checkpoint's module state_dict, trained weights in fp32 from every rank's "
                    "masters, to one safetensors file (load it with safetensors.torch.load_file).")
    ap.add_argument("checkpoint_dir", help="the directory save_checkpoint wrote (holding `latest` and the tags)")
    ap.add_argument("output_file", help="the safetensors file to write (written whole or not at all)")
    ap.add_argument("-t", "--tag", default=None, help="the tag to convert (default: the one `latest` names)")
    args = ap.parse_args(argv)
    if os.path.splitext(args.output_file)[1].lower() in (".bin", ".pt", ".pth"):
        print(f"zero_to_fp32: note: {args.output_file} will be a safetensors file, not a torch.save one "
              "(load it with safetensors.torch.load_file)", file=sys.stderr)
    try:
        convert_zero_checkpoint_to_fp32_state_dict(args.checkpoint_dir, args.output_file, tag=args.tag)
    except (OSError, ValueError) as e:
        print(f"zero_to_fp32: error: {e}", file=sys.stderr)
        return 1
    size = os.path.getsize(args.output_file)
    print(f"zero_to_fp32: wrote {args.output_file} ({size / 2**20:.1f} MiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
