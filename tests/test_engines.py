"""Engine profiles (kvbalance/perf/engines.py): the serving engine's host time around each GPU step.

``vllm-v0`` is the cost model as it was before profiles (the GPU preset's fitted host time, serial); an
overlapped engine never makes a step shorter than its GPU time nor longer than the same engine run serially;
a profile file with an unknown name, a missing field or a parameter without a source is refused by name.
"""

from __future__ import annotations

import dataclasses

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbalance.batch import StepBreakdown
from kvbalance.perf.cost import CostModel, breakdown_total_s
from kvbalance.perf.engines import (
    CPU_DEFAULT_ENGINE,
    DEFAULT_ENGINE,
    ENGINES,
    PARAMS,
    EngineProfile,
    default_engine,
    engine_from_dict,
    get_engine,
    host_time,
    load_engine,
    resolve_engine,
    step_time_s,
)
from kvbalance.perf.overlap import OverlapStepModel
from kvbalance.specs import get_gpu

SHAPES = {
    "decode1": [(1, 128, True)],
    "decode64": [(1, 600, True)] * 64,
    "mixed": [(1, 900, True)] * 30 + [(256, 1300, False), (200, 200, True)],
    "prefill": [(1024, 1024, True)],
}

# Step seconds (sequential, then NanoFlow overlap mode) of the cost model at the commit before engine profiles
# existed (git 07c893b), on the two GPUs with their own fit: vllm-v0 must give them bit for bit.
BEFORE_PROFILES = {
    ("llama-2-7b", "h100-sxm", 1, "decode1"): (0.007280017565887269, 0.007280017565887269),
    ("llama-2-7b", "h100-sxm", 1, "decode64"): (0.01794102290934514, 0.01794102290934514),
    ("llama-2-7b", "h100-sxm", 1, "mixed"): (0.021047907693342974, 0.016239207119038198),
    ("llama-2-7b", "h100-sxm", 1, "prefill"): (0.02397911742439661, 0.022262710852952367),
    ("llama-3.1-70b", "h100-sxm", 4, "decode1"): (0.02547643949698936, 0.021908954537339258),
    ("llama-3.1-70b", "h100-sxm", 4, "decode64"): (0.035278806617618196, 0.031159655332448216),
    ("llama-3.1-70b", "h100-sxm", 4, "mixed"): (0.05212068698314041, 0.04059324908283293),
    ("llama-3.1-70b", "h100-sxm", 4, "prefill"): (0.08665068609428071, 0.06822976912281951),
    ("llama-2-13b", "a40", 2, "decode1"): (0.02939929218283151, 0.02939929218283151),
    ("llama-2-13b", "a40", 2, "decode64"): (0.07054288539292983, 0.07054288539292983),
    ("llama-2-13b", "a40", 2, "mixed"): (0.11546339626263447, 0.07798756148387143),
    ("llama-2-13b", "a40", 2, "prefill"): (0.17904104372389024, 0.14191271230402028),
}


@pytest.mark.parametrize("key", sorted(BEFORE_PROFILES))
def test_vllm_v0_reproduces_the_step_times_from_before_profiles_exactly(key):
    model, gpu, tp, shape = key
    cm = CostModel(model, gpu, tp, engine="vllm-v0")
    seq, overlap = BEFORE_PROFILES[key]
    assert breakdown_total_s(cm.step(SHAPES[shape])) == seq
    assert breakdown_total_s(OverlapStepModel(cm).step(SHAPES[shape])) == overlap


@pytest.mark.parametrize("gpu", ["a100-40gb", "a100-80gb", "h200", "l40s", "a40", "h100-sxm"])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_vllm_v0_is_the_gpu_time_plus_the_presets_fitted_host_time_serially(gpu, shape):
    seqs = SHAPES[shape]
    cm = CostModel("llama-2-7b", gpu, 1, engine="vllm-v0")
    tokens = sum(n for n, _, _ in seqs)
    host = cm.gpu.host_overhead_s(len(seqs), tokens, 1)
    assert breakdown_total_s(cm.step(seqs)) == pytest.approx(
        breakdown_total_s(cm.gpu_step(seqs)) + host, rel=1e-12
    )
    ht = cm.host_time(seqs)
    assert (ht.work_s, ht.launch_s, ht.sync_s, ht.hidden_s) == (host, 0.0, 0.0, pytest.approx(0.0, abs=1e-15))
    # the same spec with the "hardware" profile is the same engine
    assert breakdown_total_s(CostModel("llama-2-7b", gpu, engine="hardware").step(seqs)) == breakdown_total_s(
        cm.step(seqs)
    )


def _profile(**kw) -> EngineProfile:
    base = dict(
        name="t",
        engine="test",
        overlap=True,
        host_fixed_s=1e-3,
        host_per_seq_s=2e-5,
        sync_s=1e-4,
        eager_launch_per_kernel_s=4e-6,
    )
    return EngineProfile(**(base | kw))


@settings(max_examples=60, deadline=None)
@given(
    batch=st.integers(1, 600),
    context=st.integers(1, 4000),
    prefill=st.sampled_from([0, 17, 512, 3000]),
    fixed=st.floats(0, 0.05),
    per_seq=st.floats(0, 3e-4),
    sync=st.floats(0, 2e-3),
    per_kernel=st.floats(0, 1e-4),
    graph_seqs=st.sampled_from([0, 8, 160]),
    graph_tokens=st.sampled_from([0, 512]),
)
def test_overlap_never_makes_a_step_shorter_than_its_gpu_time_nor_longer_than_serial(
    batch, context, prefill, fixed, per_seq, sync, per_kernel, graph_seqs, graph_tokens
):
    seqs = [(1, context, True)] * batch + ([(prefill, prefill + 64, True)] if prefill else [])
    over = _profile(
        host_fixed_s=fixed,
        host_per_seq_s=per_seq,
        sync_s=sync,
        eager_launch_per_kernel_s=per_kernel,
        cuda_graph_max_seqs=graph_seqs,
        cuda_graph_max_tokens=graph_tokens,
        graph_launch_s=1e-5,
    )
    serial = dataclasses.replace(over, overlap=False)
    cm_o = CostModel("llama-3.1-8b", "h100-sxm", engine=over)
    cm_s = CostModel("llama-3.1-8b", "h100-sxm", engine=serial)
    gpu = breakdown_total_s(cm_o.gpu_step(seqs))
    t_over = breakdown_total_s(cm_o.step(seqs))
    t_serial = breakdown_total_s(cm_s.step(seqs))
    assert gpu * (1 - 1e-12) <= t_over <= t_serial * (1 + 1e-12)
    ht = cm_o.host_time(seqs)
    assert ht.step_s == pytest.approx(t_over, rel=1e-9)  # host_time agrees with the step's own arithmetic
    assert ht.hidden_s >= -1e-12 and ht.exposed_s >= -1e-12
    # serially nothing is hidden unless the launches hide under the kernels
    assert cm_s.host_time(seqs).hidden_s == pytest.approx(min(ht.launch_s, gpu), abs=1e-12)


def test_step_time_formulas_by_hand():
    o = _profile(sync_s=0.5)
    s = dataclasses.replace(o, overlap=False)
    # gpu 10, host work 4, launch 2: overlapped max(max(10, 2), 4) + 0.5; serial 4 + max(10, 2) + 0.5
    assert step_time_s(o, 10.0, 4.0, 2.0) == 10.5 and step_time_s(s, 10.0, 4.0, 2.0) == 14.5
    # host work longer than the GPU step: the step lasts as long as the host work
    assert step_time_s(o, 3.0, 8.0, 1.0) == 8.5
    # launch-bound: launching the kernels takes longer than running them
    assert step_time_s(o, 3.0, 1.0, 5.0) == 5.5 and step_time_s(s, 3.0, 1.0, 5.0) == 6.5
    ht = host_time(o, get_gpu("h100-sxm"), 10.0, 4, 4, 100)  # work 1e-3 + 4 * 2e-5, launch 100 * 4e-6
    assert ht.work_s == pytest.approx(1.08e-3) and ht.launch_s == pytest.approx(4e-4)
    assert ht.step_s == 10.5 and ht.exposed_s == 0.5
    assert ht.hidden_s == pytest.approx(1.08e-3 + 4e-4)


def test_host_work_terms_and_tensor_parallel_extra():
    p = _profile(host_per_token_s=1e-6, host_tp_fixed_s=3e-4, host_tp_per_seq_s=1e-5, host_per_tp_rank_s=2e-4)
    hw = get_gpu("h100-sxm")
    assert p.host_work_s(hw, 10, 100, 1) == pytest.approx(1e-3 + 10 * 2e-5 + 100 * 1e-6)
    assert p.host_work_s(hw, 10, 100, 4) == pytest.approx(
        1e-3 + 10 * 2e-5 + 100 * 1e-6 + 3e-4 + 10 * 1e-5 + 3 * 2e-4
    )
    v0 = get_engine("vllm-v0")
    assert v0.host_work_s(hw, 10, 100, 4) == hw.host_overhead_s(10, 100, 4)


def test_vllm_v06_pays_no_tensor_parallel_host_term_where_vllm_v0_pays_v02s_broadcast():
    # v0.2's pickled-metadata broadcast (the A40 fit's tp > 1 terms) is gone in 0.6: shared-memory queue +
    # NCCL tensors; vllm-v0 keeps the A40 data's terms
    hw = get_gpu("h100-sxm")
    v06, v0 = get_engine("vllm-v0.6"), get_engine("vllm-v0")
    for seqs in (1, 8, 200):
        assert v06.host_work_s(hw, seqs, seqs, 4) == v06.host_work_s(hw, seqs, seqs, 1)
        assert v0.host_work_s(hw, seqs, seqs, 4) > v0.host_work_s(hw, seqs, seqs, 1) + 1e-3
    assert v06.host_work_s(hw, 200, 200, 1) == pytest.approx(1.0109e-3 + 200 * 3.658e-5)


def test_cuda_graph_applies_by_token_count_or_to_small_decode_batches():
    v1, sgl = get_engine("vllm-v1"), get_engine("sglang")
    assert v1.uses_graph(512, 512) and v1.uses_graph(3, 512) and not v1.uses_graph(513, 513)
    assert sgl.uses_graph(160, 160) and not sgl.uses_graph(161, 161)
    assert not sgl.uses_graph(2, 100)  # a prefill in the batch: eager
    assert not get_engine("vllm-v0").uses_graph(1, 1) and not v1.uses_graph(0, 0)
    assert v1.launch_s(4, 4, 500) == v1.graph_launch_s
    assert sgl.launch_s(4, 100, 500) == 500 * sgl.eager_launch_per_kernel_s


def test_an_eager_launch_bound_step_lasts_as_long_as_its_launches():
    eager = _profile(host_fixed_s=0.0, host_per_seq_s=0.0, sync_s=0.0, eager_launch_per_kernel_s=1e-3)
    cm = CostModel("tiny-llama", "h100-sxm", engine=eager)
    seqs = [(1, 8, True)]
    n = cm.num_kernels(seqs)
    assert n == sum(op.repeat for op in cm.op_counts(seqs)) > 10
    assert breakdown_total_s(cm.step(seqs)) == pytest.approx(n * 1e-3)
    graphed = dataclasses.replace(eager, cuda_graph_max_seqs=8, graph_launch_s=0.0)
    gpu = breakdown_total_s(cm.gpu_step(seqs))
    assert breakdown_total_s(CostModel("tiny-llama", "h100-sxm", engine=graphed).step(seqs)) == pytest.approx(
        gpu
    )


def test_tensor_parallel_steps_launch_two_all_reduces_per_layer():
    seqs = [(1, 100, True)] * 4
    one = CostModel("llama-3.1-70b", "h100-sxm", 1).num_kernels(seqs)
    four = CostModel("llama-3.1-70b", "h100-sxm", 4).num_kernels(seqs)
    assert four - one == 2 * 80
    assert CostModel("llama-3.1-70b", "h100-sxm", 4).num_kernels([]) == 0


def test_overlap_mode_sets_an_overlapped_engines_host_work_against_its_shorter_gpu_time():
    seqs = [(1, 900, True)] * 30 + [(512, 1300, False)]
    eng = _profile(host_fixed_s=0.0, host_per_seq_s=0.0, sync_s=2e-4, eager_launch_per_kernel_s=0.0)
    cm = CostModel("llama-2-7b", "h100-sxm", engine=eng)
    ov = OverlapStepModel(cm).step(seqs)
    gpu = cm.gpu_step(seqs)
    core = ov.compute_s + ov.memory_s + ov.comm_s
    assert core < gpu.compute_s + gpu.memory_s  # the nano-batches do overlap here
    assert ov.overhead_s == pytest.approx(gpu.overhead_s + 2e-4)  # kernel latencies + the sync
    heavy = dataclasses.replace(eng, host_fixed_s=1.0)  # host work longer than any GPU step: it sets the step
    assert breakdown_total_s(
        OverlapStepModel(CostModel("llama-2-7b", "h100-sxm", engine=heavy)).step(seqs)
    ) == (pytest.approx(1.0 + 2e-4))


def test_default_engine_by_hardware_kind_and_context():
    assert CostModel("llama-2-7b", "h100-sxm").engine.name == DEFAULT_ENGINE
    cpu = get_gpu("h100-sxm").with_(kind="cpu", name="cpu")
    assert resolve_engine(None, cpu).name == CPU_DEFAULT_ENGINE == "hardware"
    with default_engine("sglang"):
        assert CostModel("llama-2-7b", "h100-sxm").engine.name == "sglang"
        assert CostModel("llama-2-7b", "h100-sxm", engine="vllm-v0").engine.name == "vllm-v0"
    assert CostModel("llama-2-7b", "h100-sxm").engine.name == DEFAULT_ENGINE
    with pytest.raises(ValueError, match="engine: unknown 'vllm-v9'"):
        with default_engine("vllm-v9"):
            pass


def test_unknown_engine_name_is_a_named_error():
    with pytest.raises(ValueError, match=r"engine: unknown 'trt-llm' \(known: .*vllm-v1"):
        get_engine("trt-llm")
    with pytest.raises(ValueError, match="engine: unknown"):
        CostModel("llama-2-7b", "h100-sxm", engine="nope")
    assert get_engine("VLLM_V1") is ENGINES["vllm-v1"]
    with pytest.raises(ValueError, match="engine: expected a profile name"):
        get_engine(3)


def _file_dict(name: str = "mine") -> dict:
    d = get_engine("sglang").to_dict()
    d["name"] = name
    return d


def test_a_profile_file_round_trips_and_loads_by_path(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(_file_dict()))
    p = get_engine(str(path))
    assert p == dataclasses.replace(get_engine("sglang"), name="mine")
    assert p.sources == get_engine("sglang").sources
    with pytest.raises(ValueError, match="engine: no such profile file"):
        load_engine(tmp_path / "absent.yaml")
    (tmp_path / "bad.yaml").write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match="engine: cannot read profile file"):
        load_engine(tmp_path / "bad.yaml")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["params"].pop("sync_s"), r"params: missing sync_s"),
        (lambda d: d.pop("engine"), r"missing 'engine'"),
        (lambda d: d.pop("params"), r"missing 'params'"),
        (lambda d: d["params"].update(warp_s={"value": 1, "source": "x"}), r"unknown parameter\(s\) warp_s"),
        (lambda d: d.update(colour="red"), r"unknown key\(s\) colour"),
        (lambda d: d["params"]["sync_s"].update(source=" "), r"params.sync_s.source: must name where"),
        (
            lambda d: d["params"]["sync_s"].pop("source"),
            r"params.sync_s: expected \{value: ..., source: ...\}",
        ),
        (lambda d: d["params"]["sync_s"].update(value=-1.0), r"sync_s: must be a finite number >= 0"),
        (lambda d: d["params"]["overlap"].update(value="yes"), r"overlap: must be true or false"),
        (
            lambda d: d["params"]["cuda_graph_max_seqs"].update(value=1.5),
            r"cuda_graph_max_seqs: must be an integer",
        ),
        (lambda d: d.update(params=[1]), r"params: expected a mapping"),
    ],
)
def test_a_malformed_profile_is_refused_naming_the_field(mutate, message):
    d = _file_dict()
    mutate(d)
    with pytest.raises(ValueError, match=message):
        engine_from_dict(d, "engine mine.yaml")
    with pytest.raises(ValueError, match="engine: expected a mapping"):
        engine_from_dict([1])


def test_every_preset_profile_names_a_source_for_every_parameter():
    assert {"vllm-v0", "vllm-v1", "sglang", "hardware"} <= set(ENGINES)
    for name, p in ENGINES.items():
        assert set(p.sources) == set(PARAMS), name
        assert all(len(s) > 10 for s in p.sources.values()), name
        assert p.engine and p.description, name


def test_current_engines_hide_host_work_that_vllm_v0_pays():
    seqs = [(1, 512, True)] * 128
    t = {e: breakdown_total_s(CostModel("llama-3.1-8b", "a100-80gb", engine=e).step(seqs)) for e in ENGINES}
    gpu = breakdown_total_s(CostModel("llama-3.1-8b", "a100-80gb").gpu_step(seqs))
    assert t["vllm-v0"] > t["vllm-v1"] >= t["sglang"] >= gpu
    v1 = ENGINES["vllm-v1"]
    assert t["vllm-v1"] == pytest.approx(gpu + v1.sync_s)  # 128 x 21.5 us of host work hides under ~22 ms
    assert CostModel("llama-2-7b", "a100-80gb").gpu_step([]) == StepBreakdown()


def test_an_engines_own_all_reduce_takes_small_messages_over_nvlink_where_it_is_faster():
    v1 = get_engine("vllm-v1")
    # 4 x H100, 128 KB (a decode of 8 tokens of an 8192-wide model): 6 us + 1.5 x 128 KiB / 197 GB/s
    assert v1.allreduce_s(131072, 4, 30e-6, True) == pytest.approx(6e-6 + 1.5 * 131072 / 1.97e11)
    assert v1.allreduce_s(131072, 4, 30e-6, False) == 30e-6  # PCIe: NCCL only
    assert v1.allreduce_s(9 << 20, 4, 1e-3, True) == 1e-3  # above 8 MiB: NCCL
    assert v1.allreduce_s(4 << 20, 4, 20e-6, True) == 20e-6  # NCCL faster there: the engine picks it
    assert v1.allreduce_s(131072, 1, 30e-6, True) == 30e-6 and v1.allreduce_s(0, 4, 0.0, True) == 0.0
    decode = {
        e: CostModel("llama-3.1-70b", "h100-sxm", 4, engine=e).comm_s(8) for e in ("vllm-v0", "vllm-v1")
    }
    assert decode["vllm-v1"] == pytest.approx(160 * (6e-6 + 1.5 * 8 * 8192 * 2 / 1.97e11))
    assert decode["vllm-v0"] > 4 * decode["vllm-v1"]  # NCCL's fitted 29.5 us per all-reduce
    prefill = {
        e: CostModel("llama-3.1-70b", "h100-sxm", 4, engine=e).comm_s(512) for e in ("vllm-v0", "vllm-v1")
    }
    assert prefill["vllm-v0"] == prefill["vllm-v1"]  # 8 MiB messages: the ring is faster
    pcie = {e: CostModel("llama-2-13b", "a40", 2, engine=e).comm_s(8) for e in ("vllm-v0", "vllm-v1")}
    assert pcie["vllm-v0"] == pcie["vllm-v1"]
    with pytest.raises(ValueError, match="custom_allreduce_bandwidth_bytes_s: must be > 0"):
        dataclasses.replace(v1, custom_allreduce_bandwidth_bytes_s=0.0)
