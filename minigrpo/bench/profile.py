"""`minigrpo bench profile`: where one training step's time goes on this machine, phase by phase, beside the
least time each phase could take here.

The step is the real one (`train.train_step`, a run's settings: the quick start's unless told), taken after a
warm-up step, under torch's profiler. Its phases are found by labels put around the functions that run them
(the prefill, each decode step, the sampler, the update's forward passes, backward, the optimizer, the sync);
inside the decode steps each top-level op is counted by kind, and what no op accounts for is the host's own time
(Python and dispatch).

A phase's floor is the larger of its arithmetic at this machine's measured peak (one large matmul in the dtype
the phase multiplies in) and the bytes it must move at the measured memory bandwidth (one read of 1 GiB),
counted from the model's shapes and the step's real tokens: padding, masked rows and repeated weight reads are
work a floor does not pay for, so the distance to it is what a faster step could win.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import torch

from minigrpo.config import TrainConfig
from minigrpo.generate.fused import Projection

PROJECTIONS = {"aten::linear", "aten::addmm", "aten::mm", "aten::matmul", "mkldnn::_linear_pointwise",
               "quantized::linear_dynamic_fp16"}  # every kernel `fused.linear` may call
ATTENTION = {"aten::bmm", "aten::baddbmm", "aten::softmax", "aten::_softmax", "aten::index_copy_",
             "aten::index_select", "aten::diag_embed"}
CASTS = {"aten::to", "aten::_to_copy", "aten::copy_"}


def peak_gflops(dtype: torch.dtype, n: int = 2048, repeats: int = 5) -> float:
    """GFLOP/s of one n x n x n matmul in `dtype`, the median of `repeats`: the arithmetic a phase can hope for."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    return 2 * n**3 / _median_s(lambda: a @ b, repeats) / 1e9


def bandwidth_gbs(gib: float = 1.0, repeats: int = 5) -> float:
    """GB/s of one read of `gib` GiB (a sum over it), the median of `repeats`: the weights' streaming rate."""
    x = torch.ones(int(gib * 2**30) // 4)
    return x.numel() * 4 / _median_s(x.sum, repeats) / 1e9


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class Work:
    """What a phase must do at least: multiply-adds, counted as 2 FLOPs each, per dtype, and bytes moved."""
    flops: Counter = field(default_factory=Counter)  # dtype -> FLOPs
    bytes: float = 0.0

    def floor_ms(self, peaks: dict, bandwidth: float) -> tuple[float, str]:
        """The least time at these rates (GFLOP/s by dtype, GB/s), and what bounds it.

        >>> Work(Counter({torch.float32: 2e9}), 1e8).floor_ms({torch.float32: 100.0}, 20.0)
        (20.0, 'arithmetic')
        >>> Work(Counter({torch.float32: 2e9}), 1e9).floor_ms({torch.float32: 100.0}, 20.0)
        (50.0, 'memory')
        """
        compute = sum(f / (peaks[d] * 1e9) for d, f in self.flops.items()) * 1e3
        memory = self.bytes / (bandwidth * 1e9) * 1e3
        return max(compute, memory), "arithmetic" if compute >= memory else "memory"


@dataclass
class Shapes:
    """The facts of the model a floor is counted from. params: the block projections' weights by dtype."""
    params: dict  # dtype -> count
    weight_bytes: float  # what one pass over every block projection reads, as the decoder holds them
    head: int  # lm head weights (vocab x hidden)
    head_dtype: torch.dtype
    lora: int  # adapter weights
    layers: int
    attention_width: int  # heads x head dim (the queries')
    kv_width: int  # key/value heads x head dim

    @classmethod
    def of(cls, model, decoder=None) -> "Shapes":
        inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        params: Counter = Counter()
        for name, module in inner.model.layers.named_modules():  # the base's projections, not PEFT's around them
            if "lora_" in name or hasattr(module, "base_layer") or not hasattr(module, "in_features"):
                continue
            weight = module.weight
            params[torch.float32 if getattr(weight, "quant_state", None) is not None else weight.dtype] += \
                module.in_features * module.out_features
        if decoder is not None:  # the fused tensors a decode step reads
            weight_bytes = sum(t.nbytes for block in decoder.blocks for p in block.values() if isinstance(p, Projection)
                               for t in (p.weight, p.A, p.B) if t is not None)
        else:
            weight_bytes = sum(n * torch.finfo(d).bits / 8 for d, n in params.items())
        head = inner.get_output_embeddings().weight
        config = inner.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        lora = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
        return cls(dict(params), weight_bytes, head.numel(), head.dtype, lora, config.num_hidden_layers,
                   config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim)


class Recorder:
    """The step's phases, labelled for the profiler, and the work each was handed, counted as it is called."""

    def __init__(self, shapes: Shapes):
        self.shapes = shapes
        self.work: dict[str, Work] = defaultdict(Work)
        self.decode_steps = self.decode_rows = 0

    @contextlib.contextmanager
    def labelled(self, owner, name: str, label: str, count=None):
        """`owner.name` run inside a profiler range named `label`; `count(*args, **kwargs)` adds its work."""
        original, own = getattr(owner, name), name in vars(owner)  # a module's function, or an object's method

        def wrapped(*args, **kwargs):
            if count is not None:
                count(*args, **kwargs)
            with torch.profiler.record_function(label):
                return original(*args, **kwargs)

        setattr(owner, name, wrapped)
        try:
            yield
        finally:
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)

    def _projections(self, work: Work, tokens: float, head_rows: float, lora: bool = True) -> None:
        s = self.shapes
        for dtype, n in s.params.items():
            work.flops[dtype] += 2 * tokens * n
        work.flops[s.head_dtype] += 2 * head_rows * s.head
        if lora:
            work.flops[torch.float32] += 2 * tokens * s.lora

    def prefill(self, _state, prompt_ids, G, pad_id) -> None:
        work = self.work["prefill"]
        self._projections(work, sum(map(len, prompt_ids)), len(prompt_ids))
        work.bytes = self.weights_once()

    def weights_once(self) -> float:
        """Bytes of one read of every weight: what a phase that could take its tokens in one batch must move."""
        return self.shapes.weight_bytes + self.shapes.head * self.shapes.head_dtype.itemsize

    def decode_step(self, state, sampling, adapters) -> None:
        rows, s = state["token"].shape[0], self.shapes
        keys = int(state["position"].sum()) + rows  # every row attends to its cache and this token
        work = self.work["decode"]
        self._projections(work, rows, rows, adapters)
        work.flops[s.head_dtype] += 4 * keys * s.attention_width * s.layers
        kv_bytes = 2 * keys * s.kv_width * s.layers * state["keys"][0].element_size()
        work.bytes += self.weights_once() + kv_bytes  # each new token needs the last one: a read per step
        self.decode_steps += 1
        self.decode_rows = rows

    def forward(self, label: str):
        def count(model, ids, attention, n, *args, mask=None, lanes=None, **kwargs):
            s = self.shapes
            completion = mask.sum().item() if mask is not None else n * len(ids)
            lengths = attention.sum(-1).double()
            tokens = attention.sum().item()
            if lanes is not None:  # the prompt once, then each row's completion (logprobs.completion_hidden)
                tokens -= (len(ids) - 1) * (ids.shape[1] - n)
            for phase in (label, "backward") if torch.is_grad_enabled() else (label,):
                work = self.work[phase]
                self._projections(work, tokens, completion)
                work.flops[s.head_dtype] += 2 * (lengths**2).sum().item() * s.attention_width * s.layers
                work.bytes = self.weights_once()
        return count

    def optimizer(self, *args, **kwargs) -> None:
        # clipping reads the gradients; AdamW reads weight, gradient and both moments and writes three back
        self.work["optimizer"].bytes += self.shapes.lora * 4 * 8

    def sync(self, *args, **kwargs) -> None:
        self.work["sync"].bytes += self.shapes.lora * 4 * 2


def profile_step(settings: dict | None = None, warmup: int = 1) -> dict:
    """One step of a run with `settings` (TrainConfig fields; the quick start's where none), after `warmup`
    steps, profiled: {"phases": [(name, ms, floor ms, bound)], "facts": {...}}."""
    from minigrpo import loss as L
    from minigrpo import settle, update
    from minigrpo.bench.decode import cpu_model
    from minigrpo.console import quiet_libraries
    from minigrpo.generate import static
    from minigrpo.model import seed_everything
    from minigrpo.startup import load_for_training, prepare
    from minigrpo.state import RunState
    from minigrpo.tasks import get_task
    from minigrpo.train import train_step

    quiet_libraries()
    cfg = TrainConfig(**(settings or {}))
    seed_everything(cfg.seed)
    task = settle.run_task(get_task(cfg.task, cfg.rewards, extra_tools=cfg.tools, environment=cfg.environment), cfg)
    prepared = prepare(cfg, lambda *_: None, task)
    cfg = prepared.cfg
    loaded = load_for_training(prepared, lambda *_: None)
    state = RunState.start(cfg, loaded.model, loaded.tokenizer, loaded.generator, loaded.dtype,
                           task.make_data("train", cfg.seed))
    objective = L.Objective.of(cfg)
    for step in range(1, warmup + 1):
        train_step(cfg, objective, step, state, task)
    decoder = getattr(state.generator, "static", None)
    recorder = Recorder(Shapes.of(state.model, decoder))
    labels = [(update, "token_stats", "forward", recorder.forward("forward")),
              (update, "token_logprobs", "forward without gradients", recorder.forward("forward without gradients")),
              (torch.autograd, "backward", "backward", None),
              (update, "apply_update", "optimizer", recorder.optimizer),
              (state.generator, "sync", "sync", recorder.sync)]
    if decoder is not None:
        labels += [(decoder, "prefill", "prefill", recorder.prefill), (decoder, "_step", "decode", recorder.decode_step),
                   (decoder, "_head", "lm head", None), (static, "sample", "sampling", None)]
    with contextlib.ExitStack() as stack:
        for owner, name, label, count in labels:
            stack.enter_context(recorder.labelled(owner, name, label, count))
        stack.enter_context(every_row_back_propagated())
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as prof:
            started = time.perf_counter()
            metrics, _ = train_step(cfg, objective, warmup + 1, state, task)
            wall_ms = (time.perf_counter() - started) * 1e3
    state.generator.close()
    peaks = {dtype: peak_gflops(dtype) for dtype in {torch.float32, *recorder.shapes.params, recorder.shapes.head_dtype}}
    bandwidth = bandwidth_gbs()
    phases = _phases(prof.events(), recorder, wall_ms, peaks, bandwidth)
    return {"phases": phases, "facts": {
        "cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "peak_gflops": {str(d).removeprefix("torch."): round(p, 1) for d, p in peaks.items()},
        "bandwidth_gbs": round(bandwidth, 1), "decode_steps": recorder.decode_steps, "rows": recorder.decode_rows,
        "weights_mb": round(recorder.shapes.weight_bytes / 1e6), "completion_tokens": metrics.get("tokens_generated"),
        "step_s": round(wall_ms / 1e3, 2)}}


@contextlib.contextmanager
def every_row_back_propagated():
    """The profiled step back-propagates every micro-batch, as if each group's rewards differed (a run skips the
    backward of a group that scored alike, `loss.carries_gradient`), so its backward is a whole step's."""
    from minigrpo.update import L  # the loss module the update calls

    original, L.carries_gradient = L.carries_gradient, lambda *args, **kwargs: True
    try:
        yield
    finally:
        L.carries_gradient = original


def _phases(events, recorder: Recorder, wall_ms: float, peaks: dict, bandwidth: float) -> list[tuple]:
    """(phase, ms, floor ms or None, bound) rows: each labelled phase, the decode steps split by op kind, and the
    rest of the step."""
    ranges = defaultdict(float)
    kinds = defaultdict(float)
    vocab = recorder.shapes.head
    for event in events:
        if event.name not in ("prefill", "decode", "sampling", "forward", "forward without gradients", "backward",
                              "optimizer", "sync") or _inside_label(event):
            continue
        ranges[event.name] += event.cpu_time_total / 1e3
        if event.name == "decode":
            host = event.cpu_time_total
            for child in event.cpu_children:
                host -= child.cpu_time_total
                kinds[_kind(child, vocab)] += child.cpu_time_total / 1e3
            kinds["host (Python, dispatch)"] += host / 1e3
    rows = []
    for name in ("prefill", "decode"):
        if name in ranges:
            rows.append((name, ranges[name], *recorder.work[name].floor_ms(peaks, bandwidth)))
    for kind in ("projections", "lm head", "attention", "sampling", "casts", "other ops", "host (Python, dispatch)"):
        if kinds.get(kind):
            rows.append((f"  decode: {kind}", kinds[kind], None, ""))
    for name in ("forward without gradients", "forward", "backward", "optimizer", "sync"):
        if name in ranges:
            rows.append((name, ranges[name], *recorder.work[name].floor_ms(peaks, bandwidth)))
    labelled = sum(ms for name, ms in ranges.items() if name != "sampling")
    rows.append(("rest (rewards, batching, logging)", wall_ms - labelled, None, ""))
    floors = [r[2] for r in rows if r[2] is not None]
    rows.append(("step", wall_ms, sum(floors), ""))
    return rows


def _inside_label(event) -> bool:
    """Is this range nested in another labelled range (a sampler call inside a decode step is counted there)?"""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name in ("decode", "prefill", "forward", "forward without gradients", "backward"):
            return True
        parent = parent.cpu_parent
    return False


def _kind(event, vocab: int) -> str:
    if event.name in ("sampling", "lm head"):  # ranges of their own (a packed head's op shows no weight shape)
        return event.name
    if event.name in PROJECTIONS:
        shapes = getattr(event, "input_shapes", None) or []
        return "lm head" if any(len(s) == 2 and s[0] * s[1] == vocab for s in shapes[1:2]) else "projections"
    if event.name in ATTENTION:
        return "attention"
    if event.name in CASTS:
        return "casts"
    return "other ops"


def table(result: dict) -> str:
    """The profile as a markdown table, its machine and rates above it."""
    f = result["facts"]
    lines = [f"{f['cpu']} ({f['capability']}), {f['threads']} threads; peak "
             + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in f["peak_gflops"].items())
             + f"; memory {f['bandwidth_gbs']:.1f} GB/s; weights read per decode step {f['weights_mb']} MB; "
             f"{f['decode_steps']} decode steps of {f['rows']} rows; step {f['step_s']} s", "",
             "| phase | ms | floor ms | x floor | floor bound by |", "|---|---|---|---|---|"]
    for name, ms, floor, bound in result["phases"]:
        ratio = f"{ms / floor:.1f}" if floor else ""
        lines.append(f"| {name} | {ms:.0f} | {'' if floor is None else f'{floor:.0f}'} | {ratio} | {bound} |")
    return "\n".join(lines)
