"""The request sets of `pagedllm bench serve`, with `vllm bench serve`'s flags.

- `random`: prompts of random token ids at set lengths (--random-input-len, --random-output-len,
  spread by --random-range-ratio, after a shared prefix of --random-prefix-len tokens);
- `sharegpt`: ShareGPT-format JSON, the first two messages of each conversation as the prompt and
  the answer whose token count is the request's max_tokens (--sharegpt-output-len overrides it);
- `jsonl`: our workloads (pagedllm/workload.py), single-turn or conversations.

`random` and `sharegpt` count tokens with the model's tokenizer: --tokenizer, else --model's.
`pagedllm bench serve` and `bench sweep` both take these flags and load through `load_dataset_for`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from pagedllm.config import EngineConfig
from pagedllm.model.locate import resolve_model_folder, resolve_tokenizer_folder
from pagedllm.tokenizer import load_tokenizer
from pagedllm.workload import BenchRequest, Conversation, load_workload

DATASET_NAMES = ("random", "sharegpt", "jsonl")
DEFAULT_NUM_PROMPTS = 1000  # vLLM's, for the sampled sets; a JSONL file is used whole
# ShareGPT conversations vLLM keeps (so both tools sample the same requests from one file)
MIN_LEN, MAX_PROMPT_LEN, MAX_TOTAL_LEN = 4, 1024, 2048
_FIT_TRIES = 10


def add_dataset_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("dataset")
    group.add_argument(
        "--dataset-name",
        choices=DATASET_NAMES,
        default=None,
        help="default: jsonl for a .jsonl --dataset-path, sharegpt for a .json one, random without one",
    )
    group.add_argument(
        "--dataset-path", "--workload", default=None, help="ShareGPT-format JSON, or our JSONL workload"
    )
    group.add_argument(
        "--num-prompts",
        "--num-requests",
        type=int,
        default=None,
        help=f"requests to send (default: every line of a JSONL file, else {DEFAULT_NUM_PROMPTS}); "
        "for a conversation workload, the first N conversations",
    )
    group.add_argument("--random-input-len", "--input-len", type=int, default=1024)
    group.add_argument("--random-output-len", "--output-len", type=int, default=128)
    group.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="input and output lengths are drawn uniformly from LEN * (1 - R) .. LEN * (1 + R); R in [0, 1)",
    )
    group.add_argument(
        "--random-prefix-len", type=int, default=0, help="random tokens every random prompt starts with"
    )
    group.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="max_tokens of every ShareGPT request"
    )
    group.add_argument(
        "--ignore-eos",
        action="store_true",
        help="generate max_tokens whatever the model says (JSONL lines set it per line, default on)",
    )


def dataset_name(args: argparse.Namespace) -> str:
    """--dataset-name, else what --dataset-path looks like; ValueError where a set needs a path."""
    if args.dataset_name is None:
        if args.dataset_path is None:
            return "random"
        return "sharegpt" if args.dataset_path.endswith(".json") else "jsonl"
    if args.dataset_name != "random" and args.dataset_path is None:
        raise ValueError(f"--dataset-name {args.dataset_name} needs --dataset-path FILE")
    return args.dataset_name


def dataset_source(args: argparse.Namespace) -> str:
    """How a report names the set: its kind, and its file where it has one."""
    return dataset_name(args) + (f" {args.dataset_path}" if args.dataset_path else "")


def load_dataset_for(
    args: argparse.Namespace, config: EngineConfig
) -> tuple[list[BenchRequest] | list[Conversation], Path | None]:
    """The requests the flags ask for, counted with the tokenizer `config` names and seeded with its
    seed; also that tokenizer's folder (None for a JSONL set, which needs none)."""
    folder = None
    if dataset_name(args) != "jsonl":
        folder = _tokenizer_folder(config)
    return load_dataset(args, load_tokenizer(folder) if folder else None, config.seed), folder


def _tokenizer_folder(config: EngineConfig) -> Path:
    """The tokenizer the engine would load with these flags, found without the model's weights."""
    if config.tokenizer:
        return resolve_tokenizer_folder(
            config.tokenizer, revision=config.tokenizer_revision, download_dir=config.download_dir
        )
    return resolve_model_folder(
        config.model, revision=config.revision, download_dir=config.download_dir, weights=False
    )


def load_dataset(
    args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase | None, seed: int
) -> list[BenchRequest] | list[Conversation]:
    """The requests the flags ask for; `tokenizer` may be None for a JSONL set."""
    name = dataset_name(args)
    if name == "jsonl":
        workload = load_workload(args.dataset_path, args.num_prompts)
        if args.ignore_eos and workload and isinstance(workload[0], BenchRequest):
            return [dataclasses.replace(r, ignore_eos=True) for r in workload]
        return workload
    assert tokenizer is not None, "random and sharegpt sets need a tokenizer"
    num_prompts = args.num_prompts or DEFAULT_NUM_PROMPTS
    if name == "random":
        return random_requests(
            tokenizer,
            num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.random_prefix_len,
            seed,
            args.ignore_eos,
        )
    return sharegpt_requests(
        args.dataset_path, tokenizer, num_prompts, args.sharegpt_output_len, seed, args.ignore_eos
    )


def random_requests(
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    ignore_eos: bool = False,
) -> list[BenchRequest]:
    """Prompts of random non-special token ids. `input_len` counts the special tokens the tokenizer
    adds (a BOS), so a prompt's `prompt_len` is what the server will see."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    num_special = tokenizer.num_special_tokens_to_add()
    input_lens = _uniform_lens(rng, max(input_len - num_special, 0), range_ratio, num_requests)
    output_lens = np.maximum(_uniform_lens(rng, output_len, range_ratio, num_requests), 1)
    if num_requests and prefix_len + int(input_lens.min()) < 1:
        raise ValueError(
            f"--random-input-len {input_len} leaves prompts without a token once the tokenizer's "
            f"{num_special} special tokens are counted; raise it or lower --random-range-ratio"
        )
    allowed = np.setdiff1d(np.arange(tokenizer.vocab_size), tokenizer.all_special_ids)
    # the prefix from the seed and its length alone: runs of any size share it (one caches it for the next)
    prefix_rng = np.random.default_rng([seed, prefix_len]) if prefix_len else rng
    prefix_ids = prefix_rng.choice(allowed, prefix_len).tolist()
    prefix = _fit(tokenizer, prefix_ids, prefix_len, allowed, prefix_rng)[1]
    requests = []
    for num_input, num_output in zip(input_lens.tolist(), output_lens.tolist(), strict=True):
        ids = prefix + rng.choice(allowed, num_input).tolist()
        text, ids = _fit(tokenizer, ids, len(ids), allowed, rng)
        requests.append(BenchRequest(text, num_output, ignore_eos, prompt_len=len(ids) + num_special))
    return requests


def sharegpt_requests(
    path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    num_requests: int,
    output_len: int | None = None,
    seed: int = 0,
    ignore_eos: bool = False,
) -> list[BenchRequest]:
    """`num_requests` first exchanges of shuffled conversations, skipping those too short or too long
    (vLLM's rule); when too few are left, some are sent twice, as vLLM does."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [
        (c[0]["value"], c[1]["value"]) for entry in data if len(c := entry.get("conversations") or []) >= 2
    ]
    random.Random(seed).shuffle(pairs)
    requests: list[BenchRequest] = []
    for prompt, answer in pairs:
        if len(requests) == num_requests:
            break
        prompt_len = len(tokenizer(prompt).input_ids)
        num_output = len(tokenizer(answer).input_ids) if output_len is None else output_len
        too_short = prompt_len < MIN_LEN or (output_len is None and num_output < MIN_LEN)
        if too_short or prompt_len > MAX_PROMPT_LEN or prompt_len + num_output > MAX_TOTAL_LEN:
            continue
        requests.append(BenchRequest(prompt, num_output, ignore_eos, prompt_len=prompt_len))
    if not requests:
        raise ValueError(
            f"{path}: no conversation with two messages, a prompt of {MIN_LEN}-{MAX_PROMPT_LEN} tokens "
            f"and at most {MAX_TOTAL_LEN} tokens with its answer"
        )
    repeats = random.Random(seed).choices(requests, k=num_requests - len(requests))
    return requests + repeats


def _uniform_lens(rng: np.random.Generator, mean: int, range_ratio: float, size: int) -> np.ndarray:
    low, high = math.floor(mean * (1 - range_ratio)), math.ceil(mean * (1 + range_ratio))
    return rng.integers(low, high + 1, size=size)


def _fit(
    tokenizer: PreTrainedTokenizerBase,
    ids: list[int],
    target_len: int,
    allowed: np.ndarray,
    rng: np.random.Generator,
) -> tuple[str, list[int]]:
    """Text of about `target_len` tokens, and its ids. Decoded ids need not re-encode to themselves
    (two tokens may merge into one), so the ids are re-encoded, then cut or topped up, a few times."""
    for attempt in range(_FIT_TRIES):
        text = str(tokenizer.decode(ids))  # flat ids: one str
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target_len or attempt == _FIT_TRIES - 1:
            break
        ids = ids[:target_len] + rng.choice(allowed, max(target_len - len(ids), 0)).tolist()
    return text, ids
