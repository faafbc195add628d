"""What both front ends (LLMEngine, AsyncLLM) do around the core on adding a request, each step
and on an abort:
the core's token ids made text, and what a stop string or a failed output ended handed back to
the core in the same step, so its blocks are free for the next."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.request import RequestStatus

if TYPE_CHECKING:
    from pagedllm.engine.core import EngineCore
    from pagedllm.engine.messages import EngineRequest
    from pagedllm.engine.output_processor import OutputProcessor
    from pagedllm.metrics.stats_logger import StatsLogger
    from pagedllm.outputs import RequestOutput


def add_to_core(core: EngineCore, output_processor: OutputProcessor, processed: EngineRequest) -> str:
    """The core's bookkeeping for a request an InputProcessor made, then the front end's
    detokenizer for it (undone in the core if that fails). ValueError for an id already in use."""
    if output_processor.has_request(processed.req_id):
        raise ValueError(f"request_id: {processed.req_id!r} is already in use")
    request = core.add_request(processed)
    try:
        output_processor.add_request(request)
    except BaseException:
        core.finish_requests([request.req_id], RequestStatus.FINISHED_ABORTED)
        raise
    return request.req_id


def step_outputs(
    core: EngineCore, output_processor: OutputProcessor, stats_logger: StatsLogger | None
) -> list[RequestOutput]:
    """One core step, as RequestOutputs; the periodic stats line when it is due."""
    processed = output_processor.process(core.step())
    core.finish_requests(processed.stopped, RequestStatus.FINISHED_STOPPED)
    core.finish_requests(processed.failed, RequestStatus.FINISHED_ERROR)
    if stats_logger is not None and stats_logger.is_due():
        stats_logger.log(core.get_stats())
    return processed.outputs


def abort_outputs(
    core: EngineCore, output_processor: OutputProcessor, req_ids: list[str]
) -> list[RequestOutput]:
    """End requests now, wherever they are: their blocks back to the pool at once."""
    core.finish_requests(req_ids, RequestStatus.FINISHED_ABORTED)
    return output_processor.abort(req_ids)
