"""`minigrpo sample` and `minigrpo chat`: a look at what a trained adapter (or the base model) says."""

from __future__ import annotations

import typer
from rich.console import Console
from rich.markup import escape

from minigrpo.cli.flags import config_flags
from minigrpo.errors import clear_errors

talk_app = typer.Typer(rich_markup_mode=None)


@talk_app.command()
@clear_errors
@config_flags("allow_unconfined_code")
def sample(
    prompt: list[str] = typer.Argument(None, help="Prompts (user messages) [default: with --task, its held-out ones]."),
    task: str = typer.Option(None, help="Sample the held-out prompts of this task, with its tools or environment, "
                                        "and score each completion [default: none, the prompts given]."),
    tool: list[str] = typer.Option([], help="A tool the model may call, file.py:function (repeat): each "
                                            "completion becomes an episode [default: the task's own, else none]."),
    prompts: int = typer.Option(2, min=1, help="Held-out prompts, with --task."),
    adapter: str = typer.Option(None, help="A trained adapter folder (runs/<run>/adapter) [default: none, the base model]."),
    model: str = typer.Option(None, help="Base model [default: the adapter's run config, else smollm2-135m]."),
    samples: int = typer.Option(1, min=1, help="Samples per prompt to show."),
    max_new_tokens: int = typer.Option(256, min=1, help="Completion length limit (per turn, in an episode)."),
    max_turns: int = typer.Option(None, min=1, help="Model turns per episode [default: the run's, else 4]."),
    temperature: float = typer.Option(0.7, min=0.0, help="Sampling temperature; 0 is greedy."),
    seed: int = typer.Option(0, min=0, help="Seed of the draws."),
    *, allow_unconfined_code: bool,  # its option: config.py's field
) -> None:
    """Sample completions (or episodes, turn by turn) from a trained adapter or the base model."""
    from minigrpo.console import shown
    from minigrpo.evaluate import sample_completions
    from minigrpo.scoring import score
    from minigrpo.tasks import Task, refuse_unconfined_code, get_task, load_tool

    if bool(prompt) == bool(task):
        raise ValueError("give prompts, or --task for its held-out prompts (not both)")
    if task:
        t = get_task(task, extra_tools=tool)
        refuse_unconfined_code(t, allow_unconfined_code, Console().print)
        rows = t.make_data("test", seed)[:prompts]
    else:
        rows = [{"prompt": p} for p in prompt]
        t = Task("prompts", "the given prompts", lambda split, seed: rows, rewards=[],
                 tools=[load_tool(spec) for spec in tool])
    completions, columns = sample_completions(t, rows, adapter, model, samples, max_new_tokens, temperature, seed, max_turns)
    scores = score(t.rewards, t.weights or [1.0] * len(t.rewards), [c["prompt"] for c in columns], completions,
                   [[] for _ in completions], columns) if t.rewards else None
    console = Console()
    for i, completion in enumerate(completions):
        console.print(f"[bold]{escape(shown(rows[i // samples]['prompt']))}[/]\n{escape(shown(completion))}", highlight=False)
        if scores:
            parts = ", ".join(f"{name} {values[i]:.2f}" for name, values in scores.values.items()
                              if values[i] is not None)
            console.print(f"reward {scores.totals[i]:.2f} ({parts})", highlight=False)
        console.print()


@talk_app.command()
@clear_errors
def chat(
    adapter: str = typer.Option(None, help="A trained adapter folder [default: none, the base model]."),
    model: str = typer.Option(None, help="Base model [default: the adapter's run config, else smollm2-135m]."),
    max_new_tokens: int = typer.Option(256, min=1, help="Reply length limit."),
    temperature: float = typer.Option(0.7, min=0.0, help="Sampling temperature; 0 is greedy."),
) -> None:
    """Talk to a trained adapter; an empty line or `exit` ends the chat."""
    from minigrpo.generate import Sampling
    from minigrpo.generate.hf import HFGenerator
    from minigrpo.trained import load_trained
    from minigrpo.tools import render_prompt

    policy, tokenizer, _ = load_trained(adapter, model)
    generator, history, console = HFGenerator(policy, tokenizer), [], Console()
    while True:
        try:
            line = input("you> ").strip()
        except EOFError:
            break
        if not line or line == "exit":
            break
        history.append({"role": "user", "content": line})
        ids = tokenizer(render_prompt(tokenizer, history), add_special_tokens=False).input_ids
        out = generator.generate([ids], Sampling(1, max_new_tokens, temperature))
        reply = tokenizer.decode(out.completion_ids[0], skip_special_tokens=True)
        history.append({"role": "assistant", "content": reply})
        console.print(f"[bold]model>[/] {escape(reply)}", highlight=False)
