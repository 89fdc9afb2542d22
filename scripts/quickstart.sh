#!/usr/bin/env bash
# Set up, write the embedded synthetic dataset as WebDataset shards (no download), and
# pretrain a small ViT on it with masked patch prediction. Extra args are config overrides,
# e.g. `bash scripts/quickstart.sh train.steps=100`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
[ -f data/shapes/index.json ] || .venv/bin/ssl-vit make-synthetic --output data/shapes --num 6000 --seed 0
[ -f data/shapes-test/index.json ] || .venv/bin/ssl-vit make-synthetic --output data/shapes-test --num 1000 --seed 1
exec .venv/bin/python pipelines/pretrain.py --config configs/pretrain/quickstart.yaml "$@"
