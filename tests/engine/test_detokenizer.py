"""Incremental text equals a full decode; stop strings cut the text and end the request."""

from __future__ import annotations

from pagedllm import SamplingParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer


def test_incremental_text_equals_full_decode(llm):
    tokenizer = llm.get_tokenizer()
    text = "Héllo wörld! 你好吗? naïve café — emoji 🚀 and code `x = 1`."
    ids = tokenizer(text).input_ids
    prompt, output = ids[:3], ids[3:]
    detok = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    for token_id in output:
        detok.append([token_id])
    assert detok.output_text == tokenizer.decode(output)


def test_stop_string_is_cut_and_held_back_while_streaming(llm):
    tokenizer = llm.get_tokenizer()
    ids = tokenizer("one two three STOP four").input_ids
    detok = IncrementalDetokenizer(tokenizer, ids[:1], SamplingParams(stop=["STOP"]))
    shown = []
    stop = None
    for token_id in ids[1:]:
        stop = detok.append([token_id])
        shown.append(detok.visible_text(finished=stop is not None))
        if stop:
            break
    assert stop == "STOP"
    assert detok.output_text == " two three "
    assert all("ST" not in s for s in shown), "a half stop string was shown"


def test_stop_string_ends_generation_in_the_engine(llm):
    params = SamplingParams(temperature=0, max_tokens=40)
    full = llm.generate("Count: 1, 2, 3,", params, use_tqdm=False)[0].outputs[0].text
    stop = full.strip().split()[2]  # a word the model will produce
    cut = llm.generate(
        "Count: 1, 2, 3,", SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False
    )[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full[: full.index(stop)]
    kept = llm.generate(
        "Count: 1, 2, 3,",
        SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full[: full.index(stop) + len(stop)]
    assert not llm.llm_engine.has_unfinished_requests()


def test_stop_token_ids_and_finish_reasons(llm):
    base = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10
    stop_id = base.token_ids[4]
    cut = llm.generate(
        "Once upon a time",
        SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    first = base.token_ids.index(stop_id)
    assert cut.token_ids == base.token_ids[: first + 1]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop_id
