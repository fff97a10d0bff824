#!/usr/bin/env bash
# The distributed checks on GPUs: NCCL, bfloat16, and the 2-process equivalence tests.
#   tests/gpu_distributed.sh            (a machine with 2 or more CUDA GPUs, opd installed with its test extras)
# It runs tests/test_distributed.py with the student and teacher on CUDA (one GPU per process, NCCL),
# then the same in bfloat16 with autocast, where the equality is to bfloat16 rounding.
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 2 ]; then
    echo "gpu_distributed.sh: needs 2 CUDA GPUs, found $gpus" >&2
    exit 2
fi
OPD_TEST_DEVICE=cuda pytest -q tests/test_distributed.py
OPD_TEST_DEVICE=cuda OPD_TEST_DTYPE=bfloat16 pytest -q tests/test_distributed.py -k "make_the_update"
