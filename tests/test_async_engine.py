"""AsyncEngine: the asyncio <-> engine-thread bridge, against the model-free FakeEngine."""

import asyncio
import time

import pytest

from fake_engine import FakeEngine, tiny_tokenizer
from jaxserve.engine.async_engine import (AsyncEngine, EngineError, QueueFull, RequestTimeout,
                                          StreamBufferFull)
from jaxserve.sampling_params import InvalidRequest, SamplingParams

REPLY = "Hi there! 😀 Bye."


@pytest.fixture
def engines():
    fake = FakeEngine(tiny_tokenizer(), REPLY)
    bridge = AsyncEngine(fake)
    yield fake, bridge
    bridge.shutdown()


def wait_until(cond, timeout=5.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


async def await_until(cond, timeout=5.0):
    """Like wait_until, but keeps this event loop running (so the engine thread can still
    deliver to it: an abort must come from the consumer, not from a closed loop)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


async def collect(bridge, rid, prompt, **kw):
    return [o async for o in bridge.generate(rid, prompt, SamplingParams(**kw))]


def test_concurrent_requests_complete(engines):
    fake, bridge = engines

    async def main():
        return await asyncio.gather(*(collect(bridge, f"r{i}", [1, 2, 3], max_tokens=50)
                                      for i in range(8)))

    for outs in asyncio.run(main()):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].text == "".join(o.new_text for o in outs) == REPLY
        assert outs[-1].finish_reason == "stop"
    assert fake.pages_in_use == 0 and fake.aborted == []


def test_invalid_request_surfaces_to_caller(engines):
    fake, bridge = engines

    async def main():
        with pytest.raises(InvalidRequest, match="empty"):
            await collect(bridge, "bad", [])
        return await collect(bridge, "good", [5], max_tokens=2)

    assert len(asyncio.run(main())) == 2
    assert fake.added == ["good"]


def test_step_failure_fails_in_flight_then_recovers(engines):
    fake, bridge = engines
    fake.step_delay = 0.01

    async def main():
        tasks = [asyncio.create_task(collect(bridge, f"r{i}", [1, 2], max_tokens=30,
                                             ignore_eos=True)) for i in range(3)]
        while fake.num_steps < 3:  # requests are running
            await asyncio.sleep(0.005)
        fake.fail_steps = 1
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, EngineError) for r in results), results
        assert "injected" not in str(results[0]), "exception text reaches the client"
        return await collect(bridge, "after", [1, 2], max_tokens=4)

    outs = asyncio.run(main())
    assert outs[-1].finish_reason == "length" and len(outs[-1].token_ids) == 4
    assert sorted(fake.aborted) == ["r0", "r1", "r2"]  # failed requests freed their pages
    assert fake.pages_in_use == 0


def test_consumer_leaving_early_aborts(engines):
    fake, bridge = engines
    fake.step_delay = 0.005

    async def main():
        async for out in bridge.generate("leaver", [1], SamplingParams(max_tokens=40, ignore_eos=True)):
            if len(out.token_ids) == 2:
                break
        await await_until(lambda: fake.aborted == ["leaver"] and fake.pages_in_use == 0)

    asyncio.run(main())


def test_cancelled_task_aborts(engines):
    fake, bridge = engines
    fake.step_delay = 0.005

    async def main():
        task = asyncio.create_task(collect(bridge, "cancelled", [1], max_tokens=40, ignore_eos=True))
        while fake.num_steps < 2:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await await_until(lambda: fake.aborted == ["cancelled"] and fake.pages_in_use == 0)

    asyncio.run(main())


def test_idle_thread_does_not_step(engines):
    fake, bridge = engines
    asyncio.run(collect(bridge, "one", [1], max_tokens=3))
    wait_until(lambda: not fake.requests)
    steps = fake.num_steps
    time.sleep(0.2)
    assert fake.num_steps == steps


def test_shutdown_fails_in_flight_and_refuses_new(engines):
    fake, bridge = engines
    fake.step_delay = 0.01

    async def main():
        task = asyncio.create_task(collect(bridge, "inflight", [1], max_tokens=40, ignore_eos=True))
        while fake.num_steps < 2:
            await asyncio.sleep(0.005)
        await asyncio.to_thread(bridge.shutdown)
        with pytest.raises(EngineError):
            await task
        with pytest.raises(EngineError, match="shut down"):
            await collect(bridge, "late", [1])

    asyncio.run(main())
    assert not bridge.is_running
    assert fake.aborted == ["inflight"] and fake.pages_in_use == 0


# -- isolation and limits ------------------------------------------------------------------

def make_bridge(fake, **kw):
    from jaxserve.entrypoints.metrics import Metrics
    return AsyncEngine(fake, metrics=Metrics(fake.stats), **kw)


def test_request_fault_fails_only_that_stream():
    fake = FakeEngine(tiny_tokenizer(), REPLY, step_delay=0.002)
    bridge = make_bridge(fake)
    fake.fail_requests = {"bad"}

    async def main():
        return await asyncio.gather(*(collect(bridge, rid, [1, 2], max_tokens=50)
                                      for rid in ("a", "bad", "b")), return_exceptions=True)

    try:
        a, bad, b = asyncio.run(main())
    finally:
        bridge.shutdown()
    assert isinstance(bad, EngineError) and "injected" not in str(bad)
    assert a[-1].text == b[-1].text == REPLY
    assert fake.pages_in_use == 0
    assert bridge.metrics.requests_failed.labels("engine_error")._value.get() == 1
    assert bridge.metrics.request_success.labels("stop")._value.get() == 2


def test_request_timeout_aborts_and_frees():
    fake = FakeEngine(tiny_tokenizer(), REPLY, step_delay=0.01)
    bridge = make_bridge(fake, request_timeout_s=0.3)

    async def main():
        slow = asyncio.create_task(collect(bridge, "slow", [1], max_tokens=10_000,
                                           ignore_eos=True))
        quick = await collect(bridge, "quick", [1], max_tokens=3)
        with pytest.raises(RequestTimeout, match="0.3 s"):
            await slow
        return quick

    t0 = time.monotonic()
    try:
        quick = asyncio.run(main())
    finally:
        bridge.shutdown()
    assert time.monotonic() - t0 < 3
    assert quick[-1].finish_reason == "length"
    assert fake.aborted == ["slow"] and fake.pages_in_use == 0
    assert bridge.metrics.requests_failed.labels("timeout")._value.get() == 1


def test_unread_stream_is_aborted_past_the_buffer_cap():
    """A consumer that stops reading (a client that does not read its socket): once its
    unread output passes max_stream_buffer_bytes, the request is aborted, its pages freed;
    a reading consumer of the same length is not."""
    fake = FakeEngine(tiny_tokenizer(), REPLY, step_delay=0.002, max_model_len=1000)
    cap = 40 * 128  # ~40 unread outputs
    bridge = make_bridge(fake, max_stream_buffer_bytes=cap)

    async def main():
        stalled = await bridge.add_request("stalled", [1], SamplingParams(max_tokens=900,
                                                                          ignore_eos=True))
        reader = asyncio.create_task(collect(bridge, "reader", [1], max_tokens=300,
                                             ignore_eos=True))
        await await_until(lambda: "stalled" in fake.aborted)
        outs = await reader
        with pytest.raises(StreamBufferFull):
            async for _ in stalled:
                pass
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        bridge.shutdown()
    assert len(outs[-1].token_ids) == 300 and fake.aborted == ["stalled"]
    assert fake.pages_in_use == 0
    assert bridge.metrics.requests_failed.labels("stream_buffer_full")._value.get() == 1


def test_queue_full_refuses_then_admits():
    fake = FakeEngine(tiny_tokenizer(), REPLY, step_delay=0.005, max_num_seqs=1)
    bridge = make_bridge(fake, max_queued_requests=2)
    sp = SamplingParams(max_tokens=40, ignore_eos=True)

    async def main():
        streams = [await bridge.add_request(f"r{i}", [1], sp) for i in range(3)]
        await await_until(lambda: fake.stats().scheduler.waiting == 2)
        with pytest.raises(QueueFull):
            await bridge.add_request("over", [1], sp)
        for s in streams:
            async for _ in s:
                pass
        return [o async for o in bridge.generate("later", [1], SamplingParams(max_tokens=2))]

    try:
        later = asyncio.run(main())
    finally:
        bridge.shutdown()
    assert later[-1].finished and "over" not in fake.added


def test_abort_all_keeps_serving():
    fake = FakeEngine(tiny_tokenizer(), REPLY, step_delay=0.005)
    bridge = make_bridge(fake)

    async def main():
        tasks = [asyncio.create_task(collect(bridge, f"r{i}", [1], max_tokens=5000,
                                             ignore_eos=True)) for i in range(3)]
        while fake.num_steps < 3:
            await asyncio.sleep(0.005)
        bridge.abort_all()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, EngineError) for r in results)
        return await collect(bridge, "after", [1], max_tokens=3)

    try:
        after = asyncio.run(main())
    finally:
        bridge.shutdown()
    assert after[-1].finish_reason == "length" and fake.pages_in_use == 0
    assert bridge.metrics.requests_failed.labels("shutdown")._value.get() == 3
