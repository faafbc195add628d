"""The API server with faults injected, for tests/entrypoints/test_server_hardening.py:
`python -m tests.fault_server ARGS` (the api_server's own flags).

    a request with seed 13013   its sampling raises
    a request with seed 13014   its detokenization raises
    token id 13015 in a prompt  the model's forward pass raises (the whole batch's: fatal)
"""

from __future__ import annotations

import sys

from pagedllm.engine import detokenizer
from pagedllm.entrypoints.openai import api_server
from pagedllm.model import llama
from pagedllm.sample import sampler

SAMPLING_FAULT_SEED = 13013
DETOKENIZE_FAULT_SEED = 13014
FORWARD_FAULT_TOKEN = 13015


def _inject() -> None:
    sample = sampler.Sampler.__call__
    append = detokenizer.IncrementalDetokenizer.append
    forward = llama.LlamaForCausalLM.forward

    def faulty_sample(self, logits, metadata):
        if any(g.initial_seed() == SAMPLING_FAULT_SEED for g in metadata.generators.values()):
            raise RuntimeError("injected sampling fault")
        return sample(self, logits, metadata)

    def faulty_append(self, token_ids):
        if self._params.seed == DETOKENIZE_FAULT_SEED:
            raise RuntimeError("injected detokenization fault")
        return append(self, token_ids)

    def faulty_forward(self, input_ids, *args):
        if bool((input_ids == FORWARD_FAULT_TOKEN).any()):
            raise RuntimeError("injected forward fault")
        return forward(self, input_ids, *args)

    sampler.Sampler.__call__ = faulty_sample
    detokenizer.IncrementalDetokenizer.append = faulty_append
    llama.LlamaForCausalLM.forward = faulty_forward


if __name__ == "__main__":
    _inject()
    api_server.main(sys.argv[1:])
