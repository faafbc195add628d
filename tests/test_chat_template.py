"""Chat templates: our sandboxed renderer equals transformers' apply_chat_template, and a template
that is slow, escapes, or builds huge strings is stopped with a ValueError."""

from __future__ import annotations

import time

import pytest

from pagedllm import chat_template
from pagedllm.model.locate import resolve_model_folder
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
    assert time.monotonic() - start < 30  # stopped at its budget: unbudgeted, it runs for hours
    # the budget is per render: the next one starts afresh
    assert render_chat(tokenizer, CONVERSATIONS[0], time_budget=0.3)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ ''.__class__.__mro__ }}", "unsafe"),
        ("{{ 'x' * 10**8 }}", "a repetition of about 100,000,000 characters"),
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


JINJA_CONSTRUCTS = [
    "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ ',' if not loop.last }}{% endfor %}",
    "{% for m in messages if m.role != 'system' %}{{ m.role }}{% else %}none{% endfor %}",
    "{% for x in [3, 1, 2]|sort %}{% if x == 2 %}{% break %}{% endif %}{{ loop.cycle('a', 'b') }}"
    "{% endfor %}",
    "{% for k, v in {'a': 1, 'b': 2}.items() %}{{ loop.previtem }}{{ k ~ v }}{{ loop.nextitem }}{% endfor %}",
    "{% for x in [1, [2, [3]]] recursive %}{% if x is iterable %}[{{ loop(x) }}]{% else %}{{ x }}{% endif %}"
    "{% endfor %}",
    "{% macro m(x) %}<{{ caller(x) }}>{% endmacro %}{% call(y) m(2) %}{{ y * 'ab' }}{% endcall %}",
    "{% set x %}{{ 'a' ~ 1 ~ none }}{% endset %}{{ x|upper }}{% filter title %}b c{% endfilter %}",
    "{{ '%s=%05.1f|%(k)s' % ('a', 2.25, {'k': 1}) if false else '%s=%05.1f' % ('a', 2.25) }}",
    "{{ '{:>6}|{:.2f}|{k}'.format('ab', 3.14159, k=[1]) }}{{ '{a}'.format_map({'a': 7}) }}",
    "{{ 'x'|center(7) }}|{{ 'a\nb'|indent(2, first=true) }}|{{ 'aaa bbb ccc'|wordwrap(4) }}",
    "{{ 'hello world'|truncate(8, leeway=0) }}|{{ 'aXbX'|replace('X', '-', 1) }}|{{ [1, 2]|join('+') }}",
    "{{ [[1], [2]]|sum(start=[]) }}{{ [1, 2, 3]|batch(2, 0)|list }}{{ [1, 2, 3]|slice(2)|list }}",
    "{{ messages|tojson }}{{ {'b': [1, {'c': 'é'}]}|tojson(indent=2) }}{{ messages[0]|pprint }}",
    "{{ 'ab'.ljust(4, '.') }}{{ '7'.zfill(3) }}{{ '-'.join(['a', 'b']) }}{{ 'a\tb'.expandtabs(4) }}",
    "{{ [1] + [2] }}{{ (1, 2) * 2 }}{{ 2 ** 10 }}{{ 6 * 7 }}{{ 'ab' * 3 }}{{ 7 % 3 }}{{ none ~ 'x' }}",
    "{{ {}.fromkeys('ab', 0) }}{{ dict(a=1) }}{{ range(3)|list }}{{ lipsum(1, false, 5, 6)|wordcount > 0 }}",
]


@pytest.mark.parametrize("template", JINJA_CONSTRUCTS, ids=range(len(JINJA_CONSTRUCTS)))
def test_the_budgeted_sandbox_renders_as_jinjas_own(tokenizer, template):
    """The deadline, the bound and their hooks change no output: every construct they touch
    renders as in jinja's own immutable sandbox (transformers' environment)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = chat_template._tojson  # transformers' own (non-ASCII kept, keys in order)
    expected = env.from_string(template).render(messages=CONVERSATIONS[1], add_generation_prompt=True)
    assert expected
    assert render_chat(tokenizer, CONVERSATIONS[1], template=template) == expected
