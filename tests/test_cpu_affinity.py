"""CPU core binding (executor.cpu_affinity): the spec parser, the bind itself and its errors."""

import os

import pytest

from kvbalance.executor.cpu_affinity import bind_cores, parse_cores


def test_parse_cores_ranges_lists_and_duplicates():
    assert parse_cores("0") == [0]
    assert parse_cores("0-3,6") == [0, 1, 2, 3, 6]
    assert parse_cores(" 2 , 0-1,1") == [0, 1, 2]


@pytest.mark.parametrize("spec", ["", "a", "1-", "3-1", "-1", "0,,1"])
def test_parse_cores_rejects_bad_specs_naming_the_field(spec):
    with pytest.raises(ValueError, match="cpu_cores"):
        parse_cores(spec)


def test_bind_cores_binds_every_thread_and_restores():
    before = os.sched_getaffinity(0)
    core = min(before)
    try:
        assert bind_cores(str(core)) == [core]
        assert os.sched_getaffinity(0) == {core}
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == {core}
    finally:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), before)


def test_bind_cores_rejects_unavailable_cores():
    missing = max(os.sched_getaffinity(0)) + 1000
    with pytest.raises(ValueError, match=f"cpu_cores: cores \\[{missing}\\] are not available"):
        bind_cores(str(missing))


def test_torch_executor_binds_and_sets_one_thread_per_core():
    torch = pytest.importorskip("torch")
    from kvbalance.executor.torch import TorchExecutor
    from kvbalance.model.llama import LlamaConfig
    from kvbalance.model.weights import random_weights
    from kvbalance.specs import get_model

    config = LlamaConfig.from_spec(get_model("tiny-llama"))
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    core = min(before)
    try:
        TorchExecutor(config, random_weights(config), num_blocks=4, block_size=16, cpu_cores=str(core))
        assert os.sched_getaffinity(0) == {core}
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="num_threads: 2 exceeds the 1 cores"):
            TorchExecutor(config, random_weights(config), 4, 16, num_threads=2, cpu_cores=str(core))
        with pytest.raises(ValueError, match="cpu_cores: only for a CPU device"):
            TorchExecutor(config, random_weights(config), 4, 16, device="meta", cpu_cores=str(core))
    finally:
        for tid in os.listdir("/proc/self/task"):
            os.sched_setaffinity(int(tid), before)
        torch.set_num_threads(threads)


def _restore_all(before):
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), before)
        except OSError:
            pass


def test_thread_binder_pins_each_compute_thread_to_its_own_core():
    torch = pytest.importorskip("torch")
    from kvbalance.executor.cpu_affinity import ThreadBinder, _bind_library

    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    if len(before) < 2 or _bind_library() is None:
        pytest.skip("needs two cores and a C compiler")
    cores = sorted(before)[:2][::-1]  # reversed: thread 0 (this one) goes to the higher core
    try:
        torch.set_num_threads(2)
        binder = ThreadBinder(cores)
        assert binder.ensure(2)
        assert os.sched_getaffinity(0) == {cores[0]}  # the calling thread is thread 0 of its team
        others = [
            os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task") if int(t) != os.getpid()
        ]
        assert {cores[1]} in others  # the pool's worker
        torch.ones(1 << 16).sum()  # torch's parallel regions reuse the pinned pool
        assert binder.ensure(2)  # no second pin for the same thread and size
        assert not binder.ensure(1)  # one thread: nothing to pin apart
    finally:
        torch.set_num_threads(threads)
        _restore_all(before)


def test_thread_binder_rejects_no_cores():
    from kvbalance.executor.cpu_affinity import ThreadBinder

    with pytest.raises(ValueError, match="cpu_cores"):
        ThreadBinder([])
