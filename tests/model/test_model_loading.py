"""Model loading: GGUF conversion equals transformers' own GGUF reader; the Llama family
(Llama 3 rope scaling, untied embeddings, Qwen2 biases, Mistral) and Qwen3 (per-head q/k norms,
head_dim apart from hidden / heads) and Gemma 3 (sliding windows, two rope bases, 1 + weight
norms) match transformers; Qwen3 and Gemma 3 GGUFs load as their HF folders."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.quantization import BlockQuantized
from pagedllm.model.config_reader import SUPPORTED_ARCHITECTURES, model_config_from_folder
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.gguf_weights import iter_gguf_weights
from pagedllm.model.locate import default_model_path
from pagedllm.model.registry import MODELS
from pagedllm.tokenizer import load_tokenizer
from pagedllm.worker.kv_cache import KVCacheSpec, allocate_kv_caches, plan_kv_cache

from ..helpers import (
    TEST_ENGINE_ARGS,
    assert_greedy_equal,
    hf_greedy,
    pagedllm_log_lines,
    parse_gguf_once,
    save_tiny_model,
    save_with_random_norms,
    tiny_architectures,
    write_tiny_gguf,
)


def test_gguf_weights_as_read_equal_transformers_gguf_weights(reference):
    """Our reading of the GGUF's blocks (kept quantized) dequantizes to exactly transformers' weights."""
    path = default_model_path()
    config = model_config_from_folder(converted_folder(path))
    ours = dict(iter_gguf_weights(path, config))
    theirs = reference.model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: the embedding serves as lm_head
    assert {w.format for w in ours.values() if isinstance(w, BlockQuantized)} == {"Q4_1", "Q8_0"}
    for name, weight in ours.items():
        tensor = weight.dequantize() if isinstance(weight, BlockQuantized) else weight
        assert torch.equal(tensor.float(), theirs[name].float()), name  # Q/K rows un-permuted, exact dequant
    assert not list(converted_folder(path).glob("*.safetensors")), "no dequantized copy on disk"


def test_every_supported_architecture_has_a_model_class():
    assert set(MODELS) == set(SUPPORTED_ARCHITECTURES)


def test_default_model_config_and_kv_size_match_vllm_report():
    config = model_config_from_folder(converted_folder(default_model_path()))
    assert (config.num_hidden_layers, config.num_key_value_heads, config.head_dim) == (30, 3, 64)
    assert config.tie_word_embeddings and config.max_position_embeddings == 8192
    plan = plan_kv_cache(KVCacheSpec.for_model(config, 32, "bfloat16"), 4 * 2**30, 8192)
    # vLLM's CPU build on this model and budget logs: 186,400 tokens, 22.75x for 8,192 tokens
    assert plan.num_tokens == 186_400
    assert f"{plan.max_concurrency:.2f}" == "22.75"


def _rss_bytes() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_cpu_kv_cache_reads_zero_and_holds_memory_only_where_written():
    """The cache comes as fresh pages, zeroed by the kernel as each is first touched: a start
    allocates gigabytes at no cost, and memory is taken as blocks are written."""
    spec = KVCacheSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, cache_dtype="bfloat16")
    before = _rss_bytes()
    caches = allocate_kv_caches(spec, 2048, torch.device("cpu"))  # 256 MiB
    assert _rss_bytes() - before < 32 * 2**20
    k, v = caches[2]
    assert not k.any() and not v.any()
    k[5].fill_(1.0)
    assert k[5].eq(1).all() and not v[5].any() and not caches[1][0][5].any() and not k[6].any()


def test_a_kv_budget_beyond_the_hosts_memory_is_refused_at_start():
    with pytest.raises(ValueError, match="lower --kv-cache-memory-bytes"):
        LLM(**(TEST_ENGINE_ARGS | {"kv_cache_memory_bytes": 2**50}))


def test_startup_report_says_what_vllm_users_grep_for():
    with pagedllm_log_lines() as lines:
        LLM(dtype="float32", max_model_len=4096, kv_cache_memory_bytes="1GiB", disable_log_stats=True)
    text = "\n".join(lines)
    # the default GGUF's own blocks, kept: Q4_1 projections, a Q8_0 embedding (and its tied head)
    assert re.search(r"weights take 0\.\d\d GiB \(Q4_1 0\.\d\d GiB, Q8_0 0\.\d\d GiB", text), text
    assert "Available KV cache memory: 1.00 GiB" in text
    assert "KV cache size: 23,296 tokens" in text  # 1 GiB / (46,080 B/token), whole 16-token blocks
    assert "Maximum concurrency for 4,096 tokens per request: 5.69x" in text


@pytest.mark.parametrize(
    "name",
    [
        "llama3-rope-untied",
        pytest.param("llama-linear-rope", marks=pytest.mark.slow),  # the fast set: one rope scaling
        "qwen2-bias",
        "qwen2-window",
        pytest.param("mistral", marks=pytest.mark.slow),  # a window, as Qwen2's
        "qwen3-head-dim",
        "gemma3-window",
    ],
)
def test_architecture_matches_transformers(name, tmp_path, reference):
    model = save_tiny_model(name, tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"][0] == type(model).__name__
    assert saved["architectures"][0] in SUPPORTED_ARCHITECTURES
    # the planner's count from the shapes alone (`pagedllm plan`), against the model's own
    assert model_config_from_folder(tmp_path).num_parameters() == sum(p.numel() for p in model.parameters())

    ids = reference.tokenizer(
        "A short prompt to check the whole forward pass, position by position."
    ).input_ids
    new_tokens = 24
    ref_tokens, ref_logits = hf_greedy(model, ids, new_tokens)  # the full length, like ignore_eos below
    ref_logprobs = [torch.log_softmax(step, -1) for step in ref_logits]

    ours = LLM(
        str(tmp_path),
        **{**TEST_ENGINE_ARGS, "max_model_len": 512},
        max_num_batched_tokens=16,
        max_num_seqs=16,
    )
    out = ours.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=2),
        use_tqdm=False,
    )[0].outputs[0]
    for step, (a, b) in enumerate(zip(out.token_ids, ref_tokens, strict=True)):
        if a != b:
            top2 = ref_logprobs[step].topk(2).values
            assert float(top2[0] - top2[1]) < 1e-3, f"{name}: step {step} diverged away from a tie"
            break
        assert abs(out.logprobs[step][a].logprob - float(ref_logprobs[step][a])) < 1e-4, (
            f"{name}: step {step}"
        )


def test_an_image_and_text_gemma3_checkpoint_serves_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration (gemma-3-4b and up): its text_config and language_model
    weights, the vision tower left out and said so; float32 greedy tokens equal transformers' on
    the same checkpoint given text alone."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = tiny_architectures()["gemma3-window"].to_dict()
    vision = {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = Gemma3Config(
        text_config=text,
        vision_config=vision | {"image_size": 32, "patch_size": 8},
        mm_tokens_per_image=4,
        boi_token_index=49000,
        eoi_token_index=49001,
        image_token_index=49002,
    )
    torch.manual_seed(0)
    model = save_with_random_norms(Gemma3ForConditionalGeneration(config), tmp_path)
    ids = list(range(100, 130))
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        generated = model.generate(
            torch.tensor([ids]),
            max_new_tokens=16,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref_tokens = generated.sequences[0, len(ids) :].tolist()
    with pagedllm_log_lines() as lines:
        ours = LLM(str(tmp_path), **{**TEST_ENGINE_ARGS, "max_model_len": 512})
    assert ours.llm_engine.facts.model_config.architecture == "Gemma3ForCausalLM"
    assert any("34 vision tensors not loaded" in line for line in lines), lines
    out = ours.generate(
        {"prompt_token_ids": ids},
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert_greedy_equal(
        list(out.token_ids), ref_tokens, [step[0] for step in generated.logits], "gemma3-image-text"
    )


@pytest.mark.parametrize(
    ("name", "architecture"),
    [  # make test-fast keeps Gemma 3's, the file with the most to undo
        pytest.param("qwen3-head-dim", "Qwen3ForCausalLM", marks=pytest.mark.slow),
        ("gemma3-gguf", "Gemma3ForCausalLM"),
    ],
)
def test_a_gguf_loads_as_its_hf_folder(name, architecture, tmp_path, monkeypatch):
    """Qwen3 (head_dim apart from hidden / heads) and Gemma 3 (norms stored as 1 + weight, two
    rope bases, sliding layers that the file leaves to llama.cpp's rule): the same weights, the
    same config, the same tokens as the HF folder the GGUF was written from."""
    model = save_tiny_model(name, tmp_path / "hf")
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))  # after the tokenizer's copy
    write_tiny_gguf(model, tmp_path / "tiny.gguf")  # F32, as llama.cpp lays it out
    folder = converted_folder(tmp_path / "tiny.gguf")

    ours = dict(iter_gguf_weights(tmp_path / "tiny.gguf", model_config_from_folder(folder)))
    theirs = {name: t for name, t in model.state_dict().items() if name != "lm_head.weight"}
    assert set(ours) == set(theirs)
    for tensor_name, tensor in ours.items():
        if architecture == "Gemma3ForCausalLM" and tensor_name.endswith("norm.weight"):
            # the file holds 1 + weight, rounded: the factor each side computes with is the same
            assert torch.equal(tensor + 1, theirs[tensor_name] + 1), tensor_name
        else:
            assert torch.equal(tensor, theirs[tensor_name]), tensor_name
    from_gguf, from_hf = model_config_from_folder(folder), model_config_from_folder(tmp_path / "hf")
    assert from_gguf.architecture == architecture and from_gguf.head_dim == 32
    assert from_gguf.rms_norm_eps == pytest.approx(from_hf.rms_norm_eps)  # GGUF's is a float32
    # and a GGUF names no dtype
    assert from_gguf == dataclasses.replace(from_hf, torch_dtype=None, rms_norm_eps=from_gguf.rms_norm_eps)

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(100, 120))}
    tokens = [
        LLM(str(path), **{**TEST_ENGINE_ARGS, "max_model_len": 512})
        .generate(prompt, params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
        for path in (tmp_path / "tiny.gguf", tmp_path / "hf")
    ]
    assert tokens[0] == tokens[1]


@pytest.mark.slow  # transformers converts each; the fast set keeps the default model's (correctness_hf)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_gguf_tokenizer_is_what_auto_tokenizer_converts(arch, tmp_path, monkeypatch):
    """The cached folder's tokenizer files are byte for byte what AutoTokenizer makes of the
    GGUF (the class it picks differs by architecture: TokenizersBackend, Qwen2Tokenizer)."""
    from transformers import AutoTokenizer

    path = default_model_path()
    if arch == "qwen3":
        path = tmp_path / "tiny-qwen3.gguf"
        write_tiny_gguf(save_tiny_model("qwen3-head-dim", tmp_path / "hf"), path)
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    folder = converted_folder(path)
    with pytest.MonkeyPatch.context() as patch:
        parse_gguf_once(patch)  # transformers' own conversion, its file parsed once
        converted = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    converted.save_pretrained(tmp_path / "auto")
    names = sorted(p.name for p in (tmp_path / "auto").iterdir())
    assert "tokenizer.json" in names
    for name in names:
        assert (folder / name).read_bytes() == (tmp_path / "auto" / name).read_bytes(), name
    # the engine loads the folder by the class it names, without AutoTokenizer: the same tokenizer
    ours, auto = load_tokenizer(folder, named_class=True), AutoTokenizer.from_pretrained(str(folder))
    assert type(ours) is type(auto)
    text = "<|im_start|>user\n  Hello, wörld!\tdef f(x): return x ** 2<|im_end|> 🙂"
    assert ours(text).input_ids == auto(text).input_ids
    assert ours.all_special_tokens == auto.all_special_tokens and ours.chat_template == auto.chat_template
