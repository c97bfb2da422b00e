"""What a run does before step 1: plan the memory, load the policy, start the generator, check the numbers.

The plan comes first, from the model's config alone, so a run that cannot fit says so before it loads
gigabytes. Then, where the compute dtype is float16 (GPUs before sm_80, such as the T4), one short rollout
with the trainer's own modules checks that the policy's log-probs are finite and its text is not one token
repeated: some models overflow in float16. When it fails and the dtype was chosen automatically, the run
reloads in float32 and says so. Only then does the generator start: a process starts one vLLM engine.
"""

from __future__ import annotations

import gc
from collections import Counter
from dataclasses import dataclass

import torch

from minigrpo import settle
from minigrpo.config import TrainConfig
from minigrpo.errors import SetupError
from minigrpo.generate import Generator, Sampling
from minigrpo.generate.hf import HFGenerator
from minigrpo.hardware import Gpu, allocator_problem, compute_dtype, this_gpu, versions, vllm_available
from minigrpo.model import load_policy, load_tokenizer
from minigrpo.logprobs import pad_batch, token_logprobs
from minigrpo.weights import resolve_weights
from minigrpo.plan import Plan, Settings, make_plan
from minigrpo.tools import render_prompt
from minigrpo.tasks import Task, rows_and_places
from minigrpo.generate.vllm_engine import VLLMGenerator


@dataclass
class Prepared:
    """What is known before any weights load: the config as the plan settled it, and what the load reads."""
    cfg: TrainConfig
    weights: str  # the folder the weights load from
    model_config: object  # transformers' config of the model
    tokenizer: object
    gpu: Gpu | None
    plan: Plan
    longest: int | None  # the longest prompt in tokens, where the task's were measured


@dataclass
class Loaded:
    model: object  # the PEFT policy
    tokenizer: object
    generator: Generator | None
    dtype: torch.dtype
    plan: Plan


def plan_run(cfg: TrainConfig, model_config, gpu: Gpu | None, say, dtype: str | None = None,
             prompt_tokens: int | None = None) -> Plan:
    """The run's plan, said in one line; a run that cannot fit stops here, before anything loads. With
    `prompt_tokens` (the task's longest prompt), its memory is planned for those rather than a typical prompt."""
    settings = Settings.of(cfg) if prompt_tokens is None else Settings.of(cfg, prompt_tokens)
    settings.dtype = dtype or settings.dtype
    plan = make_plan(model_config, gpu, settings, vllm_available())
    say(f"plan: {plan.summary()}" + (f" ({plan.generator_reason})" if plan.generator != "vllm" and gpu else ""))
    if not plan.fits:
        raise ValueError(f"{cfg.model} does not fit {plan.card} with these settings "
                         f"(estimated {plan.peak_gb:.1f} GB): {'; '.join(plan.advice)}. "
                         f"`minigrpo plan` shows the arithmetic.")
    return plan


def longest_prompt_tokens(cfg: TrainConfig, task: Task, tokenizer, context: int | None) -> int:
    """Before the model loads: the prompt and completion budgets fit the model's context, and every prompt
    of the task's data fits the prompt budget (one tokenizer pass), naming the first that does not.
    Returns the longest prompt's length in tokens."""
    from minigrpo.episodes import offered_tools

    tools = offered_tools(task)
    budget = "--max-episode-tokens" if tools or task.environment else "--max-new-tokens"
    if context and cfg.max_prompt_tokens + cfg.completion_tokens > context:
        raise ValueError(f"--max-prompt-tokens {cfg.max_prompt_tokens} + {budget} {cfg.completion_tokens} is "
                         f"more than {cfg.model}'s context of {context} tokens: lower them to at most {context} "
                         f"together")
    rows, places, source = rows_and_places(task, cfg.seed)
    texts = [render_prompt(tokenizer, row["prompt"], tools) for row in rows]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False).input_ids]
    for length, place in zip(lengths, places):
        if length > cfg.max_prompt_tokens:
            raise ValueError(f"{source}, {place}: the prompt is {length} tokens, more than --max-prompt-tokens "
                             f"{cfg.max_prompt_tokens}: raise it (up to {context or 'the context'} minus "
                             f"{budget}), or shorten the prompt")
    return max(lengths, default=0)


def settle_run(cfg: TrainConfig, task: Task, train_rows: list[dict], say=print) -> tuple[Prepared, list[str]]:
    """A run's config settled in one step, before any weights load, each part named in turn. Returns what the load
    reads (its `cfg` the settled config) and the notes the settling made."""
    cfg = settle.episode_budget(cfg, task)  # where completions are episodes: their token budget
    cfg, note = settle.evaluation(cfg, task, train_rows)  # skipped, with a note, where nothing is held out
    cfg = settle.run_folder(cfg)  # runs/<time>-<model>-<task> where --out is not given
    return prepare(cfg, say, task), [note] if note else []  # the memory plan, and the checkpointing it chose


def prepare(cfg: TrainConfig, say=print, task: Task | None = None, longest_prompt: int | None = None) -> Prepared:
    """Before any weights load: the model's config and tokenizer; with `task`, its prompts checked against the
    budgets (with `longest_prompt`, prompts taken to be that long); the memory plan, said in one line; and an
    unset --gradient-checkpointing settled as the plan chose."""
    from transformers import AutoConfig

    gpu = this_gpu()
    weights = resolve_weights(cfg.hub_id)
    model_config = AutoConfig.from_pretrained(weights)
    tokenizer = load_tokenizer(weights)
    longest = longest_prompt
    if task is not None:
        context = getattr(model_config, "max_position_embeddings", None)
        longest = longest_prompt_tokens(cfg, task, tokenizer, context) or None
    plan = plan_run(cfg, model_config, gpu, say, prompt_tokens=longest)
    cfg = settle.checkpointing(cfg, plan.checkpointing)
    return Prepared(cfg, weights, model_config, tokenizer, gpu, plan, longest)


def load_for_training(prepared: Prepared, say=print, generate: bool = True) -> Loaded:
    """The policy, tokenizer and generator as `prepared` planned them (no generator without `generate`: SFT
    samples nothing, and a fixed-shape decoder would hold a dense copy of a 4-bit base)."""
    cfg, weights, tokenizer, gpu, plan = prepared.cfg, prepared.weights, prepared.tokenizer, prepared.gpu, prepared.plan
    dtype = compute_dtype(gpu, cfg.dtype)[0]
    model = _load(cfg, weights, dtype, say)
    # float16's numbers are judged on the trainer alone, before any engine starts: a process then starts one
    # engine, never a second beside the first one's remains (vLLM's memory check refuses it on a full card)
    problem = first_rollout_problem(model, tokenizer, cfg) if dtype == torch.float16 else None
    if problem is not None:
        if cfg.dtype != "auto":
            raise ValueError(f"with --dtype float16 the first rollout had {problem}: this model overflows in "
                             f"float16; train with --dtype float32")
        say(f"[yellow]float16 is not safe for this model: its first rollout had {problem}. Reloading in float32 "
            f"(slower, and twice the engine memory).[/]")
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        dtype = torch.float32
        plan = plan_run(cfg, prepared.model_config, gpu, say, dtype="float32", prompt_tokens=prepared.longest)
        model = _load(cfg, weights, dtype, say)
    generator = make_generator(cfg, model, tokenizer, plan, dtype, say) if generate else None
    return Loaded(model, tokenizer, generator, dtype, plan)


def _load(cfg: TrainConfig, weights: str, dtype: torch.dtype, say):
    say(f"loading {cfg.model}{' (4-bit)' if cfg.load_in_4bit else ''} and adding LoRA adapters (rank {cfg.lora_rank})")
    return load_policy(cfg, weights, dtype)


def make_generator(cfg, model, tokenizer, plan, dtype: torch.dtype, say=print) -> Generator:
    """The generator the plan chose (`plan.make_plan`). With `--generator auto`, an engine that fails to
    start (an unsupported card, driver or vLLM version) gives way to transformers generation, with one line
    saying why; with `--generator vllm` the failure stops the run."""
    # in float32 our eager decode loop's log-probs are the trainer's (a cpu's fixed-shape decoder reads float32
    # weights at half precision, and its generator then reports them itself). with bf16 projections in a float32
    # model, a one-token step and a whole-sequence forward round to bf16 differently now and then (0.015 nats a token
    # on the tiny model; all-bf16 on a cpu, 0.0000), and a card's bf16 and fp16 kernels are picked by shape: so there
    # the sampler's own log-probs go to the loss, which corrects for the gap (truncated importance sampling) and logs it
    exact = dtype == torch.float32 and not cfg.bf16_base
    if plan.generator == "hf":
        return HFGenerator(model, tokenizer, report_logprobs=not exact, decoder=cfg.decoder, say=say)
    if not vllm_available():
        raise ValueError("--generator vllm needs vLLM: pip install \"$(minigrpo doctor --vllm-requirement)\" "
                         "(the build for this machine), or train with --generator hf")
    try:
        problem = allocator_problem(versions()["vllm"]) if torch.cuda.is_available() else None
        if problem:
            raise RuntimeError(problem)
        return VLLMGenerator.start(model, tokenizer, lora_rank=cfg.lora_rank, seed=cfg.seed,
                                   max_model_len=cfg.max_prompt_tokens + cfg.completion_tokens,
                                   max_rows=cfg.num_generations * cfg.prompts_per_step,
                                   gpu_memory_utilization=plan.engine_share, sleep=plan.sleep,
                                   dtype=dtype)
    except Exception as error:  # only its message leaves: its traceback pins the half-built engine's frames
        why = f"{type(error).__name__}: {str(error).strip().splitlines()[0][:200] if str(error).strip() else ''}"
        if cfg.generator != "auto":
            raise SetupError(f"the vLLM engine could not start ({why}). Train with --generator hf, which needs "
                             f"no engine, or see `minigrpo doctor`.") from error
    gc.collect()  # out of the except block, what the engine had allocated can go back to the trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    say(f"[yellow]the vLLM engine could not start ({why}); generating with transformers instead[/]")
    return HFGenerator(model, tokenizer, report_logprobs=not exact, decoder=cfg.decoder, say=say)


def first_rollout_problem(model, tokenizer, cfg: TrainConfig, prompt: str = "Count from one to ten.") -> str | None:
    """Sample a few short completions with the trainer's own modules and take its log-probs of them; what is
    wrong, or None."""
    ids = tokenizer(render_prompt(tokenizer, prompt), add_special_tokens=False).input_ids
    generator = HFGenerator(model, tokenizer, decoder="eager")  # 48 tokens: no dense copy of the base for them
    try:
        out = generator.generate([ids], Sampling(2, 24, cfg.temperature, cfg.top_p))
    except RuntimeError as error:  # transformers refuses to sample from nan or inf probabilities
        if "inf" in str(error) or "nan" in str(error):
            return f"non-finite probabilities while sampling ({str(error).splitlines()[0][:80]})"
        raise
    rows = [(ids, c) for c in out.completion_ids if c]
    if not rows:
        return "only empty completions"
    batch, attention, mask = pad_batch(rows, tokenizer.pad_token_id, model.device)
    with torch.no_grad():
        logps = token_logprobs(model, batch, attention, mask.shape[1], cfg.temperature)  # [b, T]
    return numerics_problem(logps[mask], out.completion_ids)


def numerics_problem(logps: torch.Tensor, completions: list[list[int]]) -> str | None:
    """Why a rollout says the compute dtype is broken, or None.

    >>> numerics_problem(torch.tensor([-1.0, -2.0]), [[5, 6, 7]]) is None
    True
    >>> numerics_problem(torch.tensor([-1.0, float("nan")]), [[5, 6]])
    'non-finite log-probs (1 of 2 tokens)'
    >>> numerics_problem(torch.tensor([-0.1] * 20), [[0] * 10, [0] * 10])
    'degenerate text (every completion one token repeated)'
    """
    bad = (~torch.isfinite(logps)).sum().item()
    if bad:
        return f"non-finite log-probs ({bad} of {logps.numel()} tokens)"
    long = [c for c in completions if len(c) >= 8]
    if long and all(Counter(c).most_common(1)[0][1] >= 0.9 * len(c) for c in long):
        return "degenerate text (every completion one token repeated)"
    return None
