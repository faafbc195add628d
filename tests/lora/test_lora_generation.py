"""LoRA adapters served on their base model (pagedllm/lora/): float32 greedy tokens and logprobs
equal to transformers + PEFT (the adapter applied, not merged) on a tiny random Llama and Qwen3 at
ranks 8 and 64 (rsLoRA at 64); a batch mixing four adapters and the base model equal to each
alone; more adapters than --max-loras wait their turn; the prefix cache shares blocks within an
adapter and never across adapters; a bad adapter is a clear error before any step."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams

from .helpers import base_model, peft_greedy, random_adapter

NEW_TOKENS = 8
PROMPTS = [[5, 17, 300, 42, 9, 11] * k for k in (1, 4, 9)]  # 6, 24 and 54 tokens: chunked at 16
LOGPROB_TOLERANCE = 1e-4
ONE_ARCHITECTURE = pytest.mark.parametrize("case", ["llama"], indirect=True)
"""For what does not depend on the architecture: the Llama case alone."""


def engine(folder, **overrides) -> LLM:
    args = dict(
        dtype="float32",
        max_model_len=256,
        kv_cache_memory_bytes="64MiB",
        max_num_batched_tokens=16,
        max_num_seqs=16,
        enable_prefix_caching=True,
        enable_lora=True,
        max_loras=4,
        max_lora_rank=64,
        disable_log_stats=True,
    )
    return LLM(str(folder), **(args | overrides))


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tmp_path_factory):
    """(base folder, {name: adapter folder}, the engine) for one architecture."""
    root = tmp_path_factory.mktemp(f"lora-{request.param}")
    base = root / "base"
    base_model(request.param, base)
    adapters = {
        "r8": random_adapter(base, root / "r8", 8, seed=1),
        "r64-rslora": random_adapter(base, root / "r64", 64, seed=2, alpha=32, rslora=True),
        "r16-attention": random_adapter(
            base, root / "r16a", 16, seed=3, targets=["q_proj", "v_proj", "o_proj"]
        ),
        "r16-mlp": random_adapter(
            base, root / "r16m", 16, seed=4, targets=["gate_proj", "up_proj", "down_proj"]
        ),
    }
    llm = engine(base)
    yield base, adapters, llm
    llm.shutdown()


def lora(adapters, name: str) -> LoRARequest:
    return LoRARequest(name, list(adapters).index(name) + 1, str(adapters[name]))


def run(llm: LLM, prompts, adapters: list[LoRARequest | None]):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=adapters
    )
    results = []
    for output in outputs:
        tokens = output.outputs[0].token_ids
        results.append(
            (tokens, [entry[t].logprob for entry, t in zip(output.outputs[0].logprobs, tokens, strict=True)])
        )
    return results


def assert_equal(ours, theirs, label: str) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(ours, theirs, strict=True):
        assert tokens == ref_tokens, label
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < LOGPROB_TOLERANCE, label


@pytest.mark.parametrize("name", ["r8", "r64-rslora"])
def test_greedy_tokens_and_logprobs_equal_transformers_peft(case, name):
    base, adapters, llm = case
    theirs = peft_greedy(base, adapters[name], PROMPTS, NEW_TOKENS)
    assert theirs != peft_greedy(base, None, PROMPTS, NEW_TOKENS), "the adapter must change the output"
    assert_equal(run(llm, PROMPTS, [lora(adapters, name)] * len(PROMPTS)), theirs, name)


def test_a_batch_mixing_four_adapters_and_the_base_equals_each_alone(case):
    base, adapters, llm = case
    names = [*adapters, None]
    mixed = [(prompt, name) for prompt in PROMPTS for name in names]
    ours = run(llm, [p for p, _ in mixed], [lora(adapters, n) if n else None for _, n in mixed])
    for name in names:
        theirs = peft_greedy(base, adapters[name] if name else None, PROMPTS, NEW_TOKENS)
        assert_equal([o for o, (_, n) in zip(ours, mixed, strict=True) if n == name], theirs, str(name))


@ONE_ARCHITECTURE
def test_more_adapters_than_max_loras_wait_their_turn(case):
    base, adapters, _ = case
    llm = engine(base, max_loras=1, max_cpu_loras=2, enable_prefix_caching=False)
    try:
        names = list(adapters) * 2
        ours = run(llm, [PROMPTS[1]] * len(names), [lora(adapters, n) for n in names])
        for name, result in zip(names, ours, strict=True):
            assert_equal([result], peft_greedy(base, adapters[name], PROMPTS[1:2], NEW_TOKENS), name)
    finally:
        llm.shutdown()


def test_the_prefix_cache_keeps_adapters_apart(case):
    _, adapters, llm = case
    prompt = PROMPTS[2]  # 54 tokens: three full blocks
    llm.reset_prefix_cache()

    def hits_after(adapter: LoRARequest | None) -> int:
        before = llm.llm_engine.get_stats().prefix_cache.hits
        run(llm, [prompt], [adapter])
        return llm.llm_engine.get_stats().prefix_cache.hits - before

    first, second = lora(adapters, "r8"), lora(adapters, "r16-mlp")
    assert hits_after(first) == 0
    assert hits_after(second) == 0, "blocks computed under one adapter served to another"
    assert hits_after(None) == 0, "an adapter's blocks served to the base model"
    assert hits_after(first) > 0 and hits_after(second) > 0 and hits_after(None) > 0


@ONE_ARCHITECTURE
def test_the_cache_key_is_the_adapters_files_not_its_name(case, tmp_path):
    """The same files under another name and id share blocks; other files at the same path (a
    new version) do not meet the blocks of the old."""
    import shutil

    base, adapters, llm = case
    prompt = PROMPTS[2]
    llm.reset_prefix_cache()

    def hits_after(adapter: LoRARequest) -> int:
        before = llm.llm_engine.get_stats().prefix_cache.hits
        run(llm, [prompt], [adapter])
        return llm.llm_engine.get_stats().prefix_cache.hits - before

    path = tmp_path / "versioned"
    shutil.copytree(adapters["r8"], path)
    assert hits_after(LoRARequest("v1", 70, str(path))) == 0
    assert hits_after(LoRARequest("same-files", 71, str(adapters["r8"]))) > 0
    shutil.rmtree(path)
    random_adapter(base, path, 8, seed=99)
    assert hits_after(LoRARequest("v2", 72, str(path))) == 0, "a new version met the old one's blocks"


@ONE_ARCHITECTURE
def test_bad_adapters_are_clear_errors_before_any_step(case, tmp_path):
    base, adapters, llm = case

    def refused(request: LoRARequest, match: str) -> None:
        with pytest.raises(ValueError, match=match):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, lora_request=request, use_tqdm=False)

    refused(LoRARequest("gone", 90, str(tmp_path / "nowhere")), "no such adapter")
    refused(LoRARequest("twice", 1, str(adapters["r64-rslora"])), "is adapter 'r8'")  # id 1 is r8's
    high = random_adapter(base, tmp_path / "r128", 128, seed=5, targets=["q_proj"])
    refused(LoRARequest("high", 91, str(high)), "rank 128 is over --max-lora-rank 64")
    other = tmp_path / "other-base"
    wide = json.loads((base / "config.json").read_text()) | {"hidden_size": 96, "head_dim": 24}
    other.mkdir()
    (other / "config.json").write_text(json.dumps(wide))
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(other)).save_pretrained(other)
    refused(
        LoRARequest("other", 92, str(random_adapter(other, tmp_path / "o", 8, seed=6))), "another base model"
    )
    lm_head = random_adapter(base, tmp_path / "head", 8, seed=7, targets=["q_proj", "lm_head"])
    refused(LoRARequest("head", 93, str(lm_head)), "lm_head")
    dora = tmp_path / "dora"
    dora.mkdir()
    config = json.loads((adapters["r8"] / "adapter_config.json").read_text()) | {"use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(config))
    refused(LoRARequest("dora", 94, str(dora)), "DoRA")
    assert run(llm, PROMPTS[:1], [None])[0][0], "the engine serves on"


@ONE_ARCHITECTURE
def test_adapters_need_enable_lora(case):
    base, adapters, _ = case
    llm = engine(base, enable_lora=False)
    try:
        with pytest.raises(ValueError, match="--enable-lora"):
            llm.generate({"prompt_token_ids": PROMPTS[0]}, lora_request=lora(adapters, "r8"), use_tqdm=False)
    finally:
        llm.shutdown()
