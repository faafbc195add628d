"""POST /v1/embeddings through the OpenAI SDK against the shared server: the vectors equal the
offline engine's (LLM.embed: tests/engine/test_embeddings.py checks those against transformers),
in the inputs' order, as floats or base64, cut to `dimensions`; bad input gets a 400 naming the
field, and the server goes on serving. --runner / --task pick the routes."""

from __future__ import annotations

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from pagedllm import PoolingParams
from pagedllm.entrypoints.openai import routes_v1
from pagedllm.entrypoints.openai.server_config import ServerConfig

from ..helpers import API_KEY, MODEL

GENERATION = {"/v1/completions", "/v1/chat/completions"}
POOLING = {"/v1/embeddings", "/rerank", "/v1/rerank", "/v2/rerank", "/score"}
TEXTS = ["The cat sat on the mat.", "Paged attention keeps the KV cache in blocks.", "Bonjour"]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def cosine_gap(a, b) -> float:
    a, b = torch.tensor(a), torch.tensor(b)
    return 1 - float(a @ b / (a.norm() * b.norm()))


def test_the_sdk_gets_the_offline_engines_vectors_in_order(client, llm):
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    offline = llm.embed(TEXTS, use_tqdm=False)
    assert [d.index for d in response.data] == [0, 1, 2]
    for data, ours in zip(response.data, offline, strict=True):
        assert len(data.embedding) == len(ours.outputs.embedding)
        assert cosine_gap(data.embedding, ours.outputs.embedding) < 1e-5
    tokens = sum(len(o.prompt_token_ids) for o in offline)
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def test_base64_token_ids_and_dimensions(server, client, llm):
    ids = llm.get_tokenizer().encode(TEXTS[1])
    as_floats = client.embeddings.create(model=MODEL, input=ids, encoding_format="float").data[0].embedding
    raw = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": MODEL, "input": ids, "encoding_format": "base64"},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    ).json()["data"][0]["embedding"]
    decoded = np.frombuffer(base64.b64decode(raw), dtype="<f4")
    assert np.allclose(decoded, as_floats, atol=1e-6)
    cut = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64).data[0].embedding
    offline = llm.embed(TEXTS[0], PoolingParams(dimensions=64), use_tqdm=False)[0].outputs.embedding
    assert len(cut) == 64 and cosine_gap(cut, offline) < 1e-5


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"input": ""}, "input[0]: an empty input"),
        ({"input": []}, "input: the input list is empty"),
        ({"input": ["fine", ""]}, "input[1]: an empty input"),
        ({"input": ["x"] * 1025}, "input: 1,025 inputs is over the limit"),
        ({"input": "x", "dimensions": 0}, "dimensions: must be in"),
        ({"input": "x", "dimensions": 10**6}, "dimensions: must be in"),
        ({"input": [10**9]}, "prompt_token_ids"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_input_is_a_400_and_the_server_goes_on(client, body, message):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, **body)
    assert message in str(caught.value)
    assert client.embeddings.create(model=MODEL, input="still serving").data[0].embedding


@pytest.mark.parametrize(
    ("flags", "served"),
    [
        ({}, GENERATION | POOLING),
        ({"runner": "generate"}, GENERATION),
        ({"runner": "pooling"}, POOLING),
        ({"task": "embed"}, POOLING),
        ({"task": "score", "runner": "pooling"}, POOLING),
        ({"task": "generate"}, GENERATION),
    ],
)
def test_the_runner_picks_the_routes_as_vllms_does(flags, served):
    """vLLM registers a pooling model's routes and not a generator's (a 404 for the others)."""
    runner = ServerConfig(**flags).serves
    router = routes_v1.make_router(None, None, None, None, None, None, runner)  # type: ignore[arg-type]
    assert {route.path for route in router.routes} == served | {"/v1/models"}


def test_a_task_that_contradicts_the_runner_is_refused():
    with pytest.raises(ValueError, match="--task embed asks for --runner pooling, not generate"):
        ServerConfig(task="embed", runner="generate")
