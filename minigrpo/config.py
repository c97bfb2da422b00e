"""The one config object of a run: each setting stated once, with its default, its flag's help and its bounds.

The CLI builds its options from these fields (cli/flags.py), the trainer reads only the config, and the run
folder keeps it verbatim as `config.json`. Fields left at `None` are filled from the model's preset
(presets.py), so `--model qwen-1.5b` alone gives settings sized for a 16 GB GPU, and any flag still wins.
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

from minigrpo.presets import CUSTOM_MODEL, PRESETS

# Each setting with a fixed set of values has it written once, here: the field's type below, the flag's type
# (typer shows and checks it: `--loss <grpo|dr_grpo|...>`), and `validate`, which reads it back.
Dtype = Literal["auto", "bfloat16", "float16", "float32"]
WeightsDtype = Literal["bfloat16", "float16", "float32"]  # an export's: written weights have one
GgufType = Literal["f16", "bf16", "q8_0", "q4_0", "f32"]  # an export's for llama.cpp (to_gguf.py)
Generator = Literal["auto", "vllm", "hf"]
Decoder = Literal["auto", "static", "eager"]
ScaleRewards = Literal["group", "batch", "none"]
LossAggregation = Literal["sequence", "token", "constant"]
ImportanceSampling = Literal["token", "sequence"]
Surrogate = Literal["ppo", "cispo"]
KlEstimator = Literal["k1", "k2", "k3"]
Advantage = Literal["grpo", "rloo", "maxrl"]
RewardAggregation = Literal["sum", "normalize_then_sum"]
Tracker = Literal["tensorboard", "wandb"]
# --loss: each named loss is a setting of the knobs below (loss.py's docstring has the table)
_TOKEN_PPO = dict(importance_sampling="token", surrogate="ppo", epsilon=0.2)
LOSS_PRESETS = {
    "grpo": dict(scale_rewards="group", loss_aggregation="sequence", **_TOKEN_PPO),
    "dr_grpo": dict(scale_rewards="none", loss_aggregation="constant", **_TOKEN_PPO),
    "dapo": dict(scale_rewards="group", loss_aggregation="token", **_TOKEN_PPO),
    "bnpo": dict(scale_rewards="batch", loss_aggregation="token", **_TOKEN_PPO),
    "gspo": dict(scale_rewards="group", loss_aggregation="sequence", importance_sampling="sequence",
                 surrogate="ppo", epsilon=3e-4, epsilon_high=4e-4),
    "cispo": dict(scale_rewards="group", loss_aggregation="token", importance_sampling="token",
                  surrogate="cispo", epsilon=0.2, epsilon_high=4.0),
}
Loss = Literal[tuple(LOSS_PRESETS)]  # the names, from the presets: stated once
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


DAY = 86_400  # the longest a reward or tool call may take, in seconds (a far longer wait overflows the timer)
MICRO_BATCH = {"gpu": 8, "cpu": 4}  # --micro-batch-size's default; a cpu's holds half the activations (docs/speed.md)


def knob(default=None, help: str = "", *, panel: str, flag: tuple[str, ...] = (), shown: str | None = None,
         min: float | None = None, max: float | None = None, factory=None):
    """A TrainConfig field stated once: its default, its flag's help and panel (`minigrpo train --help`), and its
    inclusive bounds, which both the flag and `validate` enforce. `flag` spells the flag where it is not the
    field's name; `shown` says what the default is where its value (None) does not."""
    meta = dict(help=help, panel=panel, flag=flag, shown=shown, min=min, max=max)
    return field(default_factory=factory, metadata=meta) if factory else field(default=default, metadata=meta)


def flag_of(f: dataclasses.Field) -> str:
    """A field's long flag on the command line (`--out` for output_dir); a Python-only field's name."""
    if "help" not in f.metadata:
        return f.name
    return f.metadata["flag"][0].split("/")[0] if f.metadata["flag"] else "--" + f.name.replace("_", "-")


def python_only(default=None, why: str = "", factory=None):
    """A field no flag sets, and why."""
    if factory:
        return field(default_factory=factory, metadata=dict(why=why), repr=False)
    return field(default=default, metadata=dict(why=why))


# train's --help panels, in the order the fields come
TASK, POLICY, ROLLOUT, EPISODES = "What to train on", "The policy", "Rollout", "Episodes (tools)"
OBJECTIVE, PROMPTS, EVALUATION = "Objective", "Which prompts to train on", "Evaluation"
RUN = "Memory, checkpoints, logs"
PRESET = "from the model preset"
FROM_LOSS = "from --loss"


@dataclass
class TrainConfig:
    model: str = knob("smollm2-135m", "Preset name (`minigrpo models`), hub id, or local folder.", panel=TASK)
    task: str = knob("addition", "Built-in task, task .py file, data file, or hub dataset.", panel=TASK,
                     shown="addition; with --environment, the prompts its reset() writes")
    # "file.py:Class", TRL's environment_factory: one per episode, reset(**row), its methods as tools,
    # get_reward() as a reward; with task "environment", its reset() writes every prompt (no data)
    environment: str | None = knob(None, "An environment class file.py:Class (TRL's environment_factory): one per "
                                         "episode, its methods as tools.", panel=TASK, shown="the task's own")
    rewards: list[str] = knob(help="Extra reward function file.py:function (repeat).", panel=TASK, flag=("--reward",),
                              shown="none", factory=list)
    reward_weights: list[float] | None = knob(None, "One weight per reward function, the task's first (repeat).",
                                              panel=TASK, flag=("--reward-weight",), shown="1.0 each, or the task's")
    strict_rewards: bool = knob(False, "Stop when a reward function raises (default: score 0).", panel=TASK)
    allow_unconfined_code: bool = knob(False, "Run model-written code (the code task) even where the kernel lacks a "
                                              "sandbox layer (Landlock, namespaces, seccomp); `minigrpo doctor` says "
                                              "which this machine has.", panel=TASK)
    reward_timeout: float = knob(10.0, "Seconds a reward function may take per completion before it scores 0 (0: no "
                                       "limit).", panel=TASK, min=0, max=DAY)
    # the total reward at which a completion counts as solved; None: the task's own (1.0; reasoning-gym's 1.2)
    solved_reward: float | None = knob(None, "Total reward at which a completion counts as solved (pass@1, "
                                             "--retire-solved).", panel=TASK, shown="the task's own")
    output_dir: str | None = knob(None, "Run folder.", panel=TASK, flag=("--out",), shown="runs/<time>-<model>-<task>")
    seed: int = knob(0, "Seed for data order, sampling and initialisation.", panel=TASK, min=0)
    forked_from: str | None = python_only(None, "set by --fork: RUN@STEP of the checkpoint this run began from")

    # the policy: a 4-bit base with LoRA adapters on every linear projection of the blocks. None: 4-bit on a GPU,
    # the compute dtype on cpu, where bitsandbytes dequantizes on every matmul and measured slower and no leaner
    load_in_4bit: bool | None = knob(None, "nf4 base, or the compute dtype.", panel=POLICY, flag=("--4bit/--no-4bit",),
                                     shown="4-bit on GPU, the compute dtype on cpu")
    lora_rank: int | None = knob(None, "LoRA rank.", panel=POLICY, shown=PRESET, min=1)
    lora_alpha: int | None = knob(None, "LoRA alpha: the adapter's scale is alpha / rank.", panel=POLICY,
                                  shown="twice the rank", min=1)
    gradient_checkpointing: bool | None = knob(
        None, "Recompute activations in backward: less memory, slower steps.", panel=POLICY,
        shown="off on a cpu with room (`minigrpo plan` says), on on a GPU")
    dtype: Dtype = knob("auto", "Compute dtype; auto: bfloat16 on sm_80+, float16 on older GPUs, float32 on cpu.",
                        panel=POLICY)
    # None: on a cpu with bf16 instructions where the dtype is auto and transformers generates
    # (`hardware.bf16_projections`)
    bf16_base: bool | None = knob(None, "Keep a float32 model's frozen projections in bfloat16.", panel=POLICY,
                                  shown="on a cpu with bf16 instructions, with --dtype auto and transformers "
                                        "generation")
    init_adapter: str | None = knob(None, "Start the adapter from this folder's weights (`minigrpo sft`'s adapter/).",
                                    panel=POLICY, shown="a fresh adapter")

    steps: int = knob(30, "Optimizer steps (with --resume, the run's own unless given).", panel=ROLLOUT, min=1)
    prompts_per_step: int | None = knob(None, "Prompts per step.", panel=ROLLOUT, shown=PRESET, min=1)
    num_generations: int | None = knob(None, "Completions per prompt (G); a group of one has no spread.",
                                       panel=ROLLOUT, flag=("--num-generations", "-G"), shown=PRESET, min=2)
    max_new_tokens: int | None = knob(None, "Completion length limit.", panel=ROLLOUT, shown=PRESET, min=1)
    max_prompt_tokens: int = knob(512, "Prompt length limit; every prompt of the data is checked against it before "
                                       "the model loads.", panel=ROLLOUT, min=1)
    # log-probs are taken at the same temperature
    temperature: float = knob(1.0, "Sampling temperature (above 0: GRPO needs sampling).", panel=ROLLOUT)
    top_p: float = knob(1.0, "Nucleus sampling threshold; 1 keeps the full distribution.", panel=ROLLOUT)
    generator: Generator = knob("auto", "auto: vllm where it is installed and a GPU is present.", panel=ROLLOUT)
    decoder: Decoder = knob("auto", "transformers generation's decode loop: static (fixed shapes, a CUDA graph per "
                                    "token on a card: generate/static.py), eager (token by token), or auto.",
                            panel=ROLLOUT)
    gpu_memory_utilization: float | None = knob(None, "The vLLM engine's share of the card's memory.", panel=ROLLOUT,
                                                shown="sized from the model, see `minigrpo plan`")
    tis_cap: float = knob(2.0, "Cap of the truncated importance-sampling weight (0: off).", panel=ROLLOUT, min=0)

    # episodes: with tools (the task's, or these), each completion is an episode of model turns and tool results
    # (minigrpo/episodes.py)
    tools: list[str] = knob(help="A tool the model may call, file.py:function (repeat): each completion becomes an "
                                 "episode of turns.", panel=EPISODES, flag=("--tool",), shown="the task's own",
                            factory=list)
    max_turns: int = knob(4, "Model turns per episode, with tools.", panel=EPISODES, min=1)
    max_episode_tokens: int | None = knob(None, "Tokens after the prompt per episode, tool results included.",
                                          panel=EPISODES, shown="max-turns x max-new-tokens", min=1)
    tool_timeout: float = knob(10.0, "Seconds a tool call may take.", panel=EPISODES, max=DAY)

    # objective (minigrpo/loss.py has the formulas)
    learning_rate: float | None = knob(None, "Adapter learning rate.", panel=OBJECTIVE, shown=PRESET)
    beta: float = knob(0.0, "KL coefficient; 0 skips the reference pass.", panel=OBJECTIVE, min=0)
    kl_estimator: KlEstimator = knob("k3", "The KL's estimate per token (loss.kl_estimate).", panel=OBJECTIVE)
    reference_adapter: str | None = knob(None, "The KL's reference is the base plus this adapter (e.g. an SFT "
                                               "warm-up's).", panel=OBJECTIVE, shown="the base, adapters off")
    advantage: Advantage = knob("grpo", "The baseline: the group mean, the mean of the others (RLOO), or that divided "
                                        "by the group's mean success (MaxRL).", panel=OBJECTIVE)
    reward_aggregation: RewardAggregation = knob("sum", "Several rewards weighted and summed, or each normalised "
                                                        "within its group first (GDPO).", panel=OBJECTIVE)
    entropy_coef: float = knob(0.0, "Bonus on the trained tokens' mean entropy (0: none); with --entropy-target, "
                                    "its first value.", panel=OBJECTIVE, min=0)
    entropy_target: float | None = knob(None, "Adapt --entropy-coef each step to hold the mean entropy at this many "
                                              "nats (TRL's adaptive entropy).", panel=OBJECTIVE, shown="fixed")
    loss: Loss = knob("dapo", "A preset of the knobs below.", panel=OBJECTIVE)
    scale_rewards: ScaleRewards | None = knob(None, "Advantages divided by the std of the group, the batch, or none.",
                                              panel=OBJECTIVE, shown=FROM_LOSS)
    loss_aggregation: LossAggregation | None = knob(None, "Tokens averaged per completion, over the batch, or over a "
                                                          "constant.", panel=OBJECTIVE, shown=FROM_LOSS)
    importance_sampling: ImportanceSampling | None = knob(None, "A ratio per token, or one per completion (GSPO).",
                                                          panel=OBJECTIVE, shown=FROM_LOSS)
    surrogate: Surrogate | None = knob(None, "Clip the ratio, or cap it as a detached weight (CISPO).",
                                       panel=OBJECTIVE, shown=FROM_LOSS)
    epsilon: float | None = knob(None, "Clip range below 1.", panel=OBJECTIVE, shown="from --loss: 0.2, gspo 3e-4")
    epsilon_high: float | None = knob(None, "Clip range above 1 (clip-higher; cispo: the weight's cap - 1).",
                                      panel=OBJECTIVE, shown="from --loss, else --epsilon")
    top_entropy_quantile: float = knob(1.0, "Train on this top share of tokens by entropy (0.2: the 80/20 rule); 1 "
                                            "trains on all.", panel=OBJECTIVE)
    num_iterations: int = knob(1, "Optimizer passes per rollout (the ratio and clipping engage above 1).",
                               panel=OBJECTIVE, min=1)
    mask_truncated: bool = knob(False, "Completions cut at the length limit do not count.", panel=OBJECTIVE)
    max_grad_norm: float = knob(1.0, "Clip the adapter's gradient norm to this (0: no clipping).", panel=OBJECTIVE,
                                min=0)
    weight_decay: float = knob(0.0, "AdamW weight decay on the adapter.", panel=OBJECTIVE, min=0)
    warmup_steps: int = knob(0, "Linear learning-rate warmup over this many steps, then constant.", panel=OBJECTIVE,
                             min=0)

    filter_groups: bool = knob(False, "Drop groups with equal rewards and draw more prompts (DAPO).", panel=PROMPTS)
    max_filter_rounds: int = knob(3, "Extra generation rounds per step at most, with --filter-groups.", panel=PROMPTS,
                                  min=0)
    retire_solved: int = knob(0, "Retire a prompt solved by every completion on K visits in a row (0: never).",
                              panel=PROMPTS, min=0)

    eval_before_after: bool = knob(True, "A fast greedy evaluation on held-out prompts at step 0 and at the end, and "
                                         "the before/after line.", panel=EVALUATION)
    eval_every: int = knob(0, "A full evaluation (greedy and sampled) every N steps (0: never).", panel=EVALUATION,
                           min=0)
    eval_prompts: int = knob(64, "Held-out prompts per evaluation (at most the split's size).", panel=EVALUATION, min=1)
    eval_samples: int = knob(4, "Samples per held-out prompt for the mean reward.", panel=EVALUATION, min=1)
    eval_data: str | None = knob(None, "A data file of held-out rows to evaluate on.", panel=EVALUATION,
                                 shown="the task's own held-out split: every source holds out a tenth of its rows, "
                                       "at most 200")

    micro_batch_size: int | None = knob(None, "Sequences per forward/backward pass (a group's short completions "
                                        "share one); gradients accumulate across them.", panel=RUN, min=1,
                                        shown="{gpu} on a GPU, {cpu} on a cpu".format(**MICRO_BATCH))
    logprob_chunk_size: int = knob(512, "Completion tokens per lm-head chunk: bounds the logits' memory.", panel=RUN,
                                   min=1)
    save_every: int = knob(10, "Checkpoint every N steps (and at the end; 0: only at the end).", panel=RUN, min=0)
    keep: int = knob(2, "Checkpoints to keep.", panel=RUN, min=1)
    max_bad_steps: int = knob(3, "Updates in a row skipped for a NaN/inf loss or gradient before the run stops.",
                              panel=RUN, min=1)
    sample_every: int = knob(5, "Show a sampled completion every N steps (0: never).", panel=RUN, min=0)
    stop_on_hacking: bool = knob(False, "Stop the run, saved, when a reward-gaming detector fires.", panel=RUN)
    report_to: list[Tracker] = knob(help="Also log to tensorboard and/or wandb (repeat).", panel=RUN, shown="none",
                                    factory=list)

    preset: dict = python_only(why="the preset's values used, kept in config.json for the record", factory=dict)

    def __post_init__(self) -> None:
        p = PRESETS.get(self.model, CUSTOM_MODEL)
        self.preset = {k: v for k, v in dataclasses.asdict(p).items() if k not in ('model_type', 'shape')}
        for name in ("lora_rank", "learning_rate", "num_generations", "prompts_per_step", "max_new_tokens"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(p, name))
        self.lora_alpha = 2 * self.lora_rank if self.lora_alpha is None else self.lora_alpha
        if self.advantage == "maxrl":  # its divisor is the group's mean success: no other scale goes with it
            if self.scale_rewards not in (None, "none"):
                raise ValueError(f"bad config: advantage maxrl divides by the group's mean success, so "
                                 f"scale_rewards {self.scale_rewards!r} cannot apply; leave --scale-rewards out")
            self.scale_rewards = "none"
        self._check_choices()  # before the loss's presets are read by name
        for name, value in LOSS_PRESETS[self.loss].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        import torch

        from minigrpo.hardware import bf16_projections

        gpu = torch.cuda.is_available()
        self.load_in_4bit = gpu if self.load_in_4bit is None else self.load_in_4bit
        if self.micro_batch_size is None:
            self.micro_batch_size = MICRO_BATCH["gpu" if gpu else "cpu"]
        if self.bf16_base is None:
            self.bf16_base = bf16_projections(gpu, self.dtype, self.load_in_4bit, self.generator)
        self.epsilon_high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        self.validate()

    def validate(self) -> None:
        """Refuse impossible settings with one clear message, before anything loads."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, float) and not math.isfinite(v):
                    raise ValueError(f"bad config: {f.name} ({flag_of(f)}) must be a finite number, not {v}")
        self._check_choices()
        self._check_bounds()
        if self.model not in PRESETS and "/" not in self.model and not Path(self.model).exists():
            close = difflib.get_close_matches(self.model, PRESETS, n=1, cutoff=0.5)
            raise ValueError(f"unknown model {self.model!r}: " + (f"did you mean {close[0]}? " if close else "")
                             + "`minigrpo models` lists the presets; a hub id is org/name, a local model a folder")
        checks = [
            (self.temperature > 0, "temperature must be > 0 (GRPO needs sampling; use a small value, not 0)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization < 1,
             "gpu_memory_utilization must be in (0, 1), or left out to size it from the model (`minigrpo plan`)"),
            (not self.bf16_base or (self.dtype in ("auto", "float32") and not self.load_in_4bit),
             "bf16_base keeps the projections of a float32 model in bfloat16: it goes with --dtype float32 "
             "(or auto on a cpu) and --no-4bit"),
            (self.learning_rate > 0, "learning_rate must be > 0"),
            (self.epsilon > 0 and self.epsilon_high > 0, "epsilon and epsilon_high must be > 0"),
            (0 < self.top_entropy_quantile <= 1, "top_entropy_quantile must be in (0, 1]"),
            (self.eval_every <= self.steps, f"eval_every={self.eval_every} is beyond the run's {self.steps} steps"),
            (self.tool_timeout > 0, "tool_timeout must be > 0"),
            (self.entropy_target is None or self.entropy_target > 0, "entropy_target must be > 0 (nats)"),
            (not self.reference_adapter or self.beta > 0, "reference_adapter is the KL's reference: it needs "
                                                          "--beta above 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"bad config: {message}")

    def _check_bounds(self) -> None:
        """Each bounded field (its knob's min and max) within them; a list's values each."""
        for f in dataclasses.fields(self):
            low, high, value = f.metadata.get("min"), f.metadata.get("max"), getattr(self, f.name)
            for v in value if isinstance(value, list) else [value]:
                if v is not None and ((low is not None and v < low) or (high is not None and v > high)):
                    bound = (f"from {low} to {high}" if low is not None and high is not None
                             else f"at least {low}" if low is not None else f"at most {high}")
                    raise ValueError(f"bad config: {f.name} ({flag_of(f)}) must be {bound}, not {v}")

    def _check_choices(self) -> None:
        """Each choice's value is one its Literal allows (a list's, each of its values)."""
        for name, kind in choice_fields().items():
            value = getattr(self, name)
            for v in value if isinstance(value, list) else [value]:
                if v is not None and v not in choices(kind):
                    raise ValueError(f"bad config: {name} must be {or_list(choices(kind))}, not {v!r}")

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
    def load(cls, path: Path, **values) -> "TrainConfig":
        """The config a run saved (config.json), with `values` in place of its own."""
        fields = json.loads(Path(path).read_text())
        fields.pop("preset", None)
        fields.setdefault("bf16_base", False)  # a run saved before the field existed computed all in its dtype
        return cls(**fields | values)
