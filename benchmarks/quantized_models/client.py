"""The one client both quantized-model benchmarks send their load with: `pagedllm bench serve` on
random prompts (EOS ignored, C at a time), summed up as the figures their tables print."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def bench_random(
    url: str,
    model_name: str,
    c: int,
    num_prompts: int,
    input_len: int,
    output_len: int,
    out: Path,
    prefix_len: int = 0,
) -> dict:
    """num_prompts random prompts of input_len tokens (after prefix_len shared ones), output_len
    out, C in flight; returns output tokens/s, TTFT and TPOT medians, requests completed."""
    cmd = [
        str(REPO / ".venv/bin/python"), "-m", "pagedllm", "bench", "serve", "--base-url", url,
        "--served-model-name", model_name, "--dataset-name", "random",
        "--random-prefix-len", str(prefix_len), "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--random-range-ratio", "0", "--ignore-eos",
        "--num-prompts", str(num_prompts), "--max-concurrency", str(c), "--output-json", str(out),
        "--disable-tqdm", "--seed", "0",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    summary = json.loads(out.read_text())
    return {
        "output_tokens_per_s": summary["output_throughput"],
        "tpot_p50_ms": summary["median_tpot_ms"],
        "ttft_p50_ms": summary["median_ttft_ms"],
        "completed": summary["completed"],
    }
