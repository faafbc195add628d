"""AsyncLLM without a model: a scripted core shows the thread hand-offs, the atomic fan-out,
the queue limit and what callers see when the engine thread dies."""

from __future__ import annotations

import asyncio

import pytest

from pagedllm.config import EngineConfig
from pagedllm.engine.async_engine import AsyncLLM, EngineUnavailableError, QueueFullError, RequestFailedError
from pagedllm.engine.messages import EngineRequest
from pagedllm.engine.output_processor import ProcessedOutputs
from pagedllm.metrics.stats import SchedulerStats
from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput
from pagedllm.request import RequestStatus
from pagedllm.sampling_params import SamplingParams


class PassThroughProcessor:
    """Checks nothing: the prompt text rides along for ScriptedCore to read."""

    def process(self, req_id, prompt, params, **kwargs) -> EngineRequest:
        return EngineRequest(req_id, [], params, max_tokens=1, arrival_time=0.0, prompt=prompt)


class PassThroughOutputs:
    """The scripted core's step gives RequestOutputs already: nothing to detokenize."""

    def has_request(self, req_id: str) -> bool:
        return False

    def add_request(self, request) -> None:
        pass

    def abort(self, req_ids) -> list[RequestOutput]:
        return []

    def process(self, outputs) -> ProcessedOutputs:
        return ProcessedOutputs(outputs=list(outputs))


class ScriptedCore:
    """Each step gives every live request one more token 'a'; requests end after `length` tokens."""

    config = EngineConfig(disable_log_stats=True)
    facts = None

    def __init__(self, fail_on_step: int | None = None, length: int = 3) -> None:
        """A prompt "fail" makes its request fail alone at its second token."""
        self.length = length
        self.live: dict[str, tuple[str, SamplingParams, int]] = {}
        self.aborted: list[str] = []
        self.steps = 0
        self.fail_on_step = fail_on_step

    def add_request(self, request: EngineRequest) -> EngineRequest:
        req_id, prompt, params = request.req_id, request.prompt, request.sampling_params
        if prompt == "bad":
            raise ValueError("prompt: bad")
        self.live[req_id] = (prompt, params, 0)
        return request

    def finish_requests(self, req_ids, status: RequestStatus) -> None:
        if status is RequestStatus.FINISHED_ABORTED:
            self.aborted += [r for r in req_ids if r in self.live]
        for req_id in req_ids:
            self.live.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def set_failure_callback(self, on_failure) -> None:
        pass  # one rank in this process: nothing dies apart from it

    def get_stats(self) -> SchedulerStats:
        return SchedulerStats(num_waiting_reqs=len(self.live))

    def close(self) -> None:
        pass

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps == self.fail_on_step:
            raise RuntimeError("boom")
        outputs = []
        for req_id, (prompt, params, num) in list(self.live.items()):
            num += 1
            self.live[req_id] = (prompt, params, num)
            if prompt == "fail" and num == 2:
                outputs.append(self._output(req_id, num, "error", error="RuntimeError: injected"))
                del self.live[req_id]
                continue
            outputs.append(self._output(req_id, num, "length" if num == self.length else None))
            if num == self.length:
                del self.live[req_id]
        return outputs

    @staticmethod
    def _output(req_id: str, num: int, finish_reason: str | None, error: str | None = None) -> RequestOutput:
        completion = CompletionOutput(0, "a" * num, [0] * num, finish_reason=finish_reason)
        return RequestOutput(
            req_id, None, [1], [completion], finish_reason is not None, RequestMetrics(0.0), error=error
        )


def scripted(core: ScriptedCore, **kwargs) -> AsyncLLM:
    return AsyncLLM(core, PassThroughProcessor(), PassThroughOutputs(), **kwargs)  # type: ignore[arg-type]


def run(engine: ScriptedCore, body, **kwargs):
    async def main():
        llm = scripted(engine, **kwargs)
        llm.start()
        try:
            return await body(llm)
        finally:
            await llm.shutdown()

    return asyncio.run(main())


def test_fan_out_streams_every_choice_to_the_end():
    engine = ScriptedCore()

    async def body(llm: AsyncLLM):
        stream = await llm.generate(["x", "y"], SamplingParams(n=2), request_id="r")
        return await stream.collect()

    outputs = run(engine, body)
    assert [o.request_id for o in outputs] == ["r-0", "r-1", "r-2", "r-3"]
    assert all(o.outputs[0].text == "aaa" and o.finished for o in outputs)


def test_a_bad_prompt_adds_nothing_and_a_full_queue_refuses():
    engine = ScriptedCore(length=10**9)
    seeds = []
    original = engine.add_request

    def recording_add(request):
        seeds.append(request.sampling_params.seed)
        return original(request)

    engine.add_request = recording_add  # type: ignore[method-assign]

    async def body(llm: AsyncLLM):
        with pytest.raises(ValueError, match="prompt: bad"):
            await llm.generate(["x", "bad"], SamplingParams(n=2, seed=5), request_id="r")
        assert engine.aborted == ["r-0", "r-1"] and not engine.live  # all or nothing
        assert not llm._routes
        with pytest.raises(ValueError, match="can never fit --max-queue-len 4"):
            await llm.generate(["x"], SamplingParams(n=5), request_id="never")
        stream = await llm.generate(["x"], SamplingParams(n=2), request_id="ok")
        await anext(stream)  # both running, and they never end
        with pytest.raises(QueueFullError):  # 2 waiting + 3 > 4: later, it may fit
            await llm.generate(["x"], SamplingParams(n=3), request_id="q")
        stream.close()

    run(engine, body, max_queue_len=4)
    assert seeds[:2] == [5, 6]


def test_close_aborts_what_is_still_running():
    engine = ScriptedCore(length=10**9)

    async def body(llm: AsyncLLM):
        stream = await llm.generate(["x"], SamplingParams(), request_id="r")
        await anext(stream)
        stream.close()
        await llm.call(lambda e: None)  # the abort ran before this
        return engine.aborted

    assert run(engine, body) == ["r-0"]


def test_a_dead_engine_fails_streams_refuses_new_work_and_calls_the_fatal_callback():
    engine = ScriptedCore(fail_on_step=2)
    fatal: list[BaseException] = []

    async def body(llm: AsyncLLM):
        llm.set_fatal_callback(fatal.append)
        stream = await llm.generate(["x"], SamplingParams(), request_id="r")
        with pytest.raises(EngineUnavailableError, match="boom"):
            await stream.collect()
        assert not llm.is_healthy
        with pytest.raises(EngineUnavailableError):
            await llm.generate(["x"], SamplingParams(), request_id="s")
        with pytest.raises(EngineUnavailableError):
            await llm.call(lambda e: None)

    run(engine, body)
    assert [str(error) for error in fatal] == ["boom"]


def test_a_request_that_fails_alone_gets_an_error_and_the_others_finish():
    engine = ScriptedCore(length=4)
    fatal: list[BaseException] = []

    async def body(llm: AsyncLLM):
        llm.set_fatal_callback(fatal.append)
        llm.set_step_callback(lambda stats, outputs: 1 / 0)  # a broken reporter is not fatal either
        good = await llm.generate(["x"], SamplingParams(), request_id="good")
        bad = await llm.generate(["fail"], SamplingParams(), request_id="bad")
        with pytest.raises(RequestFailedError, match="injected"):
            await bad.collect()
        bad.close()
        outputs = await good.collect()
        assert llm.is_healthy
        return outputs

    outputs = run(engine, body)
    assert outputs[0].outputs[0].text == "aaaa" and not fatal


def test_shutdown_refuses_new_requests():
    async def body(llm: AsyncLLM):
        llm.stop_admitting()
        with pytest.raises(EngineUnavailableError, match="shutting down"):
            await llm.generate(["x"], SamplingParams(), request_id="r")

    run(ScriptedCore(), body)


def test_launch_builds_the_engine_on_the_engine_thread_and_reports_build_errors():
    import threading

    built_on = []

    def make() -> AsyncLLM:
        built_on.append(threading.current_thread().name)
        return scripted(ScriptedCore())

    async_llm = AsyncLLM.launch(make)
    assert built_on == ["pagedllm-engine"] and isinstance(async_llm.core, ScriptedCore)
    asyncio.run(async_llm.shutdown())
    assert not async_llm.is_healthy

    def broken() -> AsyncLLM:
        raise ValueError("max_model_len: too long")

    with pytest.raises(ValueError, match="too long"):
        AsyncLLM.launch(broken)


def test_the_front_end_owns_its_processors_and_reads_facts_not_the_core():
    """The event loop's InputProcessor is the AsyncLLM's own: nothing reaches into the core for it."""
    core = ScriptedCore()
    processor = PassThroughProcessor()
    llm = AsyncLLM(core, processor, PassThroughOutputs())  # type: ignore[arg-type]
    assert llm.input_processor is processor and llm.config is core.config and llm.facts is core.facts
    assert {name for name, value in vars(AsyncLLM).items() if isinstance(value, property)} == {"is_healthy"}
