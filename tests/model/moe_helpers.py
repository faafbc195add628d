"""What the mixture-of-experts tests (Qwen3-MoE, Qwen2-MoE, Mixtral, tensor parallel) share: tiny
configs, transformers' model of a config with random weights, random prompts, its references on
one thread, and a small engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.layers.fused_moe import FusedMoE

from ..helpers import TEST_ENGINE_ARGS, TINY, assert_greedy_equal, hf_greedy


def moe_config(**overrides):
    """4 layers, layer 1 dense (mlp_only_layers), the others 8 experts of width 96 (not the hidden
    size, so a projection read across shows), top-2."""
    from transformers import Qwen3MoeConfig

    fields = TINY | {
        "num_hidden_layers": 4,
        "head_dim": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],
        "tie_word_embeddings": False,
        "architectures": ["Qwen3MoeForCausalLM"],
    }
    return Qwen3MoeConfig(**(fields | overrides))


def qwen2_moe_config(**overrides):
    """4 layers, layer 2 dense (mlp_only_layers), the others 8 experts of width 96, top-2 not
    renormalized (as the released models), and a shared expert of width 160."""
    from transformers import Qwen2MoeConfig

    fields = TINY | {
        "num_hidden_layers": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 96,
        "shared_expert_intermediate_size": 160,
        "mlp_only_layers": [2],
        "tie_word_embeddings": False,
        "architectures": ["Qwen2MoeForCausalLM"],
    }
    return Qwen2MoeConfig(**(fields | overrides))


def eager_random_model(config):
    """transformers' model of `config`, float32, random weights (seed 0), its experts computed by
    the plain loop over experts (the definition, not a grouped kernel)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, experts_implementation="eager"
    ).eval()


def random_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(100, 49000, (n,), generator=generator).tolist() for n in lengths]


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """transformers' references on one thread: a step of these tiny models is a few hundred small
    ops, each a parallel region that waits for every thread, so on a busy 2-core host two threads
    took 8 s where one takes 0.2 s (and the results are the same but for float32 rounding)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def engine(path, **overrides) -> LLM:
    """A small engine whose 16-token budget chunks the prompts' prefills."""
    args = TEST_ENGINE_ARGS | {"max_model_len": 512, "max_num_batched_tokens": 16, "max_num_seqs": 8}
    return LLM(str(path), **(args | overrides))


def moe_blocks(llm: LLM) -> list[FusedMoE]:
    return [m for m in llm.llm_engine.core.worker.model.modules() if isinstance(m, FusedMoE)]


TOLERANCE = 2e-5
"""|logprob difference| allowed against transformers in float32: the same weights and ops, summed in
another order by the C++ kernels (seen: under 1e-5)."""


def assert_matches_transformers(
    model, llm: LLM, label: str, prompt_ids: list[list[int]], new_tokens: int
) -> None:
    """The prompts in one call (batched, a prefill over the 16-token budget chunked), greedy:
    pagedllm's tokens are transformers' (each prompt alone; up to a near tie of the reference,
    where another CPU's rounding may part the runs), each logprob until then within TOLERANCE."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=1)
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    for ids, output in zip(prompt_ids, outputs, strict=True):
        ours = output.outputs[0]
        with one_thread():
            tokens, logits = hf_greedy(model, ids, new_tokens)
        assert_greedy_equal(list(ours.token_ids), tokens, logits, f"{label}: prompt of {len(ids)}")
        for step, (token, theirs) in enumerate(zip(ours.token_ids, tokens, strict=True)):
            if token != theirs:
                break
            reference = float(torch.log_softmax(logits[step], -1)[token])
            difference = abs(ours.logprobs[step][token].logprob - reference)
            assert difference < TOLERANCE, f"{label}: prompt of {len(ids)}, step {step}: {difference:.2e}"
