"""Generation on a vLLM engine in the trainer's own process, updated in place after every optimizer step.

How the engine stays the current policy without reloads:
- its base weights are the trainer's own base (the 4-bit weights dequantized), written once at start into
  a temporary folder the engine loads: current vLLM has no bitsandbytes loader, and both sides then compute
  the same base;
- the trainer's LoRA weights go straight into the engine's adapter slots (`set_lora` on each LoRA layer,
  through `collective_rpc`), scaling folded into B and q/k/v and gate/up packed as the engine packs them:
  no disk write, no restart, a few milliseconds for a small adapter. Merged full weights cannot be pushed
  in place on vLLM's cpu build (its repacked linear layers have no weight loader), and adapters are a
  fraction of the bytes anyway;
- the prefix cache is reset after each update, or stale kv blocks of the old policy would be reused.

Everything that depends on vLLM's internals (where the LoRA layers live, how they pack) is in this file.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import torch

from minigrpo.generation import Rollout, Sampling
from minigrpo.model import export_weights

LORA_ID = 1  # the one adapter the engine serves: the policy
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the slot sizes vLLM allocates


def vllm_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


class VLLMGenerator:
    def __init__(self, model, tokenizer, *, lora_rank: int, max_model_len: int, seed: int,
                 gpu_memory_utilization: float = 0.3, dtype: torch.dtype | None = None):
        # in-process engine: the worker must live in this process to be handed tensors directly
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of kv cache on cpu
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        on_gpu = torch.cuda.is_available()
        dtype = dtype or (model.dtype if on_gpu else torch.float32)  # fp32 is ~4x faster on cpu
        self.folder = tempfile.TemporaryDirectory(prefix="minigrpo-engine-")
        base_dir, adapter_dir = Path(self.folder.name) / "base", Path(self.folder.name) / "adapter"
        export_weights(model, tokenizer, base_dir, dtype, merge_adapter=False)
        model.save_pretrained(adapter_dir)  # registers the adapter's shape once; its values come by sync

        self.sleep_mode = on_gpu  # vLLM refuses sleep mode on cpu
        rank = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), lora_rank)
        try:
            self.llm = LLM(
                model=str(base_dir), dtype=str(dtype).removeprefix("torch."), seed=seed, enable_lora=True,
                max_lora_rank=rank, max_loras=1, max_model_len=max_model_len,
                gpu_memory_utilization=gpu_memory_utilization, enable_prefix_caching=True,
                logprobs_mode="processed_logprobs",  # after temperature: comparable to the trainer's
                enable_sleep_mode=self.sleep_mode,
            )
        except Exception as error:
            raise RuntimeError(
                f"could not start the vLLM engine ({type(error).__name__}: {error}). On a GPU, lower or raise "
                f"--gpu-memory-utilization (now {gpu_memory_utilization}) or --max-new-tokens; or train with "
                f"--generator hf, which needs no engine."
            ) from error
        self.lora = LoRARequest("policy", LORA_ID, str(adapter_dir))
        self.rng = random.Random(seed)
        # one token with the adapter registers it and puts it in a slot; from then on sync overwrites the slot
        self.score([[tokenizer.eos_token_id or 0] * 2], 1)
        self.sync(model)
        self._sleep()

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling) -> Rollout:
        from vllm import SamplingParams

        self._wake()
        params = SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                max_tokens=sampling.max_new_tokens, logprobs=0,
                                seed=self.rng.randrange(2**31))
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                                    lora_request=self.lora, use_tqdm=False)
        self._sleep()
        completions, truncated, logps = [], [], []
        for request in outputs:
            for out in request.outputs:
                ids = list(out.token_ids)
                completions.append(ids)
                truncated.append(out.finish_reason == "length")
                logps.append([step[t].logprob for t, step in zip(ids, out.logprobs)])
        return Rollout(completions, truncated, logps)

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])

    def score(self, token_ids: list[list[int]], n_last: int) -> list[list[float]]:
        """The engine's log-probs (temperature 1) of the last `n_last` tokens of each sequence."""
        from vllm import SamplingParams

        self._wake()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params,
                                    lora_request=self.lora, use_tqdm=False)
        self._sleep()
        return [[step[t].logprob for t, step in zip(ids[-n_last:], out.prompt_logprobs[-n_last:])]
                for ids, out in zip(token_ids, outputs)]

    def sync(self, model) -> None:
        """Write the trainer's current LoRA weights into the engine's adapter slot, in place."""
        self._wake()
        weights = lora_weights(model)
        written = self.llm.collective_rpc(_write_lora, args=(LORA_ID, weights))
        if min(written) == 0:
            raise RuntimeError("the vLLM engine took none of the adapter's weights: its LoRA layers did not "
                               "match the trainer's module names")
        self.llm.reset_prefix_cache()

    def _wake(self) -> None:
        if self.sleep_mode and getattr(self, "asleep", False):
            self.llm.wake_up()
            self.asleep = False

    def _sleep(self) -> None:
        # hand the kv cache back to the trainer while it computes gradients
        if self.sleep_mode:
            self.llm.sleep(level=1)
            self.asleep = True


def lora_weights(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"model.layers.0.self_attn.q_proj": (A [r, in], B x scaling [out, r])} from a PEFT model."""
    weights = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            key = name.removeprefix("base_model.model.")
            a = module.lora_A["default"].weight.detach()
            b = module.lora_B["default"].weight.detach() * module.scaling["default"]
            weights[key] = (a, b)
    return weights


def _write_lora(worker, lora_id: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Runs inside the engine's worker: fill the adapter's slot in every LoRA layer. Returns layers written."""
    manager = worker.model_runner.lora_manager._adapter_manager
    if lora_id not in manager.lora_index_to_id:
        manager.activate_adapter(lora_id)  # registered at start but evicted from its slot: put it back
    index = manager.lora_index_to_id.index(lora_id)
    written = 0
    for name, layer in manager.modules.items():
        prefix, _, last = name.rpartition(".")
        packed = manager.packed_modules_mapping.get(last)  # qkv_proj -> [q_proj, k_proj, v_proj]
        parts = [weights.get(f"{prefix}.{sub}") for sub in (packed or [last])]
        if any(part is None for part in parts):
            continue
        device = layer.lora_a_stacked[0].device
        a = [p[0].to(device) for p in parts]
        b = [p[1].to(device) for p in parts]
        layer.set_lora(index, a if packed else a[0], b if packed else b[0])
        written += 1
    return written
