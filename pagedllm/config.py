"""EngineConfig: every knob of the engine in one flat, frozen dataclass.

The same fields drive `LLM(**kwargs)`, `pagedllm serve --flag` and
`python -m pagedllm.entrypoints.openai.api_server --flag`: `add_engine_args`
turns each field into a command-line flag (`max_num_seqs` -> `--max-num-seqs`)
with the help text kept next to the field, so the three never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from pagedllm.flags import flag, flag_shape
from pagedllm.speculative_config import SpeculativeConfig

DType = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDType = Literal["auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"]
Quantization = Literal["gguf", "awq", "gptq", "compressed-tensors", "fp8", "int8", "int4", "none"]
Device = Literal["auto", "cpu", "cuda"]
SchedulingPolicy = Literal["fcfs", "lpm"]
HashAlgo = Literal["sha256", "xxhash"]
ExecutorBackend = Literal["mp", "ray"]
LinearBackend = Literal["auto", "few_rows", "onednn", "torch"]

DEFAULT_CPU_KV_CACHE_BYTES = 4 * 1024**3
MAX_LORA_RANK = 512  # vLLM's highest  # what vLLM's CPU backend takes when nothing is said

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def parse_memory_size(value: int | str, name: str = "kv_cache_memory_bytes") -> int:
    """`4GiB`, `512MiB`, `1.5GB`, `1000000` -> bytes. Raises ValueError naming the bad text."""
    if isinstance(value, int):
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{name}: cannot read {value!r}; use bytes or a size like 4GiB, 512MiB, 2GB")
    return int(float(match.group(1)) * _SIZE_UNITS[unit])


def parse_cores(text: str) -> set[int]:
    """`0-3,6` -> {0, 1, 2, 3, 6}. Raises ValueError naming the bad text."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"cpu_cores: cannot read {text!r}; use core ids like 0-3,6") from None
    if not cores:
        raise ValueError(f"cpu_cores: {text!r} names no core")
    return cores


def _flag(help_text: str, **argparse_kwargs: Any) -> dict[str, Any]:
    return {"help": help_text, **argparse_kwargs}


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings. Fields keep vLLM's names so its users' flags carry over."""

    model: str | None = field(
        default=None,
        metadata=_flag(
            "Hugging Face model folder, GGUF file or hub name (ORG/NAME; ORG/NAME:QUANT picks one GGUF "
            "of several). A hub name is read from the HF cache, downloaded only when not cached and "
            "HF_HUB_OFFLINE is unset. Default: the embedded SmolLM2-135M-Instruct."
        ),
    )
    tokenizer: str | None = field(
        default=None, metadata=_flag("Tokenizer folder or hub name, when it is not the model's own.")
    )
    revision: str | None = field(
        default=None, metadata=_flag("Hub model: branch, tag or commit. Default: main.")
    )
    tokenizer_revision: str | None = field(
        default=None, metadata=_flag("Hub tokenizer (--tokenizer): branch, tag or commit. Default: main.")
    )
    download_dir: str | None = field(
        default=None,
        metadata=_flag(
            "Cache folder for hub models. Default: huggingface_hub's (HF_HUB_CACHE, HF_HOME/hub)."
        ),
    )
    dtype: DType = field(
        default="auto",
        metadata=_flag(
            "Weight and activation dtype. auto: on CUDA bfloat16, or float16 where the GPU has no "
            "bfloat16; on CPU bfloat16 where it has bfloat16 instructions (AVX-512-BF16, AMX), "
            "else float32."
        ),
    )
    quantization: Quantization | None = field(
        default=None,
        metadata=_flag(
            "How weights are held. Left out: as the checkpoint stores them (a GGUF's quantized blocks, "
            "an AWQ, GPTQ or compressed-tensors checkpoint's integer weights, kept and computed by the "
            "integer kernels, an FP8 checkpoint's read into 8-bit blocks of 32 for them; gguf, awq, "
            "gptq, compressed-tensors, fp8 say the same). int8 / int4: a float checkpoint quantized at "
            "load, per block of 32 inputs (8 bits symmetric, 4 bits with a min), every projection but "
            "the LM head. none: every weight dequantized to --dtype."
        ),
    )
    device: Device = field(default="auto", metadata=_flag("auto: cuda when available, else cpu."))
    num_threads: int | None = field(
        default=None,
        metadata=_flag(
            "CPU: threads for the model's compute. Default: one per core this process may use, "
            "one fewer for each core other processes keep busy (checked every 2 s)."
        ),
    )
    cpu_cores: str | None = field(
        default=None, metadata=_flag("CPU: pin the process to these cores, e.g. 0-3 or 0,2,4.")
    )
    linear_backend: LinearBackend = field(
        default="auto",
        metadata=_flag(
            "CPU: what computes float projections. auto: the few-rows kernel and oneDNN timed on this "
            "host per weight shape and row count at first start (cached), each product sent to the "
            "fastest (a weight where neither wins everywhere is packed for both; the log says so). "
            "few_rows / onednn / torch (unpacked PyTorch matmul) force one wherever it takes the weight."
        ),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_flag(
            "Ranks that split each layer's heads and MLP (collectives through torch.distributed: gloo "
            "on CPU, NCCL on CUDA). Ranks on one host split its cores (or --cpu-cores); "
            "--kv-cache-memory-bytes and --num-threads are per rank."
        ),
    )
    distributed_executor_backend: ExecutorBackend = field(
        default="mp",
        metadata=_flag(
            "With --tensor-parallel-size > 1: mp runs ranks 1.. as processes on this host; ray places "
            "one actor per rank in the Ray cluster (ray start --head, then ray start --address=... on "
            "other hosts), so a model can span hosts."
        ),
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_flag("Longest prompt + output in tokens. Default: the model's own context length."),
    )
    block_size: int = field(default=16, metadata=_flag("Tokens per KV cache block."))
    max_num_seqs: int = field(default=256, metadata=_flag("Most requests running in one step."))
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata=_flag(
            "Token budget of one step (prefill chunks + decodes). Default: max(2048, max_num_seqs)."
        ),
    )
    kv_cache_memory_bytes: int | str | None = field(
        default=None,
        metadata=_flag(
            "KV cache size on any device, per tensor-parallel rank: bytes or 4GiB / 512MiB. On CPU "
            "the default is 4GiB."
        ),
    )
    gpu_memory_utilization: float = field(
        default=0.9,
        metadata=_flag(
            "CUDA: fraction of device memory for this instance (weights, activations and KV cache)."
        ),
    )
    num_gpu_blocks_override: int | None = field(
        default=None, metadata=_flag("Force the number of KV cache blocks, whatever the memory budget says.")
    )
    kv_cache_dtype: KVCacheDType = field(
        default="auto", metadata=_flag("KV cache element type. auto: the model dtype.")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_flag("Share KV blocks between requests with the same prefix.")
    )
    prefix_caching_hash_algo: HashAlgo = field(
        default="sha256", metadata=_flag("Hash for prefix-cache block keys.")
    )
    kv_offload_dir: str | None = field(
        default=None,
        metadata=_flag(
            "Disk tier of the prefix cache: evicted cached blocks go to files here and come back on a "
            "later hit; at shutdown every cached block is written, so a restart starts warm."
        ),
    )
    kv_offload_max_bytes: int | str = field(
        default="8GiB", metadata=_flag("Most bytes --kv-offload-dir may hold; least recently used go first.")
    )
    prefix_cache_warmup: str | None = field(
        default=None,
        metadata=_flag(
            "JSONL of prompts or conversations (as `bench` reads) computed at start-up, before the "
            "server says ready, so the first users hit the prefix cache."
        ),
    )
    divergence_finder_tokens: int = field(
        default=1_000_000,
        metadata=_flag(
            "Prompt tokens the prefix divergence finder keeps (4 bytes each, plus an index entry "
            "per block) to say where prompts stop sharing a prefix; 0 turns it off."
        ),
    )
    max_num_partial_prefills: int | None = field(
        default=None,
        metadata=_flag(
            "Most requests computing their prompts in one step (vLLM's flag). A new prompt is "
            "admitted only while fewer are: with 1, prompts that arrive together get their first "
            "tokens one after another instead of all at the end of one long step. Default: no limit."
        ),
    )
    scheduling_policy: SchedulingPolicy = field(
        default="fcfs",
        metadata=_flag("fcfs: arrival order. lpm: prefer waiting requests with the longest cached prefix."),
    )
    seed: int = field(default=0, metadata=_flag("Seed for requests that bring none."))
    speculative_config: str | dict[str, Any] | SpeculativeConfig | None = field(
        default=None,
        metadata=_flag(
            "Speculative decoding without a draft model, vLLM's JSON: "
            '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
            '"prompt_lookup_max": 5}\' or "method": "suffix". Draft tokens are checked in the '
            "batch; greedy output is unchanged, sampled output keeps its distribution."
        ),
    )
    enable_lora: bool = field(
        default=False,
        metadata=_flag(
            "Serve LoRA adapters on the base model (PEFT folders or llama.cpp GGUF LoRA files): a "
            "request names its adapter; one step mixes rows of several adapters and the base model."
        ),
    )
    max_loras: int = field(
        default=1, metadata=_flag("Most adapters running in one step (with --enable-lora).")
    )
    max_lora_rank: int = field(
        default=16, metadata=_flag("Highest adapter rank served (with --enable-lora).")
    )
    max_cpu_loras: int | None = field(
        default=None,
        metadata=_flag("Adapters kept read in memory, least recently used let go (default: --max-loras)."),
    )
    chat_template: str | None = field(
        default=None, metadata=_flag("Chat template (Jinja text or a file) instead of the tokenizer's.")
    )
    max_logprobs: int = field(default=20, metadata=_flag("Most logprobs a request may ask for."))
    disable_log_stats: bool = field(
        default=False, metadata=_flag("Do not log the periodic throughput and cache stats line.")
    )
    log_stats_interval: float = field(default=10.0, metadata=_flag("Seconds between stats lines while busy."))

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name}: {message}")

        for f in dataclasses.fields(self):
            if f.type in _LITERALS:
                allowed = get_args(_LITERALS[str(f.type)])
                need(getattr(self, f.name) in allowed, f.name, f"must be one of {', '.join(allowed)}")
        need(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128, 256),
            "block_size",
            f"must be a power of two up to 256, got {self.block_size}",
        )
        need(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        need(
            self.num_threads is None or self.num_threads >= 1,
            "num_threads",
            f"must be >= 1, got {self.num_threads}",
        )
        if self.cpu_cores is not None:
            parse_cores(self.cpu_cores)
        need(
            self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            f"must be >= 1, got {self.tensor_parallel_size}",
        )
        need(
            self.max_model_len is None or self.max_model_len >= 1,
            "max_model_len",
            f"must be >= 1, got {self.max_model_len}",
        )
        max_num_batched_tokens = self.max_num_batched_tokens
        if max_num_batched_tokens is None:
            max_num_batched_tokens = max(2048, self.max_num_seqs)
            object.__setattr__(self, "max_num_batched_tokens", max_num_batched_tokens)
        need(
            max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"{self.max_num_batched_tokens} is below max_num_seqs {self.max_num_seqs}; "
            "every running request needs a token per step",
        )
        need(
            self.max_num_partial_prefills is None or self.max_num_partial_prefills >= 1,
            "max_num_partial_prefills",
            f"must be >= 1, got {self.max_num_partial_prefills}",
        )
        if self.kv_cache_memory_bytes is not None:
            size = parse_memory_size(self.kv_cache_memory_bytes)
            need(size > 0, "kv_cache_memory_bytes", "must be positive")
            object.__setattr__(self, "kv_cache_memory_bytes", size)
        need(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        need(
            self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
            "num_gpu_blocks_override",
            "must be >= 1",
        )
        need(self.max_logprobs >= 0, "max_logprobs", "must be >= 0")
        need(self.divergence_finder_tokens >= 0, "divergence_finder_tokens", "must be >= 0")
        kv_offload_max_bytes = parse_memory_size(self.kv_offload_max_bytes, "kv_offload_max_bytes")
        object.__setattr__(self, "kv_offload_max_bytes", kv_offload_max_bytes)
        need(kv_offload_max_bytes > 0, "kv_offload_max_bytes", "must be positive")
        need(
            self.kv_offload_dir is None or self.enable_prefix_caching,
            "kv_offload_dir",
            "needs prefix caching (the disk tier keeps cached blocks)",
        )
        need(
            not self.kv_offload_dir
            or not os.path.exists(self.kv_offload_dir)
            or os.path.isdir(self.kv_offload_dir),
            "kv_offload_dir",
            f"{self.kv_offload_dir} is not a directory; point --kv-offload-dir at one (created if missing)",
        )
        if self.prefix_cache_warmup:
            warmup = self.prefix_cache_warmup
            need(
                os.path.isfile(warmup),
                "prefix_cache_warmup",
                f"{warmup}: {'not a regular file' if os.path.exists(warmup) else 'no such file'}; "
                "give --prefix-cache-warmup a JSONL file of prompts or conversations",
            )
        need(self.max_loras >= 1, "max_loras", f"must be >= 1, got {self.max_loras}")
        need(
            1 <= self.max_lora_rank <= MAX_LORA_RANK,
            "max_lora_rank",
            f"must be 1 to {MAX_LORA_RANK}, got {self.max_lora_rank}",
        )
        if self.max_cpu_loras is None:
            object.__setattr__(self, "max_cpu_loras", self.max_loras)
        assert self.max_cpu_loras is not None
        need(
            self.max_cpu_loras >= self.max_loras,
            "max_cpu_loras",
            f"{self.max_cpu_loras} is below max_loras {self.max_loras}",
        )
        need(self.log_stats_interval > 0, "log_stats_interval", "must be > 0")
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))

    @property
    def speculation(self) -> SpeculativeConfig | None:
        """speculative_config as parsed (__post_init__ turns the JSON or dict into it)."""
        assert not isinstance(self.speculative_config, (str, dict))
        return self.speculative_config

    @property
    def token_budget(self) -> int:
        assert self.max_num_batched_tokens is not None  # set in __post_init__
        return self.max_num_batched_tokens

    def replace(self, **changes: Any) -> EngineConfig:
        return dataclasses.replace(self, **changes)


_LITERALS = {
    "DType": DType,
    "KVCacheDType": KVCacheDType,
    "Device": Device,
    "SchedulingPolicy": SchedulingPolicy,
    "HashAlgo": HashAlgo,
    "ExecutorBackend": ExecutorBackend,
    "LinearBackend": LinearBackend,
}


def add_engine_args(parser: argparse.ArgumentParser, *, model_flag: bool = True) -> None:
    """Add one `--flag` per EngineConfig field (vLLM's spelling) to `parser`; a flag not given
    leaves the field's default (engine_config_from_args)."""
    group = parser.add_argument_group("engine")
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model" and not model_flag:
            continue
        group.add_argument(
            flag(f),
            dest=f.name,
            default=argparse.SUPPRESS,
            help=f.metadata.get("help", "") + f" (default: {f.default})",
            **flag_shape(f, _LITERALS),
        )


def engine_config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """Build an EngineConfig from parsed flags; flags not given keep their defaults."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(overrides)
    return EngineConfig(**values)
