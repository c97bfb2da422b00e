"""The Python of the GPU check's stages (scripts/gpu_check.sh), each with a test at a CPU's size, so that no line of
the check runs for the first time on a card. The script runs them as `python -m minigrpo.bench.gpu_stages STAGE
ARGS...`; each prints its figures (JSON lines, or PASS/FAIL lines) and exits non-zero where a check failed."""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch


def decode_speed(folder: str, rows: list[int], lengths: tuple[int, int]) -> int:
    """ms per new token of `transformers` decoding, the fixed-shape loop first (its figures matter most if the
    stage runs out of time), then the eager one; two decode lengths whose difference is the per-token figure."""
    from minigrpo.bench.decode import cpu_model, measure
    from minigrpo.config import TrainConfig
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.model import default_dtype, load_policy, load_tokenizer

    dtype = default_dtype()
    policy = load_policy(TrainConfig(load_in_4bit=True, bf16_base=False), folder, dtype).eval()
    tokenizer = load_tokenizer(folder)
    for n in rows:
        for decoder in ("static", "eager"):
            figures = measure(HFGenerator(policy, tokenizer, decoder=decoder), n, repeats=1, lengths=lengths)
            print(json.dumps({"rows": n, "path": decoder, "dtype": str(dtype), "device": str(policy.device),
                              "cpu": cpu_model(), **figures}), flush=True)
    return 0


def decode_correct(folder: str, rows: int, tokens: int, dtypes: list[str]) -> int:
    """The fixed-shape loop decodes as the eager loop and the trainer (`bench.decode.decode_agreement`), in each
    dtype asked for once (on a T4 `auto` is float16: checked once, not twice), one model alive at a time."""
    from minigrpo.bench.decode import _policy, decode_agreement
    from minigrpo.model import default_dtype

    failed = 0
    for dtype in dict.fromkeys(str(default_dtype(d)).removeprefix("torch.") for d in dtypes):
        policy = _policy(folder, load_in_4bit=True, dtype=dtype)
        for what, ok, figures in decode_agreement(policy, rows=rows, new_tokens=tokens):
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'}: {policy.dtype}, {policy.device}: {what} ({figures})", flush=True)
        del policy
        _free()
    return 1 if failed else 0


def first_run_checks(run: str) -> int:
    """What a first run on a card must show, asserted: reward spread in some step, the adapter changed, the
    generator's log-probs follow the trainer's, no step skipped by the scaler; on a card, the peak within 25% of
    `minigrpo plan`'s estimate."""
    from safetensors.torch import load_file

    from minigrpo.bench.steps import peak_agrees
    from minigrpo.cli.machine import plans_for
    from minigrpo.config import TrainConfig
    from minigrpo.health import GAP_WARNING

    folder = Path(run)
    steps = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    adapter = load_file(str(folder / "adapter" / "adapter_model.safetensors"))
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
        plan = next(iter(plans_for(TrainConfig.load(folder / "config.json"), None, None).values()))
        ok, said = peak_agrees(plan, max(m["mem/peak_gb"] for m in steps))
        checks[said] = ok
    for what, ok in checks.items():
        print(("PASS: " if ok else "FAIL: ") + what)
    return 0 if all(checks.values()) else 1


def export_memory(folder: str, out: str) -> int:
    """The streamed export of a 4-bit policy: its extra device memory against its largest shard."""
    from minigrpo.bench.steps import extra_memory_gb
    from minigrpo.config import TrainConfig
    from minigrpo.export import export_weights
    from minigrpo.model import default_dtype, load_policy, load_tokenizer

    dtype = default_dtype()
    policy = load_policy(TrainConfig(lora_rank=16, load_in_4bit=True, bf16_base=False), folder, dtype)
    extra = extra_memory_gb(lambda: export_weights(policy, load_tokenizer(folder), out, dtype, merge_adapter=True))
    shards = [os.path.getsize(Path(out) / f) / 2**30 for f in os.listdir(out) if f.endswith(".safetensors")]
    print(json.dumps({"device": str(policy.device), "dtype": str(dtype), "exported_gb": round(sum(shards), 3),
                      "largest_shard_gb": round(max(shards), 3), "extra_device_gb": round(extra, 3)}))
    return 0


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    stage, args = argv[0], argv[1:]
    if stage == "decode-speed":
        return decode_speed(args[0], [int(r) for r in args[1].split()], tuple(int(n) for n in args[2].split()))
    if stage == "decode-correct":
        return decode_correct(args[0], int(args[1]), int(args[2]), args[3:])
    if stage == "first-run-checks":
        return first_run_checks(args[0])
    if stage == "export-memory":
        return export_memory(args[0], args[1])
    raise SystemExit(f"unknown stage {stage!r}: decode-speed, decode-correct, first-run-checks or export-memory")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
