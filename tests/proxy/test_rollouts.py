"""The rollout registry: keys, append-to-disk, close, concurrency."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from clawfast.proxy.rollouts import RolloutRegistry
from clawfast.records import LogClosed, read_rollout, rollout_path


def fields(i: int) -> dict:
    return dict(prompt_ids=np.arange(1, 5 + i), output_ids=[7, 8], infer_logprobs=[-0.5, -1.5], tags=("main",), metadata={"i": i})


def test_open_lookup_close(tmp_path):
    reg = RolloutRegistry(tmp_path, base_url="http://127.0.0.1:1")
    a = reg.open("a", task_id="t", harness="h", sample_index=2)
    b = reg.open(harness="h")
    assert a.key != b.key and a.base_url == "http://127.0.0.1:1"
    assert reg.lookup(a.key).rollout_id == "a" and reg.lookup("x") is None and reg.lookup(None) is None
    rec = reg.lookup(a.key).append(**fields(0))
    assert rec.call_index == 0 and rec.rollout_id == "a"
    # appended means on disk already, before close (a crash would keep it)
    live = read_rollout(rollout_path(tmp_path, "a"), recover=True)
    assert live.status == "running" and live.calls[0].equals(rec)
    assert reg.records("a") == [rec]
    result = reg.close("a", reward=1.0)
    assert reg.lookup(a.key) is None
    assert read_rollout(rollout_path(tmp_path, "a")).equals(result)
    assert result.reward == 1.0 and result.sample_index == 2
    with pytest.raises(KeyError):
        reg.close("a")
    with pytest.raises(ValueError):
        reg.open("a")  # its file exists
    with pytest.raises(ValueError):
        reg.open("c", key=b.key)


def test_concurrent_appends_keep_every_call_in_order(tmp_path):
    reg = RolloutRegistry(tmp_path)
    opened = [reg.open(f"r{i}") for i in range(4)]

    def worker(key: str) -> None:
        rollout = reg.lookup(key)
        for i in range(50):
            rollout.append(**fields(i % 3))

    threads = [threading.Thread(target=worker, args=(o.key,)) for o in opened for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in opened:
        result = reg.close(o.rollout_id)
        assert [c.call_index for c in result.calls] == list(range(100))
        assert read_rollout(rollout_path(tmp_path, o.rollout_id)).equals(result)


def test_append_after_close_is_refused(tmp_path):
    reg = RolloutRegistry(tmp_path)
    o = reg.open("z")
    rollout = reg.lookup(o.key)
    reg.close("z")
    with pytest.raises(LogClosed):  # what the proxy drops as a late call; any other ValueError is a bug
        rollout.append(**fields(0))


def test_close_cancels_tracked_generations_from_another_thread(tmp_path):
    """Generations run on the server's loop; `close` may come from a gRPC worker thread. A generation
    tracked after the close is cancelled at once, and a loop already closed does not stop the close."""
    reg = RolloutRegistry(tmp_path)
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever)
    runner.start()
    try:
        a, b = reg.open("a"), reg.open("b")

        async def forever():
            await asyncio.sleep(3600)

        async def start(rollout_id):
            task = asyncio.ensure_future(forever())
            reg.get(rollout_id).track(task)
            return task

        task_a = asyncio.run_coroutine_threadsafe(start("a"), loop).result(5)
        task_b = asyncio.run_coroutine_threadsafe(start("b"), loop).result(5)
        rollout_a = reg.get("a")
        assert list(rollout_a._generations) == [task_a]
        reg.close("a")  # from this thread, not the loop's
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.05), loop).result(5)
        assert task_a.cancelled() and not task_b.done() and not rollout_a._generations

        async def track_late():
            late = asyncio.ensure_future(forever())
            rollout_a.track(late)
            await asyncio.sleep(0)
            return late

        assert asyncio.run_coroutine_threadsafe(track_late(), loop).result(5).cancelled()
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()
    assert not task_b.done()  # left pending on a closed loop
    result = reg.close(b.rollout_id, status="proxy_error")
    assert result.status == "proxy_error"


@pytest.mark.parametrize("bad", [{"info": {"loss": float("nan")}}, {"info": {"pair": (1, 2)}},
                                 {"reward": float("inf")}, {"status": "fine"}])
def test_a_result_no_record_can_hold_leaves_the_rollout_open(tmp_path, bad):
    # Refused before the rollout is taken out, so the caller can close it again: it used to be gone
    # from the registry with its file never closed (no result frame).
    reg = RolloutRegistry(tmp_path)
    opened = reg.open("r", task_id="t", harness="h")
    with pytest.raises(ValueError, match="rollout 'r'"):
        reg.close("r", **bad)
    assert reg.lookup(opened.key) is not None
    reg.close("r", reward=1.0, info={"loss": 0.5})
    result = read_rollout(rollout_path(tmp_path, "r"))
    assert (result.status, result.reward, result.info) == ("ok", 1.0, {"loss": 0.5})
