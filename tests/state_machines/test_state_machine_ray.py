"""StateMachine stages as Ray async actors (state_machines/base.py): two stages wired through Ray carry every
item and end; a stage's failure reaches the driver as a StageError naming it; a stage killed under its
neighbour is the one the driver names. What crosses between processes survives pickling: a StageError
with its fields, and END_OF_STREAM as the same singleton."""

import asyncio
import time

import pytest
import ray

from helpers.clusters import RAY_CALL_GUARD_S
from state_machines.base import END_OF_STREAM, StageError, StateMachine


def test_stage_error_survives_pickling():
    """Ray pickles an actor's exception to hand it to the driver."""
    import pickle

    import cloudpickle

    try:
        raise ValueError("boom")
    except ValueError as exc:
        err = StageError("reward", exc, "process_data")
    for lib in (pickle, cloudpickle):
        back = lib.loads(lib.dumps(err))
        assert type(back) is StageError
        assert (back.stage, back.original_type, str(back)) == ("reward", "ValueError", str(err))
    assert str(err).startswith("stage 'reward' failed in process_data: ValueError: boom\n")


def test_end_of_stream_is_a_singleton_across_pickling():
    import pickle

    import cloudpickle

    assert pickle.loads(pickle.dumps(END_OF_STREAM)) is END_OF_STREAM
    assert cloudpickle.loads(cloudpickle.dumps(END_OF_STREAM)) is END_OF_STREAM
    assert repr(END_OF_STREAM) == "END_OF_STREAM"


def _ray_stage_classes():
    """Defined in a function so Ray pickles them by value (tests/ is not importable)."""

    class RaySource(StateMachine):
        def __init__(self, name, n):
            super().__init__(name)
            self.n = n
            self.i = 0

        async def get_input_data(self):
            if self.i >= self.n:
                return END_OF_STREAM
            self.i += 1
            return self.i - 1

        async def process_data(self, data):
            return data

        async def send_output_data(self, data):
            return await self.send_downstream(data)

    class RaySink(StateMachine):
        def __init__(self, name, fail_on=None):
            super().__init__(name, inbox_size=1)
            self.fail_on = fail_on
            self.got = []

        async def get_input_data(self):
            return await self.next_from_inbox()

        async def process_data(self, data):
            await asyncio.sleep(0.001)
            if data == self.fail_on:
                raise ValueError(f"bad item {data}")
            self.got.append(data * 2)
            return None

        async def send_output_data(self, data):
            return True

        def items(self):
            return self.got

    return RaySource, RaySink


def test_ray_actors_end_to_end(ray_cluster):
    RaySource, RaySink = _ray_stage_classes()
    src = ray.remote(num_cpus=0)(RaySource).remote("ray-src", 20)
    sink = ray.remote(num_cpus=0)(RaySink).remote("ray-sink")
    ray.get([src.connect.remote([sink], 0), sink.connect.remote([], 1)], timeout=RAY_CALL_GUARD_S)
    sink_ref = sink.run.remote()
    src_ref = src.run.remote()
    s_src, s_sink = ray.get([src_ref, sink_ref], timeout=RAY_CALL_GUARD_S)
    assert s_src["name"] == "ray-src" and s_src["items"] == 20
    assert s_sink["name"] == "ray-sink" and s_sink["items"] == 20
    assert ray.get(sink.items.remote(), timeout=RAY_CALL_GUARD_S) == [2 * i for i in range(20)]


def test_ray_stage_error_surfaces_with_stage_name(ray_cluster):
    RaySource, RaySink = _ray_stage_classes()
    src = ray.remote(num_cpus=0)(RaySource).remote("ray-src2", 20)
    sink = ray.remote(num_cpus=0)(RaySink).remote("ray-failing-sink", fail_on=4)
    ray.get([src.connect.remote([sink], 0), sink.connect.remote([], 1)], timeout=RAY_CALL_GUARD_S)
    sink_ref = sink.run.remote()
    src.run.remote()  # blocks on the dead stage's full inbox; killed below
    with pytest.raises(Exception) as info:
        ray.get(sink_ref, timeout=RAY_CALL_GUARD_S)
    assert not isinstance(info.value, ray.exceptions.GetTimeoutError)
    assert isinstance(info.value, ray.exceptions.RayTaskError)
    assert isinstance(info.value, StageError)  # RayTaskError keeps the cause's type
    cause = info.value.cause  # what the pipeline driver reports
    assert isinstance(cause, StageError) and cause.stage == "ray-failing-sink"
    assert str(cause).startswith("stage 'ray-failing-sink' failed in process_data: ValueError: bad item 4")
    assert "ray-failing-sink" in str(info.value) and "ValueError: bad item 4" in str(info.value)
    assert ray.get(sink.items.remote(), timeout=RAY_CALL_GUARD_S) == [0, 2, 4, 6]
    ray.kill(src)
    ray.kill(sink)


def test_a_dead_stage_is_named_not_the_neighbour_that_could_not_reach_it(ray_cluster):
    """SIGKILL-like death of a sink (ray.kill): the source's send fails first, with the sink's
    ActorDiedError inside its StageError; the driver names the sink, whose own `run` died."""
    from async_rl.loop import blame_stage

    RaySource, RaySink = _ray_stage_classes()
    src = ray.remote(num_cpus=0)(RaySource).remote("ray-src3", 10**6)
    sink = ray.remote(num_cpus=0)(RaySink).remote("ray-dying-sink")
    ray.get([src.connect.remote([sink], 0), sink.connect.remote([], 1)], timeout=RAY_CALL_GUARD_S)
    src_ref, sink_ref = src.run.remote(), sink.run.remote()
    runs = {src_ref: "source", sink_ref: "sink"}
    time.sleep(0.5)
    ray.kill(sink, no_restart=True)
    with pytest.raises(ray.exceptions.RayError) as info:  # the source's send to the dead sink fails
        ray.get(src_ref, timeout=RAY_CALL_GUARD_S)
    assert not isinstance(info.value, ray.exceptions.RayActorError)  # the source itself is alive
    stage, cause = blame_stage(runs, src_ref, info.value, [sink_ref])
    assert stage == "sink" and isinstance(cause, ray.exceptions.RayActorError)
    ray.kill(src)
