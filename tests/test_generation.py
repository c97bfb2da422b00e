"""The `transformers` generator's own decode loop: one prefill per prompt, finished rows leave the batch, and
the sampler draws from exactly softmax(logits / temperature) within the top-p nucleus."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from minigrpo.generate import Sampling
from minigrpo.generate.hf import decode, sample
from minigrpo.tools import render_prompt


def test_the_sampler_draws_from_the_tempered_nucleus():
    torch.manual_seed(0)
    logits = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log().repeat(40_000, 1)  # [n, 4]; the last token has no mass
    token, logp = sample(logits, Sampling(1, 1, temperature=1.0))
    share = torch.bincount(token, minlength=4) / len(token)
    assert torch.allclose(share, torch.tensor([0.5, 0.3, 0.2, 0.0]), atol=0.01), share
    assert torch.allclose(logp, logits[0].log_softmax(-1)[token])

    token, logp = sample(logits, Sampling(1, 1, temperature=1.0, top_p=0.7))  # the nucleus: tokens 0 and 1
    share = torch.bincount(token, minlength=4) / len(token)
    assert torch.allclose(share, torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=0.01), share
    assert torch.allclose(logp, torch.tensor([0.625, 0.375]).log()[token])

    token, _ = sample(logits, Sampling(1, 1, temperature=2.0))  # flatter: p ~ sqrt(p)
    expected = torch.tensor([0.5, 0.3, 0.2]).sqrt() / torch.tensor([0.5, 0.3, 0.2]).sqrt().sum()
    assert torch.allclose((torch.bincount(token, minlength=4) / len(token))[:3], expected, atol=0.01)

    token, logp = sample(logits[:2], Sampling(1, 1, temperature=0))
    assert token.tolist() == [0, 0] and torch.allclose(logp, torch.tensor(0.5).log())


def test_a_uniform_draw_at_zero_still_draws_from_the_nucleus(monkeypatch):
    """The race's exponentials are -log U; U = 0 (one draw in 2^24) must not make a kept token's score the 0 of
    the masked ones, or a one-token nucleus would draw any token."""
    monkeypatch.setattr(torch, "rand_like", lambda x, **kw: torch.zeros_like(x))
    logits = torch.tensor([[0.1, 0.7, 0.2]]).log()  # [1, 3]
    token, logp = sample(logits, Sampling(1, 1, temperature=1.0, top_p=0.5))  # the nucleus: token 1 alone
    assert token.item() == 1 and logp.item() == 0.0


@pytest.fixture(scope="module")
def model_and_prompts(tiny_model_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    texts = ["Tell me about the sea.", "What is 2 + 3?"]
    prompts = [tokenizer(render_prompt(tokenizer, t), add_special_tokens=False).input_ids for t in texts]
    return model, tokenizer, prompts


def test_each_prompt_is_prefilled_once_and_finished_rows_leave_the_batch(model_and_prompts):
    model, tokenizer, prompts = model_and_prompts
    sampling = Sampling(n=4, max_new_tokens=12, temperature=1.0)
    torch.manual_seed(1)
    free, _ = decode(model, prompts, sampling, eos_ids=[], pad_id=tokenizer.pad_token_id)  # nothing ends early
    assert [len(row) for row in free] == [12] * 8
    # make a token that some rows sample early the end token, and run the same draws again
    stop = free[0][2]
    first_end = min(row.index(stop) for row in free if stop in row)
    ended_then = sum(stop in row and row.index(stop) == first_end for row in free)

    rows_seen = []
    hook = model.model.embed_tokens.register_forward_hook(lambda m, args, out: rows_seen.append(args[0].shape[0]))
    try:
        torch.manual_seed(1)
        tokens, _ = decode(model, prompts, sampling, eos_ids=[stop], pad_id=tokenizer.pad_token_id)
    finally:
        hook.remove()
    assert rows_seen[0] == len(prompts), "one prefill per prompt, not one per completion"
    assert rows_seen[1:first_end + 1] == [8] * first_end
    assert rows_seen[first_end + 1] == 8 - ended_then, "rows that ended left the batch"
    assert all(a >= b for a, b in zip(rows_seen[1:], rows_seen[2:])), "the batch only shrinks"
    for row in tokens:  # each row stops at its first end token, which it keeps
        assert stop not in row[:-1] and (row[-1] == stop or len(row) == 12)


def test_greedy_decoding_matches_transformers_generate(model_and_prompts):
    """Same tokens as `model.generate` greedy, left padding and all (prompts of different lengths)."""
    model, tokenizer, prompts = model_and_prompts
    ours, _ = decode(model, prompts, Sampling(n=1, max_new_tokens=10, temperature=0), eos_ids=[-1],
                     pad_id=tokenizer.pad_token_id)
    for prompt, row in zip(prompts, ours):
        with torch.no_grad():
            # the mask is explicit: the pad token is also the template's end-of-turn token, inside the prompt
            theirs = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                    do_sample=False, max_new_tokens=10, min_new_tokens=10,
                                    eos_token_id=None, pad_token_id=tokenizer.pad_token_id, repetition_penalty=1.0,
                                    top_k=None, top_p=None, temperature=None)
        assert row == theirs[0, len(prompt):].tolist()


def test_the_cache_goes_by_the_name_this_transformers_takes(model_and_prompts):
    """transformers 5.24 renamed the forward's `past_key_values` to `cache` (the old name warns, and goes in 5.40):
    the decode loop uses whichever the model takes, so it runs without the warning on either side of the rename."""
    import warnings

    from minigrpo.generate.hf import cache_keyword

    class Before:
        def forward(self, input_ids=None, past_key_values=None, use_cache=None, **kwargs): ...

    class After:
        def forward(self, input_ids=None, cache=None, use_cache=None, **kwargs): ...

    class Wrapped:  # as PEFT wraps a model: its own forward takes **kwargs
        def forward(self, *args, **kwargs): ...

        def get_base_model(self):
            return After()

    assert [cache_keyword(m) for m in (Before(), After(), Wrapped())] == ["past_key_values", "cache", "cache"]
    model, tokenizer, prompts = model_and_prompts
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        decode(model, prompts, Sampling(n=2, max_new_tokens=3), eos_ids=[], pad_id=tokenizer.pad_token_id)
