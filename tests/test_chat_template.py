"""Chat templates: our sandboxed renderer equals transformers' apply_chat_template, and a template
that is slow, escapes, or builds huge strings is stopped with a ValueError."""

from __future__ import annotations

import time

import pytest

from pagedllm.model.loader import resolve_model_folder
from pagedllm.tokenizer import chat_prompt, load_tokenizer, render_chat

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Où est la gare ? 🚉"},
        {"role": "assistant", "content": "Tout droit."},
        {"role": "user", "content": "Merci"},
    ],
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_folder(None))


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["one turn", "with system"])
def test_rendering_equals_transformers(tokenizer, conversation, add_generation_prompt):
    expected = tokenizer.apply_chat_template(
        conversation, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert render_chat(tokenizer, conversation, add_generation_prompt) == expected
    prompt = chat_prompt(tokenizer, conversation, add_generation_prompt)
    assert prompt["prompt_token_ids"] == tokenizer(expected, add_special_tokens=False).input_ids


def test_template_kwargs_reach_the_template_but_not_the_renderer_arguments(tokenizer):
    template = "{{ greeting }} {{ messages[0].content }}{{ eos_token }}"
    text = render_chat(tokenizer, CONVERSATIONS[0], template=template, template_kwargs={"greeting": "Hey"})
    assert text == "Hey Hi!<|im_end|>"
    for name in ("messages", "add_generation_prompt", "tokenize", "conversation", "chat_template"):
        with pytest.raises(ValueError, match=f"chat_template_kwargs: may not set {name}"):
            render_chat(tokenizer, CONVERSATIONS[0], template=template, template_kwargs={name: 1})


def test_a_template_past_its_budget_stops_there(tokenizer):
    loops = "{% for a in range(100000) %}{% for b in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"time budget of 0\.3 s"):
        render_chat(tokenizer, CONVERSATIONS[0], template=loops, time_budget=0.3)
    assert time.monotonic() - start < 3
    # the budget is per render: the next one starts afresh
    assert render_chat(tokenizer, CONVERSATIONS[0], time_budget=0.3)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ 'x' * 10000000 }}", "repetition longer than"),
        ("{{ 2 ** 100000 }}", "exponents over 64"),
        ("{% set ns = namespace(_secret=1) %}", "underscore names"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{{ 1 / 0 }}", "ZeroDivisionError"),
        ("{% for %}", "chat template failed"),
        ("{{ '' }}", "empty prompt"),
        ("", "no chat template"),
    ],
)
def test_a_bad_template_is_a_value_error(tokenizer, template, message):
    with pytest.raises(ValueError, match=message):
        chat_prompt(tokenizer, CONVERSATIONS[0], template=template, time_budget=5)
