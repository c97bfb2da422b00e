"""Rewards without a checker: a model grades each completion against a rubric the user writes.

    from minigrpo.judge import Judge, RewardModel

    polite = Judge("Polite and on topic: 10. Curt: 5. Rude or off topic: 0.", name="polite")   # the base model
    ranked = Judge(RUBRIC, mode="rank")            # a group's completions graded side by side (RULER's idea)
    remote = Judge(RUBRIC, endpoint="http://127.0.0.1:8000/v1", model="qwen2.5-7b-instruct")  # OpenAI-compatible
    rm = RewardModel("OpenAssistant/reward-model-deberta-v3-base")   # a sequence classifier: hub id or folder

Each is a reward function under the usual contract (`--reward file.py:polite`). Judges:
- in memory (no `endpoint`): the model being trained with its adapters off, through the run's own generator
  (vLLM included): no second model and no extra memory, greedy, so a grade is repeatable;
- `endpoint`: any OpenAI-compatible chat server (vLLM, llama.cpp, a hosted API), the key read from the
  environment variable `api_key_env`, `concurrency` requests at once, each with `timeout` seconds and `retries`
  retries with exponential backoff (429, obeying Retry-After, and 5xx). The reward's time limit
  (`--reward-timeout` per completion) is a hard deadline for the whole call, retries included: what is not
  answered by then scores 0, counted. The endpoint is checked before training (`preflight`): a refused key,
  an address that does not answer or does not resolve, or a rubric too long for its context stops the run,
  named; mid-run failures are scored 0 and counted;
- `RewardModel`: a sequence-classification model's first logit for (prompt, completion).
Replies are parsed strictly (`Score: N` on a line of its own; in rank mode `N: score` once per completion): a
reply that does not parse is the reward's counted error for that completion, scored 0. Grades are cached on
disk by judge, rubric, prompt and completion, so a resumed run or an evaluation does not pay twice; every reply
goes to `judge.jsonl` in the run folder, and the step's metrics get `judge/<name>/calls`, `.../cached`,
`.../tokens`, `.../errors` and `.../gated`.

Defences against a policy that learns to please its judge rather than the rubric: `gate` (a program's verdict
before the judge: a completion it rejects scores 0 unasked), `max_chars` (longer completions are scaled down by
max_chars / length, so padding does not pay), and rubric echoes (a completion quoting eight or more words of
the rubric in a row scores 0, unasked).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sqlite3
import threading
from pathlib import Path
from typing import Callable

from minigrpo.judge.client import ChatEndpoint, JudgeError, JudgeUnavailable
from minigrpo.scoring import text_of

SYSTEM = "You are a strict, fair grader. You grade replies against a rubric and answer in the format asked."
SCORE = re.compile(r"^\s*\**score\**\s*:\s*(\d+)\s*$", re.IGNORECASE | re.MULTILINE)
RANK = re.compile(r"^\s*(\d+)\s*:\s*(\d+)\s*$", re.MULTILINE)
_context: dict = {"generate": None, "log": None}  # what a run attaches: the base model's generation, the log
MAX_RUBRIC_CHARS = 32_000  # about 8,000 tokens: where the judge's context is not known, a rubric longer is refused
_judges: list = []  # every judge made, for the step's metrics
_lock = threading.Lock()


class MalformedReply(ValueError):
    """The judge's reply did not follow the asked format: that completion's error, scored 0."""


def attach(generate: Callable | None = None, run_dir: Path | None = None) -> None:
    """Called by minigrpo where a model is loaded: `generate(prompt_texts, max_tokens) -> [(reply, tokens)]`
    with the base model, and the folder whose judge.jsonl receives every reply."""
    _context["generate"] = generate
    _context["log"] = Path(run_dir) / "judge.jsonl" if run_dir else None
    step_metrics()  # counts start afresh with each run


def step_metrics() -> dict[str, float]:
    """Each judge's calls, cached answers, tokens and errors since the last call."""
    out = {}
    for judge in _judges:
        with _lock:
            counts, judge.counts = judge.counts, dict.fromkeys(judge.counts, 0)
        if any(counts.values()):  # a judge this run used (others may merely have been imported)
            out.update({f"judge/{judge.__name__}/{key}": value for key, value in counts.items()})
    return out


def parse_score(reply: str, scale: int) -> float:
    """The grade in a reply, from 0 to 1: one `Score: N` line, N an integer from 0 to scale.

    >>> parse_score("Clear and kind.\\nScore: 8", 10)
    0.8
    >>> parse_score("Score: 8 or maybe Score: 9", 10)
    Traceback (most recent call last):
    ...
    minigrpo.judge.rubric.MalformedReply: no line 'Score: N' in the reply: 'Score: 8 or maybe Score: 9'
    """
    found = SCORE.findall(reply)
    if len(found) != 1:
        raise MalformedReply(f"{'no' if not found else 'more than one'} line 'Score: N' in the reply: {reply[:80]!r}")
    if not 0 <= int(found[0]) <= scale:
        raise MalformedReply(f"score {found[0]} is outside 0-{scale}")
    return int(found[0]) / scale


def parse_ranking(reply: str, k: int, scale: int) -> list[float]:
    """The grades of k completions graded together, from 0 to 1: one `i: N` line for each i in 1..k.

    >>> parse_ranking("1: 7\\n2: 2\\n3: 10", 3, 10)
    [0.7, 0.2, 1.0]
    """
    grades = {}
    for index, value in RANK.findall(reply):
        if int(index) in grades or not 1 <= int(index) <= k or not 0 <= int(value) <= scale:
            raise MalformedReply(f"line '{index}: {value}' repeats a reply, or is out of range: {reply[:80]!r}")
        grades[int(index)] = int(value) / scale
    if len(grades) != k:
        raise MalformedReply(f"{len(grades)} of {k} replies graded: {reply[:80]!r}")
    return [grades[i] for i in range(1, k + 1)]


class Judge:
    """A reward: a model's grade of each completion against `rubric`, from 0 to 1 (see the module)."""

    precheck = False  # not run on worked examples and stand-ins before the model loads

    def __init__(self, rubric: str, *, name: str = "judge", scale: int = 10, mode: str = "score",
                 endpoint: str | None = None, model: str | None = None, api_key_env: str = "OPENAI_API_KEY",
                 max_tokens: int = 256, concurrency: int = 8, timeout: float = 60.0, retries: int = 3,
                 gate: Callable[[str, str], bool] | None = None, max_chars: int | None = None,
                 cache: bool = True):
        if mode not in ("score", "rank"):
            raise ValueError(f"Judge mode must be score or rank, not {mode!r}")
        if endpoint and not model:
            raise ValueError("a Judge with an endpoint needs the model name the server serves (model=...)")
        if not rubric.strip():
            raise ValueError(f"judge {name} has an empty rubric: say what a good reply does, and what each grade means")
        if len(rubric) > MAX_RUBRIC_CHARS:
            raise ValueError(f"judge {name}'s rubric is {len(rubric):,} characters, more than the "
                             f"{MAX_RUBRIC_CHARS:,} it may be (it is sent with every completion): shorten it")
        self.__name__, self.rubric, self.scale, self.mode = name, rubric, scale, mode
        self.endpoint, self.model, self.api_key_env = endpoint and endpoint.rstrip("/"), model, api_key_env
        self.max_tokens, self.concurrency, self.timeout, self.retries = max_tokens, concurrency, timeout, retries
        self.gate, self.max_chars = gate, max_chars
        self.use_cache, self.cache = cache, None  # opened at the first call, not at import
        self.client = endpoint and ChatEndpoint(self.endpoint, model, api_key_env, timeout, retries, concurrency, name)
        self.counts = dict.fromkeys(("calls", "cached", "tokens", "errors", "gated"), 0)
        _judges.append(self)

    def __call__(self, prompts: list, completions: list, **columns) -> list:
        if self.use_cache and self.cache is None:
            self.cache = Cache(cache_path())
        texts = [_text(c) for c in completions]
        asks = [(p, t) for p, t in zip(prompts, texts)]
        unasked = {i for i, (p, t) in enumerate(asks) if self._refused(_text(p), t)}
        self._count(gated=len(unasked))
        if self.mode == "score":
            groups = [[i] for i in range(len(asks)) if i not in unasked]
        else:  # a step's completions arrive grouped: the same prompt, one after another
            groups = _runs([i for i in range(len(asks)) if i not in unasked], lambda i: str(prompts[i]))
        messages = [self._messages(asks[g[0]][0], [asks[i][1] for i in g]) for g in groups]
        replies = self._ask(messages)
        scores: list = [0.0] * len(asks)
        for g, message, reply in zip(groups, messages, replies):
            try:
                if isinstance(reply, Exception):
                    raise reply
                grades = parse_score(reply, self.scale) if self.mode == "score" else None
                grades = [grades] if grades is not None else parse_ranking(reply, len(g), self.scale)
                if self.cache:
                    self.cache.put(self._key(message), reply)
            except (MalformedReply, JudgeError) as error:
                grades = [error] * len(g)
                self._count(errors=len(g))
            for i, grade in zip(g, grades):
                scores[i] = grade if isinstance(grade, Exception) else grade * self._length_factor(asks[i][1])
            self._log(message, reply, [scores[i] for i in g])
        return scores

    def _refused(self, prompt: str, text: str) -> bool:
        """Scored 0 without asking: the gate said no, or the completion quotes the rubric."""
        words, said = self.rubric.lower().split(), " ".join(text.lower().split())
        echoes = any(" ".join(words[j:j + 8]) in said for j in range(len(words) - 7))
        return echoes or (self.gate is not None and not self.gate(prompt, text))

    def _length_factor(self, text: str) -> float:
        return min(1.0, self.max_chars / max(len(text), 1)) if self.max_chars else 1.0

    def _messages(self, prompt, replies: list[str]) -> list[dict]:
        asked = _text(prompt)
        if self.mode == "score":
            body = (f"Rubric:\n{self.rubric}\n\nThe request:\n<request>\n{asked}\n</request>\n\nThe reply:\n<reply>\n"
                    f"{replies[0]}\n</reply>\n\nGrade the reply against the rubric. End with one line exactly "
                    f"'Score: N', N a whole number from 0 to {self.scale}.")
        else:
            shown = "\n\n".join(f"<reply {i}>\n{r}\n</reply {i}>" for i, r in enumerate(replies, 1))
            body = (f"Rubric:\n{self.rubric}\n\nThe request:\n<request>\n{asked}\n</request>\n\n{len(replies)} "
                    f"replies to it:\n\n{shown}\n\nGrade each reply against the rubric, comparing them with each "
                    f"other. End with one line per reply, exactly 'i: N' (i the reply's number, N a whole "
                    f"number from 0 to {self.scale}).")
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": body}]

    def _key(self, messages: list[dict]) -> str:
        who = self.endpoint and f"{self.endpoint}|{self.model}" or "in-memory base model"
        return hashlib.sha256(json.dumps([who, self.max_tokens, messages]).encode()).hexdigest()

    def _ask(self, messages: list[list[dict]]) -> list:
        """A reply (or the exception that stood for it) per conversation: cached ones first."""
        replies = [self.cache.get(self._key(m)) if self.cache else None for m in messages]
        todo = [i for i, r in enumerate(replies) if r is None]
        self._count(cached=len(messages) - len(todo), calls=len(todo))
        if todo:
            asks = [messages[i] for i in todo]
            fresh = self.client.ask(asks, self.max_tokens, self._count) if self.client else self._ask_base(asks)
            for i, reply in zip(todo, fresh):
                replies[i] = reply
        return replies

    def _ask_base(self, messages: list[list[dict]]) -> list:
        if _context["generate"] is None:
            raise JudgeUnavailable(f"judge {self.__name__} grades with the model minigrpo has loaded, so it runs "
                                   f"inside `minigrpo train`, `eval`, `sample` and `check-reward`; elsewhere give "
                                   f"it an endpoint")
        out = _context["generate"](messages, self.max_tokens)
        self._count(tokens=sum(tokens for _, tokens in out))
        return [reply for reply, _ in out]

    def preflight(self) -> None:
        """Before training: an endpoint answers, takes the key, and has room for the rubric (JudgeUnavailable)."""
        if self.client:
            self.client.preflight(len(self.rubric), self.max_tokens)

    def _count(self, **amounts: int) -> None:
        with _lock:
            for key, value in amounts.items():
                self.counts[key] += value

    def _log(self, messages: list[dict], reply, scores: list) -> None:
        if _context["log"] is None:
            return
        record = {"judge": self.__name__, "asked": messages[-1]["content"], "reply": str(reply),
                  "scores": [str(s) if isinstance(s, Exception) else s for s in scores]}
        with _lock, open(_context["log"], "a") as f:
            f.write(json.dumps(record) + "\n")


class RewardModel:
    """A reward: a sequence-classification model's score of (prompt, completion), its first logit, as TRL
    reads a reward model. Loaded at the first call, on the GPU where there is one."""

    precheck = False

    def __init__(self, name_or_folder: str, *, name: str | None = None, batch_size: int = 8):
        self.source, self.batch_size = name_or_folder, batch_size
        self.__name__ = name or Path(name_or_folder).name.replace("-", "_")
        self.model = self.tokenizer = None

    def __call__(self, prompts: list, completions: list, **columns) -> list[float]:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if self.model is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
            self.tokenizer = AutoTokenizer.from_pretrained(self.source)
            self.model = AutoModelForSequenceClassification.from_pretrained(self.source).to(device).eval()
            if self.tokenizer.pad_token is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        texts = [self._text(p, c) for p, c in zip(prompts, completions)]
        scores = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=True).to(self.model.device)
            with torch.no_grad():
                scores += self.model(**batch).logits[:, 0].float().tolist()
        return scores

    def _text(self, prompt, completion) -> str:
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": _text(prompt)}, {"role": "assistant", "content": _text(completion)}],
                tokenize=False)
        return f"{_text(prompt)}\n{_text(completion)}"


class Cache:
    """Replies on disk (sqlite), keyed by a hash of who was asked and exactly what."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(path, check_same_thread=False, timeout=30)
        self.db.execute("CREATE TABLE IF NOT EXISTS replies (key TEXT PRIMARY KEY, reply TEXT)")

    def get(self, key: str) -> str | None:
        with _lock:
            row = self.db.execute("SELECT reply FROM replies WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def put(self, key: str, reply: str) -> None:
        with _lock:
            self.db.execute("INSERT OR REPLACE INTO replies VALUES (?, ?)", (key, reply))
            self.db.commit()


def cache_path() -> Path:
    """$MINIGRPO_JUDGE_CACHE, else judge.sqlite in minigrpo's cache folder."""
    from minigrpo.weights import cache_dir

    return Path(os.environ.get("MINIGRPO_JUDGE_CACHE") or cache_dir() / "judge.sqlite")


def base_generate(generator, tokenizer) -> Callable:
    """What `attach` takes, for a run's generator: greedy replies of the base model (adapters off)."""
    from minigrpo.generate import Sampling

    def generate(conversations: list[list[dict]], max_tokens: int) -> list[tuple[str, int]]:
        ids = [tokenizer.apply_chat_template(c, tokenize=True, add_generation_prompt=True) for c in conversations]
        ids = [list(x["input_ids"]) if isinstance(x, dict) or hasattr(x, "keys") else list(x) for x in ids]
        out = generator.generate(ids, Sampling(1, max_tokens, temperature=0.0), base=True)
        texts = tokenizer.batch_decode(out.completion_ids, skip_special_tokens=True)
        return [(t, len(p) + len(c)) for t, p, c in zip(texts, ids, out.completion_ids)]

    return generate


def _text(x) -> str:
    """A prompt or completion as text: chat messages give their last message (scoring's text_of)."""
    return str(text_of(x)) if x else ""


def _runs(items: list[int], key: Callable) -> list[list[int]]:
    """Consecutive items with the same key, grouped: [1, 2, 3] with keys a, a, b -> [[1, 2], [3]]."""
    groups: list[list[int]] = []
    for i in items:
        if groups and key(groups[-1][-1]) == key(i):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups
