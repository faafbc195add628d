"""Speculative decoding with structured output: a draft is cut before the first token the grammar
does not allow, each position a step samples at is masked by the grammar's state there, and the
output is what plain constrained decoding gives (greedy float32: the same tokens) or follows the
grammar (sampled)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.backend import RequestGrammar
from pagedllm.structured_output.bitmask import fill_bitmask

from ..helpers import TEST_ENGINE_ARGS, rows_free

ITEM = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "maxLength": 40},
        "quantity": {"type": "integer", "minimum": 0, "maximum": 1000},
        "colour": {"type": "string", "enum": ["red", "green", "blue"]},
    },
    "required": ["product", "quantity", "colour"],
    "additionalProperties": False,
}
ORDER = '{"product": "garden chair", "quantity": 12, "colour": "green"}'
PROMPTS = [
    f"The order, as JSON: {ORDER}\nThe same order again, as JSON: ",
    f"Orders: {ORDER}, {ORDER.replace('12', '7')}\nThe first order, as JSON: ",
]


def _grammar(llm: LLM, **spec) -> RequestGrammar:
    processor = llm.llm_engine.input_processor
    return RequestGrammar(processor.compile_grammar(StructuredOutputsParams(**spec)))


def _fill(grammar: RequestGrammar) -> torch.Tensor:
    bitmask = xgrammar.allocate_token_bitmask(1, grammar.vocab_size)
    grammar.fill_bitmask(bitmask, 0)
    return bitmask[0].clone()


def test_a_draft_is_valid_up_to_the_first_token_the_grammar_refuses(llm):
    grammar = _grammar(llm, json=json.dumps(ITEM))
    encode = llm.get_tokenizer().encode
    tokens = encode(ORDER, add_special_tokens=False)
    head = encode('{"product": "garden chair", "quantity": 12', add_special_tokens=False)
    refused = encode("]", add_special_tokens=False)  # not after a number, nor first
    before = _fill(grammar)
    assert grammar.valid_prefix(tokens) == len(tokens)
    assert grammar.valid_prefix(head + refused + tokens) == len(head)
    assert grammar.valid_prefix(refused + tokens) == 0
    assert torch.equal(_fill(grammar), before)  # the matcher is where it was


def test_the_bitmask_has_each_position_s_row_as_plain_decoding_would_fill_it(llm):
    tokens = llm.get_tokenizer().encode(ORDER, add_special_tokens=False)
    speculating, plain = _grammar(llm, json=json.dumps(ITEM)), _grammar(llm, json=json.dumps(ITEM))
    for token_id in tokens[:3]:  # somewhere inside the output
        assert speculating.accept(token_id) and plain.accept(token_id)
    draft = tokens[3:8]
    free = _grammar(llm, regex="[a-z]+")
    filled = fill_bitmask([("spec", speculating, draft), ("free", free, [])])
    assert filled is not None and not filled.failed
    assert filled.rows == [("spec", i) for i in range(len(draft) + 1)] + [("free", 0)]
    for i in range(len(draft) + 1):
        assert torch.equal(filled.bitmask[i], _fill(plain)), i
        if i < len(draft):
            assert plain.accept(draft[i])
    assert torch.equal(_fill(speculating), _fill(_grammar_after(llm, tokens[:3])))


def _grammar_after(llm: LLM, tokens: list[int]) -> RequestGrammar:
    grammar = _grammar(llm, json=json.dumps(ITEM))
    for token_id in tokens:
        assert grammar.accept(token_id)
    return grammar


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return rows_free(
        LLM(
            **TEST_ENGINE_ARGS,
            speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
            max_num_seqs=4,
        )
    )


def _constrained(**fields) -> SamplingParams:
    return SamplingParams(structured_outputs=StructuredOutputsParams(json=json.dumps(ITEM)), **fields)


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_greedy_constrained_output_is_the_same_with_speculation(llm, spec_llm):
    params = [
        _constrained(temperature=0.0, max_tokens=48),
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),  # a free request beside them
        SamplingParams(
            temperature=0.0,
            max_tokens=16,
            structured_outputs=StructuredOutputsParams(regex=r'\{"product": "[a-z ]+'),
        ),
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    want = llm.generate(prompts, params, use_tqdm=False)
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    for w, g in zip(want, got, strict=True):
        assert (g.outputs[0].token_ids, g.outputs[0].finish_reason) == (
            w.outputs[0].token_ids,
            w.outputs[0].finish_reason,
        )
    jsonschema.validate(json.loads(got[0].outputs[0].text), ITEM)
    for constrained in (got[0], got[2]):  # they checked drafts and kept some
        assert constrained.draft_tokens is not None and constrained.draft_tokens[1] > 0, (
            constrained.draft_tokens
        )


def test_sampled_constrained_output_follows_the_grammar_with_speculation(spec_llm):
    outputs = spec_llm.generate(
        PROMPTS * 4, _constrained(temperature=0.8, max_tokens=64, seed=None), use_tqdm=False
    )
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(output.outputs[0].text), ITEM)
    assert sum(output.draft_tokens[1] for output in outputs) > 0


FORM = {
    "type": "object",
    "properties": {
        "customer_full_name": {"type": "string", "maxLength": 30},
        "delivery_street_address": {"type": "string", "maxLength": 40},
        "number_of_items_ordered": {"type": "integer", "minimum": 1, "maximum": 99},
    },
    "required": ["customer_full_name", "delivery_street_address", "number_of_items_ordered"],
    "additionalProperties": False,
}


@pytest.mark.slow  # make test-fast leaves it out (one of the longest here)
def test_tokens_the_grammar_forces_are_checked_as_drafts(llm):
    """No JSON in the prompt for the n-gram proposer to copy: the drafts are the schema's keys,
    which the grammar forces; the output is plain constrained decoding's."""
    spec = rows_free(
        LLM(
            **TEST_ENGINE_ARGS,
            speculative_config={"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_min": 4},
        )
    )
    params = SamplingParams(
        temperature=0.0,
        max_tokens=80,
        structured_outputs=StructuredOutputsParams(json=json.dumps(FORM), disable_any_whitespace=True),
    )
    prompt = "A customer called to order garden chairs. Their order, as a form: "
    want = llm.generate(prompt, params, use_tqdm=False)[0]
    got = spec.generate(prompt, params, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    jsonschema.validate(json.loads(got.outputs[0].text), FORM)
    assert got.draft_tokens is not None and got.draft_tokens[1] >= 10, got.draft_tokens  # the keys' tokens


def test_a_draft_may_end_with_the_stop_token_where_the_grammar_ends(llm):
    """The draft `yes <eos>` where the grammar is `yes | no`: the rows after the stop token allow
    everything (the request ends there), no failure, and the matcher is left where it was."""
    grammar = _grammar(llm, choice=["yes", "no"])
    tokens = llm.get_tokenizer().encode("yes", add_special_tokens=False)
    eos = llm.get_tokenizer().eos_token_id
    before = _fill(grammar)
    assert grammar.valid_prefix([*tokens, eos, *tokens]) == len(tokens) + 1
    filled = fill_bitmask([("r", grammar, [*tokens, eos])])
    assert filled is not None and not filled.failed and not filled.dead_ends
    assert bool((filled.bitmask[len(tokens) + 1] == -1).all())  # after the stop token
    assert torch.equal(_fill(grammar), before)


class _DeadEndAfterThree:
    """A grammar that allows tokens below 100 and whose state after three tokens admits none."""

    vocab_size = 128

    def __init__(self) -> None:
        self.num_accepted = 0
        self.is_terminated = False

    def accept(self, token_id: int) -> bool:
        if token_id >= 100 or self.num_accepted == 3:
            return False
        self.num_accepted += 1
        return True

    def valid_prefix(self, tokens: list[int]) -> int:
        return min(len(tokens), 3 - self.num_accepted)

    def forced_tokens(self) -> list[int]:
        return []

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, draft: list[int]) -> None:
        for i in range(len(draft) + 1):
            bitmask[row + i] = 0 if self.num_accepted + i >= 3 else -1


def test_a_dead_end_after_draft_tokens_keeps_the_tokens_before_it_and_fails_as_plain_decoding():
    from pagedllm.core.outputs import ModelRunnerOutput
    from pagedllm.structured_output.bitmask import DEAD_END

    from ..helpers import fake_run, make_request, make_scheduler

    scheduler = make_scheduler(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    request = make_request("r", 6, max_tokens=20)
    request.grammar = _DeadEndAfterThree()  # type: ignore[assignment]
    scheduler.add_request(request)
    output = scheduler.schedule()  # the prompt, and a first token
    scheduler.grammar_bitmask(output)
    scheduler.update_from_output(output, fake_run(scheduler, output, token=3, next_draft=[7, 8, 9]))
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {"r": [7, 8]}  # cut where the grammar ends
    bitmask = scheduler.grammar_bitmask(output)
    assert bitmask is not None and bitmask.dead_ends == {"r": 2} and not bitmask.failed
    assert bool((bitmask.bitmask[2] == -1).all())
    runner_output = ModelRunnerOutput({"r": [7, 8, 50]}, grammar_dead_ends=bitmask.dead_ends)
    (failed,) = scheduler.update_from_output(output, runner_output)
    assert failed.new_token_ids == [7, 8] and failed.error == DEAD_END
    assert failed.finish_reason == "error" and "r" not in scheduler.requests
