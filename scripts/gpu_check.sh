#!/usr/bin/env bash
# The GPU path, checked on a real card, every figure written to one file:
#   1. `minigrpo doctor` (the card's facts, the dtype it chose and why, 4-bit + LoRA forward/backward on it);
#   2. `minigrpo plan` for this card and for a T4, from the preset's shape alone (the estimate);
#   3. `transformers` decoding of the preset (random weights): milliseconds per new token at 1, 8 and 32 rows,
#      with and without the adapters, torch ops per token, and the share of a token's wall time the card spends
#      in kernels: whether decoding is bound by the card or by launching kernels one at a time, the figure that
#      sizes every later stage;
#   4. `minigrpo bench model` on the preset with random weights of its shape (measured: s/step, tokens/s,
#      peak and reserved memory beside the plan's estimate);
#   5. the T4's float16 path on this card: `doctor --dtype float16` and three training steps in float16
#      (gradient scaler, first-rollout numerics check);
#   6. the streamed export of a 4-bit policy: extra device memory against its largest shard.
#
# For a GPU machine with only torch (and transformers, peft, typer, rich) installed and no network: wheels the
# machine lacks (bitsandbytes; vLLM's CUDA wheel if it fits the transfer) go in a folder beside the repository
# and are installed from there, nothing from an index; a `cache` folder beside them, if any, is used as
# MINIGRPO_CACHE (the offline model's tokenizer files there give the random models a real tokenizer). Each
# stage has a time limit and prints every python thread's stack when it reaches it, so a stage that hangs
# costs only its own figures and says where it was.
#
#   bash scripts/gpu_check.sh [OUT_FILE] [WHEEL_FOLDER]      # defaults: gpu_check.txt, .gpu/wheels
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_24_x86_64 -d .gpu/wheels bitsandbytes==0.50.2   # beforehand, where pip works
#
# Overrides: STAGES (default "doctor plan decode bench fp16 export"), MODEL, EXPORT_MODEL, SMALL, BENCH_ARGS,
# DECODE_ROWS, and DOCTOR_S, DECODE_S, BENCH_S, FP16_S, EXPORT_S (limits in seconds). A dry run on a cpu: MODEL=smollm2-135m
# BENCH_ARGS="-G 2 --max-new-tokens 8 --steps 2".
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check.txt}
wheels=${2:-.gpu/wheels}
model=${MODEL:-qwen-1.5b}
small=${SMALL:-smollm2-135m}
export_model=${EXPORT_MODEL:-$model}
stages=${STAGES:-doctor plan decode bench fp16 export}  # which stages to run
bench_args=${BENCH_ARGS:--G 4 -G 8 --max-new-tokens 128 --max-new-tokens 256 --steps 2}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
[ -d "$wheels/../cache" ] && export MINIGRPO_CACHE=$(cd "$wheels/../cache" && pwd)
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

stage() {  # stage NAME SECONDS TITLE COMMAND...: one titled, timed, time-limited step; its failure is reported
  local name=$1 limit=$2 title=$3 start=$SECONDS rc
  shift 3
  [[ " $stages " == *" $name "* ]] || return 0
  echo "## $title"
  # at the limit SIGABRT, which PYTHONFAULTHANDLER turns into every python thread's stack: where the time went
  PYTHONFAULTHANDLER=1 timeout --signal=ABRT --kill-after=15 "$limit" "$@"
  rc=$?
  echo "## $title: exit $rc after $((SECONDS - start)) s$([ $rc = 124 ] && echo " (stopped at its ${limit} s limit)")"
}

random_model() {  # random_model PRESET FOLDER: random weights of the preset's shape, with a tokenizer
  python -c "import sys; from pathlib import Path; from minigrpo.bench import weights_or_random
print(weights_or_random(sys.argv[1], Path(sys.argv[2]), random_weights=True)[0])" "$1" "$2"
}

export_memory() {  # export_memory FOLDER: the streamed export's extra device memory against its largest shard
  python - "$1" "$work/export" <<'PY'
import json, os, sys
from minigrpo.bench import extra_memory_gb
from minigrpo.config import TrainConfig
from minigrpo.export import export_weights
from minigrpo.model import default_dtype, load_policy, load_tokenizer
path, out = sys.argv[1], sys.argv[2]
dtype = default_dtype()
policy = load_policy(TrainConfig(lora_rank=16, load_in_4bit=True), path, dtype)
extra = extra_memory_gb(lambda: export_weights(policy, load_tokenizer(path), out, dtype, merge_adapter=True))
shards = [os.path.getsize(f"{out}/{f}") / 2**30 for f in os.listdir(out) if f.endswith(".safetensors")]
print(json.dumps({"device": str(policy.device), "dtype": str(dtype), "exported_gb": round(sum(shards), 3),
                  "largest_shard_gb": round(max(shards), 3), "extra_device_gb": round(extra, 3)}))
PY
}
decode_speed() {  # decode_speed FOLDER: ms per new token of `transformers` decoding, adapters on and off
  python - "$1" "${DECODE_ROWS:-1 8 32}" <<'PY'
import json, sys, time
import torch
from minigrpo.config import TrainConfig
from minigrpo.generation import HFGenerator, Sampling
from minigrpo.model import default_dtype, load_policy, load_tokenizer
path, dtype = sys.argv[1], default_dtype()
policy = load_policy(TrainConfig(load_in_4bit=True), path, dtype)
generator, prompt = HFGenerator(policy, load_tokenizer(path)), [list(range(10, 74))]  # one 64-token prompt
wait = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
for rows in map(int, sys.argv[2].split()):
    for base in (False, True):  # base: the adapters off, the 4-bit layers alone
        generator.generate(prompt, Sampling(rows, 4), base=base)  # warm-up
        wait()
        start = time.perf_counter()
        made = generator.generate(prompt, Sampling(rows, 32), base=base)
        wait()
        seconds, longest = time.perf_counter() - start, max(map(len, made.completion_ids))
        print(json.dumps({"rows": rows, "adapters": not base, "new_tokens": longest, "dtype": str(dtype),
                          "ms_per_token": round(1000 * seconds / longest, 2),
                          "tokens_per_s": round(rows * longest / seconds, 1)}), flush=True)
# on a card, the profiler also times the kernels: if they keep the card busy for a small share of the wall
# time, each token waits on python launching ops one at a time, not on the card's arithmetic
activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * torch.cuda.is_available()
with torch.profiler.profile(activities=activities) as profile:
    start = time.perf_counter()
    generator.generate(prompt, Sampling(1, 9))  # a prefill and eight decoding steps
    wait()
    wall_ms = 1000 * (time.perf_counter() - start)
ops = [e for e in profile.events() if e.cpu_parent is None and e.name.startswith("aten::")]
kernel_ms = sum(k.self_device_time_total for k in profile.key_averages()) / 1000
print(json.dumps({"torch_ops_per_new_token": len(ops) // 9, "device": str(policy.device),
                  "profiled_wall_ms_per_token": round(wall_ms / 9, 2),
                  "kernel_ms_per_token": round(kernel_ms / 9, 3) if torch.cuda.is_available() else None,
                  "card_busy_share": round(kernel_ms / wall_ms, 3) if torch.cuda.is_available() else None}))
PY
}
export -f random_model export_memory decode_speed
export work

{
  echo "# minigrpo GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  if compgen -G "$wheels/*.whl" > /dev/null; then
    echo "## installing carried wheels: $(ls "$wheels" | tr '\n' ' ')"
    python -m pip install --no-index --no-deps --no-compile --target "$work/site" "$wheels"/*.whl 2>&1 | tail -3
    export PYTHONPATH=$work/site:$PWD  # the carried wheels over the machine's own versions
  fi
  python - <<'PY'
import importlib.metadata as m, platform
print("python", platform.python_version())
for name in ("torch", "transformers", "peft", "bitsandbytes", "vllm"):
    try:
        print(f"{name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"{name} not installed")
PY
  stage doctor ${DOCTOR_S:-90} "minigrpo doctor" python -m minigrpo.cli doctor
  stage plan 40 "minigrpo plan (the estimate, before any run): this card, then a T4" \
    bash -c "python -m minigrpo.cli plan --model $model && python -m minigrpo.cli plan --model $model --gpu t4"
  stage decode ${DECODE_S:-150} "transformers decoding of $model (random weights): ms per new token" bash -c "
    folder=\$(random_model $model $work/big | tail -1) && decode_speed \$folder"
  # shellcheck disable=SC2086  # the arguments are meant to split
  stage bench ${BENCH_S:-300} "minigrpo bench model (measured)" python -m minigrpo.cli bench model --model "$model" --random-weights \
    $bench_args
  stage fp16 40 "float16, as on a T4: doctor" python -m minigrpo.cli doctor --dtype float16
  stage fp16 ${FP16_S:-80} "float16, as on a T4: three training steps of $small (random weights)" bash -c "
    folder=\$(random_model $small $work/small | tail -1) &&
    python -m minigrpo.cli train --model \$folder --task addition --steps 3 --dtype float16 --generator hf \
      --output-dir $work/run-fp16 --sample-every 0 --no-eval-before-after && tail -n 3 $work/run-fp16/metrics.jsonl"
  stage export ${EXPORT_S:-120} "export of $export_model's 4-bit policy, streamed" bash -c "
    folder=\$(random_model $export_model $work/big-export | tail -1) && export_memory \$folder"
} 2>&1 | tee "$out"
echo "figures written to $out"
