"""The front door checks a request once: on the event loop for the server, in add_request offline;
the engine thread does bookkeeping only."""

from __future__ import annotations

import asyncio

from pagedllm import SamplingParams
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputProcessor


def _spy_on_prompt_scans(monkeypatch) -> list[str]:
    """The names of the threads that scanned a prompt's ids against the vocabulary."""
    import threading

    scans: list[str] = []
    check = InputProcessor._check_token_ids

    def spy(self, name, token_ids, allow_empty=False):
        if name == "prompt_token_ids":
            scans.append(threading.current_thread().name)
        return check(self, name, token_ids, allow_empty)

    monkeypatch.setattr(InputProcessor, "_check_token_ids", spy)
    return scans


def test_a_server_request_is_validated_once_on_the_event_loop(llm, monkeypatch):
    core = llm.llm_engine.core
    monkeypatch.setattr(core, "close", lambda: None)  # the shared core outlives this AsyncLLM
    scans = _spy_on_prompt_scans(monkeypatch)
    tokenizer = llm.get_tokenizer()
    prompt_ids = tokenizer("One front door").input_ids
    processor = InputProcessor.for_model(core.facts, tokenizer, core.config.max_logprobs)

    async def main():
        async_llm = AsyncLLM(core, processor, OutputProcessor(tokenizer))
        assert async_llm.input_processor is not llm.llm_engine.input_processor  # its own front door
        async_llm.start()
        try:
            stream = await async_llm.generate(
                [{"prompt_token_ids": prompt_ids}],
                SamplingParams(temperature=0.0, max_tokens=2, n=2),
                request_id="r",
            )
            return await stream.collect()
        finally:
            await async_llm.shutdown()

    outputs = asyncio.run(main())
    assert [o.request_id for o in outputs] == ["r-0", "r-1"]
    assert all(o.prompt_token_ids == prompt_ids and o.finished for o in outputs)
    assert scans == ["MainThread"]  # once for the prompt (not per choice), never on the engine thread


def test_an_offline_request_is_validated_once(llm, monkeypatch):
    scans = _spy_on_prompt_scans(monkeypatch)
    outputs = llm.generate(["One front door"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert outputs[0].finished and scans == ["MainThread"]
