"""Worker: one device's resources (one tensor-parallel rank's): the model weights, the KV cache
tensors, the runner.

Start-up order: load the model, let its layers choose their kernels (model.prepare), find the
KV budget (CPU: --kv-cache-memory-bytes, default 4 GiB; CUDA: --gpu-memory-utilization of the
device minus weights and a measured activation peak), turn it into blocks (with tensor
parallelism, the fewest any rank can hold: the scheduler hands out one set of block ids for
all), allocate them, build the runner.
"""

from __future__ import annotations

import gc
import logging
import re
from pathlib import Path

import torch

from pagedllm.attention.backend import CpuKernelBackend
from pagedllm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from pagedllm.core.block_hash import BlockHash
from pagedllm.core.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.cpu_features import describe_host
from pagedllm.distributed.parallel_state import TPGroup
from pagedllm.kernels import cpu_ops
from pagedllm.layers import bind_attributes
from pagedllm.lora.manager import LoRAManager
from pagedllm.model.config import ModelConfig
from pagedllm.model.llama import LlamaForCausalLM
from pagedllm.model.locate import resolve_dtype
from pagedllm.model_loader import load_model
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.bitmask import GrammarBitmask
from pagedllm.worker.cpu_allocator import keep_freed_memory, return_freed_memory
from pagedllm.worker.cpu_threads import CPUThreads
from pagedllm.worker.kv_cache import (
    KVCachePlan,
    KVCacheSpec,
    allocate_kv_caches,
    plan_kv_cache,
    resolve_cache_dtype,
)
from pagedllm.worker.kv_offload import KVOffloadMover, open_mover
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _check_host_memory(budget_bytes: int) -> None:
    """Refuse a CPU cache larger than the memory available now. Its pages are taken as blocks are
    first written (allocate_kv_caches), so without this a budget the host cannot hold would
    start fine and be killed by the kernel hours later, under load."""
    try:
        meminfo = Path("/proc/meminfo").read_text()
    except OSError:
        return  # not Linux: nothing to compare with
    match = re.search(r"^MemAvailable:\s+(\d+) kB", meminfo, re.MULTILINE)
    if match is None:
        return
    available = int(match.group(1)) * 1024
    if budget_bytes > available:
        raise ValueError(
            f"kv_cache_memory_bytes: a KV cache of {budget_bytes / 2**30:.2f} GiB does not fit in "
            f"the {available / 2**30:.2f} GiB of memory this host has available now; "
            "lower --kv-cache-memory-bytes"
        )


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device: cuda was asked for but torch sees no CUDA device")
    return torch.device(device)


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        model_folder: Path,
        model_config: ModelConfig,
        tp: TPGroup | None = None,
    ) -> None:
        """`tp`: this rank's group (None: one rank)."""
        self.config = config
        self.model_folder = model_folder
        self.model_config = model_config
        self.tp = tp
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model: LlamaForCausalLM | None = None
        self.packed_copy_bytes = 0  # a tied lm_head's packed copy, beside the embedding it shares
        self.runner: ModelRunner | None = None
        self.lora: LoRAManager | None = None
        """The adapters' slots and cache, with --enable-lora."""
        self.kv_cache_plan: KVCachePlan | None = None
        self.kv_offload: KVOffloadMover | None = None
        """This rank's disk tier (--kv-offload-dir), once open_kv_offload() ran."""
        self.cpu_threads = (
            CPUThreads(config.num_threads, config.cpu_cores) if self.device.type == "cpu" else None
        )

    @property
    def weights_bytes(self) -> int:
        """The model's weights, each counted once (what the planner computes from the config)."""
        assert self.model is not None
        return sum(p.numel() * p.element_size() for p in self.model.parameters()) - self.packed_copy_bytes

    def weights_bytes_by_format(self) -> dict[str, int]:
        """Resident weight bytes by how they are held: a quantized format (Q4_K, int8...) or the
        model's dtype (whatever layout a kernel packed it in); a tied head's packed copy included."""
        assert self.model is not None
        by_format: dict[str, int] = {}

        def add(name: str, size: int) -> None:
            by_format[name] = by_format.get(name, 0) + size

        dtype = str(self.dtype).removeprefix("torch.")
        for module in self.model.modules():
            packed = getattr(module, "weight_bytes_by_format", {})  # a quantized projection's, by run
            for name, size in packed.items():
                add(name, size)
            fmt = dtype if packed else getattr(module, "weight_format", "") or dtype  # a bias: dtype
            for param in module.parameters(recurse=False):
                if not (packed and param is module.weight):
                    add(fmt, param.numel() * param.element_size())
        return by_format

    def describe_weights(self, model_name: str, load_seconds: float) -> str:
        """The start-up report's first line: what the weights take, by format, on which device.
        The formats' sizes add up to the total: a tied head's packed copy is in both."""
        assert self.model is not None
        by_format = sorted(self.weights_bytes_by_format().items(), key=lambda item: -item[1])
        copy_bytes = self.packed_copy_bytes
        tp_size = self.tp.world_size if self.tp is not None else 1
        formats = ", ".join(f"{name} {size / 2**30:.2f} GiB" for name, size in by_format if size)
        return (
            f"Model {model_name} loaded in {load_seconds:.1f} s: weights take "
            f"{(self.weights_bytes + copy_bytes) / 2**30:.2f} GiB"
            f"{f' on rank 0 of {tp_size}' if tp_size > 1 else ''} "
            f"({formats}; activations {str(self.dtype).split('.')[-1]}) on {self.device.type}"
            + (
                f", the tied lm_head's packed copy ({copy_bytes / 2**30:.2f} GiB) included"
                if copy_bytes
                else ""
            )
        )

    def load_model(self, max_position: int) -> None:
        if self.cpu_threads is not None:
            return_freed_memory()
            logger.info("CPU: %s; kernels: %s", describe_host(), cpu_ops.describe_build())
            self.cpu_threads.start()
        self.model = load_model(
            self.model_folder,
            self.model_config,
            self.dtype,
            self.device,
            max_position,
            self.tp,
            self.config.quantization,
        )
        self.packed_copy_bytes = self.model.prepare(self.dtype, self.config.linear_backend)
        if self.config.enable_lora:
            self.lora = LoRAManager(self.model, self.config, self.model_config, self.dtype)
            bind_attributes(self.model)  # the LoRA layers wrap projections bound before
            logger.info(
                "LoRA: %d slots of rank up to %d on %d projections take %.2f GiB",
                self.config.max_loras,
                self.config.max_lora_rank,
                len(self.lora.slots.layers),
                self.lora.nbytes / 1024**3,
            )
        if self.cpu_threads is not None:  # not before: loading's temporaries would stay resident
            keep_freed_memory()

    def plan_kv_cache(self, max_model_len: int) -> KVCachePlan:
        """This rank's cache: its budget in blocks of its share of the KV heads; with tensor
        parallelism, the fewest blocks any rank can hold (every rank must hold every block id)."""
        cache_dtype = resolve_cache_dtype(self.config.kv_cache_dtype, str(self.dtype).split(".")[-1])
        tp_size = self.tp.world_size if self.tp is not None else 1
        spec = KVCacheSpec.for_model(self.model_config, self.config.block_size, cache_dtype, tp_size)
        plan = plan_kv_cache(
            spec, self.kv_cache_budget_bytes(), max_model_len, self.config.num_gpu_blocks_override
        )
        if self.device.type == "cpu":  # what is allocated: the override's blocks, else the budget's
            _check_host_memory(plan.num_blocks * spec.bytes_per_block)
        if self.tp is None:
            return plan
        num_blocks = self.tp.min_over_ranks(plan.num_blocks)
        return plan_kv_cache(spec, plan.budget_bytes, max_model_len, num_blocks)

    def kv_cache_budget_bytes(self) -> int:
        """Bytes the KV cache may take on this device."""
        if self.device.type == "cuda" and self.config.kv_cache_memory_bytes is None:
            return self._cuda_budget_bytes()
        return int(self.config.kv_cache_memory_bytes or DEFAULT_CPU_KV_CACHE_BYTES)

    def initialize_cache(self, plan: KVCachePlan) -> None:
        assert self.model is not None
        self.kv_cache_plan = plan
        kv_caches = allocate_kv_caches(plan.spec, plan.num_blocks, self.device)
        self.runner = ModelRunner(
            self.model,
            kv_caches,
            plan.spec.block_size,
            self.device,
            self.config.seed,
            max_num_reqs=self.config.max_num_seqs,
            max_model_len=plan.max_model_len,
            samples=self.tp is None or self.tp.is_driver,
            speculation=self.config.speculation,
            lora=self.lora,
        )
        if isinstance(self.runner.attn_backend, CpuKernelBackend):
            logger.info("Attention: %s", self.runner.attn_backend.name)

    def append_sampled(self, sampled_token_ids: dict[str, list[int]]) -> None:
        """Ranks that do not sample: the tokens rank 0 sampled last step, before this step's input."""
        assert self.runner is not None, "initialize_cache() first"
        self.runner.append_sampled(sampled_token_ids)

    def execute_model(
        self, scheduler_output: SchedulerOutput, grammar_bitmask: GrammarBitmask | None = None
    ) -> ModelRunnerOutput:
        assert self.runner is not None, "initialize_cache() first"
        if self.cpu_threads is not None:
            self.cpu_threads.adjust()
        if scheduler_output.kv_transfers is not None:  # before the forward, which may reuse the blocks
            assert self.kv_offload is not None, "a disk tier's transfers without one"
            self.kv_offload.apply(scheduler_output.kv_transfers)
        return self.runner.execute_model(scheduler_output, grammar_bitmask)

    # ---- the disk tier (--kv-offload-dir): this rank's share of every block ------------------

    def open_kv_offload(self) -> None:
        """After initialize_cache(): open this rank's disk tier and start its threads (see
        kv_offload.open_mover; with tensor parallelism, its fingerprint names the rank).

        Raises:
            ValueError: naming --kv-offload-dir, when the directory cannot be created.
        """
        assert self.runner is not None and self.kv_cache_plan is not None, "initialize_cache() first"
        rank = (self.tp.rank, self.tp.world_size) if self.tp is not None else None
        self.kv_offload = open_mover(
            self.config, self.model_folder, self.dtype, self.kv_cache_plan, self.runner.kv_caches, rank
        )

    def stage_kv_offload(self, chains: list[list[BlockHash]]) -> list[BlockHash]:
        """Read the blocks the next schedule() may load; the hashes staged (see DiskKVStore.stage)."""
        assert self.kv_offload is not None, "open_kv_offload() first"
        return self.kv_offload.stage(chains)

    def close_kv_offload(self, saves: list[tuple[int, BlockHash]]) -> tuple[int, int]:
        """A graceful shutdown: these cached blocks saved, the writes waited for (bounded);
        the blocks and bytes now on disk."""
        assert self.kv_offload is not None, "open_kv_offload() first"
        return self.kv_offload.close(saves)

    def _cuda_budget_bytes(self) -> int:
        """device memory x utilization - (weights + activation peak + memory outside torch)."""
        torch.cuda.reset_peak_memory_stats(self.device)
        self._profile_run()
        peak_torch = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        outside_torch = max(0, (total - free) - torch.cuda.memory_reserved(self.device))
        budget = int(total * self.config.gpu_memory_utilization) - peak_torch - outside_torch
        logger.info(
            "Memory profiling: total %.2f GiB, weights %.2f GiB, peak torch %.2f GiB, outside torch %.2f GiB",
            total / 2**30,
            self.weights_bytes / 2**30,
            peak_torch / 2**30,
            outside_torch / 2**30,
        )
        if budget <= 0:
            raise ValueError(
                "no memory left for the KV cache at gpu_memory_utilization "
                f"{self.config.gpu_memory_utilization}: raise it, or lower --max-num-batched-tokens"
            )
        return budget

    def _profile_run(self) -> None:
        """One forward of a full token budget, on a throwaway cache, to measure activations."""
        num_tokens = self.config.token_budget
        spec = KVCacheSpec.for_model(
            self.model_config, self.config.block_size, str(self.dtype).split(".")[-1]
        )
        num_blocks = spec.blocks_per_sequence(num_tokens)
        assert self.model is not None
        runner = ModelRunner(
            self.model,
            allocate_kv_caches(spec, num_blocks, self.device),
            spec.block_size,
            self.device,
            self.config.seed,
            max_num_reqs=1,
            max_model_len=num_tokens + 1,  # room for the token it samples
        )
        dummy = NewRequestData(
            req_id="profile",
            prompt_token_ids=[0] * num_tokens,
            output_token_ids=[],
            sampling_params=SamplingParams(temperature=0.0),
            eos_token_ids=frozenset(),
            block_ids=list(range(num_blocks)),
            num_computed_tokens=0,
        )
        runner.execute_model(
            SchedulerOutput(
                new_requests=[dummy],
                num_scheduled_tokens={dummy.req_id: num_tokens},
                total_num_scheduled_tokens=num_tokens,
            )
        )
        torch.cuda.synchronize(self.device)
        del runner
        gc.collect()
        torch.cuda.empty_cache()
