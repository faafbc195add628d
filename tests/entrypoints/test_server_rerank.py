"""POST /rerank (and /v1/rerank, /v2/rerank) and /score against the shared server: each document's
score is the offline engine's (LLM.score: tests/engine/test_embeddings.py checks it against
transformers), results best first with Jina's and Cohere's field names, top_n and
return_documents honoured; bad input gets a 400 naming the field, and the server goes on."""

from __future__ import annotations

import httpx
import pytest

from ..helpers import API_KEY, MODEL

QUERY = "Which animal barks?"
DOCUMENTS = ["Dogs bark at strangers.", "Paris is the capital of France.", "Cats purr when content."]


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120) as c:
        yield c


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_the_documents_by_the_engines_scores(http, llm, path):
    offline = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    body = http.post(path, json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS}).json()
    results = body["results"]
    assert [r["index"] for r in results] == sorted(range(3), key=lambda i: -offline[i])
    for result in results:
        assert result["relevance_score"] == pytest.approx(offline[result["index"]], abs=1e-4)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert body["model"] == MODEL and body["usage"]["total_tokens"] > 0


def test_top_n_documents_as_objects_and_no_documents_returned(http):
    body = {
        "model": MODEL,
        "query": QUERY,
        "documents": [{"text": d} for d in DOCUMENTS],
        "top_n": 2,
        "return_documents": False,
    }
    results = http.post("/rerank", json=body).json()["results"]
    assert len(results) == 2 and all("document" not in r for r in results)
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]


def test_score_pairs_one_query_against_each_text(http, llm):
    offline = [o.outputs.score for o in llm.score(QUERY, DOCUMENTS, use_tqdm=False)]
    body = http.post("/score", json={"model": MODEL, "text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["score"] for d in body["data"]] == pytest.approx(offline, abs=1e-4)
    pairwise = http.post("/score", json={"model": MODEL, "text_1": [QUERY] * 3, "text_2": DOCUMENTS}).json()
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(offline, abs=1e-4)


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/rerank", {"query": QUERY, "documents": []}, "documents: the list is empty"),
        ("/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n: must be >= 1"),
        ("/rerank", {"query": QUERY, "documents": ["x"] * 1025}, "over the limit"),
        ("/rerank", {"query": QUERY}, "documents"),
        ("/score", {"text_1": ["a", "b"], "text_2": DOCUMENTS}, "text_1: 2 texts against 3"),
    ],
)
def test_bad_input_is_a_400_and_the_server_goes_on(http, path, body, message):
    response = http.post(path, json={"model": MODEL, **body})
    assert response.status_code == 400 and message in response.json()["error"]["message"]
    again = http.post("/rerank", json={"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    assert again.status_code == 200
