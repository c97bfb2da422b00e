#!/usr/bin/env bash
# The GPU path, checked on a real card: `minigrpo doctor`, then `minigrpo bench model` on qwen-1.5b with random
# weights of its shape (no download), with every figure written to one file.
#
# For a GPU machine with only torch (and transformers, peft, typer, rich) installed and no network: wheels the
# machine lacks (bitsandbytes; vLLM's CUDA wheel if it fits the transfer) go in a folder beside the repository
# and are installed from there, nothing from an index. Takes under ten minutes on one card.
#
#   bash scripts/gpu_check.sh [OUT_FILE] [WHEEL_FOLDER]      # defaults: gpu_check.txt, .gpu/wheels
#
# MODEL and BENCH_ARGS override what is measured (a dry run on a cpu: MODEL=smollm2-135m
# BENCH_ARGS="-G 2 --max-new-tokens 8 --steps 2").
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check.txt}
wheels=${2:-.gpu/wheels}
model=${MODEL:-qwen-1.5b}
bench_args=${BENCH_ARGS:--G 4 -G 8 --max-new-tokens 256 --max-new-tokens 512 --steps 2}
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

{
  echo "# minigrpo GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  if compgen -G "$wheels/*.whl" > /dev/null; then
    echo "## installing carried wheels: $(ls "$wheels")"
    python -m pip install --no-index --no-deps "$wheels"/*.whl 2>&1 | tail -3
  fi
  python - <<'PY'
import importlib.metadata as m
for name in ("torch", "transformers", "peft", "bitsandbytes", "vllm"):
    try:
        print(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name} not installed")
PY
  echo "## minigrpo doctor"
  time python -m minigrpo.cli doctor
  echo "## minigrpo plan (the estimate, before any run)"
  python -m minigrpo.cli plan --model "$model"
  echo "## minigrpo bench model (measured)"
  # shellcheck disable=SC2086  # the arguments are meant to split
  time python -m minigrpo.cli bench model --model "$model" --random-weights $bench_args
} 2>&1 | tee "$out"
echo "figures written to $out"
