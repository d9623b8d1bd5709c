"""A failing StateMachine stage (state_machines/base.py) raises a StageError naming the stage, the step that
failed (get_input_data, process_data, send_output_data, on_start, a downstream's put) and the original
error; the outputs before the failure went out, no END_OF_STREAM follows, and the stage's other items in
flight are cancelled."""

import asyncio

import pytest

from state_machines.base import StageError
from toy_stages import Mapper, Recorder, Sink, Source, feed, run


def test_process_data_error_raises_stage_error():
    def fn(x):
        if x == 3:
            raise ValueError("boom")
        return x

    mapper = Mapper(name="square-it", fn=fn)
    out = Recorder()
    mapper.connect([out], 1)

    async def main():
        feeder = asyncio.ensure_future(feed(mapper, range(10)))
        try:
            await mapper.run()
        finally:
            feeder.cancel()

    with pytest.raises(StageError) as info:
        run(main())
    msg = str(info.value)
    assert "square-it" in msg and "ValueError: boom" in msg and "process_data" in msg
    assert info.value.stage == "square-it" and info.value.original_type == "ValueError"
    assert isinstance(info.value.__cause__, ValueError)
    assert out.items == [0, 1, 2]  # outputs before the failure went out, no END_OF_STREAM


def test_process_data_error_with_inflight_names_process_data():
    """With max_inflight > 1 an item can fail while the loop waits for the next input;
    the message must still say the failure was in process_data."""

    def fn(x):
        raise ValueError("boom")

    mapper = Mapper(name="m4", fn=fn, delay=lambda x: 0.01, max_inflight=4)
    mapper.connect([Recorder()], 1)

    async def main():
        await mapper.put(0)  # then nothing more: the loop is waiting in get_input_data
        await mapper.run()

    with pytest.raises(StageError) as info:
        run(main())
    msg = str(info.value)
    assert "'m4'" in msg and "ValueError: boom" in msg
    assert "failed in process_data" in msg, msg.splitlines()[0]


def test_process_data_error_cancels_other_inflight_items():
    def fn(x):
        if x == 0:
            raise ValueError("boom")
        return x

    mapper = Mapper(name="m", fn=fn, delay=lambda x: 0.01 if x == 0 else 60.0, max_inflight=3)
    mapper.connect([Recorder()], 1)

    async def main():
        await feed(mapper, [0, 1], end=False)
        try:
            await mapper.run()
        finally:
            await asyncio.sleep(0.01)  # let cancellations land

    with pytest.raises(StageError, match="ValueError: boom"):
        run(main())
    assert mapper.cancelled == [1]


class FailingInput(Sink):
    async def get_input_data(self):
        raise KeyError("no input")


class FailingOutput(Mapper):
    async def send_output_data(self, data):
        raise ConnectionError(f"cannot send {data}")


class FailingStart(Sink):
    async def on_start(self):
        raise RuntimeError("no start")


def test_get_input_data_error_raises_stage_error():
    stage = FailingInput(name="reader")
    stage.connect([], 1)
    with pytest.raises(StageError) as info:
        run(stage.run())
    msg = str(info.value)
    assert "'reader'" in msg and "get_input_data" in msg and "KeyError: 'no input'" in msg


def test_send_output_data_error_raises_stage_error():
    stage = FailingOutput(name="writer")
    stage.connect([Recorder()], 1)

    async def main():
        await stage.put(5)
        await stage.run()

    with pytest.raises(StageError) as info:
        run(main())
    msg = str(info.value)
    assert "'writer'" in msg and "send_output_data" in msg and "ConnectionError: cannot send 5" in msg
    assert stage.finished == [5]


def test_on_start_error_raises_stage_error():
    stage = FailingStart(name="starter")
    stage.connect([], 1)
    with pytest.raises(StageError, match="'starter' failed in on_start: RuntimeError: no start"):
        run(stage.run())


def test_downstream_put_error_raises_stage_error():
    class BrokenDownstream:
        async def put(self, item):
            raise OSError("pipe closed")

    src = Source(3, name="src")
    src.connect([BrokenDownstream()], 0)
    with pytest.raises(StageError) as info:
        run(src.run())
    assert "'src'" in str(info.value) and "OSError: pipe closed" in str(info.value)
