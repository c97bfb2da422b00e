"""Will a run fit a card? The memory of a run from the model's shape alone, and the choices that follow.

One GPU holds, at once:
- the trainer: the base (4-bit linear layers, 16-bit embeddings), the LoRA adapter with its gradient and
  AdamW's two moments and its foreach step's temporary (fp32, 20 bytes a parameter), and the CUDA context;
- one step's working memory (`StepMemory`): transformers generation's key/value cache, or one micro-batch of
  training, whichever is larger (and with transformers generation, a 4-bit base's dense copy it decodes from);
- with vLLM, the engine: a 16-bit copy of the base (vLLM has no 4-bit bitsandbytes loader), its LoRA slots,
  its activation workspace and a key/value cache. `gpu_memory_utilization` is the engine's share of the
  card's *total* memory, not of what the trainer leaves, so the share is sized here from these terms.

While the trainer computes gradients the engine can sleep (weights to host RAM, cache dropped); vLLM pins a
new host copy at every sleep (0.10 to 0.33 alike), so a run sleeps only when the trainer needs the room.
`minigrpo plan` prints all this; `train` sizes the engine with it (or says before anything loads that it does
not fit, and generates with transformers); `minigrpo bench model` measures the same terms on a real card.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from minigrpo.hardware import Gpu, compute_dtype, dtype_name, host_memory_gb
from minigrpo.memory import GiB, Sizes, StepMemory

BUDGET = 0.92  # share of a card's memory a plan may fill; the rest is fragmentation and allocator slack
CUDA_CONTEXT_GB = 0.5  # cuda context, cublas workspaces, kernels: held outside torch's allocator
ENGINE_OVERHEAD_GB = 0.45  # vLLM's cuda graphs, sampler buffers and non-torch memory beyond its weights
ENGINE_MARGIN_GB = 0.75  # room for what the estimate misses (profiling peaks, graph pools); vLLM fills it with cache
ENGINE_ASLEEP_GB = 0.3  # what a sleeping engine still holds on the card
SLEEP_ABOVE = 0.85  # the engine sleeps during training when awake it would leave the card fuller than this
QUANT_BYTES = 0.5 + 4 / 64 / 4 + 0.02  # nf4: half a byte a weight, double-quantized block scales
ADAPTER_BYTES = 20  # a LoRA parameter: fp32 weight, gradient, AdamW's two moments, and the foreach step's sqrt copy
VLLM_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)  # the slot sizes vLLM allocates
MAX_BATCHED_TOKENS = 4096  # the engine's per-forward token budget (prefill chunks); sizes its workspace


@dataclass
class Settings:
    """The parts of a run's config a plan reads (TrainConfig has them all; `Settings.of(cfg)`)."""
    rows: int  # completions per step: G x prompts per step
    prompts: int
    prompt_tokens: int  # a typical prompt's length; the engine must still hold one max_prompt_tokens prompt
    new_tokens: int
    max_prompt_tokens: int = 512
    lora_rank: int = 16
    load_in_4bit: bool = True
    micro_batch_size: int = 8
    chunk: int = 512
    checkpointing: bool | None = True  # None: off on a cpu with room for the activations, else on
    dtype: str = "auto"
    generator: str = "auto"
    gpu_memory_utilization: float | None = None
    bf16_base: bool = False  # a float32 model's projections kept in bfloat16 (a cpu)
    eval_prompts: int = 0  # held-out prompts an evaluation decodes at once; 0 without an evaluation
    eval_samples: int = 1  # rows per held-out prompt (the sampled evaluation's n; greedy alone: 1)
    top_p: float = 1.0

    @property
    def eval_rows(self) -> int:
        return self.eval_prompts * self.eval_samples

    @classmethod
    def of(cls, cfg, prompt_tokens: int = 192) -> "Settings":
        return cls(cfg.num_generations * cfg.prompts_per_step, cfg.prompts_per_step,
                   min(prompt_tokens, cfg.max_prompt_tokens), cfg.completion_tokens, cfg.max_prompt_tokens,
                   cfg.lora_rank, cfg.load_in_4bit if cfg.load_in_4bit is not None else True, cfg.micro_batch_size,
                   cfg.logprob_chunk_size, cfg.gradient_checkpointing, cfg.dtype, cfg.generator,
                   cfg.gpu_memory_utilization, cfg.bf16_base,
                   cfg.eval_prompts if cfg.eval_every or cfg.eval_before_after else 0,
                   cfg.eval_samples if cfg.eval_every else 1,  # the sampled evaluation decodes n rows a prompt
                   cfg.top_p)


@dataclass
class Plan:
    card: str
    total_gb: float
    dtype: str
    dtype_reason: str
    generator: str  # "vllm" or "hf"
    generator_reason: str
    trainer_gb: float  # loaded: base, adapter, gradients, optimizer moments, cuda context
    step_gb: float  # what a step adds on top
    engine_gb: float = 0.0  # the engine's share of the card, awake
    engine_share: float | None = None  # gpu_memory_utilization to give vLLM
    kv_gb: float = 0.0
    kv_tokens: int = 0  # tokens the engine's cache holds at once
    sleep: bool = False  # the engine sleeps while the trainer computes gradients
    host_gb: float = 0.0  # host RAM the sleeping engine's weights take
    peak_gb: float = 0.0
    fits: bool = True
    advice: list[str] = field(default_factory=list)
    checkpointing: bool = True  # gradient checkpointing: activations recomputed in backward
    dense_gb: float = 0.0  # the fixed-shape decoder's dense copy of a 4-bit base (included in trainer_gb)
    taken_gb: float = 0.0  # of the card, held by other processes when planned (`usable_gb`)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def summary(self) -> str:
        engine = "transformers generation"
        if self.generator == "vllm":
            engine = "the vLLM engine" if self.engine_share is None else (
                f"the vLLM engine with {self.engine_share:.2f} of the card ({self.engine_gb:.1f} GB, KV for "
                f"{self.kv_tokens} tokens{', asleep while training' if self.sleep else ''})")
        if not self.total_gb:  # a cpu: no card to fill
            return f"cpu, {self.dtype}, {engine}, gradient checkpointing {'on' if self.checkpointing else 'off'}"
        verdict = ("fits" if self.fits else "does NOT fit") + (
            f" ({self.taken_gb:.1f} GB of it held by others)" if self.taken_gb > 0.05 else "")
        return (f"{self.card}, {self.dtype}, {engine}; estimated peak {self.peak_gb:.1f} of {self.total_gb:.1f} GB: "
                f"{verdict}")


def make_plan(shape, gpu: Gpu | None, s: Settings, vllm_installed: bool = True, advise: bool = True) -> Plan:
    """What a run of `s` on `shape` would use on `gpu` (None: this cpu), and whether it fits; with `advise`,
    where it does not, the nearest lighter settings that do."""
    dtype, dtype_reason = compute_dtype(gpu, s.dtype)
    nbytes = dtype.itemsize
    sizes = Sizes.of(shape)
    trainer = trainer_gb(sizes, s.lora_rank, s.load_in_4bit, nbytes) + (CUDA_CONTEXT_GB if gpu else 0.0)
    if s.checkpointing is None:
        s = dataclasses.replace(s, checkpointing=needs_checkpointing(shape, gpu, s, nbytes, trainer, host_memory_gb()))
    memory = StepMemory(shape, nbytes, s.micro_batch_size, s.chunk, True, s.checkpointing, s.top_p)
    hf_step = memory.step_gb(s.rows, s.prompt_tokens, s.new_tokens, s.eval_rows, s.prompts, s.eval_prompts)
    train_step = memory.training_gb(s.rows, s.prompt_tokens, s.new_tokens)
    name, total = (gpu.name, gpu.total_gb) if gpu else ("cpu", 0.0)
    dense = (sizes.linear + sizes.fused_lora_per_rank * s.lora_rank) * nbytes / GiB * s.load_in_4bit  # the fixed-shape
    # decoder's dense copy of a 4-bit base and its adapter's stacked copy,
    # unless it is over half of what is free once the trainer (its CUDA context included) is loaded
    dense *= not gpu or dense <= (total - max(0.0, gpu.taken_gb - CUDA_CONTEXT_GB) - trainer) / 2
    if not gpu:  # and on a cpu its copy of the frozen projections and the lm head repacked for the cpu's matmul,
        # two bytes a weight: float32 ones at half precision for fbgemm (kept), bf16 ones reordered for oneDNN
        # (dropped while the update runs, so where training is the larger part this over-counts the peak)
        dense += (sizes.linear + sizes.vocab * sizes.hidden) * 2 / GiB
    hf = Plan(name, total, dtype_name(dtype), dtype_reason, "hf", "", trainer + dense, hf_step,
              peak_gb=trainer + dense + hf_step, checkpointing=s.checkpointing, dense_gb=dense)

    if gpu is None:
        choice = "vllm" if s.generator == "vllm" else "hf"
        reason = ("asked for; on cpu vLLM generated slower than transformers and holds a second copy of the base"
                  if choice == "vllm" else "on cpu transformers generation measured faster than vLLM's cpu build")
        bf16 = " with bfloat16 projections" if s.bf16_base and hf.dtype == "float32" else ""
        return dataclasses.replace(hf, dtype=hf.dtype + bf16, generator=choice, generator_reason=reason, fits=True)
    if s.generator == "hf" or (s.generator == "auto" and not vllm_installed):
        why = "asked for" if s.generator == "hf" else "vLLM is not installed"
        return finish(dataclasses.replace(hf, generator_reason=why), gpu, s, shape, advise)

    engine = engine_plan(sizes, gpu, s, nbytes, trainer, train_step)
    if not engine.fits:
        if s.generator == "vllm":
            return finish(engine, gpu, s, shape, advise)
        return finish(dataclasses.replace(hf, generator_reason=engine.generator_reason + "; generating with "
                                          "transformers"), gpu, s, shape, advise)
    return finish(engine, gpu, s, shape, advise)


def needs_checkpointing(shape, gpu: Gpu | None, s: Settings, nbytes: int, trainer: float,
                        host_gb: float | None) -> bool:
    """Recompute activations in backward? On a cpu, not where the estimate without it is under an eighth of RAM
    (a forward pass saved; docs/speed.md); on a card, yes: its estimates are not yet checked on one.

    >>> from minigrpo.presets import preset_shape
    >>> s = Settings(rows=16, prompts=2, prompt_tokens=64, new_tokens=48, checkpointing=None)
    >>> [needs_checkpointing(preset_shape(m), None, s, 2, gb, 16) for m, gb in (("smollm2-135m", .3), ("qwen-1.5b", 3))]
    [False, True]
    """
    if gpu is not None or not host_gb:
        return True
    without = StepMemory(shape, nbytes, s.micro_batch_size, s.chunk, True, checkpointing=False)
    return trainer + without.step_gb(s.rows, s.prompt_tokens, s.new_tokens) > host_gb / 8


def weights_gb(sizes: Sizes, load_in_4bit: bool, nbytes: int) -> float:
    """The base: its block projections in 4-bit (or the compute dtype), its embeddings in the compute dtype."""
    return (sizes.linear * (QUANT_BYTES if load_in_4bit else nbytes) + sizes.embedding * nbytes) / GiB


def trainer_gb(sizes: Sizes, lora_rank: int, load_in_4bit: bool, nbytes: int) -> float:
    return weights_gb(sizes, load_in_4bit, nbytes) + sizes.lora_per_rank * lora_rank * ADAPTER_BYTES / GiB


def engine_plan(sizes: Sizes, gpu: Gpu, s: Settings, nbytes: int, trainer: float, train_step: float) -> Plan:
    """The vLLM engine beside the trainer: its share, its cache, whether it sleeps, whether it fits."""
    kv_per_token = 2 * sizes.layers * sizes.kv_dim * nbytes / GiB
    rank = next((r for r in VLLM_LORA_RANKS if r >= s.lora_rank), s.lora_rank)
    workspace = (MAX_BATCHED_TOKENS * (2 * sizes.intermediate + 4 * sizes.hidden) * nbytes
                 + s.rows * sizes.vocab * 4 * 2) / GiB  # the largest forward's activations; the sampler's logits
    weights = (sizes.total + sizes.lora_per_rank * rank) * nbytes / GiB  # the 16-bit base and one LoRA slot
    fixed = weights + workspace + ENGINE_OVERHEAD_GB + ENGINE_MARGIN_GB
    budget = usable_gb(gpu)
    room = budget - trainer - fixed  # what is left for the cache while the engine is awake
    min_tokens = s.max_prompt_tokens + s.new_tokens  # vLLM refuses to start without room for one full sequence
    want_tokens = s.prompts * s.prompt_tokens + s.rows * s.new_tokens  # every row at once; prompts shared by G
    if room < min_tokens * kv_per_token:
        need = fixed + min_tokens * kv_per_token
        why = (f"the engine needs {need:.1f} GB (its 16-bit base is {weights:.1f} GB) beside the trainer's "
               f"{trainer:.1f} GB, and {budget:.1f} GB of the card is usable")
        return Plan(gpu.name, gpu.total_gb, "", "", "vllm", why, trainer, train_step, need, None,
                    peak_gb=trainer + need, fits=False)
    tokens = int(min(want_tokens, room / kv_per_token))
    kv = tokens * kv_per_token
    engine = fixed + kv
    share = min(0.95, (engine + 0.05) / gpu.total_gb)
    if s.gpu_memory_utilization is not None:  # the user's share: the cache is what is left of it
        share = s.gpu_memory_utilization
        engine = share * gpu.total_gb
        kv = engine - fixed
        tokens = max(0, int(kv / kv_per_token))
    awake_peak = trainer + engine
    sleep = trainer + engine + train_step > SLEEP_ABOVE * gpu.total_gb
    training_peak = trainer + train_step + (ENGINE_ASLEEP_GB if sleep else engine)
    host = sizes.pinned_gb(nbytes) if sleep else 0.0
    fits = max(awake_peak, training_peak) <= budget and tokens >= min_tokens
    reason = "the engine fits beside the trainer"
    if tokens < min_tokens:
        reason = (f"an engine share of {share:.2f} leaves room for {tokens} cached tokens, fewer than one sequence "
                  f"({min_tokens})")
    elif max(awake_peak, training_peak) > budget:
        reason = f"trainer and engine need {max(awake_peak, training_peak):.1f} GB of {budget:.1f} usable"
    if fits and sleep and gpu.host_gb is not None and host > 0.6 * gpu.host_gb:
        fits, reason = False, (f"the sleeping engine would pin {host:.1f} GB of host RAM, more than this machine's "
                               f"{gpu.host_gb:.1f} GB can spare")
    return Plan(gpu.name, gpu.total_gb, "", "", "vllm", reason, trainer, train_step, engine, round(share, 2), kv,
                tokens, sleep, host, max(awake_peak, training_peak), fits)


FLAGS = {"micro_batch_size": "--micro-batch-size", "generator": "--generator", "new_tokens": "--max-new-tokens",
         "prompts": "--prompts-per-step", "eval_prompts": "--eval-prompts"}


def usable_gb(gpu: Gpu) -> float:
    """What a plan may fill: `BUDGET` of the card, less what others held when it was measured (a 3090 driving a
    display has 0.3-1.5 GB taken; vLLM's start check counts only free memory). The trainer's own CUDA context is
    in `taken_gb` and is planned for already (`CUDA_CONTEXT_GB`).

    >>> from minigrpo.hardware import CARDS
    >>> import dataclasses
    >>> round(usable_gb(CARDS["3090"]), 2), round(usable_gb(dataclasses.replace(CARDS["3090"], taken_gb=1.5)), 2)
    (21.79, 20.79)
    """
    return BUDGET * gpu.total_gb - max(0.0, gpu.taken_gb - CUDA_CONTEXT_GB)


def finish(plan: Plan, gpu: Gpu, s: Settings, shape, advise: bool) -> Plan:
    """Fill the dtype and the verdict, and where the run does not fit, the settings that would."""
    dtype, reason = compute_dtype(gpu, s.dtype)
    plan.dtype, plan.dtype_reason, plan.checkpointing = dtype_name(dtype), reason, s.checkpointing
    plan.taken_gb = gpu.total_gb * BUDGET - usable_gb(gpu)
    if plan.generator == "hf":
        plan.fits = plan.peak_gb <= usable_gb(gpu)
    if plan.fits or not advise:
        return plan
    for smaller in smaller_settings(s):
        trial = make_plan(shape, gpu, smaller, advise=False)
        if trial.fits:
            changes = " ".join(f"{flag} {getattr(smaller, k)}" for k, flag in FLAGS.items()
                               if getattr(s, k) != getattr(smaller, k))
            plan.advice.append(f"fits with {changes} ({trial.generator} generation, peak {trial.peak_gb:.1f} GB)")
            break
    else:
        plan.advice.append("no smaller setting tried fits: use a smaller model or a larger card")
    return plan


def smaller_settings(s: Settings):
    """Settings a little lighter each time: micro-batch, then the generator, then length, then group size; for
    each, fewer held-out prompts decoded at once first (an evaluation's own precision is all they cost)."""
    micro, held_out = s.micro_batch_size, s.eval_prompts
    for m in (micro, max(1, micro // 2), max(1, micro // 4)):
        for generator in ([s.generator] if s.generator == "hf" else [s.generator, "hf"]):
            for new in (n for n in (s.new_tokens, s.new_tokens // 2, s.new_tokens // 4) if n >= 16):
                for prompts in (s.prompts, max(1, s.prompts // 2), 1):
                    for evaluated in dict.fromkeys((held_out, held_out // 2, held_out // 4)):
                        yield dataclasses.replace(s, micro_batch_size=m, generator=generator, new_tokens=new,
                                                  prompts=prompts, rows=s.rows // s.prompts * prompts,
                                                  gpu_memory_utilization=None, eval_prompts=evaluated)
