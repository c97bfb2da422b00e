"""`minigrpo bench model` on CPU: it trains each setting for real and prints what it measured and a plan.
(The figures themselves are for people to read, not for asserts: these machines are too noisy to time.)"""

import torch
from rich.console import Console

from minigrpo.bench.steps import bench_model


def test_bench_model_measures_each_setting_and_prints_a_plan():
    console = Console(record=True, width=160)
    rows = bench_model("smollm2-135m", groups=(2,), lengths=(8, 16), steps=2, generator="hf", console=console)
    assert [(r["G"], r["max_new_tokens"]) for r in rows] == [(2, 8), (2, 16)]
    for r in rows:
        assert 0 < r["completion tokens"] <= r["max_new_tokens"] and r["prompt tokens"] > 0
        assert r["s/step"] > 0 and r["tokens/s"] > 0
        assert 0.1 < r["loaded GB"] <= r["peak GB"]
    text = console.export_text()
    assert "memory plan" in text and "Fits this machine" in text


def test_a_failing_benchmark_child_shows_its_last_lines():
    import pytest

    from minigrpo.bench.steps import ChildFailed, run_child

    with pytest.raises(ChildFailed, match=r"exit status 1(.|\n)*ZeroDivisionError: division by zero"):
        run_child("print('noise'); 1 / 0", [])


def test_the_trl_table_prints_what_was_measured_and_why_the_rest_was_not():
    from minigrpo.bench.trl import print_trl_table

    console = Console(record=True, width=200)
    measured = [{"time/step": 10.0, "mem/peak_gb": 2.0, "time/generate": 4.0, "tokens_per_s": 150.0},
                {"time/step": 12.0, "mem/peak_gb": 2.5, "time/generate": 5.0, "tokens_per_s": 130.0}]
    print_trl_table({"minigrpo": measured}, {"TRL GRPOTrainer": "TRL is not installed (pip install trl)",
                                             "minigrpo (vllm)": "failed (exit status 1)"}, 3, 1, console)
    text = console.export_text()
    assert "TRL GRPOTrainer: not measured: TRL is not installed" in text
    assert "minigrpo (vllm): not measured: failed (exit status 1)" in text
    row = next(line for line in text.splitlines() if line.startswith("│ minigrpo "))
    assert "11.00" in row and "2.50" in row and "4.50" in row and "140" in row  # medians and the peak


def test_a_benchmark_killed_from_outside_takes_its_child_along(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    pid_file = tmp_path / "child.pid"
    child_code = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)"
    parent = subprocess.Popen([sys.executable, "-c", "import sys; from minigrpo.bench.steps import run_child; "
                               f"run_child({child_code!r}, [sys.argv[1]])", str(pid_file)])
    while not (pid_file.exists() and pid_file.read_text()):  # the child is up (no clock: it gets there or the test hangs)
        assert parent.poll() is None, "the benchmark ended before its child started"
        time.sleep(0.05)
    child = int(pid_file.read_text())
    parent.send_signal(signal.SIGTERM)  # as `kill` or a scheduler ends it: no Ctrl-C reaching the child's group
    parent.wait()

    def alive() -> bool:
        try:  # a zombie (state Z) waits only for its reaper: it runs nothing
            return Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    for _ in range(600):  # the kernel kills it at once; the loop only lets it finish dying
        if not alive():
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)  # left behind: not for the machine to keep
    raise AssertionError(f"the benchmark's child {child} outlived it")


def test_the_avx2_caps_make_a_run_compute_as_an_avx2_cpu_computes():
    """ONEDNN_MAX_CPU_ISA=AVX2 (with torch's own cap) leaves bf16 emulated: the default then keeps the projections
    in float32, as it does on an AVX2 cpu, and a card's hardware line says the cap."""
    import os
    import subprocess
    import sys

    caps = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    code = ("from minigrpo.config import TrainConfig; from minigrpo.bench.learn import hardware, describe_hardware; "
            "print(TrainConfig().bf16_base, describe_hardware(hardware()))")
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **caps}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("False "), done.stderr[-500:]
    assert "avx512_bf16" not in done.stdout


def test_the_profile_counts_each_kernel_a_decoder_multiplies_with_as_a_projection():
    """Whichever kernel `pack` chose for a weight (fbgemm's half precision, oneDNN's order, none), its matmul is
    counted among the projections, not the other ops."""
    from minigrpo.bench.profile import _kind
    from minigrpo.generate.fused import linear, pack

    weight, x = torch.randn(64, 32), torch.randn(4, 32)
    packs = {"none": None, "fp32": pack(weight, 4), "bf16": pack(weight.bfloat16(), 4)}
    for name, packed in packs.items():
        w = weight.bfloat16() if name == "bf16" else weight
        rows = x.to(w.dtype)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            linear(rows, w, None, packed)
        top = [e for e in prof.events() if e.cpu_parent is None]
        assert [_kind(e, vocab=49152) for e in top] == ["projections"], (name, [e.name for e in top])


def test_the_profile_splits_a_real_step_into_phases_each_with_its_floor():
    from minigrpo.bench.profile import profile_step, table

    result = profile_step({"prompts_per_step": 1, "num_generations": 2, "max_new_tokens": 6, "steps": 2})
    rows = {name: (ms, floor, bound) for name, ms, floor, bound in result["phases"]}
    for phase in ("prefill", "decode", "forward", "backward", "optimizer", "sync"):
        ms, floor, bound = rows[phase]
        assert ms > 0 and floor > 0 and bound in ("arithmetic", "memory"), phase
    # the decode steps' ops are told apart: the block projections, the lm head (by its shape), the sampler
    assert {"  decode: projections", "  decode: lm head", "  decode: sampling"} <= set(rows)
    facts = result["facts"]
    assert facts["rows"] == 2 and 1 <= facts["decode_steps"] <= 5  # the first token comes from the prefill
    assert "| decode | " in table(result)
