"""A run's memory from the model's shape alone: where its parameters go (`Sizes`) and what one step adds to the
loaded model (`StepMemory`). `plan.py` adds these up for a card; `rehearse.py` holds each term to the code."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

GiB = 2**30
# a chunk's lm-head bytes per vocabulary entry: float32 logits and one float32 temporary at a time (logsumexp's,
# then the entropy's p log p, made in one buffer); at top-p < 1 the kept mass of rows bisected over the whole
# vocabulary (every row, at worst) holds two floats and a mask beside the logits (minigrpo/rehearse.py counts both)
LOGPROB_BYTES = {True: 8, False: 13}  # keyed by top-p == 1

# The shapes the decoders build, stated here (below them) so that what the plan counts is what they make.
LENGTH_STEP = 64  # cache lengths are rounded up to this, so rollouts of similar prompts share one graph
PREFILL_TOKENS = 4096  # prompt tokens per prefill forward: its cache and activations are what the plan counts
NUCLEUS_TOP_K = 256  # tokens ranked per row for the kept mass; a row whose nucleus reaches past them is bisected


def rows_bucket(rows: int) -> int:
    """The rows a decode state is built with: the next power of two, so turns with a few episodes fewer share one.

    >>> [rows_bucket(r) for r in (1, 3, 8, 9, 64)]
    [1, 4, 8, 16, 64]
    """
    return 1 << (rows - 1).bit_length()


def prefill_prompts(longest: int) -> int:
    """How many prompts one prefill forward takes: `PREFILL_TOKENS` tokens' worth at the batch's longest prompt.

    >>> prefill_prompts(100), prefill_prompts(512), prefill_prompts(9000)
    (40, 8, 1)
    """
    return max(1, PREFILL_TOKENS // longest)


@dataclass(frozen=True)
class Sizes:
    """Parameter counts of a decoder-only model, by where they go."""
    linear: int  # the block projections: 4-bit in the trainer, LoRA-wrapped
    embedding: int  # token embeddings, plus the lm head when it is not tied
    lora_per_rank: int  # LoRA parameters per unit of rank over all seven projections of all layers
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_dim: int  # key (or value) width per token per layer
    q_dim: int  # query width per token per layer (heads x head_dim)
    head_dim: int

    @classmethod
    def of(cls, c) -> "Sizes":
        H, I, L, V = c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or H // heads
        kv = (getattr(c, "num_key_value_heads", None) or heads) * head_dim
        q = heads * head_dim
        per_layer = H * q + 2 * H * kv + q * H + 3 * H * I  # q, k, v, o; gate, up, down
        lora = (H + q) + 2 * (H + kv) + (q + H) + 3 * (H + I)  # r x (in + out) for each projection
        tied = getattr(c, "tie_word_embeddings", True)
        return cls(L * per_layer, V * H * (1 if tied else 2), L * lora, L, H, I, V, kv, q, head_dim)

    @property
    def total(self) -> int:
        return self.linear + self.embedding

    def pinned_gb(self, nbytes: int) -> float:
        """Host RAM a sleeping vLLM engine pins for its weights. It copies each block of its memory pool to a pinned
        host buffer of its own, and torch's pinned allocator rounds every buffer up to a power of two (and keeps it
        cached after wake-up): the pool's blocks are the caching allocator's segments, a tensor of 10 MB or more
        rounded to 2 MB, smaller ones sharing 20 MB segments, the smallest (1 MB and less) 2 MB ones.

        >>> from minigrpo.presets import preset_shape
        >>> [round(Sizes.of(preset_shape(m)).pinned_gb(2), 2) for m in ("qwen-1.5b", "qwen-3b")]  # 16-bit: 2.9, 5.8
        [3.6, 8.78]
        """
        H, I, q, kv, V = self.hidden, self.intermediate, self.q_dim, self.kv_dim, self.vocab
        tensors = [V * H] * (self.embedding // (V * H)) + [(q + 2 * kv) * H, H * q, 2 * I * H, H * I] * self.layers
        MB = 2**20
        large = sum(_pow2(-(-n * nbytes // (2 * MB)) * 2 * MB) for n in tensors if n * nbytes >= 10 * MB)
        medium = sum(n * nbytes for n in tensors if MB < n * nbytes < 10 * MB)
        small = sum(n * nbytes for n in tensors if n * nbytes <= MB) + (self.layers * 4 * H + H) * nbytes  # norms
        return (large + -(-medium // (20 * MB)) * _pow2(20 * MB) + -(-small // (2 * MB)) * 2 * MB) / GiB

    @property
    def fused_lora_per_rank(self) -> int:
        """The fixed-shape decoder's copy of the adapter, per unit of rank: each fused projection's A stacked and
        its B block-diagonal (q|k|v, o, gate|up, down)."""
        H, I, q, kv = self.hidden, self.intermediate, self.q_dim, self.kv_dim
        A = 3 * H + q + 2 * H + I
        B = 3 * (q + 2 * kv) + H + 2 * 2 * I + H
        return self.layers * (A + B)


@dataclass
class StepMemory:
    """What one training step adds to the memory of the loaded model, from the model's shape alone.

    Generation with transformers keeps keys and values for every row at once (vLLM's cache is part of the
    engine's fixed share instead), in the fixed-shape decoder's one state (generate/static.py), which stays
    through training: the largest rollout's while it decodes (the held-out evaluation's `eval_rows` may be the
    largest), and through training the one the last rollout left (an evaluation's, where the training rollout
    fitted in it). Training runs one micro-batch at a time: with gradient checkpointing it keeps each layer's
    input, recomputes one layer at a time in backward (its activations and their gradients), and sends `chunk`
    completion tokens at a time through the lm head (`LOGPROB_BYTES` per vocabulary entry). The step's peak is the
    larger of decoding (state and prefill) and the state kept plus training; the rest (weights, optimizer, runtime
    buffers) is measured, by `calibrate`. Every term is held to what the code allocates at the presets' sizes by
    `minigrpo/rehearse.py` (tests/test_rehearsal.py).

    >>> from transformers import LlamaConfig
    >>> memory = StepMemory(LlamaConfig(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
    ...                                 num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
    ...                     dtype_bytes=2, micro_batch_size=8, chunk=512)
    >>> round(memory.step_gb(rows=32, prompt_tokens=128, new_tokens=512), 3)  # 32 rows' state + training
    0.977
    >>> round(memory.step_gb(rows=32, prompt_tokens=128, new_tokens=512, eval_rows=256), 3)  # 256 rows decoding
    2.832
    """

    shape: object  # a transformers config
    dtype_bytes: int
    micro_batch_size: int
    chunk: int  # completion tokens per lm-head pass (TrainConfig.logprob_chunk_size)
    hf_generation: bool = True
    checkpointing: bool = True
    top_p: float = 1.0

    def generation_gb(self, rows: int, prompt_tokens: int, new_tokens: int) -> float:
        """The fixed-shape decoder's state: keys and values for every row, its length rounded up as the decoder
        rounds it, and per row and position a float32 mask entry per kv head, the token and its log-prob."""
        s = Sizes.of(self.shape)
        T = -(-(prompt_tokens + new_tokens) // LENGTH_STEP) * LENGTH_STEP
        heads = getattr(self.shape, "num_key_value_heads", None) or self.shape.num_attention_heads
        return (rows * T * (2 * s.layers * s.kv_dim * self.dtype_bytes + 4 * heads + 12)
                + (T + 1) * 2 * s.head_dim * 4) / GiB  # the rotary table

    def kept_gb(self, rows: int, prompt_tokens: int, new_tokens: int) -> float:
        """What a micro-batch keeps through its forward: each layer's input under checkpointing, else all."""
        s = Sizes.of(self.shape)
        kept = s.hidden if self.checkpointing else 8 * s.hidden + 4 * s.intermediate
        tokens = min(rows, self.micro_batch_size) * (prompt_tokens + new_tokens)
        return tokens * s.layers * kept * self.dtype_bytes / GiB

    def activations_gb(self, rows: int, prompt_tokens: int, new_tokens: int) -> float:
        """One micro-batch's activations through forward and backward, the lm head aside: what is kept, and two
        layers' worth being recomputed and differentiated."""
        s = Sizes.of(self.shape)
        # per token: norms, q/k/v/o, grouped keys' and values' copies, residuals; gate, up, activation
        layer = 10 * s.hidden + 4 * s.intermediate
        micro = min(rows, self.micro_batch_size)
        return self.kept_gb(rows, prompt_tokens, new_tokens) + \
            micro * (prompt_tokens + new_tokens) * 2 * layer * self.dtype_bytes / GiB

    def logprob_gb(self, rows: int, new_tokens: int) -> float:
        """The lm head's buffers for one chunk of completion tokens (logprobs.HeadLogprobs)."""
        s = Sizes.of(self.shape)
        chunk = min(min(rows, self.micro_batch_size) * new_tokens, self.chunk)
        per_row = 2 * s.hidden * self.dtype_bytes  # a row's hidden state and its gradient
        if self.top_p < 1.0:
            per_row += 12 * NUCLEUS_TOP_K  # the top k's probabilities and their int64 indices
        return chunk * (s.vocab * LOGPROB_BYTES[self.top_p >= 1.0] + per_row) / GiB

    def prefill_gb(self, rows: int, prompt_tokens: int, prompts: int | None = None) -> float:
        """What a rollout's prefill adds to its decode state (`StaticDecoder.prefill`): one group of prompts' cache
        and one layer's working set without gradients (PEFT's adapter path in float32), and the rows' logits."""
        s = Sizes.of(self.shape)
        b = self.dtype_bytes
        tokens = min(prefill_prompts(prompt_tokens), prompts or rows) * prompt_tokens
        per_token = 2 * s.layers * s.kv_dim * b + s.intermediate * (8 + 2 * b) + s.hidden * (4 + 6 * b)
        return (tokens * per_token + rows * s.vocab * b) / GiB

    def training_gb(self, rows: int, prompt_tokens: int, new_tokens: int) -> float:
        """A micro-batch's peak: its trunk's backward, or the lm head's chunk beside what the trunk kept."""
        return max(self.activations_gb(rows, prompt_tokens, new_tokens),
                   self.kept_gb(rows, prompt_tokens, new_tokens) + self.logprob_gb(rows, new_tokens))

    def step_gb(self, rows: int, prompt_tokens: int, new_tokens: int, eval_rows: int = 0, prompts: int | None = None,
                eval_prompts: int | None = None) -> float:
        training = self.training_gb(rows, prompt_tokens, new_tokens)
        if not self.hf_generation:
            return training
        trained, evaluated = rows_bucket(rows), rows_bucket(eval_rows) if eval_rows else 0
        kept = evaluated if rows <= evaluated <= 2 * trained else trained  # the state a training rollout leaves
        decoding = max(self.generation_gb(trained, prompt_tokens, new_tokens)
                       + self.prefill_gb(trained, prompt_tokens, prompts),
                       self.generation_gb(evaluated, prompt_tokens, new_tokens)
                       + self.prefill_gb(evaluated, prompt_tokens, eval_prompts) if evaluated else 0.0)
        return max(decoding, self.generation_gb(kept, prompt_tokens, new_tokens) + training)

    def calibrate(self, rows: list[dict]) -> float:
        """The measured part: the median over the measured settings of peak memory minus what their step adds."""
        return statistics.median(r["peak GB"] - self.step_gb(r["G"] * r["prompts"], r["prompt tokens"],
                                                              r["completion tokens"]) for r in rows)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
