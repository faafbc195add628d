"""What several test files share: engine settings, a server in a subprocess, the OpenAI error
shape, a scheduler driven by a fake model, and the prompts and schemas the reference and structured
output tests use. Fixtures and session hooks live in conftest.py; test modules import from here,
never from one another."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import functools
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.draft_policy import DraftPolicy
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.outputs import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.step_cost import StepCostModel
from pagedllm.entrypoints.llm import LLM
from pagedllm.model.gguf_convert import converted_folder
from pagedllm.model.locate import default_model_path
from pagedllm.request import Request
from pagedllm.sampling_params import SamplingParams

AVX2_FLAGS = frozenset({"avx", "avx2", "fma", "f16c", "bmi2", "movbe"})
"""An AVX2 host's flags as /proc/cpuinfo spells them: what gcc's x86-64-v3 code needs."""
AVX512_FLAGS = AVX2_FLAGS | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"}
"""An AVX-512 host's (Skylake-SP on): what x86-64-v4 code needs."""

MODEL = "SmolLM2-135M-Instruct"  # the served name of the default model
API_KEY = "test-key"

# Small enough to keep the suite fast, large enough for every test prompt.
TEST_ENGINE_ARGS = {
    # a fixed thread count, not the adaptive one: two engines that must agree bit for bit split
    # their work alike whatever else loads the host (tests/worker/test_cpu_threads.py tests the rule)
    "num_threads": len(os.sched_getaffinity(0)),
    "dtype": "float32",
    "quantization": "none",  # the default GGUF dequantized: float32 tokens equal transformers'
    "max_model_len": 1024,
    "kv_cache_memory_bytes": "256MiB",
    "disable_log_stats": True,
}


def server_engine_args() -> list[str]:
    """TEST_ENGINE_ARGS as `pagedllm serve` flags."""
    return [
        "--dtype",
        TEST_ENGINE_ARGS["dtype"],
        "--quantization",
        TEST_ENGINE_ARGS["quantization"],
        "--max-model-len",
        str(TEST_ENGINE_ARGS["max_model_len"]),
        "--kv-cache-memory-bytes",
        TEST_ENGINE_ARGS["kv_cache_memory_bytes"],
        "--num-threads",
        str(TEST_ENGINE_ARGS["num_threads"]),
        "--disable-log-stats",
    ]


def mechanism_server_args(mechanism_model: str) -> list[str]:
    """server_engine_args() on the mechanism model (save_mechanism_model), answering to MODEL: for
    server tests of protocol, routing and caching, where the default model's steps were the cost."""
    return ["--model", mechanism_model, "--served-model-name", MODEL, *server_engine_args()]


SHARED_MAX_NUM_SEQS = 8
SHARED_MAX_QUEUE_LEN = 40
SHARED_MAX_BODY_BYTES = 256 * 1024


def shared_server_args() -> list[str]:
    """The flags of the one server that tests without flags of their own share (conftest's
    `server`): a queue bound, a body limit and a key that no other test's request reaches."""
    return [
        *server_engine_args(),
        "--max-num-seqs",
        str(SHARED_MAX_NUM_SEQS),
        "--max-queue-len",
        str(SHARED_MAX_QUEUE_LEN),
        "--api-key",
        API_KEY,
        "--max-request-body-bytes",
        str(SHARED_MAX_BODY_BYTES),
    ]


def assert_greedy_equal(
    ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor], label: str
) -> None:
    """Token-exact, except that a divergence is accepted where the reference's top-2 logit gap
    at that step is below 1e-3 (a near tie that float rounding may flip); comparison stops there."""
    for step, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)):
        if a != b:
            top2 = ref_logits[step].topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < 1e-3, f"{label}: step {step}: ours {a} != reference {b} with top-2 gap {gap:.2e}"
            return
    assert len(ours) == len(ref_tokens), f"{label}: ours {len(ours)} tokens, reference {len(ref_tokens)}"


# ---- servers in a subprocess ---------------------------------------------------------------------

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None  # loaded before any fork


@torch.inference_mode()
def hf_greedy(model, ids: list[int], max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy tokens after `ids` alone, EOS ignored (as ignore_eos runs), and each
    step's logits in float32: the reference a model's run is compared with."""
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([ids]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(ids) :].tolist(), [step[0].float() for step in out.logits]


def die_with_parent() -> None:
    """A test subprocess's `preexec_fn`: on Linux the kernel sends it SIGTERM when the thread that
    started it ends, so a test process killed outright (SIGKILL, no finalizer runs) leaves no server
    behind. That thread, not the process: start long-lived servers from the main thread."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def hears_ctrl_c() -> None:
    """For a child a test sends SIGINT, before it execs: a shell starts a background job
    (`make test &`) with SIGINT ignored, every child inherits that, and a Python started so installs
    no KeyboardInterrupt: the Ctrl-C would go unheard and the test wait on a server serving on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class RemoteServer:
    """`python -m pagedllm.entrypoints.openai.api_server ARGS --port 0` in a subprocess; the
    URL is read from its log line, so no port is guessed."""

    def __init__(
        self,
        args: list[str],
        timeout: float = 240.0,
        env: dict[str, str] | None = None,
        module: str = "pagedllm.entrypoints.openai.api_server",
    ) -> None:
        command = [sys.executable, "-m", module, *args]
        if "--port" not in args:
            command += ["--port", "0"]
        self.proc = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
            # the kernel's parent-death signal follows the starting thread: only the main thread's
            preexec_fn=die_with_parent if threading.current_thread() is threading.main_thread() else None,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read_log, daemon=True).start()
        if not self._ready.wait(timeout) or self.url is None:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.lines))

    def _read_log(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            if "Serving the OpenAI API on " in line:
                self.url = line.split("Serving the OpenAI API on ")[1].split()[0]
                self._ready.set()
        self._ready.set()  # exited

    def stop(self, sig: int = 15, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout)


class FreeRows(StepCostModel):
    """A step-cost model that takes every row as free (a memory-bound step), whatever it was told."""

    def row_cost(self, rows: int) -> float:
        return 0.0


def rows_free(llm: LLM) -> LLM:
    """The engine's scheduler given a draft policy whose rows are free (FreeRows), before any
    request: a test that counts the drafts kept then does not depend on how busy the host's cores
    were while the steps it timed ran (the back-off itself is tested with fake timings, in
    test_spec_decode). LLMEngine builds its scheduler itself, so the policy is swapped in here."""
    scheduler = llm.llm_engine.core.scheduler
    assert scheduler.config.speculation is not None and not scheduler.requests
    scheduler.draft_policy = DraftPolicy(scheduler.config.speculation, FreeRows())
    return llm


def assert_openai_error(response: httpx.Response, status: int, names: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["param"] == names or names in body["error"]["message"], body


# ---- a scheduler driven by a fake model ----------------------------------------------------------

EOS = 0


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    budget=32,
    caching=False,
    max_model_len=None,
    policy="fcfs",
    speculative_config=None,
    draft_policy=None,
    max_num_partial_prefills=None,
):
    max_model_len = max_model_len or num_blocks * block_size  # the engine guarantees one request fits
    config = EngineConfig(
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        enable_prefix_caching=caching,
        scheduling_policy=policy,
        speculative_config=speculative_config,
        max_num_partial_prefills=max_num_partial_prefills,
    )
    manager = KVCacheManager(num_blocks, block_size, caching)
    return Scheduler(config, manager, max_model_len, draft_policy=draft_policy)


def make_request(
    req_id: str, num_prompt: int, max_tokens: int = 8, first_token: int = 1, **params
) -> Request:
    prompt = [first_token + (i % 7) for i in range(num_prompt)]
    return Request(
        req_id=req_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=frozenset({EOS}),
        max_tokens=max_tokens,
    )


def fake_run(
    scheduler: Scheduler,
    output: SchedulerOutput,
    token: int = 5,
    num_accepted: int | None = None,
    next_draft: list[int] | None = None,
) -> ModelRunnerOutput:
    """What a runner returns for this step: for each request whose share reaches its last known
    token (and the draft tokens it checks; before update_from_output moves the scheduler's counts
    on), the first `num_accepted` of its draft tokens (all where None) and then `token`; and
    `next_draft` proposed for each of them."""
    requests = scheduler.requests
    sampled = {}
    for req_id, num_new in output.num_scheduled_tokens.items():
        draft = output.scheduled_spec_decode_tokens.get(req_id, [])
        if requests[req_id].num_computed_tokens + num_new == requests[req_id].num_tokens + len(draft):
            sampled[req_id] = [*draft[: len(draft) if num_accepted is None else num_accepted], token]
    return ModelRunnerOutput(
        sampled, spec_token_ids={req_id: list(next_draft) for req_id in sampled} if next_draft else {}
    )


def step(scheduler: Scheduler, token: int = 5):
    output = scheduler.schedule()
    return output, scheduler.update_from_output(output, fake_run(scheduler, output, token))


# ---- prompts and schemas -------------------------------------------------------------------------

LONG_TEXT = (
    "The paged KV cache stores keys and values in fixed-size blocks. Each request owns a block table "
    "that maps its logical blocks to physical ones, so memory is taken on demand and returned the "
    "moment a request ends. "
) * 4
RAW_PROMPTS = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    LONG_TEXT + "In one sentence, the main idea is that",
]
CHATS = [
    [{"role": "user", "content": "What is the boiling point of water at sea level?"}],
    [
        {"role": "system", "content": "You answer in one short paragraph."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [{"role": "user", "content": "Give me three names for a pet turtle."}],
    [{"role": "user", "content": "Summarize this:\n" + LONG_TEXT}],
]


def labelled_prompts(tokenizer) -> list[tuple[str, list[int]]]:
    """The 4 raw prompts and 4 chats as token ids, tokenized by transformers itself."""
    prompts = [(f"raw{i}", tokenizer(p).input_ids) for i, p in enumerate(RAW_PROMPTS)]
    for i, chat in enumerate(CHATS):
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompts.append((f"chat{i}", tokenizer(text, add_special_tokens=False).input_ids))
    return prompts


PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Alice", "Bob", "Carol"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def nested_schema_text(depth: int) -> str:
    """`depth` objects, each the only property of the one above (450: the 15 KB schema of issue
    21, which compiled for 25-45 s)."""
    return '{"type": "object", "properties": {"a": ' * depth + '{"type": "string"}' + "}}" * depth


TINY = {
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49152,
    "max_position_embeddings": 512,
    "initializer_range": 0.3,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def tiny_architectures():
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    llama3 = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 500000.0,
    }
    return {
        "llama3-rope-untied": LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters=llama3),
        "llama-linear-rope": LlamaConfig(
            **TINY,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        ),
        "qwen2-bias": Qwen2Config(**TINY, tie_word_embeddings=True),
        # layer 1 slides over 8 keys (max_window_layers 1), layer 0 sees every key
        "qwen2-window": Qwen2Config(
            **TINY, tie_word_embeddings=True, use_sliding_window=True, sliding_window=8, max_window_layers=1
        ),
        # Mistral-7B-v0.1's kind: every layer slides (there over 4,096 keys, here 8)
        "mistral": MistralConfig(**TINY, sliding_window=8, tie_word_embeddings=False),
        # head_dim 32, not hidden / heads = 16, as Qwen3-0.6B's 128 is not 1024 / 16
        "qwen3-head-dim": Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
        # a window of 8 keys on two of three layers, so a 40-token run slides; a linear-scaled
        # global rope; scores scaled by 24 ** -0.5, not head_dim 32 ** -0.5
        "gemma3-window": Gemma3TextConfig(
            **(TINY | {"num_hidden_layers": 3}),
            head_dim=32,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            query_pre_attn_scalar=24,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
        # what a Gemma 3 GGUF can say: one global layer in 6, scores scaled by head_dim ** -0.5
        "gemma3-gguf": Gemma3TextConfig(
            **(TINY | {"num_hidden_layers": 6}),
            head_dim=32,
            sliding_window=8,
            query_pre_attn_scalar=32,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    }


MECHANISM_MODEL = {  # SmolLM2-135M's heads (64 wide, three queries to a KV head), two layers
    "hidden_size": 192,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 3,
    "num_key_value_heads": 1,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "initializer_range": 0.3,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def save_mechanism_model(folder: Path) -> Path:
    """A random Llama of MECHANISM_MODEL's shapes with SmolLM2's tokenizer, as an HF folder: for
    tests that check a path of ours (batching, chunking, preemption, prefix caching, speculation)
    against our own plain path on the same weights. Its step reads ~40 MB where the default
    model's float32 weights are 0.6 GiB (most of those tests' time); token-exactness against
    transformers stays with the default model's weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    save_with_random_norms(LlamaForCausalLM(LlamaConfig(**MECHANISM_MODEL)), folder)
    shutil.copy(converted_folder(default_model_path()) / "chat_template.jinja", folder)
    return folder


def save_tiny_model(name, folder):
    """A random tiny model of `name` (_architectures) saved as an HF folder with SmolLM2's tokenizer.
    Norm weights are random too (transformers starts them at 1), so a misplaced one shows."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return save_with_random_norms(
        AutoModelForCausalLM.from_config(tiny_architectures()[name], dtype=torch.float32), folder
    )


def save_with_random_norms(model, folder):
    """`model` (random weights) with its norm weights drawn from [0.5, 1.5), saved as an HF folder
    with SmolLM2's tokenizer; returns it, in eval mode."""
    model.eval()
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "norm" in param_name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    for file in converted_folder(default_model_path()).glob("tokenizer*"):
        shutil.copy(file, folder)
    return model


@contextlib.contextmanager
def pagedllm_log_lines():
    """The messages pagedllm logs at INFO and above while in the block (a list, filled as they come)."""
    lines: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("pagedllm")
    logger.addHandler(handler)
    level, logger.level = logger.level, logging.INFO
    try:
        yield lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # Qwen3-MoE's router and its experts, stacked
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # Qwen2-MoE's shared expert and its gate
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}


GEMMA3_GGUF_LAYER_NAMES = GGUF_LAYER_NAMES | {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_reader_in_memory(path: str):
    """The `gguf` package's reader over `path`, parsing the file's bytes read into memory rather
    than the memmap it would map: each of its ~250,000 slices of a memmap (a 49,152-token
    vocabulary) costs numpy a Python-level finalizer (5.8 against 2.1 s on one host). For the
    small files of the tests only."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class, also where parse_gguf_once patched it

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(np, "memmap", lambda file, mode="r": np.fromfile(file, dtype=np.uint8))
        return GGUFReader(path)


@functools.cache
def default_gguf_reader():
    """The reader over the default model, made once per run: both the tiny GGUFs' tokenizer and
    transformers' reference read it."""
    return gguf_reader_in_memory(str(default_model_path().resolve()))


def parse_gguf_once(patch: pytest.MonkeyPatch) -> None:
    """Under `patch`, transformers' GGUF loading makes what it makes, faster: the files it reads
    with the `gguf` package's reader (the config's metadata, more than once) are each parsed once,
    in memory, while the patch lasts (the default model's reader once per run); its tensor-name
    map is built once, not once per tensor; and the metadata it parses (every token and merge, in
    Python) for the config and again for the tokenizer's config is parsed once."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    default = str(default_model_path().resolve())
    readers: dict[str, object] = {}

    def reader(file) -> object:
        path = str(Path(file).resolve())
        if path == default:
            return default_gguf_reader()
        if path not in readers:
            readers[path] = gguf_reader_in_memory(path)
        return readers[path]

    patch.setattr(gguf, "GGUFReader", reader)
    patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    load = gguf_utils.load_gguf_checkpoint
    parse = functools.cache(lambda file: load(file, return_tensors=False))

    def parsed_once(file, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return load(file, return_tensors=return_tensors, **kwargs)
        return copy.deepcopy(parse(str(file)))

    patch.setattr(gguf_utils, "load_gguf_checkpoint", parsed_once)


@functools.cache
def _default_tokenizer_fields() -> list[tuple]:
    """The default model's tokenizer metadata as (key, value, type, item type)."""
    import gguf

    fields = []
    for key, field in default_gguf_reader().fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub_type))
    return fields


def write_tiny_gguf(model, path, types: dict | None = None) -> None:
    """A transformers Llama, Qwen3, Qwen3-MoE, Mixtral or Gemma 3 `model` as llama.cpp lays out its GGUF,
    with the default model's tokenizer metadata. `types`: GGML type by GGUF tensor kind
    (token_embd, attn_q, attn_v, ffn_down, ffn_up_exps, ...; F32 where none is named), quantized
    with the `gguf` package; norms F32 (Gemma's stored as 1 + weight, as llama.cpp's converter
    does). Llama's Q/K rows are permuted as llama.cpp's converter does (Qwen3's and Gemma's
    rotary is NEOX: none). Qwen3-MoE's and Mixtral's experts are stacked per projection, [experts,
    rows, columns], as llama.cpp's converter stacks them; a layer transformers keeps dense (its
    mlp_only_layers) keeps its ffn_gate/up/down, which llama.cpp itself would not load. Mixtral is
    written as llama.cpp writes it: a "llama" file with an expert count, no expert width."""
    import gguf
    import numpy as np

    types = types or {}
    config = model.config
    arch = {
        "llama": "llama",
        "mixtral": "llama",
        "qwen3": "qwen3",
        "qwen3_moe": "qwen3moe",
        "qwen2_moe": "qwen2moe",
        "gemma3_text": "gemma3",
    }[config.model_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if arch == "gemma3":
        rope = config.rope_parameters["full_attention"]
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    else:
        rope = config.rope_parameters
    writer.add_rope_freq_base(rope["rope_theta"])
    if config.model_type in ("qwen3_moe", "qwen2_moe", "mixtral"):
        writer.add_expert_count(config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if arch in ("qwen3moe", "qwen2moe"):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen2moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    for key, value, value_type, sub_type in _default_tokenizer_fields():
        writer.add_key_value(key, value, value_type, sub_type)
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    for i in range(config.num_hidden_layers):
        for hf, ours in (GEMMA3_GGUF_LAYER_NAMES if arch == "gemma3" else GGUF_LAYER_NAMES).items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{ours}.weight"
            names[f"model.layers.{i}.{hf}.bias"] = f"blk.{i}.{ours}.bias"  # Qwen2-MoE's q/k/v
    state = _experts_stacked_per_projection(model.state_dict())
    names = {hf: name for hf, name in names.items() if hf in state}  # q_norm, k_norm: Qwen3's only
    assert set(state) - ({"lm_head.weight"} if config.tie_word_embeddings else set()) == set(names)
    for hf, gguf_name in names.items():
        tensor = state[hf].float().numpy()
        kind = gguf_name.split(".")[-2]
        if arch == "gemma3" and kind.endswith("norm"):
            tensor = tensor + 1.0
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
            shape = tensor.shape
            tensor = tensor.reshape(heads, 2, shape[0] // heads // 2, shape[1]).swapaxes(1, 2).reshape(shape)
        if kind == "ffn_gate_inp_shexp":
            tensor = tensor.reshape(-1)  # llama.cpp keeps the one-row gate as a vector
        qtype = types.get(kind, gguf.GGMLQuantizationType.F32) if tensor.ndim in (2, 3) else None
        if qtype in (None, gguf.GGMLQuantizationType.F32):
            writer.add_tensor(gguf_name, np.ascontiguousarray(tensor))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, tensor.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def random_gguf_blocks(qtype, rows: int, columns: int, seed: int = 0):
    """Random bytes in `qtype`'s block layout (uint8 [rows, row bytes]), its float16 fields set to
    finite values."""
    import gguf
    import numpy as np

    kind = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * columns // block_size, type_size), dtype=np.uint8)
    halves = {kind.Q8_0: 1, kind.Q4_0: 1, kind.Q4_1: 2, kind.Q4_K: 2, kind.Q5_K: 2, kind.Q6_K: 1}[qtype]
    fields = rng.uniform(-0.05, 0.05, size=(raw.shape[0], halves)).astype(np.float16)
    at = type_size - 2 if qtype == kind.Q6_K else 0  # Q6_K's d comes last
    raw[:, at : at + 2 * halves] = fields.view(np.uint8).reshape(raw.shape[0], -1)
    return raw.reshape(rows, -1)


def _experts_stacked_per_projection(state: dict) -> dict:
    """transformers' experts (gate_up_proj [experts, 2 x width, hidden], down_proj) as llama.cpp's
    converter stacks them: one tensor per projection, under its mlp.experts.<proj>.weight name."""
    state = dict(state)
    for key in [key for key in state if key.endswith(".mlp.experts.gate_up_proj")]:
        prefix = key.removesuffix("gate_up_proj")
        gate, up = state.pop(key).chunk(2, dim=1)
        state[prefix + "gate_proj.weight"], state[prefix + "up_proj.weight"] = gate, up
        state[prefix + "down_proj.weight"] = state.pop(prefix + "down_proj")
    return state


def benchmark_module(relative_path: str):
    """A script under benchmarks/ imported as a module (benchmarks/ is not a package)."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "benchmarks" / relative_path
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass in it looks its module up there
    spec.loader.exec_module(module)
    return module
