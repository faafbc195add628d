"""What every `pagedllm eval` check measures the same way: the fixed eval set (eval/data/),
teacher-forced perplexity through the paged path, greedy runs, where two greedy runs part."""

from __future__ import annotations

import json
import math
from importlib import resources

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


def load_eval_set(name: str) -> list[str]:
    """`texts` (a few KB of varied English) or `prompts` (8 prompt openings)."""
    data = resources.files("pagedllm.eval").joinpath("data", f"{name}.json")
    return json.loads(data.read_text(encoding="utf-8"))


def run_generation(engine: LLMEngine, prompts: list, params: SamplingParams) -> list[RequestOutput]:
    """Every prompt to completion, outputs in the prompts' order."""
    req_ids = [engine.add_request(None, prompt, params) for prompt in prompts]
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step() if o.finished)
    return [finished[req_id] for req_id in req_ids]


def perplexity(engine: LLMEngine, texts: list[str]) -> tuple[float, int, bool]:
    """(perplexity, tokens scored, all logprobs finite) of the texts, teacher-forced through the
    paged path; each text is cut to max_model_len - 1 tokens."""
    limit = engine.max_model_len - 1
    prompts = [{"prompt_token_ids": engine.tokenizer(text).input_ids[:limit]} for text in texts]
    outputs = run_generation(
        engine, prompts, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    )
    logprobs = [
        position[token_id].logprob
        for output in outputs
        for token_id, position in zip(output.prompt_token_ids, output.prompt_logprobs or [], strict=True)
        if position is not None
    ]
    return math.exp(-sum(logprobs) / len(logprobs)), len(logprobs), all(map(math.isfinite, logprobs))


def tokens_until_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
