#!/usr/bin/env bash
# Download the wheels the GPU check needs on the GPU machine into .whl/ (ignored by git).
#
# The machine (the `device` tool's nvidia-h200; Python 3.12, x86_64) has torch, numpy, httpx,
# safetensors, accelerate, huggingface-hub and the rest of its image, and no package registry.
# What the engines import beyond that image travels as wheels: pydantic and its parts (the
# contract), tenacity (the client), and the versions of transformers, tokenizers and peft that
# pyproject.toml pins (the image's transformers is newer than our range). Run this once on a
# machine with pip and network, before `bash benchmarks/gpu_check.sh` is run with `.whl` carried.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=(
    pydantic==2.14.4
    pydantic_core==2.50.5
    annotated-types==0.8.0
    typing-inspection==0.4.5
    typing-extensions==4.16.0
    tenacity==9.2.1
    transformers==5.10.4
    tokenizers==0.22.2
    peft==0.21.2
)
PYTHON=${PYTHON:-python3}
rm -rf .whl
"$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
du -sh .whl
