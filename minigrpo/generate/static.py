"""Decoding with fixed shapes: a handful of host calls per new token, one replayed CUDA graph on a card.

`generate.hf.decode` runs the trainer's own modules token by token: ~4,000 torch ops and ~200 bitsandbytes calls
per new token from Python, 100 ms of host time at a 1.5B model's depth whatever the card, which the card spends
waiting. This decoder reads the same weights through a flat, fixed-shape step instead:

- each block's projections fused into four matmuls (q|k|v, o, gate|up, down), the frozen base weights kept in
  the compute precision (a 4-bit base dequantized once, since it never changes; a 16-bit base re-pointed at the
  fused tensor, so no second copy), and the LoRA adapters beside them, unmerged, in two small matmuls per
  fused projection (`A` stacked, `B` block-diagonal with the scaling folded in);
- a static key/value cache sized for the rollout (rows rounded up to a power of two, its length up to a multiple
  of `LENGTH_STEP`, or to an episode's whole length); a finished row keeps decoding masked on a card (no shape
  changes), its tokens past eos dropped at the end, and leaves the batch on a cpu (`_drop_finished`). The decoder
  holds one such state at a time: a rollout that fits in it (no more rows or length, and at least half of its
  rows used) reuses it, graphs and all, so an episode's turns share one, and so do rollouts of other kinds (the
  reference's or a judge's without the adapter, an evaluation's temperature), each kind's graph captured once
  into the state's one memory pool; any other rollout frees it first, then builds its own. Its memory is one
  state's (`held_bytes`), which `plan.py` counts through training;
- rotary embeddings as one small batched matmul per layer, from a rotation built once per token;
- sampling (`sampling.sample`, the trainer's temperature and top-p) inside the step, its tokens and log-probs
  written to device buffers; the host reads "has every row ended?" once per `CHECK_EVERY` tokens.

On CUDA the step is captured once per batch shape as a CUDA graph and replayed per token (one launch); the
adapter's tensors are refreshed in place after each optimizer step, so a graph never goes stale and nothing
recompiles. Where the model is not one of the supported layouts (Llama, Qwen2, Mistral) `StaticDecoder.build`
says why and the caller decodes as before.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from minigrpo.generate.fused import Projection, dense_copy_gb, has_mixed_bmm, lasts, linear, pack
from minigrpo.memory import LENGTH_STEP, prefill_prompts, rows_bucket
from minigrpo.model import cache_keyword
from minigrpo.checkpoint import streams_kept
from minigrpo.generate.sampling import Sampling, sample

CHECK_EVERY = 8  # new tokens between host reads of "has every row ended?" (the only sync while decoding)
LAYOUTS = ("llama", "qwen2", "mistral")  # pre-norm blocks, rotary attention, SwiGLU: the step below
GROUPS = {"qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")), "o": ("self_attn", ("o_proj",)),
          "gate_up": ("mlp", ("gate_proj", "up_proj")), "down": ("mlp", ("down_proj",))}


class Unsupported(Exception):
    """This model cannot use the static decoder; the message says why in a few words."""


class StaticDecoder:
    """The policy's weights read by a fixed-shape decode step (see the module's docstring). Build it once per
    run with `build`; call `refresh` after each optimizer step; `decode` is `generate.hf.decode`'s drop-in."""

    def __init__(self, model, stream: torch.dtype):
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = inner.config
        self.model, self.inner = model, inner
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.stream = stream
        self.scale = getattr(inner.model.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        self.blocks = []
        for layer in inner.model.layers:
            block = {"norm1": layer.input_layernorm, "norm2": layer.post_attention_layernorm}
            for name, (part, names) in GROUPS.items():
                block[name] = Projection([getattr(getattr(layer, part), n) for n in names], stream)
            self.blocks.append(block)
        self.mixed_bmm = has_mixed_bmm(inner.device)
        self.rounds = any(b[n].rounds for b in self.blocks for n in GROUPS)  # a cpu's float32 weights: `fused.pack`
        self.head_packed, self.packed_rows = None, 0  # the lm head repacked as the projections are (`fused.pack`)
        self.held: dict | None = None  # the one state kept: its buffers and, on a card, a graph per kind
        self.states_built = 0  # how many times a batch shape's buffers were made

    @classmethod
    def build(cls, model) -> "StaticDecoder":
        """The decoder for `model`, or `Unsupported` saying why it cannot read this model."""
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        config = getattr(inner, "config", None)
        if config is None or not hasattr(getattr(inner, "model", None), "layers"):
            raise Unsupported("not a transformers decoder model")
        if config.model_type not in LAYOUTS:
            raise Unsupported(f"a {config.model_type} model (fixed-shape decoding knows {', '.join(LAYOUTS)})")
        windowed = getattr(config, "use_sliding_window", config.model_type == "mistral")  # qwen2 has a flag for it
        if getattr(config, "hidden_act", "silu") != "silu" or (windowed and getattr(config, "sliding_window", None)):
            raise Unsupported("a block unlike Llama's (activation or sliding-window attention)")
        if any(getattr(m, "use_dora", {}).get("default") for m in inner.modules()):
            raise Unsupported("DoRA adapters (their magnitude vector is not a low-rank addition)")
        if getattr(config, "rope_parameters", None) and config.rope_parameters.get("rope_type") in ("dynamic",):
            raise Unsupported("dynamic rope scaling (positions' frequencies change with the length)")
        stream = inner.model.embed_tokens.weight.dtype
        dense_gb = dense_copy_gb(inner, stream)
        if dense_gb and inner.device.type == "cuda" and dense_gb > torch.cuda.mem_get_info(inner.device)[0] / 2**30 / 2:
            raise Unsupported(f"its 4-bit base as dense weights needs {dense_gb:.1f} GB, more than half of what is "
                              f"free on the card")
        return cls(model, stream)

    def refresh(self) -> None:
        """The adapters' new weights, copied in place into the fused tensors every captured step reads."""
        with torch.no_grad():
            for block in self.blocks:
                for name in GROUPS:
                    block[name].refresh()

    # one new token for every row: the whole per-token work, with no python branch on tensor values
    def _forward(self, s: dict, adapters: bool) -> torch.Tensor:
        b, H, hd, group = s["token"].shape[0], self.heads, self.head_dim, self.heads // self.kv_heads
        cos_sin = s["rotary"].index_select(0, s["position"])  # [b, 2, hd]
        half = hd // 2
        rotation = (torch.diag_embed(cos_sin[:, 0]) + torch.diag_embed(cos_sin[:, 1, half:], offset=half)
                    - torch.diag_embed(cos_sin[:, 1, :half], offset=-half))  # [b, hd, hd]: x @ R = rotary(x)
        x = F.embedding(s["token"], self.inner.model.embed_tokens.weight)  # [b, hidden]
        for i, block in enumerate(self.blocks):
            h = _rms_norm(x, block["norm1"])  # [b, hidden]
            qkv = block["qkv"](h, adapters)  # [b, (H + 2 Hkv) hd]
            qk = torch.bmm(qkv[:, :(H + self.kv_heads) * hd].view(b, -1, hd), rotation)  # [b, H + Hkv, hd]
            # each key/value head serves `group` query heads: the queries of one kv head form its rows
            q = qk[:, :H].view(b, self.kv_heads, group, hd)  # [b, Hkv, g, hd]
            s["keys"][i].index_copy_(2, s["slot"], qk[:, H:].unsqueeze(2))  # [b, Hkv, T, hd]
            s["values"][i].index_copy_(2, s["slot"], qkv[:, (H + self.kv_heads) * hd:].view(b, -1, 1, hd))
            # plain attention for one query: a fused kernel costs more to start than it saves here
            scores = self._scores(s["mask"], q.reshape(-1, group, hd), s["keys_t"][i])  # [b Hkv, g, T] float32
            weights = scores.softmax(-1).to(self.stream)  # [b Hkv, g, T]
            attended = torch.bmm(weights, s["values_v"][i])  # [b Hkv, g, hd]
            x = x + block["o"](attended.view(b, H * hd), adapters)  # [b, hidden]
            gate_up = block["gate_up"](_rms_norm(x, block["norm2"]), adapters)  # [b, 2 I]
            gate, up = gate_up.chunk(2, dim=-1)  # [b, I] each
            x = x + block["down"](F.silu(gate) * up, adapters)  # [b, hidden]
        return self._head(_rms_norm(x, self.inner.model.norm))  # [b, V]

    def _head(self, x: torch.Tensor) -> torch.Tensor:  # [b, hidden] -> [b, V]: its own method, for `bench profile`
        return linear(x, self.inner.get_output_embeddings().weight, None, self.head_packed)

    def _scores(self, mask: torch.Tensor, q: torch.Tensor, keys_t: torch.Tensor) -> torch.Tensor:
        """q k^T / sqrt(hd) + mask, in float32 as SDPA keeps them (a bf16 score near 20 is off by up to 0.06 before
        the softmax, a 6% error in its weight). q: [n, g, hd], keys_t: [n, hd, T], mask: [n, 1, T] -> [n, g, T]."""
        if q.dtype == torch.float32:
            return torch.baddbmm(mask, q, keys_t, alpha=self.scale)
        if self.mixed_bmm:  # a card's bmm accumulates in float32 and writes that out
            return torch.bmm(q, keys_t, out_dtype=torch.float32).mul_(self.scale).add_(mask)
        return torch.baddbmm(mask, q.float(), keys_t.float(), alpha=self.scale)  # a cpu has no such bmm

    def _step(self, s: dict, sampling: Sampling, adapters: bool) -> None:
        """Feed the last sampled token, sample the next, record it: every tensor here has a fixed shape."""
        s["mask"].index_fill_(-1, s["slot"], 0.0)  # the slot this token's key goes into is now visible
        logits = self._forward(s, adapters)
        token, logp = sample(logits.float(), sampling)  # [b], [b]
        s["tokens"].index_copy_(1, s["t"], token[:, None])
        s["logps"].index_copy_(1, s["t"], logp[:, None])
        s["token"].copy_(token)
        s["done"].logical_or_(torch.isin(token, s["eos"]))
        s["position"].add_(1)
        s["slot"].add_(1)
        s["t"].add_(1)

    def _state(self, rows: int, T: int, eos_ids: list[int]) -> dict:
        dev = self.inner.device
        self.states_built += 1
        kv = (rows, self.kv_heads, T, self.head_dim)
        z = lambda *shape, dtype=torch.long: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        keys = [torch.zeros(kv, dtype=self.stream, device=dev) for _ in self.blocks]
        values = [torch.zeros(kv, dtype=self.stream, device=dev) for _ in self.blocks]
        return {"keys": keys, "values": values,  # and the views attention reads them through, made once
                "keys_t": [k.view(-1, T, self.head_dim).transpose(1, 2) for k in keys],  # [b Hkv, hd, T]
                "values_v": [v.view(-1, T, self.head_dim) for v in values],  # [b Hkv, T, hd]
                "mask": torch.full((rows * self.kv_heads, 1, T), -math.inf, device=dev),  # float32, as the scores
                "rotary": self._rotary(T + 1), "token": z(rows), "position": z(rows), "slot": z(1), "t": z(1),
                "tokens": z(rows, T), "logps": z(rows, T, dtype=torch.float32), "done": z(rows, dtype=torch.bool),
                "eos": torch.tensor(eos_ids, dtype=torch.long, device=dev)}

    def held_bytes(self) -> int:
        """Device bytes of the state held between rollouts (on a card its graphs' pool adds a step's activations)."""
        if self.held is None:
            return 0
        tensors = [t for v in self.held["state"].values() for t in (v if isinstance(v, list) else [v])]
        storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}  # views once
        return sum(storages.values())

    def _take_state(self, rows: int, need: int, reserve: int, eos_ids: list[int]) -> dict:
        """The held state where this rollout fits in it, else a new one, the old freed first. `need` is the cache
        length this call fills, `reserve` what its later turns may reach. Rollouts of other kinds (a judge's or the
        reference's, without the adapter; an evaluation's temperature) share it: their graphs are kept beside each
        other in one memory pool, so alternating kinds neither rebuilds the state nor grows the card's memory."""
        held = self.held
        if (held is not None and held["eos"] == tuple(eos_ids) and rows <= held["rows"] <= 2 * rows_bucket(rows)
                and need <= held["T"] <= 2 * max(reserve, need) + LENGTH_STEP):
            return held
        self.held = held = None  # its cache and graphs go back before the next are made
        T = -(-max(need, reserve) // LENGTH_STEP) * LENGTH_STEP
        R = rows_bucket(rows)
        self.held = {"eos": tuple(eos_ids), "rows": R, "T": T, "state": self._state(R, T, eos_ids), "graphs": {},
                     "pool": torch.cuda.graph_pool_handle() if self.inner.device.type == "cuda" else None}
        return self.held

    def _pack(self, rows: int) -> None:
        """On a cpu, the frozen weights repacked for `rows` rows (a no-op on a card): a float32 weight's pack serves
        every row count and is kept (2.4 s for the 135M model), a bf16 one's is made per row count (0.1-0.25 s)."""
        if rows != self.packed_rows:
            self.release()  # the old order freed before the new is made
            for p in (block[name] for block in self.blocks for name in GROUPS):
                p.packed = p.packed if lasts(p.packed) else pack(p.weight, rows)
            head = self.inner.get_output_embeddings().weight
            self.head_packed, self.packed_rows = self.head_packed if lasts(self.head_packed) else pack(head, rows), rows

    def release(self) -> None:
        """Drop the reordered bf16 weights until the next rollout reorders them: the update's activations need the
        room more than a rollout needs the 0.1-0.25 s. A half-precision pack stays (half a copy, counted by `plan`)."""
        for p in (block[name] for block in self.blocks for name in GROUPS):
            p.packed = p.packed if lasts(p.packed) else None
        self.head_packed, self.packed_rows = self.head_packed if lasts(self.head_packed) else None, 0

    def _rotary(self, length: int) -> torch.Tensor:
        """cos and sin of every position up to `length`, from the model's own rotary module (its scaling
        included): [length, 2, hd]."""
        probe = torch.zeros(1, dtype=self.stream, device=self.inner.device)
        cos, sin = self.inner.model.rotary_emb(probe, torch.arange(length, device=self.inner.device)[None])
        return torch.stack([cos[0], sin[0]], dim=1)

    @torch.no_grad()
    def decode(self, prompt_ids: list[list[int]], sampling: Sampling, eos_ids: list[int], pad_id: int,
               adapters: bool = True) -> tuple[list[list[int]], list[list[float]]]:
        """As `generate.hf.decode`: G sampled continuations of each prompt, grouped, each up to its first eos
        (kept) or `max_new_tokens`, and each sampled token's log-prob under the distribution it came from."""
        dev, G, n = self.inner.device, sampling.n, sampling.max_new_tokens
        P, longest = len(prompt_ids), max(len(p) for p in prompt_ids)
        held = self._take_state(P * G, longest + n, sampling.context_tokens or 0, eos_ids)
        self._pack(held["rows"])
        s = held["state"]
        token, logp = sample(self.prefill(s, prompt_ids, G, pad_id).float(), sampling)  # [R], [R]
        s["tokens"][:, 0], s["logps"][:, 0], s["token"][:] = token, logp, token
        s["done"].logical_or_(torch.isin(token, s["eos"]))
        kind = (sampling.temperature, sampling.top_p, adapters)  # what a captured step bakes in
        if dev.type == "cuda" and kind not in held["graphs"]:
            held["graphs"][kind] = self._capture(s, sampling, adapters, held["pool"])
        graph = held["graphs"].get(kind)
        order = torch.arange(len(s["done"]), device=dev)  # which row of the batch each state row holds
        live, made = s, 1
        while made < n:
            if made % CHECK_EVERY == 1:  # the one host read, every few tokens
                ended = int(live["done"].sum())
                if ended == len(live["done"]):
                    break
                if ended and graph is None:  # no captured shape to keep: finished rows stop costing a step
                    live = self._drop_finished(s, len(live["done"]), order)
            if graph is not None:
                graph.replay()
            else:
                self._step(live, sampling, adapters)
            made += 1
        back = order.argsort()[:P * G]  # each row of the batch, in its order
        tokens, logps = s["tokens"][back, :made].tolist(), s["logps"][back, :made].tolist()
        eos = set(eos_ids)
        for row in range(len(tokens)):  # each row ends at its first eos; what a finished row sampled after is dropped
            end = next((j + 1 for j, tok in enumerate(tokens[row]) if tok in eos), made)
            tokens[row], logps[row] = tokens[row][:end], logps[row][:end]
        return tokens, logps

    def _drop_finished(self, s: dict, b: int, order: torch.Tensor) -> dict:
        """The unfinished rows among the state's first `b` moved to its front, in place (their cache, mask and place;
        every row's tokens and log-probs kept, the finished ones' behind them, `order` permuted alike), and views of
        them: what the next decode steps read and write."""
        done = s["done"][:b]
        keep = (~done).nonzero().squeeze(-1)  # [k]
        moved = torch.cat([keep, done.nonzero().squeeze(-1), torch.arange(b, len(order), device=order.device)])
        for row_wise in (s["tokens"], s["logps"], s["done"], order):
            row_wise.copy_(row_wise[moved])
        k, kh = len(keep), len(keep) * self.kv_heads
        heads = (keep[:, None] * self.kv_heads + torch.arange(self.kv_heads, device=keep.device)).reshape(-1)  # [kh]
        s["token"][:k], s["position"][:k], s["mask"][:kh] = s["token"][keep], s["position"][keep], s["mask"][heads]
        for cache in (*s["keys"], *s["values"]):
            cache[:k] = cache[keep]  # [k, Hkv, T, hd]
        rows = {name: s[name][:k] for name in ("token", "position", "tokens", "logps", "done")}
        views = {name: [t[:kh] for t in s[name]] for name in ("keys_t", "values_v")}  # [kh, ...]
        return {**s, **rows, **views, "keys": [t[:k] for t in s["keys"]], "values": [t[:k] for t in s["values"]],
                "mask": s["mask"][:kh]}

    @torch.no_grad()
    def prefill(self, s: dict, prompt_ids: list[list[int]], G: int, pad_id: int) -> torch.Tensor:
        """The prompts through the trainer's own modules, a group of prompts at a time, each group's keys and
        values copied into its G rows of the state before the next group runs: beside the state, the card holds
        one group's cache and activations (`prefill_prompts` of them), never all P prompts' at once. Rows beyond
        P x G (the state's spare rows) repeat prompt 0 and start done. Returns each row's next-token logits [R, V];
        the state is then ready for the first sampled token."""
        from transformers import DynamicCache

        dev, P, R = self.inner.device, len(prompt_ids), s["tokens"].shape[0]
        longest = max(len(p) for p in prompt_ids)
        mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompt_ids], device=dev)  # [P, Lp]
        last = None  # [R, V]
        group = prefill_prompts(longest)
        for first in range(0, P, group):
            ids = torch.tensor([[pad_id] * (longest - len(p)) + p for p in prompt_ids[first:first + group]],
                               device=dev)  # [g, Lp]
            part = mask[first:first + group]  # [g, Lp]
            cache = DynamicCache()
            logits = self.model(input_ids=ids, attention_mask=part, position_ids=(part.cumsum(-1) - 1).clamp(min=0),
                                **{cache_keyword(self.model): cache}, use_cache=True, logits_to_keep=1).logits[:, -1]
            g = len(ids)
            if last is None:
                last = logits.new_empty(R, logits.shape[-1])  # [R, V]
            rows = slice(first * G, (first + g) * G)
            last[rows].view(g, G, -1).copy_(logits[:, None])  # [g, G, V]: each prompt's to its G rows
            for i, layer in enumerate(cache.layers):  # each prompt's cache broadcast to its G rows, no copy made
                for kept, new in ((s["keys"][i], layer.keys), (s["values"][i], layer.values)):
                    kept[rows, :, :longest].view(g, G, *new.shape[1:]).copy_(new[:, None])
            del cache, logits
        spare = slice(P * G, R)
        last[spare] = last[0]
        for k, v in zip(s["keys"], s["values"]):
            k[spare, :, :longest], v[spare, :, :longest] = k[0, :, :longest], v[0, :, :longest]
        rows_mask = torch.cat([mask.repeat_interleave(G, dim=0), mask[:1].expand(R - P * G, -1)])  # [R, Lp]
        s["mask"].fill_(-math.inf)
        s["mask"][:, 0, :longest].masked_fill_(rows_mask.repeat_interleave(self.kv_heads, dim=0).bool(), 0.0)
        s["position"].copy_(rows_mask.sum(-1))
        s["slot"].fill_(longest)
        s["t"].fill_(1)
        s["done"].zero_()
        s["done"][P * G:] = True
        return last

    def _capture(self, s: dict, sampling: Sampling, adapters: bool, pool):
        """One decode step recorded as a CUDA graph; its state is restored, so the capture decodes nothing."""
        saved = {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor) and k not in ("rotary", "eos")}
        with streams_kept(None):  # the warm-up draws, so a run's samples don't depend on when it captured
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up on a side stream, as capture requires
                    self._step(s, sampling, adapters)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):  # one pool for a state's graphs: they never run at once
                self._step(s, sampling, adapters)
        for k, v in saved.items():
            s[k].copy_(v)
        return graph


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """The model's RMSNorm: float32 statistics, as transformers computes them (one op in a float32 model)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    return F.rms_norm(x.float(), (x.shape[-1],), None, norm.variance_epsilon).to(x.dtype) * norm.weight
