"""Tasks from reasoning-gym (`pip install 'minigrpo[reasoning-gym]'`): its procedural generators, scored by their
own `score_answer`, a `--task` away.

    minigrpo train --task rg:chain_sum                                # a generator by name
    minigrpo train --task rg:chain_sum:min_terms=2,max_terms=3,size=500   # its options, a size, a seed

    from minigrpo.tasks import get_task
    task = get_task("rg:chain_sum:size=500,min_terms=2,max_terms=3")      # the same, from Python

Each row's prompt is reasoning-gym's own: one of its system prompts (`system_prompt=`: default, simple,
direct, chain_of_draft, DeepSeekZero; each asks for the answer between <answer></answer> tags), with
`shots=N`, N worked exchanges (a question of the generator's and its answer in tags), then the generator's
question. Two rewards: `rg_<name>`, the generator's `score_answer`
on the last <answer> of the completion (0 without one), and `answer_format` (weight 0.2), one well-formed
<answer> tag, which a small model needs to find before the task's own reward can say anything. With
`partial=False` the generator's score counts only when it is full: many generators keep reasoning-gym's generic
rule, which pays len(right)/len(given) for any answer that contains the right one ("26" for 6 earns 0.5), and a
small model climbs that by writing longer numbers, not by solving more. The training
rows come from the run's seed (or `seed=`); the held-out rows from another seed, with any question that is also
a training question left out, so no evaluation item was trained on. A generator with few distinct questions
(one-digit sums: some two hundred) would give every one of them to a thousand training rows and leave none
held out; `held_out=0.25` splits its questions instead: a quarter of them, chosen by a hash of the question,
are never trained on (nor shown as worked exchanges) and are the held-out rows, each once.
"""

from __future__ import annotations

import difflib
import functools
import hashlib

from minigrpo.sources.spec import held_out_size, parse_spec

EXTRA = "pip install 'minigrpo[reasoning-gym]'"
DEFAULT_SIZE = 1000  # training rows; the held-out split draws held_out_size(size) more from another seed
HELD_OUT_SEED = 1_000_003  # added to the training seed for the held-out rows
SHOTS_SEED = 7_777_777  # the seed of the worked exchanges shown before each question (shots=N)
FORMAT_WEIGHT = 0.2


def task_fields(name: str, size: int = DEFAULT_SIZE, seed: int | None = None, system_prompt: str = "default",
                shots: int = 0, partial: bool = True, held_out: float | None = None, **options) -> dict:
    """The fields of a minigrpo Task for reasoning-gym's generator `name` with its `options` (see the module;
    `minigrpo.tasks.get_task` makes the Task)."""
    _check_our_options(name, size, seed, shots, partial, held_out)
    rg = _library()
    if name not in rg.factory.DATASETS:
        close = difflib.get_close_matches(name, list(rg.factory.DATASETS), n=3)
        raise ValueError(f"reasoning-gym has no generator {name!r}" + (f"; did you mean {', '.join(close)}?" if close
                         else f"; `minigrpo tasks` lists the {len(rg.factory.DATASETS)} it has"))
    if system_prompt not in rg.utils.SYSTEM_PROMPTS:
        raise ValueError(f"rg:{name}: system_prompt={system_prompt!r} is none of reasoning-gym's: "
                         f"{', '.join(rg.utils.SYSTEM_PROMPTS)}")
    system = rg.utils.SYSTEM_PROMPTS[system_prompt]
    # worked exchanges before the question (few-shot), from a generator stream of their own: a small model
    # that ignores the answer tags when told follows them when shown
    examples = [] if not shots else list(rg.create_dataset(name, size=shots, seed=SHOTS_SEED, **options))
    shown = [turn for entry in examples
             for turn in ({"role": "user", "content": entry["question"]},
                          {"role": "assistant", "content": f"<answer>{entry['answer']}</answer>"})]
    system = [{"role": "system", "content": system}, *shown]
    in_held_out = functools.partial(held_out_question, share=held_out)
    try:
        rg.create_dataset(name, size=1, seed=0, **options)
    except Exception as error:  # its own config check: a wrong option name or value
        raise ValueError(f"rg:{name}: reasoning-gym refused the options {options}: {error}") from None

    @functools.cache
    def dataset(split: str, run_seed: int):
        base = run_seed if seed is None else seed
        if split == "train":
            return rg.create_dataset(name, size=size, seed=base, **options)
        if held_out is not None:  # as many draws as training has, of which the held-out share's questions stay
            return rg.create_dataset(name, size=size, seed=base + HELD_OUT_SEED, **options)
        if not held_out_size(size):
            return []
        return rg.create_dataset(name, size=held_out_size(size), seed=base + HELD_OUT_SEED, **options)

    def make_data(split: str, run_seed: int) -> list[dict]:
        data = dataset(split, run_seed)
        if held_out is not None:  # the question space split by hash: no held-out question is trained on or shown
            if split == "train":
                rows = [_row(entry, split, i, run_seed, system) for i, entry in enumerate(data)
                        if not in_held_out(entry["question"])]
                if not rows:
                    raise ValueError(f"rg:{name}: held_out={held_out} keeps every one of the {size} questions "
                                     f"drawn for training out of it: lower held_out, or raise size")
                return rows
            seen, rows = {entry["question"] for entry in examples}, []  # each question once, none shown
            for i, entry in enumerate(data):
                if in_held_out(entry["question"]) and entry["question"] not in seen:
                    seen.add(entry["question"])
                    rows.append(_row(entry, split, i, run_seed, system))
            return rows
        rows = [_row(entry, split, i, run_seed, system) for i, entry in enumerate(data)]
        if split == "test":  # a question also drawn for training is not held out
            trained = {entry["question"] for entry in dataset("train", run_seed)}
            rows = [r for r, entry in zip(rows, data) if entry["question"] not in trained]
        return rows

    def score(completions, rg_split, rg_index, rg_seed, **columns) -> list[float]:
        out = []
        for completion, split, index, run_seed in zip(completions, rg_split, rg_index, rg_seed):
            data = dataset(split, run_seed)
            given = float(data.score_answer(_answer(completion), data[index]))
            out.append(given if partial else float(given >= 1.0))
        return out

    score.__name__ = f"rg_{name}"
    first = dataset("train", 0)[0]
    example = dict(_row(first, "train", 0, 0, system), completion=f"<answer>{first['answer']}</answer>",
                   expected=1.0 + FORMAT_WEIGHT)
    return dict(name=f"rg:{name}", description=f"reasoning-gym's {name} generator, scored by its score_answer",
                make_data=make_data, rewards=[score, answer_format], weights=[1.0, FORMAT_WEIGHT], examples=[example],
                # solved: the generator's full score with the format; partial credit of 0.8 (a four-digit
                # answer inside five) plus the format's 0.2 is not
                solved_reward=1.0 + FORMAT_WEIGHT,
                answer=_answer)


def _check_our_options(name: str, size, seed, shots, partial, held_out) -> None:
    """The options minigrpo adds to the generator's own, each refused in one line naming the fix."""
    for option, value, low in (("size", size, 1), ("shots", shots, 0)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"rg:{name}: {option}={value!r} must be a whole number, at least {low}")
    if not isinstance(partial, bool):
        raise ValueError(f"rg:{name}: partial={partial!r} must be True or False")
    if held_out is not None and not (isinstance(held_out, float) and 0 < held_out < 1):
        raise ValueError(f"rg:{name}: held_out={held_out!r} must be a share of the questions, between 0 and 1 "
                         f"(0.25: a quarter of them held out)")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError(f"rg:{name}: seed={seed!r} must be a whole number (or left out: the run's --seed)")


def held_out_question(question: str, share: float | None) -> bool:
    """Whether `question` is in the held-out `share` of a generator's questions: by its hash, the same on every
    machine and run, so a question is held out or trained on, never both.

    >>> [held_out_question(f"What is 2 + {b}?", 0.25) for b in range(1, 5)]
    [False, True, True, False]
    >>> held_out_question("What is 2 + 3?", None)
    False
    """
    if share is None:
        return False
    return int.from_bytes(hashlib.sha256(question.encode()).digest()[:8], "big") / 2**64 < share


def fields_from_spec(spec: str) -> dict:
    name, options = parse_spec(spec)
    return task_fields(name, **options)


def answer_format(completions, **columns) -> list[float]:
    """1.0 for exactly one non-empty <answer>...</answer>, the format reasoning-gym's prompt asks for.

    >>> answer_format(["I think 3. <answer>3</answer>", "<answer></answer>", "3", "<answer>1</answer><answer>2</answer>"])
    [1.0, 0.0, 0.0, 0.0]
    """
    from minigrpo.scoring import text_of

    out = []
    for completion in completions:
        text = text_of(completion)
        found = _library().utils.extract_answer(text)
        out.append(float(bool(found) and text.count("<answer>") == 1))
    return out


def listing() -> str:
    """What `--task rg:NAME` offers on this machine, or how to get it (for `minigrpo tasks`)."""
    try:
        names = sorted(_library().factory.DATASETS)
    except ValueError:
        return f"--task rg:NAME runs a reasoning-gym generator ({EXTRA})"
    return (f"--task rg:NAME[:option=value,...] runs one of reasoning-gym's {len(names)} generators: "
            f"{', '.join(names)}")


def _row(entry: dict, split: str, index: int, run_seed: int, before: list[dict]) -> dict:
    return {"prompt": [*before, {"role": "user", "content": entry["question"]}],
            "answer": str(entry["answer"]), "rg_split": split, "rg_index": index, "rg_seed": run_seed}


def _answer(completion) -> str | None:
    """The completion's last <answer>, as reasoning-gym extracts it."""
    from minigrpo.scoring import text_of

    return _library().utils.extract_answer(text_of(completion))


def _library():
    try:
        import reasoning_gym
        import reasoning_gym.utils  # noqa: F401
    except ImportError:
        raise ValueError(f"--task rg:... needs reasoning-gym: {EXTRA}") from None
    return reasoning_gym
