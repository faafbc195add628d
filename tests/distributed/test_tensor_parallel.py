"""Tensor parallelism on CPU (gloo): TP=2 gives TP=1's greedy tokens, token for token, through
prefix hits and preemptions, with both executor backends, for dense models and mixtures of experts
(the experts split over the ranks); sizes that split no head are refused;
a rank killed under a running server ends the server, non-zero, saying which rank and how."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import httpx
import psutil
import pytest
import torch

from pagedllm import LLM, PoolingParams, SamplingParams
from pagedllm.bench.server_process import ServerProcess
from pagedllm.core.block_hash import extend_hashes, get_hash_function
from pagedllm.distributed import shm_all_reduce
from pagedllm.kernels import cpu_ops
from pagedllm.model.config_reader import model_config_from_folder
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.locate import default_model_path
from pagedllm.planner import MemoryBudget, config_from_numbers, plan_capacity
from pagedllm.rerank_prompt import yes_no_tokens

from ..helpers import save_with_random_norms, write_tiny_gguf
from ..model.moe_helpers import eager_random_model, moe_config, qwen2_moe_config

pytestmark = pytest.mark.slow  # two ranks per engine, a killed rank, ray: about a minute

# 4 heads / 2 KV heads (head_dim 64: the kernel's AVX-512 path), tied embeddings like SmolLM2.
TINY_LLAMA = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 512,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
}
# 40 blocks of 16 tokens for 8 requests of up to ~110 tokens: the scheduler must preempt.
ENGINE_ARGS = {
    "dtype": "float32",
    "max_model_len": 256,
    "num_gpu_blocks_override": 40,
    "max_num_seqs": 8,
    "disable_log_stats": True,
}
PROMPTS = [f"Story {i}: once upon a time there was a" + " very" * (i * 7) for i in range(8)]
PROMPTS += [PROMPTS[3] + " and then", PROMPTS[5] + " but"]  # prefix hits on whole blocks
Q = gguf.GGMLQuantizationType
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# logits of prompt rows and sampled rows, which a vocabulary-parallel LM head gathers from the ranks
SCORED = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, prompt_logprobs=3)


def write_tiny_model(folder, **changes) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**TINY_LLAMA, **changes}), dtype=torch.float32)
    model.save_pretrained(folder)
    for file in converted_folder(default_model_path()).glob("tokenizer*"):
        shutil.copy(file, folder)
    return str(folder)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-4-heads"))


@dataclass
class Run:
    tokens: list[list[int]]
    """Greedy tokens of PROMPTS."""
    num_preemptions: int
    prefix_hits: int
    all_reduce: str | None
    """How rank 0 all-reduced (None with one rank)."""
    scored: list[tuple[int, float]]
    """SCORED's prompt and sampled logprobs, as (token, logprob) in order."""
    weight_bytes: dict[str, int]
    """Rank 0's weight bytes by how they are held (Q4_0, float32, ...)."""
    num_accepted_drafts: int
    """Draft tokens accepted (speculative decoding; 0 without)."""


def generate(model: str, **engine_args) -> Run:
    llm = LLM(model, **ENGINE_ARGS, **engine_args)
    tp = llm.llm_engine.core.worker.tp
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        stats = llm.llm_engine.get_stats()
        (scored,) = llm.generate(PROMPTS[:1], SCORED, use_tqdm=False)
        weight_bytes = llm.llm_engine.core.worker.weights_bytes_by_format()
    finally:
        llm.llm_engine.close()
    positions = [p for p in scored.prompt_logprobs or [] if p is not None] + scored.outputs[0].logprobs
    return Run(
        tokens=[o.outputs[0].token_ids for o in outputs],
        num_preemptions=stats.num_preemptions,
        prefix_hits=stats.prefix_cache.hits,
        all_reduce=None if tp is None else "gloo" if tp.shm is None else "shared memory",
        scored=[(token, lp.logprob) for p in positions for token, lp in p.items()],
        weight_bytes=weight_bytes,
        num_accepted_drafts=stats.spec_decode.num_accepted_tokens if stats.spec_decode else 0,
    )


def assert_same_output(ours: Run, reference: Run, label: str) -> None:
    assert ours.num_preemptions > 0 and ours.prefix_hits > 0
    for i, (a, b) in enumerate(zip(ours.tokens, reference.tokens, strict=True)):
        assert a == b, f"prompt {i}: {label} departs from TP=1"
    assert [t for t, _ in ours.scored] == [t for t, _ in reference.scored]
    assert [lp for _, lp in ours.scored] == pytest.approx([lp for _, lp in reference.scored], abs=1e-4)


@pytest.fixture(scope="module")
def tp1(tiny_model) -> Run:
    run = generate(tiny_model)
    assert run.num_preemptions > 0 and run.prefix_hits > 0, "the workload must preempt and hit the cache"
    assert all(len(set(t)) > 10 for t in run.tokens), "degenerate outputs would prove little"
    return run


@pytest.mark.parametrize(
    ("backend", "all_reduce"), [("mp", "shared memory"), ("mp", "gloo"), ("ray", "shared memory")]
)
def test_tp2_greedy_equals_tp1_token_for_token(tiny_model, tp1, backend, all_reduce, monkeypatch):
    if all_reduce == "gloo":  # as across hosts: rank 0 (this process) offers no shared file
        monkeypatch.setattr(shm_all_reduce, "is_supported", lambda: False)
    run = generate(tiny_model, tensor_parallel_size=2, distributed_executor_backend=backend)
    assert run.all_reduce == all_reduce
    assert_same_output(run, tp1, f"TP=2 ({backend}, {all_reduce})")


class OracleProposer:
    """Drafts from the reference outputs (a random model repeats nothing an n-gram could find):
    what follows the context's last tokens in the reference, its last token spoiled every other
    time, so drafts are accepted whole, in part, and not at all."""

    def __init__(self, outputs: list[list[int]]) -> None:
        self.outputs = outputs
        self.calls = 0

    def propose(self, req_id: str, token_ids, max_tokens: int) -> list[int]:
        context = token_ids.tolist()
        for output in self.outputs:
            for j in range(len(output) - 1):
                before = output[max(0, j - 2) : j + 1]
                if context[len(context) - len(before) :] == before:
                    draft = output[j + 1 : j + 1 + max_tokens]
                    self.calls += 1
                    return [*draft[:-1], draft[-1] + 1] if self.calls % 2 else draft
        return []

    def finish(self, req_id: str) -> None:
        pass


def test_tp2_with_speculative_decoding_equals_tp1(tiny_model, tp1, monkeypatch):
    """Draft tokens checked on two ranks: rank 0 proposes and checks, rank 1 computes the same
    rows (the drafts come with the step) and appends the tokens rank 0 accepted."""
    from pagedllm.worker import model_runner

    monkeypatch.setattr(model_runner, "make_proposer", lambda config: OracleProposer(tp1.tokens))
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    run = generate(
        tiny_model, tensor_parallel_size=2, distributed_executor_backend="mp", speculative_config=spec
    )
    assert run.tokens == tp1.tokens and run.num_accepted_drafts > 0


def test_a_shut_down_llm_lets_another_start_in_the_same_process(tiny_model, tp1):
    """A notebook's second LLM(tensor_parallel_size=2): after shutdown(), leaving `with`, or the
    first being collected; while the first still runs, an error that says what to do."""
    import gc
    import multiprocessing

    import torch.distributed as dist

    args = {**ENGINE_ARGS, "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    with LLM(tiny_model, **args) as llm:
        (first,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert not dist.is_initialized() and not multiprocessing.active_children()
    llm = LLM(tiny_model, **args)
    with pytest.raises(RuntimeError, match=r"call that LLM's shutdown\(\)"):
        LLM(tiny_model, **args)
    assert dist.is_initialized()  # the refused start left the running engine's group alone
    (again,) = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == tp1.tokens[0]
    del llm
    gc.collect()
    assert not dist.is_initialized() and not multiprocessing.active_children()
    llm = LLM(tiny_model, **args)
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert not dist.is_initialized()


def test_the_disk_tier_with_two_ranks_serves_a_restart_as_tp1(tiny_model, tp1, tmp_path):
    """--kv-offload-dir with TP=2: each rank keeps its share of the KV heads under its own
    fingerprint; a restart over the directory loads prefix hits from disk on both ranks (a rank
    that loaded the wrong bytes, or none, would change the tokens) and gives TP=1's greedy tokens."""
    args = {
        **ENGINE_ARGS,
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "mp",
        "kv_offload_dir": str(tmp_path / "kv"),
    }
    with LLM(tiny_model, **args) as first:  # leaving `with`: every cached block saved, on both ranks
        first.generate(PROMPTS, GREEDY, use_tqdm=False)
    rank_dirs = list((tmp_path / "kv").iterdir())
    assert len(rank_dirs) == 2
    assert sorted(p.name for p in rank_dirs[0].glob("*.kv")) == sorted(
        p.name for p in rank_dirs[1].glob("*.kv")
    )
    with LLM(tiny_model, **args) as restarted:
        outputs = restarted.generate(PROMPTS, GREEDY, use_tqdm=False)
        num_disk_hit_tokens = restarted.llm_engine.get_stats().num_disk_hit_tokens
        tokenize = restarted.get_tokenizer()
    hash_fn = get_hash_function("sha256")
    hittable = {h for p in PROMPTS for h in extend_hashes([], tokenize(p).input_ids[:-1], 16, hash_fn)}
    # most prompt blocks come from disk (under this small pool's preemptions, one evicted after
    # its request's staging is computed instead)
    assert num_disk_hit_tokens > 16 * len(hittable) // 2 > 0
    for i, (output, reference) in enumerate(zip(outputs, tp1.tokens, strict=True)):
        assert output.outputs[0].token_ids == reference, f"prompt {i}: TP=2 from disk departs from TP=1"


def test_an_untied_lm_head_splits_by_vocabulary_too(tmp_path):
    model = write_tiny_model(tmp_path, tie_word_embeddings=False)
    assert_same_output(generate(model, tensor_parallel_size=2), generate(model), "TP=2, untied")


# a GGUF's Q4_0 and Q8_0 blocks, fused projections mixing the two (each run packed at its own bits)
QUANTIZED_TYPES = {
    "token_embd": Q.Q8_0,
    "attn_q": Q.Q4_0,
    "attn_k": Q.Q4_0,
    "attn_v": Q.Q8_0,
    "attn_output": Q.Q4_0,
    "ffn_gate": Q.Q4_0,
    "ffn_up": Q.Q4_0,
    "ffn_down": Q.Q8_0,
}


def write_tiny_quantized_gguf(path, architecture: str, **changes) -> str:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config_class, extra = {"llama": (LlamaConfig, {}), "qwen3": (Qwen3Config, {"head_dim": 64})}[architecture]
    torch.manual_seed(0)
    config = config_class(**{**TINY_LLAMA, **extra, **changes})
    write_tiny_gguf(AutoModelForCausalLM.from_config(config, dtype=torch.float32), path, QUANTIZED_TYPES)
    return str(path)


@pytest.mark.parametrize("architecture", ["llama", "qwen3"])
def test_tp2_serves_quantized_weights_as_tp1(architecture, tmp_path):
    """Weights kept in their GGUF blocks: each rank holds its rows of a column-parallel one (a
    fused one's Q4_0 q and k apart from its Q8_0 v) and its whole blocks of columns of a
    row-parallel one; TP=2 gives TP=1's greedy tokens."""
    model = write_tiny_quantized_gguf(tmp_path / f"tiny-{architecture}.gguf", architecture)
    reference = generate(model)
    if cpu_ops.serves_quant_linear(4, 32, 32):
        assert {"Q4_0", "Q8_0"} <= reference.weight_bytes.keys()
        assert not any("+" in name for name in reference.weight_bytes)  # nothing widened to join
    run = generate(model, tensor_parallel_size=2)
    assert run.weight_bytes.keys() == reference.weight_bytes.keys()
    assert_same_output(run, reference, f"TP=2 on quantized {architecture}")


def test_tp2_holds_a_row_parallel_share_that_cuts_blocks_as_float(tmp_path):
    """intermediate_size 544 leaves each of 2 ranks 272 inputs of down_proj, 8.5 blocks of 32:
    the ranks hold their share of it dequantized (exact: test_quantized_weights.py), and serve.
    (Its greedy tokens are not TP=1's, which rounds down_proj's activations to 8 bits.)"""
    if not cpu_ops.serves_quant_linear(8, 32, 32):
        pytest.skip("no integer kernel in this CPU's build: every weight is float anyway")
    model = write_tiny_quantized_gguf(tmp_path / "tiny-544.gguf", "llama", intermediate_size=544)
    reference = generate(model)
    run = generate(model, tensor_parallel_size=2)
    down_proj = TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["hidden_size"] * 272 * 4  # float32 bytes
    assert run.weight_bytes["float32"] - reference.weight_bytes["float32"] == down_proj
    assert run.num_preemptions > 0 and all(len(set(t)) > 10 for t in run.tokens)


def test_a_size_that_splits_heads_is_refused_saying_what_works():
    # the default SmolLM2-135M: 9 attention heads, 3 KV heads
    with pytest.raises(ValueError, match=r"2 does not divide this model's 9 attention heads.*: 1, 3$"):
        LLM(dtype="float32", max_model_len=256, kv_cache_memory_bytes="64MiB", tensor_parallel_size=2)


@pytest.mark.parametrize("when", ["idle", "mid-request"])
def test_a_killed_rank_ends_the_server_with_status_1_and_the_reason(tiny_model, tmp_path, when):
    """Idle, the monitor must notice (no step runs); mid-request, rank 0's all-reduce must stop
    waiting for the dead peer. Either way the reason reaches the log."""
    log = tmp_path / "server.log"
    args = [
        "--model",
        tiny_model,
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--tensor-parallel-size",
        "2",
        "--kv-cache-memory-bytes",
        "64MiB",
        "--disable-log-stats",
    ]
    server = ServerProcess(args, log_path=log)
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200
        body = {"model": tiny_model, "prompt": "Hello", "max_tokens": 4}
        assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).status_code == 200
        # forked by the server's forkserver child (its other child is the resource tracker)
        descendants = psutil.Process(server.proc.pid).children(recursive=True)
        (rank_1,) = [p for p in descendants if p.ppid() != server.proc.pid]
        if when == "idle":
            rank_1.send_signal(signal.SIGKILL)
            start = time.monotonic()
        else:
            long = {**body, "max_tokens": 240, "stream": True, "ignore_eos": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=long, timeout=60) as stream:
                lines = stream.iter_lines()
                next(lines)  # the first tokens are out: steps are running
                rank_1.send_signal(signal.SIGKILL)
                start = time.monotonic()
                rest = "\n".join(lines)
            assert '"error"' in rest and "the engine has stopped" in rest  # an error event, not a finish
        status = server.proc.wait(timeout=30)
        elapsed = time.monotonic() - start
    finally:
        server.stop()
    assert status == 1
    assert elapsed < 60  # noticed, not waited on forever (a busy host's monitor is slower than 10 s)
    text = log.read_text()
    assert f"tensor-parallel rank 1 (process {rank_1.pid}) was killed by SIGKILL" in text
    assert "The engine failed (WorkerDiedError" in text
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health")


def test_a_rank_that_dies_before_it_joins_ends_the_start_at_once_saying_why(tiny_model, tmp_path):
    """A script without `if __name__ == "__main__":` is run again by its rank's process, which may
    not start processes while it starts: that rank exits at once, and so must the start (not wait
    out the 300 s rendezvous), naming the rank, with Python's advice about the guard on stderr."""
    script = tmp_path / "unguarded.py"
    engine = "dtype='float32', max_model_len=256, kv_cache_memory_bytes='64MiB', tensor_parallel_size=2"
    script.write_text(f"from pagedllm import LLM\n\nLLM({tiny_model!r}, {engine})\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "WorkerDiedError: tensor-parallel rank 1 (process" in done.stderr
    assert "exited with status 1" in done.stderr and "__main__" in done.stderr


def test_the_planner_reports_one_ranks_share():
    # Llama-3-8B's shape: 8 KV heads over 2 ranks leave 4 per rank, so a rank's budget holds twice the tokens
    shape = {"layers": 32, "hidden_size": 4096, "num_heads": 32, "num_kv_heads": 8}
    config = config_from_numbers(**shape, intermediate_size=14336, vocab_size=128256)
    budget = MemoryBudget(kv_cache_memory_bytes=8 * 2**30)
    one, two = (
        plan_capacity(config, "8B", dtype="bfloat16", budget=budget, tensor_parallel_size=n) for n in (1, 2)
    )
    assert two.kv.spec.num_kv_heads == 4
    assert two.kv.spec.bytes_per_token * 2 == one.kv.spec.bytes_per_token
    assert two.kv.num_blocks == 2 * one.kv.num_blocks
    whole = 128256 * 4096 + 4096 + 32 * 2 * 4096  # embed_tokens and the norms, on every rank
    assert two.num_parameters == (one.num_parameters - whole) // 2 + whole  # layers and lm_head split
    assert two.as_dict()["kv_cache_allocated_bytes_all_ranks"] == 2 * two.kv.allocated_bytes
    with pytest.raises(ValueError, match="3 does not divide this model's 32 attention heads"):
        plan_capacity(config, "8B", budget=budget, tensor_parallel_size=3)


def test_a_start_up_that_fails_after_the_ranks_started_stops_them(tiny_model, monkeypatch):
    """The engine's own set-up failing once ranks 1.. run (here its output processor) raises, and
    leaves no rank behind waiting for a step."""
    import multiprocessing

    from pagedllm.engine import llm_engine

    def broken(*args, **kwargs):
        raise RuntimeError("set-up failed")

    monkeypatch.setattr(llm_engine, "OutputProcessor", broken)
    with pytest.raises(RuntimeError, match="set-up failed"):
        LLM(tiny_model, **ENGINE_ARGS, tensor_parallel_size=2, distributed_executor_backend="mp")
    assert not [p for p in multiprocessing.active_children() if p.is_alive()]


@pytest.mark.parametrize("format_index", [0, 5], ids=["awq", "w8a8"])
def test_tp2_serves_a_quantized_checkpoint(format_index, tiny_model, tmp_path):
    """An AWQ and a W8A8 checkpoint: each rank holds its rows, or its whole blocks of columns, of
    every projection still quantized. AWQ's activations are rounded per block of 32, so a rank's
    share gives TP=1's output; W8A8's per token, so a row-parallel rank rounds its half of a row
    with that half's own scale (as vLLM's ranks do) and the logprobs stay close, not equal."""
    from ..quantization.test_checkpoint_quant import FORMATS, write_quantized_checkpoint

    fmt = FORMATS[format_index]
    quantized = tmp_path / "quantized"
    write_quantized_checkpoint(Path(tiny_model), quantized, tmp_path / "dequantized", fmt)
    reference = generate(str(quantized))
    run = generate(str(quantized), tensor_parallel_size=2)
    assert run.weight_bytes.keys() == reference.weight_bytes.keys()
    if cpu_ops.serves_quant_linear(fmt.bits, 32, 32):
        assert f"{fmt.method} int{fmt.bits}" in run.weight_bytes
    if fmt.name == "awq":
        assert_same_output(run, reference, "TP=2 on an AWQ checkpoint")
        return
    # measured: mean 0.08, max 0.30 (bounds as test_checkpoint_quant's against the float run)
    pairs = zip(run.scored, reference.scored, strict=True)
    difference = torch.tensor([a - b for (_, a), (_, b) in pairs]).abs()
    assert float(difference.mean()) < 0.2 and float(difference.max()) < 1.2
    assert run.num_preemptions > 0 and all(len(set(t)) > 10 for t in run.tokens)


# ---- mixtures of experts: the experts split over the ranks ------------------------------------


@pytest.mark.parametrize("architecture", ["Qwen3-MoE", "Qwen2-MoE"])
def test_tp2_splits_the_experts_and_gives_tp1s_tokens(architecture, tmp_path):
    """Each rank holds half the experts, whole (and half the shared expert's width); every rank's
    router chooses the same experts, each computes the pairs routed to its own, and the layer's
    output is summed once: TP=2 gives TP=1's greedy tokens through chunked prefills, preemptions
    and prefix hits, and rank 0 holds the share the planner counts."""
    config = {"Qwen3-MoE": moe_config, "Qwen2-MoE": qwen2_moe_config}[architecture]()
    save_with_random_norms(eager_random_model(config), tmp_path)
    reference = generate(str(tmp_path))
    run = generate(str(tmp_path), tensor_parallel_size=2)
    assert_same_output(run, reference, f"TP=2 on {architecture}")
    ours = model_config_from_folder(tmp_path)
    assert sum(reference.weight_bytes.values()) == 4 * ours.num_parameters(1)
    assert sum(run.weight_bytes.values()) == 4 * ours.num_parameters(2)


def test_tp2_holds_half_the_quantized_experts_in_their_blocks(tmp_path):
    """A GGUF's experts in Q4_0: rank 0 holds half of them, still in their blocks, grouped."""
    model = save_with_random_norms(eager_random_model(moe_config()), tmp_path / "hf")
    path = tmp_path / "tiny-moe.gguf"
    write_tiny_gguf(model, path, dict.fromkeys(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), Q.Q4_0))
    reference = generate(str(path))
    run = generate(str(path), tensor_parallel_size=2)
    assert_same_output(run, reference, "TP=2 on Q4_0 experts")
    if cpu_ops.serves_quant_linear(4, 32, 32):
        assert run.weight_bytes["Q4_0"] * 2 == reference.weight_bytes["Q4_0"]


def test_tp2_embeds_and_scores_as_tp1_in_the_steps_of_generation(tiny_model):
    """Embedding, scoring and generation requests in the same steps on two ranks: the pooled rows
    leave the step's logits alike on every rank (a vocabulary-parallel head's logits are a
    collective, the scoring rows' first), and the vectors, scores and tokens are TP=1's."""
    prompts = [{"prompt_token_ids": ids} for ids in ([7, 8, 9, 10] * 3, [11, 12] * 9, [13] * 30)]

    def run(**engine_args) -> dict:
        with LLM(tiny_model, **ENGINE_ARGS, **engine_args) as llm:
            engine = llm.llm_engine
            score = PoolingParams(score_tokens=yes_no_tokens(llm.get_tokenizer()))
            kinds = {
                "gen": GREEDY,
                "emb": SamplingParams(max_tokens=1, pooling=PoolingParams()),
                "score": SamplingParams(max_tokens=1, pooling=score),
            }
            for i, prompt in enumerate(prompts):
                for kind, params in kinds.items():
                    engine.add_request(f"{kind}-{i}", prompt, params)
            outputs = {}
            while engine.has_unfinished_requests():
                outputs |= {o.request_id: o for o in engine.step() if o.finished}
        return {
            req_id: o.embedding if o.embedding is not None else o.outputs[0].token_ids
            for req_id, o in outputs.items()
        }

    ours, reference = run(tensor_parallel_size=2), run()
    assert ours.keys() == reference.keys() and len(ours) == 9
    for req_id, theirs in reference.items():
        assert ours[req_id] == (theirs if req_id.startswith("gen") else pytest.approx(theirs, abs=1e-5))


def test_tp2_serves_lora_adapters_as_tp1(tiny_model, tmp_path):
    """Each rank reads the adapters itself and holds its share: B's rows of the column-parallel
    projections, A's columns of the row-parallel ones (their partial products join the
    all-reduce the base projection makes); a batch mixing two adapters and the base model."""
    from pagedllm import LoRARequest

    from ..lora.helpers import random_adapter

    adapters = [
        LoRARequest(f"a{i}", i + 1, str(random_adapter(Path(tiny_model), tmp_path / f"a{i}", rank, seed=i)))
        for i, rank in enumerate((8, 16))
    ]
    per_prompt = [adapters[0], adapters[1], None] * 4

    def run(**tp) -> list[list[int]]:
        llm = LLM(tiny_model, **ENGINE_ARGS, enable_lora=True, max_loras=2, max_lora_rank=16, **tp)
        try:
            outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=per_prompt[: len(PROMPTS)])
            return [o.outputs[0].token_ids for o in outputs]
        finally:
            llm.llm_engine.close()

    reference = run()
    assert reference != generate(tiny_model).tokens, "the adapters must change the output"
    assert run(tensor_parallel_size=2) == reference
