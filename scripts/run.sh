#!/usr/bin/env bash
# The main job: installs what is missing (Debian packages, the Python package), then pretrains a small
# GPT on the Python standard library's source with 2 local processes through zero8-launch, using the
# zero8 config (8-bit AdamW states, ZeRO stage 2, int8 gradients and parameter sync). Progress on the
# terminal; CSV log, loss plot and checkpoints in out/pretrain/ (per-rank logs in out/pretrain/logs).
# Extra arguments go to examples/pretrain_gpt.py (try --help; e.g. --steps 100, --resume).
# The C++ optimizer demo is `bash scripts/build.sh && build/examples/demo_optimizers`.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-python3}"
cd "$root"

bash "$root/scripts/python_setup.sh"
echo
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
exec "$python" -m zero8_launch --num_procs 2 --log_dir out/pretrain/logs \
  examples/pretrain_gpt.py --config examples/configs/gpt_zero8_stage2.json --out_dir out/pretrain "$@"
