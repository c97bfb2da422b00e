"""`minigrpo export` and `minigrpo plot`: what a run leaves, in the forms other tools read. Merged into the `minigrpo`
command by minigrpo/cli/app.py."""

from __future__ import annotations

import typer
from rich.console import Console

from minigrpo.config import GgufType, WeightsDtype
from minigrpo.errors import clear_errors

after_app = typer.Typer(rich_markup_mode=None)


@after_app.command()
@clear_errors
def export(
    run: str = typer.Argument(..., help="A run folder."),
    out: str = typer.Option(..., help="Where to write the exported model."),
    merge: bool = typer.Option(True, "--merge/--adapter-only",
                               help="A merged standalone model, or just the PEFT adapter folder."),
    dtype: WeightsDtype = typer.Option("bfloat16", help="Weights of the merged model."),
    gguf: GgufType = typer.Option(None, "--gguf", help="Write one GGUF file of this type instead (llama.cpp, Ollama, "
                                  "LM Studio), and an Ollama Modelfile beside it [default: none, a transformers "
                                  "folder]."),
    overwrite: bool = typer.Option(False, help="With --gguf: replace the GGUF file and Modelfile in --out."),
) -> None:
    """Export a trained run: a merged 16-bit model that transformers and vLLM load, one GGUF file that llama.cpp and
    Ollama load, or the adapter alone."""
    import shutil
    from pathlib import Path

    import torch

    from minigrpo.trained import adapter_folder
    from minigrpo.run import results_folder

    adapter = adapter_folder(run)
    target = Path(out)
    if gguf:
        return export_gguf(adapter, target, gguf, overwrite)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise ValueError(f"--out {out} already exists and is not an empty folder; pick a new one (nothing was written)")
    results_folder(target, "--out")
    if not merge:
        shutil.copytree(adapter, out, dirs_exist_ok=True)
        Console().print(f"copied the adapter to {out}")
        return
    from minigrpo.export import export_weights
    from minigrpo.trained import load_trained

    policy, tokenizer, _ = load_trained(adapter, bf16_base=False)  # the base's float32 weights, not a run's bf16 copies
    export_weights(policy, tokenizer, Path(out), getattr(torch, dtype), merge_adapter=True)
    Console().print(f"wrote a merged {dtype} model to {out}")


def export_gguf(adapter, target, kind: str, overwrite: bool) -> None:
    """`export --gguf`: the merged policy as one GGUF file in `target`, an Ollama Modelfile beside it."""
    from minigrpo.run import results_folder
    from minigrpo.to_gguf import modelfile, refuse_unsupported, write_gguf
    from minigrpo.trained import load_trained

    name = adapter.parent.name if adapter.name == "adapter" else adapter.name
    files = [target / f"{name}-{kind}.gguf", target / "Modelfile"]
    there = [str(f) for f in files if f.exists()]
    if there and not overwrite:
        raise ValueError(f"{' and '.join(there)} already exist; give --overwrite to replace them, or another --out")
    if target.exists() and not target.is_dir():
        raise ValueError(f"--out {target} is a file; give a folder for the GGUF file and its Modelfile")
    # merged in float32, from the base's own float32 weights where the run kept them in bfloat16 (a 4-bit base stays
    # the 4-bit base it trained on, dequantized)
    policy, tokenizer, cfg = load_trained(adapter, dtype="float32", bf16_base=False)
    refuse_unsupported(policy.get_base_model().config, tokenizer)  # before a folder or a byte is written
    if not target.exists():
        results_folder(target, "--out")
    write_gguf(policy, tokenizer, files[0], kind, name, Console().print)
    files[1].write_text(modelfile(tokenizer, files[0].name, cfg.temperature, cfg.top_p, cfg.max_new_tokens))
    Console().print(f"wrote {files[0]} and {files[1]}: llama.cpp reads the file (llama-cli -m {files[0]}), "
                    f"Ollama the Modelfile (cd {target} && ollama create {name} -f Modelfile)", highlight=False)


@after_app.command()
@clear_errors
def plot(
    run: str = typer.Argument(..., help="A run folder, or a result card (bench learn's NAME.json)."),
    out: str = typer.Option(None, help="PNG path [default: <run>/curves.png, or the card's NAME.png]."),
) -> None:
    """Write a run's curves (reward and its parts, groups with spread, eval, KL, length, step time) as a PNG;
    for a result card, held-out pass@1 against seconds of training for each trainer and seed."""
    from minigrpo.plot import plot_card, plot_run

    Console().print(f"wrote {(plot_card if run.endswith('.json') else plot_run)(run, out)}")
