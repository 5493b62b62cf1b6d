"""The loop's seams are structural (typing.Protocol), so nothing at run time ties a class to the protocol it stands
behind: this reads every member a protocol declares off the real classes (and a test double), with the parameter
names and async-ness of each method, so renaming one side fails here rather than in a run."""
from __future__ import annotations

import inspect

import pytest

from glue.loop.buffer import RolloutBuffer
from glue.loop.replay import ReplayStream, SavingStream
from glue.loop.staleness import StalenessGate
from glue.loop.stream import BatchStream, GroupSource, RolloutStream
from glue.rollout.manager import RolloutManager
from helpers.managers import HangingGroups, NeverCheckpointed, ScriptedManager


def declared(protocol: type) -> dict[str, object]:
    """name -> what the protocol declares: its methods and properties, and its annotated attributes (as None)."""
    names = {name: value for name, value in vars(protocol).items()
             if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    return {**{name: None for name in vars(protocol).get("__annotations__", {})}, **names}


def check(obj: object, protocol: type, *, parameter_names: bool = True) -> None:
    """`obj` has every member of `protocol`; each method with the same parameters (by name when
    `parameter_names`: test doubles may name them their own way) and the same async-ness."""
    for name, member in declared(protocol).items():
        assert hasattr(obj, name), f"{type(obj).__name__} lacks {protocol.__name__}.{name}"
        if not callable(member):
            continue
        theirs = getattr(obj, name)  # bound (a wrapper's, delegated): no self
        assert inspect.iscoroutinefunction(theirs) == inspect.iscoroutinefunction(member), name
        want, have = list(inspect.signature(member).parameters)[1:], list(inspect.signature(theirs).parameters)
        assert have == want if parameter_names else len(have) == len(want), (name, have, want)


def rollout_manager() -> RolloutManager:
    """A real manager; constructing one loads the function and the task but talks to no engine."""
    return RolloutManager(function_path="rollout_fns.single_turn:generate_group",
                          task_path="rollout_fns.toy_tasks:EchoTask", task_args={"k": 2}, client=None,
                          sampling_params={"max_new_tokens": 3}, prompts_per_step=1, samples_per_prompt=1, seed=0)


def test_the_rollout_manager_is_what_the_stream_drives():
    check(rollout_manager(), GroupSource)


@pytest.mark.parametrize("double", [HangingGroups, lambda: ScriptedManager(engine=None)])
def test_the_test_managers_stand_in_for_it(double):
    check(double(), GroupSource, parameter_names=False)


def test_every_stream_the_loop_is_given_is_a_batch_stream(tmp_path):
    gate = StalenessGate(groups_per_step=1, max_staleness=0)
    stream = RolloutStream(manager=rollout_manager(), gate=gate, buffer=RolloutBuffer(groups_per_step=1),
                           max_groups=1)
    check(stream, BatchStream)
    check(ReplayStream(tmp_path, gate=gate), BatchStream)
    check(SavingStream(stream, tmp_path), BatchStream, parameter_names=False)


def test_a_renamed_method_or_parameter_is_caught():
    class Renamed(NeverCheckpointed):
        def next_groups(self):
            raise NotImplementedError

    class Reparametered(Renamed):
        def next_group(self):
            raise NotImplementedError

        def partial_samples(self, ids):
            return {}

    with pytest.raises(AssertionError, match="lacks GroupSource.next_group"):
        check(Renamed(), GroupSource)
    with pytest.raises(AssertionError, match="partial_samples"):
        check(Reparametered(), GroupSource)
