"""A trained policy as one GGUF file, the format llama.cpp, Ollama and LM Studio read, with an Ollama Modelfile beside
it (`minigrpo export RUN --gguf q8_0 --out FOLDER`).

The `gguf` package writes the file: its tensor-name maps, value types and quantizers (f16, bf16 and, in numpy,
q8_0 and q4_0; its K-quants only read). What it lacks is written here: the merge, streamed as `export.py` streams
it (each weight dequantized from the 4-bit base and merged with its LoRA update in float32, one at a time, written
and dropped), the llama layout of the query and key rows that llama.cpp's rotary embedding expects, Llama 3's
rotary frequency factors, and the tokenizer as llama.cpp reads a byte-level BPE one (its tokens, their kinds, its
merges, its pre-tokenizer's name, its special ids and its chat template). Architectures: llama (SmolLM2, Llama
3.2) and qwen2 (Qwen2.5); any other is refused before anything is written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

# transformers' model_type -> the architecture name llama.cpp gives it
ARCHITECTURES = {"llama": "LLAMA", "qwen2": "QWEN2"}
# llama.cpp's name for a tokenizer's pre-tokenizer (its regex split), by (model_type, vocabulary size): the
# presets' three families. llama.cpp tells them apart by hashing a tokenization; a tokenizer not listed is refused.
PRE_TOKENIZERS = {("llama", 49152): "smollm", ("llama", 128256): "llama-bpe", ("qwen2", 151936): "qwen2",
                  ("qwen2", 152064): "qwen2"}


@dataclass
class Planned:
    """What the file will hold, known before any weight is computed."""
    names: list[tuple[str, str]]  # (transformers name, GGUF name), in writing order
    shapes: dict[str, tuple[int, ...]]  # by transformers name
    kinds: dict[str, object]  # by transformers name: the GGMLQuantizationType each is written as
    nbytes: int  # the tensors' bytes


def refuse_unsupported(config, tokenizer) -> str:
    """The llama.cpp pre-tokenizer name for this model; a ValueError, in one line, for a model the writer does not
    know (before anything is written)."""
    if config.model_type not in ARCHITECTURES:
        raise ValueError(f"--gguf writes llama and qwen2 models (SmolLM2, Llama 3.2, Qwen2.5), not "
                         f"{config.model_type}: export a merged folder (no --gguf) and convert it with llama.cpp's "
                         f"convert_hf_to_gguf.py")
    pre = PRE_TOKENIZERS.get((config.model_type, config.vocab_size))
    if pre is None or not getattr(tokenizer, "is_fast", False):
        raise ValueError(f"--gguf knows the tokenizers of SmolLM2, Llama 3 and Qwen2.5, not this one "
                         f"({config.model_type}, {config.vocab_size} tokens): export a merged folder (no --gguf) "
                         f"and convert it with llama.cpp's convert_hf_to_gguf.py")
    return pre


def plan(inner, kind: str) -> Planned:
    """The tensors the file will hold: their names, shapes and types, and the file's size."""
    import gguf

    from minigrpo.export import _shard_groups

    config = inner.config
    names_map = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, ARCHITECTURES[config.model_type]),
                                         config.num_hidden_layers)
    wanted = getattr(gguf.GGMLQuantizationType, kind.upper())  # config.GgufType: the GGML type's name, lower case
    names, shapes, kinds, total = [], {}, {}, 0
    for name in [n for group in _shard_groups(inner).values() for n in group]:
        target = names_map.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ValueError(f"--gguf has no GGUF name for the tensor {name}")
        shape = _shape(inner, name)
        block = gguf.GGML_QUANT_SIZES[wanted][0]
        # vectors stay float32 (as llama.cpp's own converter keeps norms), and a row that does not split into the
        # type's blocks stays float16
        kinds[name] = (gguf.GGMLQuantizationType.F32 if len(shape) == 1 else wanted if shape[-1] % block == 0
                       else gguf.GGMLQuantizationType.F16)
        names.append((name, target))
        shapes[name] = shape
        total += _nbytes(shape, kinds[name])
    factors = rope_factors(config)
    if factors is not None:
        names.append(("rope_freqs", gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"))
        shapes["rope_freqs"], kinds["rope_freqs"] = tuple(factors.shape), gguf.GGMLQuantizationType.F32
        total += factors.numel() * 4
    return Planned(names, shapes, kinds, total)


def write_gguf(model, tokenizer, path: Path, kind: str, name: str, say=print) -> Path:
    """Write `model` (a PEFT policy: its adapter merged into the base) and its tokenizer as one GGUF file."""
    import gguf

    from minigrpo.export import _export_tensor

    inner = model.get_base_model()
    config = inner.config
    pre = refuse_unsupported(config, tokenizer)
    planned = plan(inner, kind)
    say(f"writing {path} ({kind}, {planned.nbytes / 2**30:.2f} GB)")
    architecture = getattr(gguf.MODEL_ARCH, ARCHITECTURES[config.model_type])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[architecture])
    _write_model_values(writer, config, kind, name)
    _write_tokenizer(writer, tokenizer, config.vocab_size, pre)
    for source, target in planned.names:
        shape, qtype = planned.shapes[source], planned.kinds[source]
        dtype = np.uint8 if qtype not in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16) else \
            (np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16)
        byte_shape = gguf.quant_shape_to_byte_shape(shape, qtype) if dtype == np.uint8 else shape
        writer.add_tensor_info(target, byte_shape, np.dtype(dtype), _nbytes(shape, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for source, _ in planned.names:  # one tensor at a time: merged, laid out, converted, written, dropped
        weight = rope_factors(config) if source == "rope_freqs" else _export_tensor(inner, source, True)
        writer.write_tensor_data(_encoded(_llama_layout(weight, source, config), planned.kinds[source]))
        del weight
    writer.close()
    return path


def _shape(inner, name: str) -> tuple[int, ...]:
    owner, _, leaf = name.rpartition(".")
    module = inner.get_submodule(owner)
    if hasattr(module, "base_layer"):  # a LoRA-wrapped projection, its weight perhaps 4-bit (packed)
        layer = module.base_layer
        return (layer.out_features, layer.in_features) if leaf == "weight" else tuple(layer.bias.shape)
    return tuple(getattr(module, leaf).shape)


def _nbytes(shape, qtype) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def _encoded(weight: torch.Tensor, qtype) -> np.ndarray:
    """A float32 tensor as the bytes (or floats) of its GGUF type."""
    import gguf

    data = weight.detach().to("cpu", torch.float32).contiguous().numpy()
    if qtype == gguf.GGMLQuantizationType.F32:
        return data
    if qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, qtype)


def _llama_layout(weight: torch.Tensor, name: str, config) -> torch.Tensor:
    """llama.cpp's llama rotates each head's dimensions in adjacent pairs, transformers' in two halves: a query or
    key projection's rows are reordered from halves to pairs (qwen2 rotates in halves in both: left as it is)."""
    if config.model_type != "llama" or not name.endswith(("q_proj.weight", "k_proj.weight")):
        return weight
    heads = config.num_attention_heads if name.endswith("q_proj.weight") else config.num_key_value_heads
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).transpose(1, 2).reshape(weight.shape)


def rope_factors(config) -> torch.Tensor | None:
    """Llama 3's rotary scaling as llama.cpp takes it: per frequency, how much slower it turns than the plain
    rotation (1 for the fast ones). None for a model without that scaling."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params.get("rope_type", params.get("type")) != "llama3":
        return None
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    plain = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    return (plain / scaled.float()).float()


def _write_model_values(writer, config, kind: str, name: str) -> None:
    import gguf

    params = getattr(config, "rope_parameters", None) or {}
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, {"f32": "ALL_F32"}.get(kind, f"MOSTLY_{kind.upper()}")))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _write_tokenizer(writer, tokenizer, vocab_size: int, pre: str) -> None:
    """A byte-level BPE tokenizer as llama.cpp reads one ("gpt2"): every id's token and kind (ids past the
    tokenizer's own, up to the embedding's rows, as unused padding), the merges, the special ids, the template."""
    import gguf

    special = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    vocab = {i: t for t, i in tokenizer.get_vocab().items()}
    tokens, kinds = [], []
    for i in range(vocab_size):
        token = vocab.get(i)
        tokens.append(token if token is not None else f"[PAD{i}]")
        kinds.append(gguf.TokenType.UNUSED if token is None else gguf.TokenType.CONTROL if token in special
                     else gguf.TokenType.USER_DEFINED if i in tokenizer.added_tokens_decoder else gguf.TokenType.NORMAL)
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(kinds)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    for key, value in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                       ("unk", tokenizer.unk_token_id), ("pad", tokenizer.pad_token_id)):
        if value is not None:
            getattr(writer, f"add_{key}_token_id")(value)
    probe = tokenizer("a").input_ids
    writer.add_add_bos_token(bool(probe) and probe[0] == tokenizer.bos_token_id)
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


# the two chat formats the presets use, as Ollama's Go templates: a system turn where there is one, then the
# conversation (Ollama gathers system messages into .System). A model whose chat template is neither gets no
# TEMPLATE line, and Ollama reads the template stored in the file.
TURNS = {"chatml": ("<|im_start|>{role}\n", "<|im_end|>\n"),
         "llama3": ("<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>")}


def go_template(format: str) -> str:
    start, end = TURNS[format]
    return ("{{- if .System }}" + start.format(role="system") + "{{ .System }}" + end + "{{ end }}"
            + "{{- range .Messages }}{{- if ne .Role \"system\" }}" + start.format(role="{{ .Role }}")
            + "{{ .Content }}" + end + "{{ end }}{{ end }}" + start.format(role="assistant"))


def modelfile(tokenizer, gguf_name: str, temperature: float, top_p: float, max_new_tokens: int) -> str:
    """An Ollama Modelfile for the file: FROM, the chat template (with the system text the model's own template adds
    when a conversation has none, as training rendered every prompt), its stop token, and the sampling the run
    trained with."""
    from minigrpo.tools import render_prompt

    rendered = render_prompt(tokenizer, "PROMPT")
    format = "chatml" if "<|im_start|>" in rendered else "llama3" if "<|start_header_id|>" in rendered else None
    lines = [f"FROM ./{gguf_name}"]
    if format is not None:
        start, end = TURNS[format][0].format(role="system"), TURNS[format][1]
        before = rendered[:rendered.index("PROMPT")]
        lines.append(f'TEMPLATE """{go_template(format)}"""')
        if start in before:  # the system text the model's template adds to a conversation that has none
            at = before.index(start) + len(start)
            lines.append(f'SYSTEM """{before[at:before.index(end, at)]}"""')
    stop = tokenizer.eos_token
    lines += [f'PARAMETER stop "{stop}"'] if stop else []
    lines += [f"PARAMETER temperature {temperature:g}", f"PARAMETER top_p {top_p:g}",
              f"# the run trained on completions of at most {max_new_tokens} tokens"]
    return "\n".join(lines) + "\n"
