#!/usr/bin/env bash
# The GPU path, checked on a real card, every figure written to one file:
#   1. `minigrpo doctor` (the card's facts, the dtype it chose and why, 4-bit + LoRA forward/backward on it);
#   2. `minigrpo plan` for this card and for a T4, from the preset's shape alone (the estimate);
#   3. `transformers` decoding of the preset (random weights, 4-bit + LoRA): milliseconds per new token at 1, 8
#      and 32 rows, the fixed-shape loop (a CUDA graph per token) beside the eager one, with host time, torch ops,
#      kernel launches (and their mean host time) and syncs per token, and the share of a token's wall time the
#      card spends in kernels; then `minigrpo bench decode` on models of the preset's depth and tiny widths (the
#      host's cost alone);
#   4. the fixed-shape loop's correctness on the card, in its default dtype and in float16 (a T4's): greedy tokens
#      equal the eager loop's (or part only at a tie), sampled tokens' log-probs within 1e-2 of the trainer's, and
#      both again after an optimizer step and the adapter's refresh, asserted;
#   4b. `minigrpo bench model` on the preset with random weights of its shape (measured: s/step, tokens/s,
#      peak and reserved memory beside the plan's estimate);
#   5. the T4's float16 path on this card: `doctor --dtype float16` and three training steps in float16
#      (gradient scaler, first-rollout numerics check), then what a first run on a card must show, asserted:
#      reward spread in some step, the adapter changed, the generator's log-probs follow the trainer's, no step
#      skipped by the scaler, peak memory within 25% of `minigrpo plan`'s estimate;
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

export_memory() {  # export_memory FOLDER: the streamed export's extra device memory against its largest shard
  python - "$1" "$work/export" <<'PY'
import json, os, sys
from minigrpo.bench.steps import extra_memory_gb
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
decode_speed() {  # decode_speed FOLDER: ms per new token of `transformers` decoding, eager and fixed-shape loops
  python - "$1" "${DECODE_ROWS:-1 8 32}" "${DECODE_TOKENS:-3 35}" <<'PY'
import json, sys
from minigrpo.bench.decode import cpu_model, measure
from minigrpo.config import TrainConfig
from minigrpo.generate.hf import HFGenerator
from minigrpo.model import default_dtype, load_policy, load_tokenizer
path, dtype = sys.argv[1], default_dtype()
policy = load_policy(TrainConfig(load_in_4bit=True), path, dtype).eval()
tokenizer = load_tokenizer(path)
for rows in map(int, sys.argv[2].split()):
    for decoder in ("static", "eager"):  # the new loop first: its figures matter most if the stage runs out of time
        lengths = tuple(map(int, sys.argv[3].split()))  # two decodes whose difference is the per-token figure
        figures = measure(HFGenerator(policy, tokenizer, decoder=decoder), rows, repeats=1, lengths=lengths)
        print(json.dumps({"rows": rows, "path": decoder, "dtype": str(dtype), "device": str(policy.device),
                          "cpu": cpu_model(), **figures}), flush=True)
PY
}
decode_correct() {  # decode_correct FOLDER: the fixed-shape loop decodes as the eager loop and the trainer (exit 1 if not)
  python - "$1" "${CHECK_ROWS:-8}" "${CHECK_TOKENS:-24}" ${CHECK_DTYPES:-auto float16} <<'PY'
import sys
import torch
from minigrpo.bench.decode import _policy, decode_agreement
folder, rows, tokens, failed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), 0
for dtype in sys.argv[4:]:
    policy = _policy(folder, load_in_4bit=True, dtype=dtype)
    for what, ok, figures in decode_agreement(policy, rows=rows, new_tokens=tokens):
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'}: {policy.dtype}, {policy.device}: {what} ({figures})", flush=True)
    del policy
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
sys.exit(1 if failed else 0)
PY
}
first_run_checks() {  # first_run_checks RUN_DIR: what a first run on a card must show, asserted (exit 1 if not)
  python - "$1" <<'PY'
import json, sys
from pathlib import Path
import torch
from safetensors.torch import load_file
from minigrpo.config import TrainConfig
from minigrpo.bench.steps import peak_agrees
from minigrpo.cli.machine import plans_for
from minigrpo.health import GAP_WARNING
run = Path(sys.argv[1])
steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
gaps = [m["sampler_logprob_gap/mean"] for m in steps[1:] if "sampler_logprob_gap/mean" in m]
checks = {
    "some step has reward spread above zero": any(m.get("frac_groups_reward_differs", 0) > 0 for m in steps),
    "the adapter changed (its B matrices, zero at the start)": any(
        t.abs().sum() > 0 for name, t in adapter.items() if "lora_B" in name),
    f"the generator samples with the updated adapter (its log-probs within {GAP_WARNING} of the trainer's "
    f"after step 1: {[round(g, 4) for g in gaps]})": bool(gaps) and max(gaps) < GAP_WARNING,
    "no float16 step was skipped by the gradient scaler": not any(m.get("skipped_overflow") for m in steps),
}
if torch.cuda.is_available():  # the plan's estimate is for a card
    plan = next(iter(plans_for(TrainConfig.load(run / "config.json"), None, None).values()))
    ok, said = peak_agrees(plan, max(m["mem/peak_gb"] for m in steps))
    checks[said] = ok
for what, ok in checks.items():
    print(("PASS: " if ok else "FAIL: ") + what)
sys.exit(0 if all(checks.values()) else 1)
PY
}
preset_flags() {  # preset_flags PRESET: the preset's settings as flags, for a random model passed as a folder
  python -c "import sys; from minigrpo.config import PRESETS; p = PRESETS[sys.argv[1]]
print(f'--max-new-tokens {p.max_new_tokens} --num-generations {p.num_generations} --prompts-per-step '
      f'{p.prompts_per_step} --lora-rank {p.lora_rank} --learning-rate {p.learning_rate}')" "$1"
}
export -f random_model export_memory decode_speed decode_correct preset_flags first_run_checks
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
    folder=\$(random_model $model $work/big | tail -1) && decode_speed \$folder &&
    python -m minigrpo.cli bench decode --preset $model $(printf -- '--rows %s ' ${DECODE_BENCH_ROWS:-1 16 64}) --json"
  stage correct ${CORRECT_S:-70} "fixed-shape decoding of $model decodes as the eager loop and the trainer" bash -c "
    folder=$work/big; [ -f $work/big/config.json ] || folder=\$(random_model $model $work/big | tail -1)
    decode_correct \$folder"
  # shellcheck disable=SC2086  # the arguments are meant to split
  stage bench ${BENCH_S:-110} "minigrpo bench model (measured)" python -m minigrpo.cli bench model --model "$model" --random-weights \
    $bench_args
  stage fp16 30 "float16, as on a T4: doctor" python -m minigrpo.cli doctor --dtype float16
  stage fp16 ${FP16_S:-60} "float16, as on a T4: three training steps of $small (random weights)" bash -c "
    folder=\$(random_model $small $work/small | tail -1) &&
    python -m minigrpo.cli train --model \$folder \$(preset_flags $small) --task addition --steps 3 --dtype float16 --generator hf \
      --reward $work/varied.py:vowel_share --out $work/run-fp16 --sample-every 0 --no-eval-before-after &&
    tail -n 3 $work/run-fp16/metrics.jsonl && first_run_checks $work/run-fp16"
  stage export ${EXPORT_S:-60} "export of $export_model's 4-bit policy, streamed" bash -c "
    folder=\$(random_model $export_model $work/big-export | tail -1) && export_memory \$folder"
} 2>&1 | tee "$out"
echo "figures written to $out"
