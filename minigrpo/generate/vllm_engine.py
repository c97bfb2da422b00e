"""Generation on a vLLM engine in the trainer's own process, updated in place after every optimizer step.

How the engine stays the current policy without reloads:
- its base weights are the trainer's own base (the 4-bit weights dequantized), written once into a folder
  the engine loads and kept for the next run of that base (`engine_base`): current vLLM has no bitsandbytes
  loader, and both sides then compute the same base;
- the trainer's LoRA weights go straight into the engine's adapter slots (`set_lora` on each LoRA layer,
  through `collective_rpc`), scaling folded into B and q/k/v and gate/up packed as the engine packs them:
  no disk write, no restart, a few milliseconds for a small adapter. Merged full weights cannot be pushed
  in place on vLLM's cpu build (its repacked linear layers have no weight loader), and adapters are a
  fraction of the bytes anyway;
- the prefix cache is reset after each update, or stale kv blocks of the old policy would be reused.

On a GPU the engine may sleep while the trainer computes gradients (level 1: weights to host RAM, cache
dropped; level 2 would drop the LoRA slots too). `sync` only marks the adapter stale; `generate` wakes the
engine, writes the adapter, generates and sleeps again, so nothing is written into a sleeping engine and the
engine is awake only while it samples.

Everything that depends on vLLM's internals is in this file, and everything that differs between the vLLM
versions it supports (`hardware.VLLM_RANGE`, 0.10.2 up to 0.33) is in `adapt_set_lora` and `engine_options`.
"""

from __future__ import annotations

import gc
import inspect
import os
import random
import tempfile
from pathlib import Path

import torch

from minigrpo.export import export_weights
from minigrpo.generate import Rollout, Sampling
from minigrpo.plan import MAX_BATCHED_TOKENS, VLLM_LORA_RANKS

LORA_ID = 1  # the one adapter the engine serves: the policy


def adapt_set_lora(set_lora):
    """A `write(index, a, b)` for a LoRA layer's `set_lora`, whatever its vLLM version.

    a is [r, in] and b is [out, r] as PEFT holds them (lists of them for packed layers). vLLM 0.12 and later
    take exactly that: set_lora(index, a, b). 0.11 adds a fourth argument, the embeddings tensor (None for
    linear layers). 0.10 takes that fourth argument and an optional bias, and wants A and B transposed
    ([in, r] and [r, out]), which it transposes back as it copies them into its slots.
    """
    params = inspect.signature(set_lora).parameters
    if "lora_bias" in params:  # 0.10.x
        def t(x):
            return [p.T for p in x] if isinstance(x, list) else x.T

        return lambda index, a, b: set_lora(index, t(a), t(b), None)
    if "embeddings_tensor" in params:  # 0.11.x
        return lambda index, a, b: set_lora(index, a, b, None)
    return set_lora  # 0.12 and later


def engine_options(on_gpu: bool, max_rows: int) -> dict:
    """LLM(...) keyword arguments that differ by version or platform."""
    options = dict(enable_sleep_mode=on_gpu)  # vLLM refuses sleep mode on cpu
    mode = "processed_logprobs"  # log-probs after temperature: comparable to the trainer's
    try:  # 0.10 declares the mode as an enum, later versions as a string literal
        from vllm.config import LogprobsMode

        options["logprobs_mode"] = LogprobsMode(mode) if isinstance(LogprobsMode, type) else mode
    except ImportError:
        options["logprobs_mode"] = mode
    if on_gpu:  # bound the engine's batch, so its workspace (and `plan.py`'s estimate of it) stays small
        options.update(max_num_seqs=max(max_rows, 8), max_num_batched_tokens=MAX_BATCHED_TOKENS)
    try:  # its progress bar for loading the exported base, where the version lets it be turned off
        import dataclasses

        from vllm.engine.arg_utils import EngineArgs

        if "use_tqdm_on_load" in {f.name for f in dataclasses.fields(EngineArgs)}:
            options["use_tqdm_on_load"] = False
    except ImportError:
        pass
    return options


def quiet_vllm() -> None:
    """vLLM's start-up chatter off the console (45 lines of configuration, platform advice and load
    bars per engine): the run's own lines say what happens, and an engine that fails raises with its reason.
    Its errors still show; VLLM_LOGGING_LEVEL=INFO (or WARNING) brings the rest back."""
    import logging
    import warnings

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # read when vllm is first imported
    # deprecation notices raised inside vllm's own modules: nothing a user of minigrpo can act on
    warnings.filterwarnings("ignore", category=FutureWarning, module="vllm")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="vllm")
    import vllm  # noqa: F401  (configures its logger)

    logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())  # imported before: set it now


EXPORT_FORMAT = 1  # bump when export_weights writes a base differently: cached bases of older formats are not read


def engine_base(model, tokenizer, dtype: torch.dtype) -> Path:
    """The folder the engine loads: the trainer's base as `export_weights` writes it, kept under the cache and
    keyed by where the weights came from (the hub's commit, or a local folder's files), their quantization and
    the dtype. A later run of the same base reuses it: no gigabytes written per start (on tmpfs they would sit in
    RAM), and vLLM's compile cache, keyed by the model's path among others, finds its kernels again. Written to
    a folder of its own and renamed into place whole, so a run stopped mid-export leaves nothing to be read."""
    import hashlib
    import json
    import shutil

    from minigrpo.weights import cache_dir

    config = model.get_base_model().config
    source = str(config._name_or_path)
    files = sorted(Path(source).glob("*.safetensors")) + sorted(Path(source).glob("*.bin")) \
        if Path(source).is_dir() else []
    origin = getattr(config, "_commit_hash", None) or [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    quantized = getattr(config, "quantization_config", None)
    key = json.dumps([source, origin, str(dtype), quantized.to_dict() if hasattr(quantized, "to_dict") else None,
                      EXPORT_FORMAT], sort_keys=True, default=str)
    folder = cache_dir() / "engine-bases" / hashlib.sha256(key.encode()).hexdigest()[:16]
    if (folder / "model.safetensors.index.json").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        export_weights(model, tokenizer, partial, dtype, merge_adapter=False)
        (partial / "minigrpo-base.json").write_text(key + "\n")  # what it is the base of
        partial.rename(folder)
    except OSError:
        if not (folder / "model.safetensors.index.json").exists():  # not another run's finished export
            raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return folder


class VLLMGenerator:
    """The generator interface (`generate.Generator`) on a colocated vLLM engine."""

    def __init__(self, llm, lora_request, *, sleep: bool, seed: int, folder=None, base: Path | None = None):
        self.llm, self.lora = llm, lora_request
        self.base = base  # the folder of the base it loaded (`engine_base`)
        self.folder = folder  # the adapter's shape, removed at close (the base stays cached: `engine_base`)
        self.sleep_between = sleep
        self.asleep = False
        self.pending = None  # LoRA weights written at the next wake-up (`sync` before `generate`)
        self.rng = random.Random(seed)

    @classmethod
    def start(cls, model, tokenizer, *, lora_rank: int, max_model_len: int, seed: int, max_rows: int,
              gpu_memory_utilization: float | None, sleep: bool, dtype: torch.dtype,
              eager: bool = False) -> "VLLMGenerator":
        """Export the trainer's base, start the engine on it, register the adapter and fill it. With `eager`, no
        compilation and no CUDA graphs: a start in seconds for an engine that only checks (`minigrpo doctor`)."""
        # in-process engine: the worker must live in this process to be handed tensors directly
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of kv cache on cpu
        quiet_vllm()
        from vllm import LLM
        from vllm.lora.request import LoRARequest

        on_gpu = torch.cuda.is_available()
        folder = tempfile.TemporaryDirectory(prefix="minigrpo-engine-")
        base_dir, adapter_dir = engine_base(model, tokenizer, dtype), Path(folder.name) / "adapter"
        model.save_pretrained(adapter_dir)  # registers the adapter's shape once; its values come by sync
        rank = next((r for r in VLLM_LORA_RANKS if r >= lora_rank), lora_rank)
        share = {"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization else {}
        llm = LLM(model=str(base_dir), dtype=str(dtype).removeprefix("torch."), seed=seed, enable_lora=True,
                  max_lora_rank=rank, max_loras=1, max_model_len=max_model_len, enable_prefix_caching=True,
                  enforce_eager=eager, **share, **engine_options(on_gpu, max_rows))
        engine = cls(llm, LoRARequest("policy", LORA_ID, str(adapter_dir)), sleep=sleep and on_gpu, seed=seed,
                     folder=folder, base=base_dir)
        try:
            # one token with the adapter registers it and puts it in a slot; from then on sync overwrites the slot
            engine.score([[tokenizer.eos_token_id or 0] * 2], 1)
            engine.sync(model)
            engine._wake()  # writes the adapter now, so a wrong layout fails at start, not at step 1
            engine._sleep()
        except Exception:
            engine.close()  # an engine that started but cannot serve the policy gives its memory back
            raise
        return engine

    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, base: bool = False) -> Rollout:
        """Completions from the policy; with `base`, from the base model alone (no adapter: the reference,
        the in-memory judge), which draws nothing from the policy's seed stream."""
        from vllm import SamplingParams

        # a seed per prompt: vLLM seeds completion i of a request with seed + i, so one seed for the whole call
        # would give a prompt that appears twice the same group twice. Seeds from our own stream keep a resumed
        # run's samples those of the run it continues
        params = [SamplingParams(n=sampling.n, temperature=sampling.temperature, top_p=sampling.top_p,
                                 max_tokens=sampling.max_new_tokens, logprobs=0,
                                 seed=None if base else self.rng.randrange(2**31)) for _ in prompt_ids]
        self._wake()
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params,
                                    lora_request=None if base else self.lora, use_tqdm=False)
        self._sleep()
        completions, truncated, logps = [], [], []
        for request in outputs:
            for out in request.outputs:
                ids = list(out.token_ids)
                completions.append(ids)
                truncated.append(out.finish_reason == "length")
                logps.append([step[t].logprob for t, step in zip(ids, out.logprobs)])
        return Rollout(completions, truncated, logps)

    def score(self, token_ids: list[list[int]], n_last: int) -> list[list[float]]:
        """The engine's log-probs (temperature 1) of the last `n_last` tokens of each sequence."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        self._wake()
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in token_ids], params,
                                    lora_request=self.lora, use_tqdm=False)
        self._sleep()
        return [[step[t].logprob for t, step in zip(ids[-n_last:], out.prompt_logprobs[-n_last:])]
                for ids, out in zip(token_ids, outputs)]

    def sync(self, model) -> None:
        """Take the trainer's current LoRA weights; they reach the engine's slot at its next wake-up."""
        self.pending = lora_weights(model)
        if not self.asleep:
            self._write_pending()

    def release(self) -> None:
        """Nothing: on a card the engine sleeps after each generation already (on a cpu it cannot)."""

    def cache_gb(self) -> float:
        """The engine's key/value cache, as it allocated it: blocks x tokens a block x layers x keys and values."""
        config = self.llm.llm_engine.vllm_config
        model, parallel = config.model_config, config.parallel_config
        per_token = 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size()
        return (config.cache_config.num_gpu_blocks * config.cache_config.block_size * per_token
                * model.dtype.itemsize / 2**30)

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])

    def close(self) -> None:
        """Shut the engine down and free its memory, so a later engine in this process can start."""
        if self.llm is None:
            return
        core = getattr(getattr(self.llm, "llm_engine", None), "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()
        self.llm = None
        # vLLM 0.11.1 to 0.19 freeze the collector when the engine core starts in this process (`gc.freeze()`, so
        # that its start-up objects are never scanned) and do not undo it at shutdown: everything alive then, the
        # engine and the trainer's policy with their reference cycles, would stay in memory for good, and a second
        # engine in this process (a notebook cell run again) would find the card still full. 0.20 on undo it
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if self.folder is not None:
            self.folder.cleanup()

    def _write_pending(self) -> None:
        if self.pending is None:
            return
        for missing, unused in self.llm.collective_rpc(_write_lora, args=(LORA_ID, self.pending)):
            # every LoRA layer of the engine written, every adapter weight taken: a projection whose adapter
            # never reaches the engine passes every shape check and silently samples from another policy
            said = ([f"no weights for the engine's {_few(missing)}"] if missing else []) + (
                [f"no engine layer for the trainer's {_few(unused)}"] if unused else [])
            if said:
                raise RuntimeError(f"the vLLM engine's LoRA layers and the trainer's adapter differ: {'; '.join(said)}")
        self.llm.reset_prefix_cache()  # cached kv blocks were computed with the old adapter
        self.pending = None

    def _wake(self) -> None:
        if self.asleep:
            # vLLM before 0.12 maps its memory back without emptying torch's cache first: the trainer's freed
            # blocks would still be held, and the wake-up could run out of memory
            gc.collect()
            torch.cuda.empty_cache()
            self.llm.wake_up()
            self.asleep = False
        self._write_pending()

    def _sleep(self) -> None:
        if self.sleep_between:  # level 1: weights (and LoRA slots) to host RAM; level 2 would lose the slots
            self.llm.sleep(level=1)
            self.asleep = True


def _few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def lora_weights(model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"model.layers.0.self_attn.q_proj": (A [r, in], B x scaling [out, r])} from a PEFT model."""
    weights = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            key = name.removeprefix("base_model.model.")
            a = module.lora_A["default"].weight.detach()
            b = module.lora_B["default"].weight.detach() * module.scaling["default"]
            weights[key] = (a.clone(), b)
    return weights


def _write_lora(worker, lora_id: int, weights: dict[str, tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[list[str], list[str]]:
    """Runs inside the engine's worker: fill the adapter's slot in every LoRA layer. Returns the engine's
    projections that had no weights (a packed layer names its missing parts) and the weights no layer took."""
    manager = worker.model_runner.lora_manager._adapter_manager
    if lora_id not in manager.lora_index_to_id:
        manager.activate_adapter(lora_id)  # registered at start but evicted from its slot: put it back
    index = manager.lora_index_to_id.index(lora_id)
    targets = {key.rpartition(".")[2] for key in weights}  # the kinds of projection the adapter has
    missing, taken = [], set()
    for name, layer in manager.modules.items():
        prefix, _, last = name.rpartition(".")
        packed = manager.packed_modules_mapping.get(last)  # qkv_proj -> [q_proj, k_proj, v_proj]
        names = [f"{prefix}.{sub}" for sub in (packed or [last])]
        if not targets & {n.rpartition(".")[2] for n in names}:
            continue  # a kind the adapter does not train (the engine wraps embeddings and the head as well)
        parts = [weights.get(n) for n in names]
        if any(part is None for part in parts):
            missing += [n for n, part in zip(names, parts) if part is None]
            continue
        taken.update(names)
        device = layer.lora_a_stacked[0].device
        dtype = layer.lora_a_stacked[0].dtype
        a = [p[0].to(device, dtype) for p in parts]
        b = [p[1].to(device, dtype) for p in parts]
        adapt_set_lora(layer.set_lora)(index, a if packed else a[0], b if packed else b[0])
    return missing, sorted(set(weights) - taken)
