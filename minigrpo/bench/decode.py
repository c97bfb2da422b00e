"""`minigrpo bench decode`: the host's cost of a new token, the eager decode loop beside the fixed-shape one.

The models have each preset's depth and layer kinds (attention heads, key/value heads, biases) but tiny widths
and vocabulary, random weights built in memory: their arithmetic is close to nothing, so what a token costs is
the host's work of issuing it (Python, dispatch, kernel launches). On a GPU that work is the floor of a token,
whatever the card, so this figure measured on a CPU is the proxy for a card's decode speed. The policy is built
as training builds it (4-bit NF4 + LoRA where bitsandbytes is installed, adapters non-zero).

Per token figures come from two decodes of different lengths, differenced, so the prefill and the setup cancel:
host ms from `time.process_time` (other jobs on the machine do not inflate it), torch ops (top-level aten and
bitsandbytes calls) and host-device syncs (`aten::_local_scalar_dense`, and device-to-host copies on a card)
from the profiler. `first_call_s` is the first decode's wall time at that shape (on a card, the CUDA graph's
capture included): the warm-up paid once per shape.
"""

from __future__ import annotations

import platform
import tempfile
import time
from pathlib import Path

import torch

from minigrpo.config import TrainConfig
from minigrpo.generate.sampling import Sampling

PATHS = ("eager", "static")
SHORT, LONG = 3, 35  # new tokens of the two decodes whose difference is 32 tokens' work


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def depth_only(preset: str, folder: Path, head_dim: int = 8, vocab: int = 512, layers: int | None = None) -> str:
    """Random weights with the preset's depth (or `layers`), head counts and layer kinds, 8 dims a head: a
    folder to load."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from minigrpo.presets import PRESETS

    kind, shape = PRESETS[preset].model_type, PRESETS[preset].shape
    hidden = shape["num_attention_heads"] * head_dim
    config = AutoConfig.for_model(kind, max_position_embeddings=4096, **dict(
        shape, hidden_size=hidden, head_dim=head_dim, intermediate_size=2 * hidden, vocab_size=vocab,
        num_hidden_layers=layers or shape["num_hidden_layers"]))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return str(folder)


def _policy(folder: str, load_in_4bit: bool, dtype: str = "auto"):
    from minigrpo.model import default_dtype, load_policy

    cfg = TrainConfig(lora_rank=16, load_in_4bit=load_in_4bit, bf16_base=False,
                      dtype=dtype if torch.cuda.is_available() else "float32")
    policy = load_policy(cfg, folder, default_dtype(cfg.dtype)).eval()
    policy.generation_config.eos_token_id = None  # no token ends a row: every decode runs to its limit
    with torch.no_grad():  # a trained adapter's size, so its matmuls are not skipped as zeros anywhere
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.02)
    return policy


class _Pad:  # what HFGenerator reads from a tokenizer; eos outside the vocabulary: every decode runs to its limit
    pad_token_id, eos_token_id = 0, 512


class TransformersStatic:
    """transformers' own `generate` with its static key/value cache, as a generator the benchmark can time: the
    well-kept library's path beside ours (its `compile_config` compiles on a card only; on a cpu it runs eager)."""

    def __init__(self, policy):
        self.policy = policy

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, base: bool = False) -> None:
        ids = torch.tensor(prompt_ids, device=self.policy.device)
        self.policy.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                             top_p=sampling.top_p, temperature=sampling.temperature, pad_token_id=0,
                             max_new_tokens=sampling.max_new_tokens, min_new_tokens=sampling.max_new_tokens,
                             num_return_sequences=sampling.n, cache_implementation="static")


def _wait() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")


def _counts(generate, rows: int, n: int) -> dict:
    """Torch ops, syncs, kernel launches (and their host microseconds) and card-busy milliseconds of one decode
    of `n` new tokens for `rows` rows."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        generate(rows, n)
        _wait()
    events = profile.events()
    on_card = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    top = [e for e in events if e.cpu_parent is None and e.device_type == torch.autograd.DeviceType.CPU]
    launches = [e for e in events if e.name in LAUNCHES]
    return {"ops": sum(e.name.startswith(("aten::", "bitsandbytes::")) or e.name in LAUNCHES for e in top),
            "syncs": sum(e.name == "aten::_local_scalar_dense" for e in events)
            + sum("DtoH" in e.name or "Device -> Host" in e.name for e in on_card),
            "launches": len(launches), "launch_us": sum(e.cpu_time_total for e in launches),
            "busy_ms": sum(e.self_device_time_total for e in on_card) / 1000}


def measure(generator, rows: int, repeats: int = 2, lengths: tuple[int, int] = (SHORT, LONG)) -> dict:
    """Per-token figures of one generator at `rows` rows, from decodes of `lengths` new tokens (see the module's
    docstring)."""
    short_n, long_n = lengths
    prompt = [list(range(10, 74))]  # one 64-token prompt, every row continuing it

    def generate(r: int, n: int) -> None:
        generator.generate(prompt, Sampling(r, n))

    start = time.perf_counter()
    generate(rows, short_n)
    _wait()
    first = time.perf_counter() - start

    def host(n: int) -> tuple[float, float]:
        best = (float("inf"), float("inf"))
        for _ in range(repeats):
            cpu, wall = time.process_time(), time.perf_counter()
            generate(rows, n)
            _wait()
            best = min(best, (time.process_time() - cpu, time.perf_counter() - wall))
        return best

    (cpu_short, wall_short), (cpu_long, wall_long) = host(short_n), host(long_n)
    short, long = _counts(generate, rows, short_n), _counts(generate, rows, long_n)
    tokens = long_n - short_n
    per_token = {k: (long[k] - short[k]) / tokens for k in long}
    wall_ms = 1000 * (wall_long - wall_short) / tokens
    figures = {"host_ms_per_token": round(1000 * (cpu_long - cpu_short) / tokens, 2),
               "wall_ms_per_token": round(wall_ms, 2),
               "ops_per_token": round(per_token["ops"], 1),
               "syncs_per_token": round(per_token["syncs"], 3),
               "first_call_s": round(first, 2)}
    if torch.cuda.is_available():
        figures["launches_per_token"] = round(per_token["launches"], 1)
        figures["launch_mean_us"] = round(per_token["launch_us"] / per_token["launches"], 2) \
            if per_token["launches"] > 0 else None
        figures["card_busy_share"] = round(per_token["busy_ms"] / wall_ms, 3) if wall_ms > 0 else None
    return figures


def decode_agreement(policy, rows: int = 8, new_tokens: int = 24,
                     tolerance: float = 1e-2) -> list[tuple[str, bool, str]]:
    """Does the fixed-shape loop (a captured CUDA graph on a card) decode what the eager loop and the trainer do?
    Greedy tokens equal the eager loop's (where a row parts, only at a tie the precision decides: the trainer's
    log-probs of both tokens within `tolerance`); sampled tokens' log-probs within `tolerance` of the trainer's
    per token on average; and both again after an optimizer step and the adapter's refresh. Returns (check, passed,
    figures) for each."""
    from minigrpo.generate.hf import HFGenerator, decode
    from minigrpo.model import lora_parameters
    from minigrpo.logprobs import pad_batch, positions, token_logprobs

    prompts = [list(range(10 + 7 * i, 40 + 5 * i)) for i in range(max(1, rows // 2))]  # left-padded widths
    generator = HFGenerator(policy, _Pad(), report_logprobs=True, decoder="static")
    eos = generator.eos_ids or [_Pad.eos_token_id]

    def trainer(pairs: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, attention, mask = pad_batch(pairs, 0, policy.device)
        with torch.no_grad():
            return token_logprobs(policy, ids, attention, mask.shape[1]).float().cpu(), mask.cpu()  # [B, T]

    def greedy() -> tuple[bool, str]:
        fixed = generator.generate(prompts, Sampling(1, new_tokens, 0.0)).completion_ids
        eager, _ = decode(policy, prompts, Sampling(1, new_tokens, 0.0), eos, 0)
        parted, ties = 0, []
        for prompt, a, b in zip(prompts, fixed, eager):
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if j is None:
                continue
            parted += 1
            logps, _ = trainer([(prompt, a[:j + 1]), (prompt, b[:j + 1])])
            ties.append(abs(logps[0, j] - logps[1, j]).item())
        ok = all(t < tolerance for t in ties)
        return ok, f"{len(prompts) - parted} of {len(prompts)} rows identical" + (
            f"; parted at log-prob differences {[round(t, 4) for t in ties]}" if ties else "")

    def sampled() -> tuple[bool, str]:
        out = generator.generate(prompts, Sampling(2, new_tokens, 1.0))
        logps, mask = trainer([(prompts[i // 2], c) for i, c in enumerate(out.completion_ids)])
        ours = torch.tensor([x for row in out.sampler_logps for x in row])
        gap = (logps[mask] - ours).abs()
        return gap.mean().item() < tolerance, f"mean {gap.mean().item():.2g}, max {gap.max().item():.2g} per token"

    def in_nucleus(temperature: float = 0.7, top_p: float = 0.9) -> tuple[bool, str]:
        """Sort, cumulative sum and scatter run only here inside a captured graph: every token it samples must be
        in the trainer's nucleus (its mass ahead at most top-p, give or take `tolerance` of rounding)."""
        from minigrpo.generate.sampling import nucleus

        out = generator.generate(prompts, Sampling(2, new_tokens, temperature, top_p))
        pairs = [(prompts[i // 2], c) for i, c in enumerate(out.completion_ids)]
        ids, attention, mask = pad_batch(pairs, 0, policy.device)
        n = mask.shape[1]
        with torch.no_grad():
            logits = policy(input_ids=ids, attention_mask=attention, position_ids=positions(attention)
                            ).logits[:, -n - 1:-1].float() / temperature  # [B, n, V]
        outside = nucleus(logits.reshape(-1, logits.shape[-1]), top_p + tolerance).view(*mask.shape, -1)  # [B, n, V]
        drawn = outside.gather(-1, ids[:, -n:, None]).squeeze(-1)[mask]  # [tokens]: True where outside
        return not drawn.any().item(), (f"{int(drawn.sum())} of {drawn.numel()} sampled tokens outside the trainer's "
                                        f"top-p {top_p} nucleus at temperature {temperature}")

    results = [("greedy tokens, fixed-shape = eager", *greedy()),
               ("sampled log-probs, fixed-shape = trainer", *sampled()),
               ("top-p sampling inside the fixed-shape step", *in_nucleus())]
    policy.train()  # one optimizer step on the adapter, as training takes, then the refresh `sync` makes
    optimizer = torch.optim.SGD(lora_parameters(policy), lr=0.5)
    ids = torch.tensor([prompts[0]], device=policy.device)
    token_logprobs(policy, ids, torch.ones_like(ids), 8).sum().backward()
    optimizer.step()
    policy.eval()
    generator.sync(policy)
    results += [(f"{name}, after a step", *check()) for name, check in
                (("greedy tokens, fixed-shape = eager", greedy), ("sampled log-probs, fixed-shape = trainer", sampled))]
    return results


def bench_decode(presets=("smollm2-135m", "qwen-1.5b"), rows=(1, 16, 64), load_in_4bit: bool | None = None,
                 threads: int = 1, emit=print, with_transformers: bool = False) -> list[dict]:
    """Every preset x rows x path (with `with_transformers`, transformers' static-cache `generate` too); each
    result is handed to `emit` as it is measured, and returned."""
    from minigrpo.console import quiet_libraries
    from minigrpo.generate.hf import HFGenerator

    quiet_libraries()
    if load_in_4bit is None:
        load_in_4bit = _has_bitsandbytes()
    machine_threads = torch.get_num_threads()
    if not torch.cuda.is_available():
        torch.set_num_threads(threads)
    where = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "cpu": cpu_model(),
             "threads": torch.get_num_threads(), "4bit": load_in_4bit}
    results = []
    for preset in presets:
        with tempfile.TemporaryDirectory(prefix="minigrpo-decode-") as tmp:
            policy = _policy(depth_only(preset, Path(tmp)), load_in_4bit)
            generators = {path: HFGenerator(policy, _Pad(), decoder=path) for path in PATHS}
            if with_transformers:
                generators["transformers-static"] = TransformersStatic(policy)
            for r in rows:
                for path in generators:  # side by side at each shape, so a noisy moment hurts them alike
                    result = {"preset": preset, "rows": r, "path": path, **measure(generators[path], r), **where}
                    results.append(result)
                    emit(result)
            del generators, policy
    torch.set_num_threads(machine_threads)  # what follows (`--real`) runs as training would
    return results


def bench_real(rows: int = 16, new_tokens: int = 48, threads: int | None = None, emit=print) -> list[dict]:
    """The offline smollm2-135m at the quick start's shape (16 rows: 4 prompts x 4 completions, 48 new tokens) with
    the quick start's settings on this machine: new tokens per second of each path, over the same prompts."""
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.model import default_dtype, load_policy, load_tokenizer
    from minigrpo.tools import render_prompt
    from minigrpo.tasks import get_task
    from minigrpo.weights import OFFLINE_HUB_ID, resolve_weights

    if threads:
        torch.set_num_threads(threads)
    cfg = TrainConfig()
    weights = resolve_weights(OFFLINE_HUB_ID)
    tokenizer = load_tokenizer(weights)
    policy = load_policy(cfg, weights, default_dtype(cfg.dtype)).eval()
    rows_data = get_task("addition").make_data("train", 0)[:rows // cfg.num_generations]
    prompts = [tokenizer(render_prompt(tokenizer, r["prompt"]), add_special_tokens=False).input_ids for r in rows_data]
    results = []
    for path in PATHS:
        generator = HFGenerator(policy, tokenizer, decoder=path)
        generator.generate(prompts, Sampling(cfg.num_generations, 4))  # warm-up
        made, start = 0, time.perf_counter()
        for seed in range(3):
            torch.manual_seed(seed)
            made += sum(map(len, generator.generate(prompts, Sampling(cfg.num_generations, new_tokens)).completion_ids))
        seconds = time.perf_counter() - start
        result = {"preset": "smollm2-135m (real weights)", "rows": len(prompts) * cfg.num_generations, "path": path,
                  "tokens_per_s": round(made / seconds, 1), "seconds_per_rollout": round(seconds / 3, 2),
                  "bf16_projections": cfg.bf16_base, "threads": torch.get_num_threads(), "cpu": cpu_model()}
        results.append(result)
        emit(result)
    return results


def _has_bitsandbytes() -> bool:
    try:
        import bitsandbytes  # noqa: F401
    except Exception:
        return False
    return True
