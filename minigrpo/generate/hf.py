"""Generation with `transformers`: the training model itself samples, by the fixed-shape loop or token by token."""

from __future__ import annotations

import contextlib

import torch

from minigrpo.generate import Rollout, Sampling
from minigrpo.generate.sampling import sample
from minigrpo.generate.static import StaticDecoder, Unsupported
from minigrpo.model import cache_keyword


class HFGenerator:
    """Sampling with the training model itself: no second copy of the model, always in sync.

    Two decode loops over the same weights. Where the model's layout allows (Llama, Qwen2, Mistral), the
    fixed-shape one (`static.py`): a handful of host calls per new token, one CUDA graph replay on a
    card, the adapter refreshed in place by `sync`. Otherwise, and with `decoder="eager"`, our loop over the
    trainer's own modules (`decode`). Both prefill each distinct prompt once and copy its cache to its G rows,
    and sample with exactly the settings the trainer's log-probs assume (temperature, top-p, nothing else): the
    model's own `generation_config` (a repetition penalty, top-k, banned words) plays no part. With
    `report_logprobs`, and always where the fixed-shape decoder rounds the weights, it returns its own log-probs of
    what it sampled, as the vLLM engine does (the loss corrects for their gap to the trainer's; tests and
    `minigrpo doctor` compare them)."""

    def __init__(self, model, tokenizer, report_logprobs: bool = False, decoder: str = "auto", say=print):
        self.model = model
        self.pad_id = tokenizer.pad_token_id
        self.eos_ids = _eos_ids(model, tokenizer)
        self.decoder, self.say, self.static = decoder, say, None
        if decoder != "eager":
            try:
                self.static = StaticDecoder.build(model)
            except Unsupported as why:
                if decoder == "static":
                    raise ValueError(f"--decoder static cannot decode this model: {why}; use --decoder auto") from None
                say(f"decoding token by token through the model's own modules: {why}")
        # a fixed-shape decoder whose weights stream at half precision (a cpu's float32 ones) always reports: its
        # log-probs are not the trainer's, so the loss corrects for the gap and the run logs it
        self.report_logprobs = report_logprobs or (self.static is not None and self.static.rounds)

    def sync(self, model) -> None:
        if self.static is not None:  # the adapter's new weights into the fixed-shape decoder's tensors, in place
            self.static.refresh()

    def release(self) -> None:
        if self.static is not None:  # its reordered weights (a cpu's), made again at the next rollout
            self.static.release()

    def close(self) -> None:
        self.static = None  # its cache, graphs and (for a 4-bit base) dense weights go back

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling: Sampling, base: bool = False) -> Rollout:
        was_training = self.model.training
        self.model.eval()
        try:
            with self.model.disable_adapter() if base else contextlib.nullcontext():
                tokens, logps = self._decode(prompt_ids, sampling, base)
        finally:
            self.model.train(was_training)
        ended = [bool(row) and row[-1] in self.eos_ids for row in tokens]
        return Rollout(tokens, [not e for e in ended], logps if self.report_logprobs else None)

    def _decode(self, prompt_ids, sampling: Sampling, base: bool):
        if self.static is not None:
            try:
                return self.static.decode(prompt_ids, sampling, self.eos_ids, self.pad_id, adapters=not base)
            except Exception as error:  # a graph that cannot be captured, an op this torch lacks: say so, go on
                if self.decoder == "static" or isinstance(error, torch.OutOfMemoryError):
                    raise  # out of memory: the eager loop would only decode slower into the same wall
                self.static = None
                self.say(f"fixed-shape decoding failed ({type(error).__name__}: {str(error)[:160]}); decoding "
                         f"token by token through the model's own modules from now on")
        return decode(self.model, prompt_ids, sampling, self.eos_ids, self.pad_id)


def decode(model, prompt_ids: list[list[int]], sampling: Sampling, eos_ids: list[int],
           pad_id: int) -> tuple[list[list[int]], list[list[float]]]:
    """G sampled continuations of each prompt, grouped (rows [0, G) continue prompt 0), each ending at its
    first eos token (kept: the model learns to stop) or after `max_new_tokens`; and the log-prob of each
    sampled token under the distribution it was drawn from (after temperature and top-p)."""
    from transformers import DynamicCache

    dev = model.device
    cache_arg = cache_keyword(model)
    width = max(len(ids) for ids in prompt_ids)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompt_ids], device=dev)  # [P, Lp]
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids], device=dev)  # [P, Lp]
    cache = DynamicCache()
    out = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
                **{cache_arg: cache}, use_cache=True, logits_to_keep=1)
    cache.batch_repeat_interleave(sampling.n)  # one prefill per prompt, copied to its G rows
    logits = out.logits[:, -1].repeat_interleave(sampling.n, dim=0)  # [B, V]
    mask = mask.repeat_interleave(sampling.n, dim=0)  # [B, Lp]
    B = logits.shape[0]
    live = torch.arange(B, device=dev)  # [b]: which of the B rows are still generating
    tokens: list[list[int]] = [[] for _ in range(B)]
    logps: list[list[float]] = [[] for _ in range(B)]
    eos = torch.tensor(eos_ids, dtype=torch.long, device=dev)
    for t in range(sampling.max_new_tokens):
        token, logp = sample(logits.float(), sampling)  # [b], [b]
        for row, tok, lp in zip(live.tolist(), token.tolist(), logp.tolist()):
            tokens[row].append(tok)
            logps[row].append(lp)
        going = ~torch.isin(token, eos)  # [b]
        if t == sampling.max_new_tokens - 1 or not going.any():
            break
        if not going.all():  # finished rows leave the batch and its cache
            keep = going.nonzero().squeeze(-1)
            live, token, mask = live[keep], token[keep], mask[keep]
            cache.batch_select_indices(keep)
        mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)  # [b, L + 1]
        out = model(input_ids=token[:, None], attention_mask=mask, position_ids=mask.sum(-1, keepdim=True) - 1,
                    **{cache_arg: cache}, use_cache=True)
        logits = out.logits[:, -1]  # [b, V]
    return tokens, logps


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = list(ids) if isinstance(ids, (list, tuple)) else [ids] if ids is not None else []
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids
