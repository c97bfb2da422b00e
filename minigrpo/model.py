"""The policy: a 4-bit (or 16-bit) base with LoRA adapters (its per-token log-probs: `minigrpo.logprobs`).

The reference model is the same object with its adapters disabled (`with model.disable_adapter():`), or
with `--reference-adapter`, holding that adapter's weights for the reference pass (`minigrpo.adapters`), so
a run holds one copy of the base, never two.
"""

from __future__ import annotations

import inspect
import random
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from minigrpo.config import TrainConfig
from minigrpo.console import quiet_libraries


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def default_dtype(requested: str = "auto") -> torch.dtype:
    """The compute dtype for this machine (`hardware.compute_dtype` says why)."""
    from minigrpo.hardware import compute_dtype, this_gpu

    return compute_dtype(this_gpu(), requested)[0]


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def byte_tokenizer():
    """A tokenizer that needs no download: one token per byte, ChatML's two markers, a chat template. For
    random-weight models (`minigrpo doctor`, `bench model` where no real tokenizer is at hand)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab.update({"<|im_start|>": len(vocab), "<|im_end|>": len(vocab) + 1})
    raw = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tokenizer


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_tokenizer(weights: str):
    from transformers import AutoTokenizer

    quiet_libraries()
    tokenizer = AutoTokenizer.from_pretrained(weights)
    tokenizer.padding_side = "left"  # completions start at the same column for the whole batch
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_base(weights: str, load_in_4bit: bool, dtype: torch.dtype, longest: int = 1024, micro_batch: int = 8,
              bf16_base: bool = False):
    """The base model on this machine's device: nf4 linear layers computing in `dtype`, or all in `dtype`
    (with `bf16_base`, its block projections in bfloat16: `Bf16Linear`)."""
    quiet_libraries()
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    quant = None
    if load_in_4bit:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                   bnb_4bit_compute_dtype=dtype, bnb_4bit_use_double_quant=True)
    heads = getattr(AutoConfig.from_pretrained(weights), "num_attention_heads", 32)
    model = AutoModelForCausalLM.from_pretrained(
        weights, dtype=dtype, quantization_config=quant, device_map={"": device()},
        attn_implementation=attention(device().type == "cuda", micro_batch, heads, longest))
    if bf16_base and dtype == torch.float32:
        for name, module in model.named_modules():
            if type(module) is torch.nn.Linear and name.rpartition(".")[2] in LORA_TARGETS:
                module.to(torch.bfloat16)
                module.__class__ = Bf16Linear  # a subclass that adds no state: the layer's weights stay as they are
        # the rest (embeddings, norms) still view the checkpoint file, mapped into memory, and so hold all of its
        # pages resident, the float32 projections' too: copied into memory of their own, the file is let go
        # (0.4 GB less for the 135M model)
        for tensor in model.parameters():
            if tensor.dtype == torch.float32:
                tensor.data = tensor.data.clone()
    return model


class Bf16Linear(torch.nn.Linear):
    """A frozen projection kept and multiplied in bfloat16 inside a float32 model, as a 4-bit layer computes
    in its compute dtype: the input is cast down and the output back up, so the LoRA addition beside it, the
    residual stream, the norms and the logits stay float32. On a cpu with bf16 instructions that streams half
    the bytes per weight and multiplies about twice as fast, without rounding the adapter's small additions
    away as an all-bfloat16 model does (docs/speed.md)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def attention(gpu: bool, micro_batch: int, heads: int, longest: int) -> str:
    """Plain matmul attention on a cpu where one micro-batch's attention scores are small; sdpa elsewhere.
    On a cpu, torch's fused attention backward ran slower than the plain one at a quick start's lengths (a
    bfloat16 training pass of the tiny model took 4.1-4.4 s against 5.0 s), while the plain one holds every
    score: rows x heads x length^2.

    >>> attention(False, 8, 9, 560), attention(False, 8, 9, 4096), attention(True, 8, 9, 560)
    ('eager', 'sdpa', 'sdpa')
    """
    scores_bytes = micro_batch * heads * longest**2 * 4
    return "eager" if not gpu and scores_bytes <= 256 * 2**20 else "sdpa"


def load_policy(cfg: TrainConfig, weights: str, dtype: torch.dtype | None = None):
    """The base model (nf4 or 16-bit) with fresh LoRA adapters on every block projection."""
    quiet_libraries()  # before peft, which imports bitsandbytes
    base = load_base(weights, cfg.load_in_4bit, dtype or default_dtype(cfg.dtype),
                     cfg.max_prompt_tokens + cfg.completion_tokens, cfg.micro_batch_size, cfg.bf16_base)
    return wrap_policy(base, cfg)


def wrap_policy(base, cfg: TrainConfig):
    """A loaded base made the policy: checkpointing as configured, fresh LoRA adapters on every block
    projection (or the --init-adapter's), and the --reference-adapter held beside them."""
    from peft import LoraConfig, get_peft_model

    base.config.use_cache = False  # training forward passes never reuse a kv cache
    for module in base.modules():
        # on cpus with avx512-bf16, bitsandbytes repacks a 4-bit weight for inference the first time it
        # runs in eval mode without grad (our generation), and from then on its kernel has no backward:
        # gradients stop at every base layer, silently. keep the trainable layout.
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
    if cfg.gradient_checkpointing:
        # the current name where transformers has it (its old name warns that it goes away in v6)
        enable = getattr(base, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        base.enable_input_require_grads()
    lora = LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                      target_modules=[t for t in LORA_TARGETS if _has_module(base, t)],
                      task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # PEFT reads the old property name, which newer transformers deprecate: nothing for a user to act on
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        policy = get_peft_model(base, lora)
    from minigrpo.adapters import start_from

    return start_from(policy, cfg.init_adapter, cfg.reference_adapter)


def _has_module(model, suffix: str) -> bool:
    return any(name.endswith("." + suffix) for name, _ in model.named_modules())


def lora_parameters(model) -> list[torch.nn.Parameter]:
    return [p for n, p in model.named_parameters() if p.requires_grad and "lora_" in n]


def checkpointing(model) -> bool:
    """Whether a model recomputes its layers in the backward pass: `is_activation_checkpointing` where transformers
    has it (from 5.2x on, where the old `is_gradient_checkpointing` warns, and is to go in 6), the old name before."""
    current = "is_activation_checkpointing" if hasattr(type(model), "is_activation_checkpointing") else None
    return bool(getattr(model, current or "is_gradient_checkpointing", False))


def cache_keyword(model) -> str:
    """The name a model's forward takes its key/value cache by: `cache` from transformers 5.24 on (where the old
    `past_key_values` warns, and is to go in 5.40), `past_key_values` before."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model  # PEFT's forward takes **kwargs
    return "cache" if "cache" in inspect.signature(inner.forward).parameters else "past_key_values"
