"""Benchmarks of one part of a step, each in a child process of its own: a matmul in float32 and bfloat16 (why
bf16 projections only where the CPU has bf16 instructions), and the log-prob + loss pass's memory, chunked
against the full log-softmax.

    minigrpo bench dtype     # or: python -c "from minigrpo.bench.parts import dtype_speed; dtype_speed()"
    minigrpo bench memory
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from minigrpo.bench.steps import LIVE_MEMORY_ENV, extra_memory_gb, run_child
from minigrpo.config import TrainConfig


# oneDNN's instruction-set cap: how a cpu without bf16 instructions would run the same matmuls
ISA_CAPS = {"this cpu": None, "capped at AVX-512 without bf16": "AVX512_CORE", "capped at AVX2": "AVX2"}


def dtype_speed(console: Console | None = None, rows: tuple[int, ...] = (16, 1024)) -> list[dict]:
    """Milliseconds of a matmul of the tiny model's MLP shape (576 -> 1536) in float32 and bfloat16, for 16 rows
    (a decode step of G=8 x 2 prompts) and 1024 (a training micro-batch), on this cpu and with oneDNN capped
    below bf16 instructions: why `hardware.compute_dtype` picks bfloat16 only where the cpu has them."""
    console = console or Console(width=140)
    results = []
    for name, cap in ISA_CAPS.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "t.json"
            run_child("import sys; from minigrpo.bench.parts import _dtype_child; _dtype_child(sys.argv[1], sys.argv[2])",
                      [",".join(map(str, rows)), str(out)], {"ONEDNN_MAX_CPU_ISA": cap} if cap else None)
            results.append({"cpu": name, **json.loads(out.read_text())})
    table = Table(title="one matmul (rows x 576) by (576 x 1536), median ms")
    for column in ["cpu"] + [f"{n} rows {d}" for n in rows for d in ("fp32", "bf16", "bf16/fp32")]:
        table.add_column(column)
    for r in results:
        cells = []
        for n in rows:
            f, b = r[f"{n}/float32"], r[f"{n}/bfloat16"]
            cells += [f"{f:.3f}", f"{b:.3f}", f"{b / f:.2f}"]
        table.add_row(r["cpu"], *cells)
    console.print(table)
    return results


def _dtype_child(rows: str, out: str) -> None:
    import torch

    figures = {}
    for n in map(int, rows.split(",")):
        for dtype in (torch.float32, torch.bfloat16):
            x, w = torch.randn(n, 576, dtype=dtype), torch.randn(1536, 576, dtype=dtype)
            times = []
            for _ in range(60):
                start = time.perf_counter()
                x @ w.t()
                times.append(time.perf_counter() - start)
            figures[f"{n}/{str(dtype).removeprefix('torch.')}"] = statistics.median(times[10:]) * 1e3
    Path(out).write_text(json.dumps(figures))


def _memory_child(path: str, rows: int, length: int, out: str) -> None:
    """One log-prob + loss pass (forward and backward, in training mode as in a step) with the tiny model;
    its peak memory above what was in use just before it."""
    import torch

    from minigrpo import loss as L
    from minigrpo.model import load_policy, load_tokenizer
    from minigrpo.logprobs import full_logprobs, token_logprobs
    from minigrpo.weights import resolve_weights

    cfg = TrainConfig(load_in_4bit=torch.cuda.is_available())
    weights = resolve_weights(cfg.hub_id)
    model = load_policy(cfg, weights).train()
    tokenizer = load_tokenizer(weights)
    device = model.device
    logprobs = token_logprobs if path == "chunked" else full_logprobs

    def one_pass(rows: int, length: int) -> None:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(10, tokenizer.vocab_size, (rows, 32 + length), generator=g).to(device)
        logps = logprobs(model, ids, torch.ones_like(ids), length)  # [rows, length]
        mask = torch.ones(rows, length, dtype=torch.bool, device=device)
        loss, _ = L.policy_loss(L.Objective(), logps, logps.detach(), None, torch.randn(rows, device=device), mask)
        loss.backward()
        model.zero_grad(set_to_none=True)

    one_pass(1, 8)  # warm-up: thread pools and kernels allocate their buffers once
    extra = extra_memory_gb(lambda: one_pass(rows, length))
    Path(out).write_text(json.dumps({"extra_gb": extra}))


def memory_scaling(lengths=(64, 256, 1024, 2048), rows_at=4, groups=(4, 8, 16, 32), length_at=256,
                   console: Console | None = None) -> None:
    """Peak memory of the log-prob + loss pass, chunked vs the full log-softmax, as length and G grow."""
    console = console or Console(width=140)

    def measure(path, rows, length):
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "m.json"
            code = ("import sys; from minigrpo.bench.parts import _memory_child; "
                    "_memory_child(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])")
            run_child(code, [path, str(rows), str(length), str(out)], LIVE_MEMORY_ENV)
            return json.loads(out.read_text())["extra_gb"]

    for title, cases in ((f"completion length grows (G = {rows_at} rows in one pass)", [(rows_at, n) for n in lengths]),
                         (f"G grows ({length_at} tokens each, all rows in one pass)", [(r, length_at) for r in groups])):
        table = Table(title=f"extra peak memory of the log-prob + loss pass, GB: {title}")
        for column in ("rows x tokens", "chunked (ours)", "full log-softmax", "full / chunked"):
            table.add_column(column)
        for rows, length in cases:
            ours, naive = measure("chunked", rows, length), measure("full", rows, length)
            table.add_row(f"{rows} x {length}", f"{ours:.2f}", f"{naive:.2f}", f"{naive / max(ours, 1e-3):.1f}")
            console.print(f"  {rows} x {length}: chunked {ours:.2f} GB, full {naive:.2f} GB", highlight=False)
        console.print(table)
