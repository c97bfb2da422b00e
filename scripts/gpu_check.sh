#!/usr/bin/env bash
# The GPU path, checked on a real card, every figure written to one file:
#   1. `minigrpo doctor` (the card's facts, the dtype it chose and why, 4-bit + LoRA forward/backward on it);
#   2. `minigrpo plan` for this card and for a T4, from the preset's shape alone (the estimate);
#   3. `transformers` decoding of the preset (random weights, 4-bit + LoRA): milliseconds per new token at 1, 8
#      and 32 rows, the fixed-shape loop (a CUDA graph per token) beside the eager one, with host time, torch ops,
#      kernel launches (and their mean host time) and syncs per token, and the share of a token's wall time the
#      card spends in kernels; then `minigrpo bench decode` on models of the preset's depth and tiny widths (the
#      host's cost alone);
#   4. the fixed-shape loop's correctness on the card, in its default dtype and in float16 (a T4's; once where they
#      are the same): greedy tokens equal the eager loop's (or part only at a tie), sampled tokens' log-probs within
#      1e-2 of the trainer's, every token sampled at top-p 0.9 and temperature 0.7 inside the captured graph in the
#      trainer's nucleus, and the first two again after an optimizer step and the adapter's refresh, asserted;
#   4b. `minigrpo bench model` on the preset with random weights of its shape (measured: s/step, tokens/s,
#      peak and reserved memory beside the plan's estimate);
#   5. the T4's float16 path on this card: `doctor --dtype float16` and three training steps in float16
#      (gradient scaler, first-rollout numerics check), then what a first run on a card must show, asserted:
#      reward spread in some step, the adapter changed, the generator's log-probs follow the trainer's, no step
#      skipped by the scaler, peak memory within 25% of `minigrpo plan`'s estimate;
#   6. the streamed export of a 4-bit policy (the decode stages' model): extra device memory against its largest shard.
#
# The stages' Python is in minigrpo/bench/gpu_stages.py, each stage with a test at a CPU's size
# (tests/test_gpu_stages.py), so no line of this check runs for the first time on a card.
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
# A CPU dry run with the stages scaled down (what the tests run): MODEL=smollm2-135m DECODE_ROWS=2 DECODE_TOKENS="2 4"
# DECODE_BENCH_ROWS=2 CHECK_ROWS=2 CHECK_TOKENS=4 CHECK_DTYPES=auto STAGES="plan decode correct".
# The limits add up to 580 s, so the whole check ends within 10 minutes on one card even where every stage runs
# out of time (a fresh process per bench setting: two settings, two steps each).
# Overrides: STAGES (default "doctor plan decode correct bench fp16 export"), MODEL, EXPORT_MODEL, SMALL, BENCH_ARGS,
# DECODE_ROWS, DECODE_TOKENS, DECODE_BENCH_ROWS, CHECK_ROWS, CHECK_TOKENS, CHECK_DTYPES, and DOCTOR_S, DECODE_S,
# CORRECT_S, BENCH_S, FP16_S, EXPORT_S (limits in seconds). A dry run on a cpu: MODEL=smollm2-135m
# BENCH_ARGS="-G 2 --max-new-tokens 8 --steps 2".
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check.txt}
wheels=${2:-.gpu/wheels}
model=${MODEL:-qwen-1.5b}
small=${SMALL:-smollm2-135m}
export_model=${EXPORT_MODEL:-$model}
stages=${STAGES:-doctor plan decode correct bench fp16 export}  # which stages to run
bench_args=${BENCH_ARGS:--G 4 -G 8 --max-new-tokens 256 --steps 2}
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
  python -c "import sys; from pathlib import Path; from minigrpo.bench.steps import weights_or_random
print(weights_or_random(sys.argv[1], Path(sys.argv[2]), random_weights=True)[0])" "$1" "$2"
}

stages_py() {  # stages_py STAGE ARGS...: a stage's python, kept in the package with a CPU test each
  python -m minigrpo.bench.gpu_stages "$@"
}
preset_flags() {  # preset_flags PRESET: the preset's settings as flags, for a random model passed as a folder
  python -c "import sys; from minigrpo.presets import PRESETS; p = PRESETS[sys.argv[1]]
print(f'--max-new-tokens {p.max_new_tokens} --num-generations {p.num_generations} --prompts-per-step '
      f'{p.prompts_per_step} --lora-rank {p.lora_rank} --learning-rate {p.learning_rate}')" "$1"
}
export -f random_model stages_py preset_flags
export work

# a reward random text earns unevenly (random weights never solve a sum), so a step's groups have a spread to learn
printf 'def vowel_share(completions, **kwargs):\n    return [sum(c in "aeiou" for c in t) / max(len(t), 1) for t in completions]\n' \
  > "$work/varied.py"

{
  echo "# minigrpo GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
  nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv 2>&1 || echo "no nvidia-smi"
  if compgen -G "$wheels/*.whl" > /dev/null; then
    echo "## installing carried wheels: $(ls "$wheels" | tr '\n' ' ')"
    if python -m pip --version > /dev/null 2>&1; then
      python -m pip install --no-index --no-deps --no-compile --target "$work/site" "$wheels"/*.whl 2>&1 | tail -3
    else  # a python without pip: a wheel is a zip whose top level is what site-packages holds
      for wheel in "$wheels"/*.whl; do python -m zipfile -e "$wheel" "$work/site" && echo "unpacked $(basename "$wheel")"; done
    fi
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
  stage doctor ${DOCTOR_S:-60} "minigrpo doctor" python -m minigrpo.cli doctor
  stage plan 40 "minigrpo plan (the estimate, before any run): this card, then a T4" \
    bash -c "python -m minigrpo.cli plan --model $model && python -m minigrpo.cli plan --model $model --gpu t4"
  stage decode ${DECODE_S:-150} "transformers decoding of $model (random weights): ms per new token" bash -c "
    folder=\$(random_model $model $work/big | tail -1) &&
    stages_py decode-speed \$folder \"${DECODE_ROWS:-1 8 32}\" \"${DECODE_TOKENS:-3 35}\" &&
    python -m minigrpo.cli bench decode --preset $model $(printf -- '--rows %s ' ${DECODE_BENCH_ROWS:-1 16 64}) --json"
  stage correct ${CORRECT_S:-70} "fixed-shape decoding of $model decodes as the eager loop and the trainer" bash -c "
    folder=$work/big; [ -f $work/big/config.json ] || folder=\$(random_model $model $work/big | tail -1)
    stages_py decode-correct \$folder ${CHECK_ROWS:-8} ${CHECK_TOKENS:-24} ${CHECK_DTYPES:-auto float16}"
  # shellcheck disable=SC2086  # the arguments are meant to split
  stage bench ${BENCH_S:-110} "minigrpo bench model (measured)" python -m minigrpo.cli bench model --model "$model" --random-weights \
    $bench_args
  stage fp16 30 "float16, as on a T4: doctor" python -m minigrpo.cli doctor --dtype float16
  stage fp16 ${FP16_S:-60} "float16, as on a T4: three training steps of $small (random weights)" bash -c "
    folder=\$(random_model $small $work/small | tail -1) &&
    python -m minigrpo.cli train --model \$folder \$(preset_flags $small) --task addition --steps 3 --dtype float16 --generator hf \
      --reward $work/varied.py:vowel_share --out $work/run-fp16 --sample-every 0 --no-eval-before-after &&
    tail -n 3 $work/run-fp16/metrics.jsonl && stages_py first-run-checks $work/run-fp16"
  stage export ${EXPORT_S:-60} "export of $export_model's 4-bit policy, streamed" bash -c "
    folder=$work/big; [ $export_model = $model ] && [ -f $work/big/config.json ] ||
      folder=\$(random_model $export_model $work/big-export | tail -1)  # the decode stages' model where it is the same
    stages_py export-memory \$folder $work/export"
} 2>&1 | tee "$out"
echo "figures written to $out"
