"""When a request ends: the stop rules applied to each token it appends (vLLM's check_stop)."""

from __future__ import annotations

from pagedllm.request import Request, RequestStatus


def check_stop(request: Request, token_id: int, max_model_len: int) -> RequestStatus | None:
    """The status `token_id`, just appended, ends `request` with, or None if it goes on.

    EOS and stop tokens count only once `min_tokens` are out; a finished grammar ends the request
    whatever `min_tokens` says, since nothing may follow a complete structured output.
    """
    params = request.sampling_params
    if request.num_output_tokens >= params.min_tokens:
        if not params.ignore_eos and token_id in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if params.stop_token_ids and token_id in params.stop_token_ids:  # a list after __post_init__
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
    if request.grammar is not None and request.grammar.is_terminated:
        return RequestStatus.FINISHED_STOPPED
    if request.num_output_tokens >= request.max_tokens or request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH_CAPPED
    return None
