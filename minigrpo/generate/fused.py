"""The fixed-shape decoder's weights: each block's projections fused, the frozen base dense in the compute
precision and the LoRA adapters beside it, refreshed in place after each optimizer step (static.py reads them).

On a cpu the frozen weights are also repacked for the cpu's matmul (`pack`), a second copy of them. A float32
weight is packed at half precision for fbgemm's fp16 matmul, which converts it back to float32 as it streams it and
multiplies in float32: a decode step is bound by how fast two cores read weights, and half the bytes made a rollout
at the `bench trl` setting 1.2x as fast capped at AVX2. The sampler's products then round the weights to fp16's 11
bits (bf16 projections round to 8), a gap to the trainer's log-probs the loss corrects for by importance sampling
and the run logs (`sampler_logprob_gap/mean`). That pack serves every row count and takes 2.4 s for the 135M model
on 2 cores, so it is made once and kept. A bf16 weight is reordered for oneDNN's matmul instead (on an AMD EPYC,
Zen 4, `F.linear` ran a 135M model's block projections at a third of the cpu's peak at a decode step's rows and the
reordered copy at twice that), for each rollout's row count, and given back during the update (docs/speed.md,
"What each change bought")."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minigrpo.hardware import cap_fbgemm_like_torch


def base_weight(linear: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A frozen projection's weight as a dense matrix [out, in]: a 4-bit one dequantized to `dtype`, a dense one
    as stored (a bf16 projection in a float32 model stays bf16: it multiplies in bf16, as in training)."""
    weight = linear.weight
    if getattr(weight, "quant_state", None) is not None:
        import bitsandbytes.functional as bnbf

        return bnbf.dequantize_4bit(weight.data, weight.quant_state).to(dtype)
    return weight.data


class Projection:
    """Some projections of one block that read the same input, fused: y = (x W^T + b) + (x A^T) B^T, where
    W holds the base's weights stacked, A the adapters' down-projections stacked and B their up-projections
    on a block diagonal, each scaled by its adapter's alpha / r."""

    def __init__(self, modules: list, stream: torch.dtype):
        bases = [getattr(m, "base_layer", m) for m in modules]
        weights = [base_weight(b, stream) for b in bases]
        self.weight = torch.cat(weights)  # [out, in]
        if not any(getattr(b.weight, "quant_state", None) is not None for b in bases):
            start = 0  # the base's own layers read views of the fused tensor: one copy of the weights, not two
            for b, w in zip(bases, weights):
                b.weight.data = self.weight[start:start + len(w)]
                start += len(w)
        biases = [b.bias.data if b.bias is not None else None for b in bases]
        self.bias = None if all(x is None for x in biases) else torch.cat(
            [x if x is not None else w.new_zeros(len(w)) for x, w in zip(biases, weights)]).to(self.weight.dtype)
        self.modules = modules
        self.packed: torch.Tensor | None = None  # the base's weights reordered for the cpu's matmul (`pack`)
        self.rounds = at_half_precision(self.weight)  # then its products are not quite the trainer's
        ranks = [m.lora_A["default"].weight.shape[0] for m in modules] if _has_lora(modules) else []
        self.A = self.B = None
        if ranks:
            self.A = self.weight.new_zeros(sum(ranks), self.weight.shape[1], dtype=stream)  # [R, in]
            self.B = self.weight.new_zeros(sum(ranks), self.weight.shape[0], dtype=stream)  # [R, out]: B^T
            self.refresh()

    def refresh(self) -> None:
        """Copy the adapters' current weights into A and B, in place (a captured graph reads these tensors)."""
        if self.A is None:
            return
        r0 = o0 = 0
        for m in self.modules:
            a, b = m.lora_A["default"].weight, m.lora_B["default"].weight  # [r, in], [out, r]
            r, out = a.shape[0], b.shape[0]
            self.A[r0:r0 + r].copy_(a)
            self.B[r0:r0 + r, o0:o0 + out].copy_(b.T * m.scaling["default"])
            r0, o0 = r0 + r, o0 + out

    def __call__(self, x: torch.Tensor, adapters: bool) -> torch.Tensor:
        y = linear(x.to(self.weight.dtype), self.weight, self.bias, self.packed).to(x.dtype)  # [b, out]: a bf16
        # projection in a float32 model multiplies in bf16 and adds its adapter in float32
        if adapters and self.A is not None:
            y = torch.addmm(y, F.linear(x, self.A), self.B)  # [b, out] + [b, R] @ [R, out]
        return y


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b, through `packed` (W as `pack` repacked it) where there is one. x: [b, in] -> [b, out]."""
    if packed is None:
        return F.linear(x, weight, bias)
    if not isinstance(packed, torch.Tensor):  # fbgemm's fp16 weight, packed without the bias
        y = torch.ops.quantized.linear_dynamic_fp16(x, packed)  # [b, out]
        return y if bias is None else y.add_(bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def at_half_precision(weight: torch.Tensor) -> bool:
    """Whether `pack` streams `weight` at half precision (fbgemm's fp16 matmul): a float32 weight on a cpu whose
    torch has fbgemm, within fp16's range. The sampler's log-probs are then not quite the trainer's."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and "fbgemm" in torch.backends.quantized.supported_engines
            and bool(weight.abs().max() < torch.finfo(torch.float16).max))


def pack(weight: torch.Tensor, rows: int):
    """`weight` [out, in] repacked for a cpu's matmul at about `rows` rows of input: a float32 one at half precision
    for fbgemm, another reordered for oneDNN; None where there is no such kernel: a card, a build without them, or
    bf16 on a cpu without AVX-512 (oneDNN refuses it there). The result is opaque: only `linear` reads it."""
    if weight.device.type != "cpu":
        return None
    if at_half_precision(weight):
        cap_fbgemm_like_torch()  # before fbgemm's first matmul reads its cap
        return torch.ops.quantized.linear_prepack_fp16(weight, None)
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, rows)
        torch.ops.mkldnn._linear_pointwise(weight.new_zeros(1, weight.shape[1]), packed, None, "none", [], "")
    except (AttributeError, RuntimeError, NotImplementedError):  # an op this build lacks, or a dtype refused here
        return None
    return packed


def lasts(packed) -> bool:
    """Whether a `pack` serves every row count (fbgemm's does; oneDNN's order is for one), so a decoder keeps it."""
    return packed is not None and not isinstance(packed, torch.Tensor)


def _has_lora(modules) -> bool:
    return all(hasattr(m, "lora_A") and "default" in m.lora_A for m in modules)


def dense_copy_gb(inner, stream: torch.dtype) -> float:
    """GB the dequantized copy of a 4-bit base's block projections takes (0 for a 16-bit base: read in place)."""
    quantized = [m for m in inner.model.layers.modules()  # the 4-bit layers themselves, not PEFT's wrappers of them
                 if not hasattr(m, "base_layer") and getattr(getattr(m, "weight", None), "quant_state", None)]
    return sum(m.out_features * m.in_features for m in quantized) * torch.finfo(stream).bits / 8 / 2**30


def has_mixed_bmm(device: torch.device) -> bool:
    """Does this device multiply 16-bit matrices into a float32 result (`bmm(..., out_dtype=)`: CUDA builds)?"""
    if device.type != "cuda":
        return False
    try:
        a = torch.zeros(1, 1, 8, dtype=torch.float16, device=device)
        return torch.bmm(a, a.transpose(1, 2), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False
