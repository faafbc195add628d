"""Structured output (xgrammar): the offline API. Outputs parse and validate; greedy constrained
tokens equal transformers' argmax over the same grammar mask; free requests sharing a step with
constrained ones are untouched; bad grammars are a ValueError naming the field."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest
import torch
import xgrammar

from pagedllm import SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

from ..schema_bombs import LINKED_LIST, TREE, ref_chain_schema_text, ref_diamond_schema

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Alice", "Bob", "Carol"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PROMPT = "Here is a person described as JSON, with a name, an age and a city:\n"


def constrained(max_tokens: int = 64, **grammar) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**grammar)
    )


def test_json_schema_output_validates(llm):
    out = llm.generate([PROMPT], constrained(json=PERSON), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), PERSON)


def test_each_kind_of_grammar(llm):
    moods = ["positive", "negative", "neutral"]
    kinds = {
        "regex": (dict(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        "choice": (dict(choice=moods), lambda t: t in moods),
        "grammar": (dict(grammar='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),
        "json_object": (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        "json text": (
            dict(json=json.dumps(PERSON)),
            lambda t: jsonschema.validate(json.loads(t), PERSON) is None,
        ),
    }
    prompts = ["The phone number is ", "The review 'I loved it' is ", "Is water wet? ", PROMPT, PROMPT]
    outputs = llm.generate(prompts, [constrained(**grammar) for grammar, _ in kinds.values()], use_tqdm=False)
    for (name, (_, check)), output in zip(kinds.items(), outputs, strict=True):
        text = output.outputs[0].text
        assert output.outputs[0].finish_reason == "stop", (name, text)
        assert check(text), (name, text)


@pytest.mark.slow  # the fast set keeps the constrained path against transformers
def test_free_requests_in_a_constrained_batch_are_untouched(llm):
    """Free greedy rows sharing steps with constrained rows give what they give alone."""
    free_prompts = ["The capital of France is", "def fibonacci(n):"]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(free_prompts, free, use_tqdm=False)]
    mixed = llm.generate(
        [free_prompts[0], PROMPT, free_prompts[1], PROMPT],
        [free, constrained(json=PERSON), free, constrained(regex="[a-z]+ [a-z]+")],
        use_tqdm=False,
    )
    assert [mixed[0].outputs[0].token_ids, mixed[2].outputs[0].token_ids] == alone
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), PERSON)
    assert re.fullmatch("[a-z]+ [a-z]+", mixed[3].outputs[0].text)


def test_greedy_constrained_tokens_equal_transformers_under_the_same_mask(llm, reference):
    """The reference: transformers' float32 logits, xgrammar's mask for the same schema applied
    by hand, argmax; step by step until the grammar ends."""
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer(PROMPT).input_ids
    ours = llm.generate([{"prompt_token_ids": prompt_ids}], constrained(json=PERSON), use_tqdm=False)
    ours_ids = ours[0].outputs[0].token_ids

    vocab = reference.model.config.vocab_size
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab, stop_token_ids=[2])
    matcher = xgrammar.GrammarMatcher(
        xgrammar.GrammarCompiler(info).compile_json_schema(json.dumps(PERSON), any_whitespace=False)
    )
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    logits, cache = reference.extend(prompt_ids)
    ref: list[int] = []
    while not matcher.is_terminated() and len(ref) < 64:
        matcher.fill_next_token_bitmask(bitmask)
        xgrammar.apply_token_bitmask_inplace(logits, bitmask)
        top2 = logits[0].topk(2).values
        token = int(logits[0].argmax())
        if len(ref) < len(ours_ids) and ours_ids[len(ref)] != token:
            gap = float(top2[0] - top2[1])
            assert gap < 1e-3, (
                f"step {len(ref)}: ours {ours_ids[len(ref)]} != reference {token} (gap {gap:.2e})"
            )
            return  # a near tie: the comparison ends there
        assert matcher.accept_token(token)
        ref.append(token)
        logits, cache = reference.extend([token], cache)
    assert ours_ids == ref


@pytest.mark.slow  # four sampled replies of 64 tokens; the greedy test checks the path against transformers
def test_sampled_choices_follow_the_grammar(llm):
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=7,
        max_tokens=64,
        structured_outputs=StructuredOutputsParams(json=PERSON),
    )
    for completion in llm.generate([PROMPT], params, use_tqdm=False)[0].outputs:
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), PERSON)
        else:  # cut by max_tokens: a prefix the grammar allows
            assert completion.finish_reason == "length"


@pytest.mark.parametrize(
    ("grammar", "field"),
    [
        (dict(regex="("), "structured_outputs.regex"),
        (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar"),
        (dict(choice=["\U00040000"]), "structured_outputs.choice"),  # no token can begin it
        (
            dict(json={"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}),
            "structured_outputs.json",
        ),
    ],
)
def test_a_bad_grammar_is_a_value_error_and_harms_no_one(llm, grammar, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["Hi"], constrained(**grammar), use_tqdm=False)
    assert (
        llm.generate(["Hi"], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0].outputs[0].text
    )


def _nested_dict(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


def test_schemas_within_the_limits_pass():
    StructuredOutputsParams(json=_nested_dict(64))
    StructuredOutputsParams(json='{"a": ' * 63 + '"[[[[{{{{ brackets in a string"' + "}" * 63)
    StructuredOutputsParams(json={"$defs": {"a": {"type": "string"}}, "$ref": "#/$defs/a"})
    StructuredOutputsParams(json=ref_chain_schema_text(20))  # 20 objects deep through $ref
    StructuredOutputsParams(json=ref_diamond_schema(12))  # 2**12 objects written out
    StructuredOutputsParams(json=LINKED_LIST)  # recursion: a rule calling itself to xgrammar
    StructuredOutputsParams(json=TREE)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"json": "[1, 2]"}, "a JSON schema is an object"),
        ({"choice": []}, "non-empty list"),
        ({"json_object": False, "regex": ""}, "non-empty string"),
        ({"regex": "a" * 70_000}, "over the limit"),
        ({"regex": "\ud800"}, "lone surrogate"),
        ({"json": "[" * 30_000 + "]" * 30_000}, "nested deeper than 64"),  # no RecursionError
        ({"json": '{"a": ' * 65 + "1" + "}" * 65}, "nested deeper than 64"),
        ({"json": _nested_dict(65)}, "nested deeper than 64"),
        ({"json": {"$ref": "https://example.com/schema.json"}}, "points outside the schema"),
        ({"json": "{" * 70_000}, "over the limit"),  # the size first: the depth scan is linear anyway
        ({"json": ref_chain_schema_text(450)}, r"nested deeper than 64 .*counting each \$ref"),
        ({"json": ref_chain_schema_text(40)}, r"nested deeper than 64 .*counting each \$ref"),
        ({"json": ref_diamond_schema(20)}, r"over 100,000 objects and lists once each \$ref"),
        ({"json": ref_diamond_schema(6, width=10)}, "over 100,000 objects and lists"),
    ],
)
def test_structured_outputs_params_checks(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_the_bitmask_only_touches_constrained_rows():
    from pagedllm.structured_output.bitmask import GrammarBitmask, apply_bitmask

    logits = torch.zeros(3, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2 allowed
    apply_bitmask(logits, GrammarBitmask([("b", 0)], bitmask), {"a": 0, "b": 1, "c": 2})
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0, 2]


def test_ref_bombs_are_refused_quickly_and_say_the_limit_counts_through_ref():
    """The 42 KB chain of issue 45 nests 900 objects once written out; a 50 KB diamond would be
    2**500: measured without writing either out, and the message no longer offers $defs as the
    way around the depth limit."""
    for schema in (ref_chain_schema_text(450), json.dumps(ref_diamond_schema(500))):
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"once each \$ref|counting each \$ref") as error:
            StructuredOutputsParams(json=schema)
        assert time.monotonic() - start < 30  # measured, not written out: 2**500 nodes never end
        assert "$defs" not in str(error.value)
