"""The memory plan rehearsed: the real code of a run's step at a preset's real sizes, on tensors that hold no data.

`plan.py` works a run's memory out from the model's shape; this runs the code that arithmetic is about, at the
same sizes, and counts the bytes alive after every op, so each term of the plan can be held to what the code
allocates (tests/test_rehearsal.py) instead of to a reading of it. The model is built from its preset's config as
a run builds it on a card (a 4-bit NF4 base with double-quantized scales, 16-bit embeddings, LoRA on every
block projection, gradient checkpointing, SDPA attention, the card's compute dtype), with every tensor on torch's
`meta` device: shapes, dtypes and storage sizes, no data, so a 3B model's step runs in seconds on a CPU.
bitsandbytes' 4-bit ops have meta kernels of their own. Then, each under the counter: the update of one
micro-batch (`update.policy_update`: the reference pass, the trainer's log-probs, the loss, backward, AdamW),
one SFT step (`sft.sft_step`), the log-prob head alone, the trunk's forward and backward alone, and the
fixed-shape decoder's dense copy, state and prefill for a training rollout and for the held-out evaluation.

Why `meta` and not fake CUDA tensors (`FakeTensorMode`): Python indexing of a fake CUDA tensor needs CUDA's
device guard, which a CPU-only torch lacks, and a model indexes everywhere. The code's choices for a card are
made here by what the rehearsal passes (SDPA, the card's dtype), and SDPA itself runs as the fused kernel a card
runs (`card_attention`), not as the math fallback a meta tensor would take. Where the code asks a tensor for a
value (a bool, `.item()`, which positions are real), the counter answers the costliest case: every position is
real, every branch that allocates more is taken.

What it cannot see, and how the plan covers it: the CUDA context, kernels and cuBLAS workspaces
(`plan.CUDA_CONTEXT_GB`), the caching allocator's fragmentation (the plan fills at most `plan.BUDGET` of a
card; blocks are counted rounded up to 512 bytes, as the allocator rounds them), a captured graph's private
pool, and vLLM's engine (its share is sized by `plan.engine_plan`).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.fx.experimental._config
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from minigrpo.memory import GiB, Sizes

BLOCK = 512  # the CUDA caching allocator's rounding of every block
aten = torch.ops.aten
VALUE_OPS = (aten._local_scalar_dense.default, aten.item.default, aten.is_nonzero.default)


class LiveBytes(TorchDispatchMode):
    """The bytes of every storage the ops under it make, alive now and at their peak since `reset`. A storage
    is counted once however many views read it, from its first op until it is freed (torch keeps a storage's Python
    object as long as the storage lives, autograd's saved tensors included, so a finalizer on it says when). Ops
    asking for a tensor's value get the costliest answer (see the module's docstring)."""

    def __init__(self):
        super().__init__()
        self.alive: set[int] = set()  # the storages counted and not yet freed
        self.live = 0
        self.peak = 0

    def now(self) -> int:
        """Bytes alive now."""
        return self.live

    def reset(self) -> int:
        self.peak = self.live
        return self.peak

    def _count(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.alive:
            return
        nbytes = -(-storage.nbytes() // BLOCK) * BLOCK
        self.alive.add(key)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._freed, key, nbytes)

    def _freed(self, key: int, nbytes: int) -> None:
        self.alive.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args and isinstance(args[0], torch.Tensor) and args[0].device.type == "meta" else None
        if x is not None and func in VALUE_OPS:
            return True if x.dtype == torch.bool else 0.0 if x.is_floating_point() else 0
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "meta":
                self._count(t)
        return out


def card_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """SDPA as a card runs it (the memory-efficient kernel: output and log-sum-exp kept, no [L, L] scores), where a
    meta tensor would take the math fallback. Registered with transformers as the "card_sdpa" attention."""
    groups = getattr(module, "num_key_value_groups", 1)
    if groups > 1:  # grouped-query attention: counted as the copies transformers makes where a mask is given
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    bias = None
    if attention_mask is not None:  # SDPA turns a boolean mask into an additive one of the query's dtype
        bias = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
        bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    causal = query.shape[2] > 1 and attention_mask is None
    out = aten._scaled_dot_product_efficient_attention(query, key, value, bias, query.requires_grad, 0.0, causal,
                                                       scale=scaling)[0]  # [b, heads, L, hd]
    return out.transpose(1, 2).contiguous(), None


def _register_card_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register("card_sdpa", card_attention)
    AttentionMaskInterface.register("card_sdpa", sdpa_mask)
    return "card_sdpa"


@dataclass
class Component:
    name: str
    tracked_gb: float  # the peak the rehearsal counted
    planned_gb: float  # what plan.py says for it

    @property
    def ratio(self) -> float:
        return self.planned_gb / self.tracked_gb if self.tracked_gb else float("inf")


def meta_policy(shape, dtype: torch.dtype, cfg):
    """The policy a run loads on a card, built on the meta device: the base's block projections as bitsandbytes
    4-bit layers, quantized (NF4, double-quantized scales) as `from_pretrained` does, then `model.wrap_policy`."""
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM

    from minigrpo.model import LORA_TARGETS, wrap_policy

    with torch.device("cpu"):  # bitsandbytes builds its code tables from values once: let it, on real ones
        bnbf.quantize_4bit(torch.zeros(64, 64), compress_statistics=True, quant_type="nf4")
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(shape, dtype=dtype, attn_implementation=_register_card_attention())
        for module in list(base.modules()):
            for name, child in list(module.named_children()):
                if type(child) is torch.nn.Linear and name in LORA_TARGETS and cfg.load_in_4bit:
                    quantized = bnb.nn.Linear4bit(child.in_features, child.out_features, child.bias is not None,
                                                  compute_dtype=dtype, compress_statistics=True, quant_type="nf4")
                    packed, state = bnbf.quantize_4bit(child.weight, blocksize=64, compress_statistics=True,
                                                       quant_type="nf4", quant_storage=torch.uint8)
                    quantized.weight = bnb.nn.Params4bit(packed, requires_grad=False, quant_state=state,
                                                         blocksize=64, compress_statistics=True, quant_type="nf4",
                                                         quant_storage=torch.uint8, bnb_quantized=True)
                    quantized.weight.module = quantized
                    quantized.bias = child.bias
                    setattr(module, name, quantized)
        base.is_loaded_in_4bit = bool(cfg.load_in_4bit)
        return wrap_policy(base, cfg)


def _bytes(tensors) -> int:
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(-(-n // BLOCK) * BLOCK for n in storages.values())


def _model_tensors(module, lora: bool) -> list[torch.Tensor]:
    params = [p for n, p in module.named_parameters() if ("lora_" in n) == lora]
    quant = [t for p in params for t in _quant_tensors(getattr(p, "quant_state", None))]
    return params + quant + ([] if lora else list(module.buffers()))


def _quant_tensors(state) -> list[torch.Tensor]:
    if state is None:
        return []
    return [state.absmax, state.code, *(_quant_tensors(state.state2) if state.nested else [])] + (
        [state.offset] if state.nested else [])


def peak_above(counter: LiveBytes, work) -> int:
    """The bytes `work()` adds at its peak to what is alive when it starts."""
    base = counter.reset()
    work()
    return counter.peak - base


def rehearse(preset: str, gpu, top_p: float = 1.0, prompt_tokens: int = 192, say=lambda _: None) -> list[Component]:
    """Run a step of `preset` as it would run on `gpu` (hardware.CARDS), count each part's bytes, and set each
    beside `plan.py`'s figure for it. `prompt_tokens` is the plan's typical prompt."""
    import dataclasses

    import transformers

    from minigrpo.config import MICRO_BATCH, TrainConfig
    from minigrpo.presets import preset_shape
    from minigrpo.hardware import compute_dtype
    from minigrpo.plan import Settings, StepMemory, make_plan, weights_gb

    if int(transformers.__version__.split(".")[0]) < 5:
        raise ValueError(f"--rehearse needs transformers 5 or later (this is {transformers.__version__}, whose "
                         f"rotary embedding asks autocast about the meta device); the plan itself works as it is")
    shape = preset_shape(preset)
    dtype = compute_dtype(gpu, "auto")[0]
    cfg = TrainConfig(model=preset, top_p=top_p, load_in_4bit=True, gradient_checkpointing=True, bf16_base=False,
                      micro_batch_size=MICRO_BATCH["gpu"])
    s = dataclasses.replace(Settings.of(cfg, prompt_tokens), generator="hf")  # the fixed-shape decoder's plan
    plan = make_plan(shape, gpu, s, advise=False)
    sizes, nbytes = Sizes.of(shape), dtype.itemsize
    memory = StepMemory(shape, nbytes, s.micro_batch_size, s.chunk, True, True, top_p)
    rows: list[Component] = []

    def row(name: str, tracked: int, planned_gb: float) -> None:
        rows.append(Component(name, tracked / GiB, planned_gb))
        say(f"{name}: {tracked / GiB:.3f} GB counted, {planned_gb:.3f} GB planned")

    counter = LiveBytes()
    # which positions are real (a mask's nonzero, a boolean index): all of them, the costliest answer
    with torch.fx.experimental._config.patch(meta_nonzero_assume_all_nonzero=True), counter:
        policy = meta_policy(shape, dtype, cfg)
        lora = [p for n, p in policy.named_parameters() if "lora_" in n]
        row("weights: 4-bit base, 16-bit embeddings", _bytes(_model_tensors(policy, lora=False)),
            weights_gb(sizes, True, nbytes))
        _trainer_parts(policy, lora, counter, cfg, s, memory, dtype, row)
        _decoder_parts(policy, counter, dtype, s, memory, plan.dense_gb, row)
    return rows


def _trainer_parts(policy, lora: list, counter: LiveBytes, cfg, s, memory, dtype, row) -> None:
    """AdamW's step on the adapter, the trunk's forward and backward, the lm head's log-probs, one micro-batch's
    update and one SFT step, each beside the plan's figure (`row(name, counted bytes, planned GB)`)."""
    from minigrpo.logprobs import HeadLogprobs, positions
    from minigrpo.plan import ADAPTER_BYTES
    from minigrpo.sft import sft_step
    from minigrpo.loss import Objective
    from minigrpo.update import micro_batches, policy_update

    sizes, inner = Sizes.of(policy.get_base_model().config), policy.get_base_model()
    micro, T, Lp, V, top_p = s.micro_batch_size, s.new_tokens, s.prompt_tokens, sizes.vocab, s.top_p
    optimizer = torch.optim.AdamW(lora, lr=cfg.learning_rate, weight_decay=cfg.weight_decay, foreach=True)

    def adam_step():
        for p in lora:
            p.grad = torch.empty_like(p)
        optimizer.step()  # a card's default: foreach, all moments' temporaries at once
    row("LoRA: weights, gradients, AdamW moments", _bytes(lora) + peak_above(counter, adam_step),
        sizes.lora_per_rank * cfg.lora_rank * ADAPTER_BYTES / GiB)
    optimizer.zero_grad(set_to_none=True)

    ids = torch.zeros(micro, Lp + T, dtype=torch.long, device="meta")
    attention = torch.ones_like(ids)

    def trunk():
        hidden = inner.model(input_ids=ids, attention_mask=attention, position_ids=positions(attention))
        hidden.last_hidden_state[:, -T:].float().sum().backward()
    policy.train()
    trunk_bytes = peak_above(counter, trunk)
    optimizer.zero_grad(set_to_none=True)
    row(f"activations: {micro} rows x {Lp + T} tokens, forward and backward", trunk_bytes - _bytes(lora),
        memory.activations_gb(micro, Lp, T))

    head = inner.get_output_embeddings()
    chunk = min(micro * T, s.chunk)

    def head_pass():
        h = torch.empty(chunk, sizes.hidden, dtype=dtype, device="meta", requires_grad=True)
        t = torch.zeros(chunk, dtype=torch.long, device="meta")
        logp, _, _ = HeadLogprobs.apply(h, head.weight, head.bias, t, cfg.temperature, True, False, top_p)
        logp.sum().backward()
    row(f"log-prob buffers: {chunk} tokens x {V} at top-p {top_p:g}", peak_above(counter, head_pass),
        memory.logprob_gb(micro, T))

    # one micro-batch of full-length completions (the rollout's fields the update reads), as a rollout makes
    prompts = -(-micro // cfg.num_generations)  # completion i continues prompt i // G
    batch = SimpleNamespace(prompt_ids=[[0] * Lp] * prompts, completion_ids=[[0] * T] * micro,
                            truncated=[False] * micro, model_masks=None,
                            sampler_logps=[[0.0] * T] * micro if top_p < 1 else None)
    mb = micro_batches(cfg, batch, 0, "meta")
    scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)  # a T4 scales float16 losses
    planned = memory.training_gb(micro, Lp, T) + sizes.lora_per_rank * cfg.lora_rank * 4 / GiB  # and gradients
    objective = Objective.of(cfg)
    update = lambda: policy_update(cfg, objective, policy, mb, torch.ones(micro), optimizer, scaler)  # noqa: E731
    row(f"one micro-batch's update ({micro} rows: log-probs, loss, backward, AdamW)", peak_above(counter, update),
        planned)
    sft = lambda: sft_step(cfg, policy, [([0] * Lp, [0] * T)] * micro, 0, optimizer, scaler)  # noqa: E731
    row(f"one SFT step ({micro} examples of {Lp} + {T} tokens)", peak_above(counter, sft), planned)


def _decoder_parts(policy, counter: LiveBytes, dtype, s, memory, dense_gb: float, row) -> None:
    """The fixed-shape decoder's dense copy, then its state and prefill for a training rollout and for the
    held-out evaluation, each beside the plan's figure (`row(name, counted bytes, planned GB)`)."""
    from minigrpo.generate.static import StaticDecoder
    from minigrpo.memory import rows_bucket

    Lp, T = s.prompt_tokens, s.new_tokens
    policy.eval()
    before = counter.now()
    decoder = StaticDecoder(policy, dtype)
    row("the decoder's dense copy of the 4-bit base", counter.now() - before, dense_gb)
    for what, prompts, G in (("a training rollout", s.prompts, s.rows // s.prompts),
                             ("the held-out evaluation", s.eval_prompts, s.eval_samples)):
        if not prompts:
            continue
        held = decoder._take_state(prompts * G, Lp + T, 0, [0])
        row(f"decode state for {what}: {rows_bucket(prompts * G)} rows x {held['T']} tokens",
            decoder.held_bytes(), memory.generation_gb(rows_bucket(prompts * G), Lp, T))
        fill = lambda: decoder.prefill(held["state"], [[0] * Lp] * prompts, G, 0)  # noqa: E731
        row(f"prefill for {what}: {prompts} prompts of {Lp} tokens", peak_above(counter, fill),
            memory.prefill_gb(prompts * G, Lp, prompts))
        decoder.held = None


def print_rehearsal(model: str, gpu: str, top_p: float, console) -> None:
    """`plan --rehearse`: each part of a step as counted on meta tensors beside the plan's figure for it."""
    from rich.table import Table

    from minigrpo.presets import PRESETS
    from minigrpo.hardware import CARDS

    if model not in PRESETS or gpu not in CARDS:
        raise ValueError(f"--rehearse needs a preset (one of {', '.join(PRESETS)}) and a named --gpu "
                         f"(one of {', '.join(CARDS)})")
    table = Table(title=f"{model} on a {gpu}, top-p {top_p:g}: a step's code run at these sizes (minigrpo/rehearse.py)")
    for column in ("part", "counted GB", "planned GB", "planned / counted"):
        table.add_column(column, justify="left" if column == "part" else "right")
    for part in rehearse(model, CARDS[gpu], top_p):
        table.add_row(part.name, f"{part.tracked_gb:.3f}", f"{part.planned_gb:.3f}", f"{part.ratio:.2f}")
    console.print(table)
    console.print("not counted: the CUDA context and cuBLAS workspaces (the plan adds 0.5 GB), the allocator's "
                  "fragmentation (a plan fills at most 92% of the card), a CUDA graph's pool, vLLM's engine")

