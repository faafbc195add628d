"""Embeddings (pooling_params.py): a prompt's last token's final hidden state, normed and
normalized, equal to transformers' on the same random Qwen3 (float32); through chunked prefills,
prefix-cache hits and beside generation requests in the same steps, which it leaves as they were.
Reranking scores (rerank_prompt.py): P("yes") over "yes" and "no" at the prompt's last position,
equal to transformers' on the same prompt."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.rerank_prompt import reranker_prompt, yes_no_tokens

from ..helpers import TINY, save_with_random_norms

PROMPTS = [[5, 17, 300, 42, 9, 11] * k for k in (1, 3, 7)]  # 6 to 42 tokens: chunked at 16
COSINE = 1e-4
"""1 - cosine allowed against transformers in float32 (seen: under 1e-6)."""


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**TINY, head_dim=16), dtype=torch.float32)
    folder = tmp_path_factory.mktemp("qwen3-embedding")
    save_with_random_norms(model, folder)
    llm = LLM(
        str(folder),
        dtype="float32",
        max_model_len=256,
        max_num_batched_tokens=16,
        max_num_seqs=8,
        kv_cache_memory_bytes="64MiB",
        enable_prefix_caching=True,
        disable_log_stats=True,
    )
    yield model, llm
    llm.shutdown()


@torch.inference_mode()
def reference(model, ids: list[int]) -> torch.Tensor:
    """transformers' last hidden state (after the final norm) of the prompt's last token."""
    return model.model(torch.tensor([ids])).last_hidden_state[0, -1]


def embed(llm: LLM, prompts, params: PoolingParams | None = None) -> list[torch.Tensor]:
    outputs = llm.embed([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
    return [torch.tensor(output.outputs.embedding) for output in outputs]


def test_embeddings_equal_transformers_last_token_pooled_and_normalized(qwen3):
    model, llm = qwen3
    for ids, ours in zip(PROMPTS, embed(llm, PROMPTS), strict=True):
        theirs = F.normalize(reference(model, ids), dim=-1)
        assert abs(float(ours.norm()) - 1) < 1e-5
        assert 1 - float(ours @ theirs) < COSINE, f"prompt of {len(ids)} tokens"


def test_dimensions_keep_the_first_values_then_normalize(qwen3):
    model, llm = qwen3
    (ours,) = embed(llm, PROMPTS[1:2], PoolingParams(dimensions=24))
    theirs = F.normalize(reference(model, PROMPTS[1])[:24], dim=-1)
    assert ours.shape == (24,) and 1 - float(ours @ theirs) < COSINE
    (raw,) = embed(llm, PROMPTS[1:2], PoolingParams(normalize=False))
    assert torch.allclose(raw, reference(model, PROMPTS[1]), atol=1e-4)


def test_a_cached_prefix_gives_the_same_embedding(qwen3):
    _, llm = qwen3
    llm.reset_prefix_cache()
    first = llm.embed({"prompt_token_ids": PROMPTS[2]}, use_tqdm=False)[0]
    hits_before = llm.llm_engine.get_stats().prefix_cache.hits
    again = llm.embed({"prompt_token_ids": PROMPTS[2]}, use_tqdm=False)[0]
    assert llm.llm_engine.get_stats().prefix_cache.hits > hits_before  # two full blocks reused
    assert torch.allclose(
        torch.tensor(first.outputs.embedding), torch.tensor(again.outputs.embedding), atol=1e-6
    )


def test_embedding_requests_share_steps_with_generation_and_leave_it_unchanged(qwen3):
    """Generation requests alone, then the same beside embedding requests in one engine: the same
    tokens, and every embedding as when computed alone; every block back at the end."""
    _, llm = qwen3
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy)]
    embedded_alone = embed(llm, PROMPTS)
    engine = llm.llm_engine
    pool = PoolingParams()
    for i, ids in enumerate(PROMPTS):
        engine.add_request(f"gen-{i}", {"prompt_token_ids": ids}, greedy)
        engine.add_request(f"emb-{i}", {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, pooling=pool))
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    for i in range(len(PROMPTS)):
        assert finished[f"gen-{i}"].outputs[0].token_ids == alone[i]
        assert finished[f"emb-{i}"].outputs[0].token_ids == []  # no token sampled
        mixed = torch.tensor(finished[f"emb-{i}"].embedding)
        assert torch.allclose(mixed, embedded_alone[i], atol=1e-5)
    stats = engine.get_stats()
    assert stats.num_running_reqs == 0 and stats.kv_cache_usage == 0.0


def test_rerank_scores_equal_transformers_yes_over_no(qwen3):
    model, llm = qwen3
    tokenizer = llm.get_tokenizer()
    no, yes = yes_no_tokens(tokenizer)
    query, documents = "what is a paged KV cache", ["blocks of keys and values", "a recipe for bread", "yes"]
    ours = [o.outputs.score for o in llm.score(query, documents, use_tqdm=False)]
    for document, score in zip(documents, ours, strict=True):
        ids = tokenizer.encode(reranker_prompt(query, document), add_special_tokens=False)
        with torch.inference_mode():
            last = model(torch.tensor([ids])).logits[0, -1]
        theirs = float(torch.softmax(last[[no, yes]], dim=-1)[1])
        assert abs(score - theirs) < 1e-5, document
    assert len(set(ours)) == 3  # the documents are told apart


def test_bad_pooling_settings_are_refused():
    with pytest.raises(ValueError, match="dimensions: must be an integer >= 1"):
        PoolingParams(dimensions=0)
    with pytest.raises(ValueError, match="normalize: must be true or false"):
        PoolingParams(normalize="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="score_tokens: must be two token ids"):
        PoolingParams(score_tokens=(1,))  # type: ignore[arg-type]
