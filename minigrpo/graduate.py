"""`minigrpo graduate`: the same task, rewards and settings, continued on TRL's GRPOTrainer across GPUs.

minigrpo is for one GPU. Past it, the established engine is TRL launched with `accelerate` (DeepSpeed ZeRO or
FSDP, vLLM colocated or as a server). This writes a folder with `train_trl.py` (a short script building
GRPOConfig and GRPOTrainer from the run's settings, its data and rewards loaded through minigrpo, so nothing is
rewritten), `accelerate.yaml` for N GPUs, and a README with the launch commands and the mapping of every
setting, including what has no equivalent.
"""

from __future__ import annotations

import dataclasses
from importlib import resources
from pathlib import Path
from typing import Callable

from minigrpo.config import Backend, TrainConfig, VllmMode, choices, or_list
from minigrpo import settle
from minigrpo.model import LORA_TARGETS
from minigrpo.tasks import get_task

# our loss aggregation -> TRL's loss_type (which fixes TRL's aggregation); cispo's surrogate has its own
LOSS_TYPES = {"sequence": "grpo", "token": "dapo", "constant": "dr_grpo"}


def trl_settings(cfg: TrainConfig, gpus: int, full_finetune: bool = False, vllm_mode: str = "colocate") -> dict:
    """GRPOConfig's arguments equivalent to `cfg` on `gpus` GPUs: every optimizer step sees the same
    prompts_per_step x G completions, split across the GPUs."""
    completions = cfg.prompts_per_step * cfg.num_generations
    if completions % gpus:
        raise ValueError(f"{cfg.prompts_per_step} prompts x G={cfg.num_generations} = {completions} completions per "
                         f"step do not split evenly over {gpus} GPUs; choose --prompts-per-step so that they do")
    cispo = cfg.surrogate == "cispo"
    settings = dict(
        max_steps=cfg.steps, seed=cfg.seed,
        per_device_train_batch_size=completions // gpus, gradient_accumulation_steps=1,
        num_generations=cfg.num_generations, max_completion_length=cfg.completion_tokens,
        temperature=cfg.temperature, top_p=cfg.top_p,
        learning_rate=cfg.learning_rate, lr_scheduler_type="constant_with_warmup", warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm or 1e9,
        beta=cfg.beta, use_bias_correction_kl=False,  # our KL term is not weighted by the importance ratio
        num_iterations=cfg.num_iterations, epsilon=cfg.epsilon,
        # TRL's cispo caps the weight at epsilon_high itself; ours at 1 + epsilon_high
        epsilon_high=cfg.epsilon_high + 1 if cispo else cfg.epsilon_high,
        loss_type="cispo" if cispo else LOSS_TYPES[cfg.loss_aggregation], scale_rewards=cfg.scale_rewards,
        importance_sampling_level=cfg.importance_sampling, top_entropy_quantile=cfg.top_entropy_quantile,
        mask_truncated_completions=cfg.mask_truncated, reward_weights=None,
        gradient_checkpointing=cfg.gradient_checkpointing is not False,
        use_vllm=True, vllm_mode=vllm_mode, vllm_importance_sampling_correction=cfg.tis_cap > 0,
        vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=cfg.tis_cap or 3.0,
        logging_steps=1, save_steps=cfg.save_every or cfg.steps, save_total_limit=cfg.keep,
        report_to=list(cfg.report_to) or ["none"], log_completions=True, bf16=True,
        multi_objective_aggregation={"sum": "sum_then_normalize"}.get(cfg.reward_aggregation, cfg.reward_aggregation),
        entropy_coef=cfg.entropy_coef, use_adaptive_entropy=cfg.entropy_target is not None,
        **({"entropy_target": cfg.entropy_target} if cfg.entropy_target is not None else {}),
    )
    return settings


def not_carried(cfg: TrainConfig) -> list[str]:
    """The run's settings that TRL's GRPOTrainer (1.16) has no option for, each with what the script does."""
    out = []
    if cfg.advantage != "grpo":
        out.append(f"`--advantage {cfg.advantage}`: GRPOTrainer forms the group-mean advantage (its scale set by "
                   f"scale_rewards); " + ("TRL's RLOO is its own RLOOTrainer" if cfg.advantage == "rloo" else
                                          "TRL 1.16 has no MaxRL") + ". The script trains with the group mean.")
    if cfg.kl_estimator != "k3":
        out.append(f"`--kl-estimator {cfg.kl_estimator}`: TRL's KL term is the k3 estimate; the script uses k3.")
    if cfg.reference_adapter:
        out.append("`--reference-adapter`: TRL's reference for a PEFT model is the base with the adapter off; "
                   "the script's KL is to the base.")
    return out


def trl_rewards(task, strict: bool = False, timeout: float | None = None) -> tuple[list[Callable], list[float]]:
    """The task's reward functions as TRL calls them, with their weights, each scored as minigrpo scores it
    (`scoring.score`: copies, the time limit, async awaited, dict parts summed, a failure scored 0 and named
    unless `strict`) and given what it gets in minigrpo: plain-text prompts and completions where the data's
    prompts are text (the script hands TRL chat messages, so the model reads them as minigrpo renders them).
    What it logs goes to TRL's log_extra and log_metric. An environment's own get_reward is left out: TRL
    adds it itself."""
    from minigrpo.scoring import reward_name, score, text_of

    def for_trl(fn):
        name = reward_name(fn)

        def reward(prompts, completions, completion_ids=None, trainer_state=None, log_extra=None, log_metric=None,
                   **columns):
            if columns.pop("plain_text", [False])[0]:
                prompts, completions = [text_of(p) for p in prompts], [text_of(c) for c in completions]
            rows = [dict({k: v[i] for k, v in columns.items()}, prompt=prompts[i]) for i in range(len(prompts))]
            ids = completion_ids or [[] for _ in completions]
            result = score([fn], [1.0], prompts, completions, ids, rows, strict=strict, timeout=timeout,
                           state=trainer_state)
            for column, values in result.extra.items():
                log_extra and log_extra(column, values)
            for metric, values in result.metrics.items():
                log_metric and log_metric(metric, sum(values) / len(values))
            return result.values[name]  # None stays None: TRL ignores it, as minigrpo counts it 0

        reward.__name__ = name  # TRL logs rewards/<name>/mean
        return reward

    weights = task.weights or [1.0] * len(task.rewards)
    kept = [(fn, w) for fn, w in zip(task.rewards, weights) if not getattr(fn, "environment_owned", False)]
    return [for_trl(fn) for fn, _ in kept], [w for _, w in kept]


def accelerate_yaml(gpus: int, backend: str = "zero2") -> str:
    """An accelerate config for one machine with `gpus` GPUs: DeepSpeed ZeRO-2 (or 3), or FSDP 2."""
    if backend == "fsdp":
        engine = ("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                  "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n  fsdp_state_dict_type: FULL_STATE_DICT\n"
                  "  fsdp_cpu_ram_efficient_loading: true\n  fsdp_reshard_after_forward: true\n"
                  "  fsdp_offload_params: false\n")
    else:
        stage = backend[-1]
        engine = (f"distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: {stage}\n"
                  f"  zero3_init_flag: {'true' if stage == '3' else 'false'}\n"
                  + ("  zero3_save_16bit_model: true\n" if stage == "3" else "")
                  + "  offload_optimizer_device: none\n  offload_param_device: none\n"
                  "  deepspeed_multinode_launcher: standard\n")
    return (f"# {backend} on one machine with {gpus} GPUs (minigrpo graduate). For several machines, set\n"
            f"# num_machines, machine_rank (0 on the first), main_process_ip and main_process_port, and\n"
            f"# num_processes to the GPUs of all machines together; run the same launch on each machine.\n"
            f"compute_environment: LOCAL_MACHINE\n{engine}mixed_precision: bf16\nnum_machines: 1\n"
            f"machine_rank: 0\nnum_processes: {gpus}\nrdzv_backend: static\nsame_network: true\nuse_cpu: false\n")


def graduate(cfg: TrainConfig, out: Path, gpus: int = 1, backend: str = "zero2", full_finetune: bool = False,
             vllm_mode: str = "colocate", from_adapter: str | None = None) -> Path:
    """Write train_trl.py, accelerate.yaml and README.md into `out` (a new or empty folder)."""
    from minigrpo.run import usable_or_fail

    if gpus < 1:
        raise ValueError("--gpus must be at least 1")
    for flag, value, kind in (("--backend", backend, Backend), ("--vllm-mode", vllm_mode, VllmMode)):
        if value not in choices(kind):  # before anything is written
            raise ValueError(f"{flag} must be {or_list(choices(kind))}, not {value!r}")
    from_adapter = from_adapter or cfg.init_adapter  # a run that began from an SFT warm-up's adapter
    if from_adapter and not (Path(from_adapter) / "adapter_config.json").exists():
        raise FileNotFoundError(f"--init-adapter {from_adapter}: no adapter_config.json there (a run's adapter "
                                f"folder is runs/<run>/adapter)")
    cfg = dataclasses.replace(cfg, task=_absolute(cfg.task), rewards=[_absolute(r) for r in cfg.rewards],
                              tools=[_absolute(t) for t in cfg.tools],
                              environment=cfg.environment and _absolute(cfg.environment))
    # a task or reward that cannot load stops here
    task = get_task(cfg.task, cfg.rewards, cfg.tools, environment=cfg.environment)
    cfg = settle.episode_budget(cfg, task)  # an episode's budget, not one turn's, is TRL's max_completion_length
    if task.tools or task.environment:
        check_tool_template(cfg)
    settings = trl_settings(cfg, gpus, full_finetune, vllm_mode)
    if task.tools or task.environment:  # our turns count model turns; TRL's iterations, the tool calls between
        settings["max_tool_calling_iterations"] = cfg.max_turns - 1
    in_4bit = bool(cfg.load_in_4bit) and not full_finetune and backend == "zero2"
    folder = Path(out)
    usable_or_fail(folder, "--out", may_hold_results=False)  # a new or empty folder: nothing of yours overwritten
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train_trl.py").write_text(script(cfg, settings, in_4bit, full_finetune, from_adapter, gpus))
    (folder / "accelerate.yaml").write_text(accelerate_yaml(gpus, backend))
    (folder / "README.md").write_text(readme(cfg, settings, gpus, backend, in_4bit, full_finetune))
    cfg.save(folder / "minigrpo_config.json")
    return folder


def check_tool_template(cfg: TrainConfig) -> None:
    """TRL parses tool calls with the chat template's own tool support; minigrpo writes the tools into the
    system message where a template has none, which TRL does not. Refuse a model TRL cannot run the task with."""
    from minigrpo.model import load_tokenizer
    from minigrpo.tools import template_has_tools
    from minigrpo.weights import resolve_weights

    try:
        tokenizer = load_tokenizer(resolve_weights(cfg.hub_id))
    except Exception:  # not on this machine: TRL will say so itself
        return
    if not template_has_tools(tokenizer):
        raise ValueError(f"{cfg.model}'s chat template has no tool support, which TRL needs to run a task with tools "
                         f"or an environment (minigrpo describes the tools in the system message instead); graduate "
                         f"with a model whose template has it: --model qwen-0.5b, qwen-1.5b, qwen-3b, qwen-7b, "
                         f"llama-3.2-1b or llama-3.2-3b")


def _absolute(spec: str) -> str:
    """A task, reward or tool given as a path (file.py, data.jsonl, file.py:function), made absolute so the
    script finds it from any folder on this machine; names of built-ins and modules stay as they are (a
    library's task, `vf:file.py:options`, has its file made absolute the same way)."""
    if spec.startswith("vf:"):
        return "vf:" + _absolute(spec[3:])
    path, sep, function = spec.rpartition(":") if ":" in spec and not Path(spec).exists() else (spec, "", "")
    return str(Path(path).resolve()) + sep + function if Path(path).exists() else spec


def template(name: str) -> str:
    """One of the files graduate writes, as a str.format template (package data: minigrpo/templates/)."""
    return (resources.files("minigrpo") / "templates" / f"{name}.template").read_text()


def lora_settings(cfg: TrainConfig) -> dict:
    return dict(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(LORA_TARGETS), task_type="CAUSAL_LM")




def script(cfg: TrainConfig, settings: dict, in_4bit: bool, full_finetune: bool, from_adapter: str | None,
           gpus: int) -> str:
    shown = "dict(\n" + "".join(f"    {k}={v!r},\n" for k, v in settings.items()) + ")"
    return template("train_trl.py").format(model=cfg.model, task=cfg.task, hub_id=cfg.hub_id, rewards=list(cfg.rewards),
                         tools=list(cfg.tools), seed=cfg.seed, weights=cfg.reward_weights, in_4bit=in_4bit, gpus=gpus,
                         environment=cfg.environment, strict=cfg.strict_rewards,
                         timeout=cfg.reward_timeout or None,
                         lora=None if full_finetune else lora_settings(cfg), settings=shown,
                         from_adapter=str(Path(from_adapter).resolve()) if from_adapter else None)


def readme(cfg: TrainConfig, settings: dict, gpus: int, backend: str, in_4bit: bool, full_finetune: bool) -> str:
    table = "\n".join(f"| {a} | {b} | {c} |" for a, b, c in mapping(cfg, settings, gpus, in_4bit, full_finetune))
    missing = "".join(f"- {line}\n" for line in not_carried(cfg))
    return template("README.md").format(cfg=cfg, gpus=gpus, backend=backend, table=table, missing=missing)


def mapping(cfg: TrainConfig, settings: dict, gpus: int, in_4bit: bool, full_finetune: bool) -> list[tuple]:
    """(setting, minigrpo's value, TRL's equivalent), one row per setting."""
    return [("model", cfg.model, f"`MODEL = {cfg.hub_id!r}`"),
            ("task, rewards, tools", f"{cfg.task}; {', '.join(cfg.rewards) or 'its own rewards'}",
             "loaded through minigrpo (`get_task`); rewards wrapped by `trl_rewards` (dict parts summed)"),
            ("G, prompts per step", f"{cfg.num_generations}, {cfg.prompts_per_step}",
             f"num_generations={settings['num_generations']}, per_device_train_batch_size="
             f"{settings['per_device_train_batch_size']} x {gpus} GPUs"),
            ("completion length", cfg.completion_tokens, f"max_completion_length={settings['max_completion_length']}"),
            ("learning rate, warmup", f"{cfg.learning_rate:g}, {cfg.warmup_steps}",
             "learning_rate, constant_with_warmup"),
            ("beta, epsilon, epsilon_high", f"{cfg.beta:g}, {cfg.epsilon:g}, {cfg.epsilon_high:g}",
             f"beta, epsilon, epsilon_high={settings['epsilon_high']:g}" + (" (TRL's cispo: the cap itself)"
                                                                             if cfg.surrogate == "cispo" else "")),
            ("loss", f"--loss {cfg.loss}: scale {cfg.scale_rewards}, {cfg.loss_aggregation} mean, "
                     f"{cfg.importance_sampling} ratios, {cfg.surrogate}",
             f"loss_type={settings['loss_type']!r}, scale_rewards={settings['scale_rewards']!r}, "
             f"importance_sampling_level={settings['importance_sampling_level']!r}"),
            ("num_iterations, top_entropy_quantile, mask_truncated",
             f"{cfg.num_iterations}, {cfg.top_entropy_quantile:g}, {cfg.mask_truncated}", "same names"),
            ("advantage, KL estimator", f"{cfg.advantage}, {cfg.kl_estimator}",
             "group mean, k3 (GRPOTrainer's only ones: see below if they differ)"),
            ("reward aggregation", cfg.reward_aggregation,
             f"multi_objective_aggregation={settings['multi_objective_aggregation']!r}"),
            ("entropy bonus", f"{cfg.entropy_coef:g}" + (f", adaptive to {cfg.entropy_target:g} nats"
                                                          if cfg.entropy_target is not None else ""),
             "entropy_coef" + (", use_adaptive_entropy, entropy_target" if cfg.entropy_target is not None else "")),
            ("start adapter", cfg.init_adapter or "fresh", "`FROM_ADAPTER` (--init-adapter)"),
            ("TIS cap (vLLM vs trainer)", cfg.tis_cap, "vllm_importance_sampling_mode='token_truncate', _clip_max"),
            ("LoRA", "none: full fine-tuning" if full_finetune else f"r={cfg.lora_rank}, alpha={cfg.lora_alpha}, "
             "all linear projections", "`LORA` (peft LoraConfig)"),
            ("4-bit base", cfg.load_in_4bit, f"`LOAD_IN_4BIT = {in_4bit}` (bitsandbytes nf4; ZeRO-2 only)"),
            ("generator", cfg.generator, f"use_vllm=True, vllm_mode={settings['vllm_mode']!r}"),
            ("reward failures, time limit", f"{'stop' if cfg.strict_rewards else 'score 0, named'}; "
             f"{cfg.reward_timeout:g} s per completion", "`STRICT_REWARDS`, `REWARD_TIMEOUT`: each reward runs "
             "through minigrpo's scoring inside TRL (a failing reward does not stop TRL unless strict)"),
            ("environment", cfg.environment or "the task's own", "environment_factory; its get_reward is added "
             "by TRL once (minigrpo's copy is left out)"),
            ("compute dtype", cfg.dtype, "bf16 where the GPU has it, else fp16 (as minigrpo's auto)"),
            ("gradient checkpointing", {None: "auto (on a GPU)", True: "on", False: "off"}[cfg.gradient_checkpointing],
             f"gradient_checkpointing={settings['gradient_checkpointing']}"),
            ("checkpoints, logging", f"every {cfg.save_every}, keep {cfg.keep}; {cfg.report_to or 'console'}",
             "save_steps, save_total_limit; report_to, logging_steps=1")]
