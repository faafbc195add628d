"""benchmarks/quantized_models/write_gguf.py's files, which every GGUF figure in the docs is
measured on: a `-real` shape's vocabulary padded to the released model's size (and its own LM head
where that model's is untied), and Q4_K_M in llama-quantize's mix of types (the LM head and a third
of the layers' attn_v / ffn_down in Q6_K, the rest Q4_K); pagedllm loads and runs what it writes."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import gguf
import pytest

from pagedllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "quantized_models"))
from write_gguf import SHAPES, Shape, use_more_bits, write_shape

Q = gguf.GGMLQuantizationType
TINY = Shape("llama", 256, 9, 4, 2, 64, 512, 10000.0, 1e-5, vocab_size=50000, tie_word_embeddings=False)


def test_use_more_bits_is_llama_cpps_rule():
    # 16 layers (Llama-3.2-1B): layers 0, 1 (first eighth), 14, 15 (last), and 4, 7, 10, 13
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


def test_real_shapes_have_the_released_vocabularies():
    assert SHAPES["llama-1b-real"].vocab_size == 128256 and SHAPES["llama-1b-real"].tie_word_embeddings
    assert SHAPES["qwen3-1.7b-real"].vocab_size == 151936
    assert not SHAPES["llama-8b-real"].tie_word_embeddings
    assert (
        dataclasses.replace(SHAPES["llama-1b-real"], vocab_size=0, tie_word_embeddings=True)
        == SHAPES["llama-1b"]
    )


def written_types(shape: Shape, path: Path) -> dict[str, gguf.GGMLQuantizationType]:
    write_shape(shape, "tiny", "Q4_K_M", path, seed=0, context_length=512)
    return {t.name: Q(t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}


@pytest.mark.parametrize("tied", [False, True])
def test_q4_k_m_is_written_in_llama_quantizes_mix(tmp_path, tied):
    shape = dataclasses.replace(TINY, tie_word_embeddings=tied)
    types = written_types(shape, tmp_path / "tiny-Q4_K_M.gguf")
    head = "token_embd.weight" if tied else "output.weight"
    assert types[head] == Q.Q6_K and types["blk.0.attn_q.weight"] == Q.Q4_K
    for layer in range(shape.num_hidden_layers):
        expected = Q.Q6_K if use_more_bits(layer, shape.num_hidden_layers) else Q.Q4_K
        assert types[f"blk.{layer}.attn_v.weight"] == types[f"blk.{layer}.ffn_down.weight"] == expected
    assert ("output.weight" in types) is not tied and (tied or types["token_embd.weight"] == Q.Q4_K)


@pytest.mark.slow  # a tokenizer of 50,000 tokens converted: ~10 s
def test_pagedllm_loads_and_runs_what_is_written(tmp_path):
    path = tmp_path / "tiny-Q4_K_M.gguf"
    write_shape(TINY, "tiny", "Q4_K_M", path, seed=0, context_length=512)
    llm = LLM(str(path), max_model_len=128, kv_cache_memory_bytes="32MiB", disable_log_stats=True)
    try:
        assert llm.llm_engine.facts.vocab_size == 50000
        formats = llm.llm_engine.core.worker.weights_bytes_by_format()
        assert any("Q4_K" in name for name in formats) and any("Q6_K" in name for name in formats)
        output = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(output[0].outputs[0].token_ids) == 4
    finally:
        llm.shutdown()
