"""Cost-model pieces pinned by hand (milliseconds each): overlap's resource bound, the step report, the
profile readers and the fit's error table.

Overlap (NanoFlow Eq. 5 over the per-operator rooflines): core = min(sum_op max(c, m) + comm,
f * max(sum c, sum m, comm)), booked to the busiest resource, plus the serial overhead. The step report's
throughput is tokens / step time and its MFU flops / (step time * peak). Profiles are Vidur CSVs written in a
temporary folder, with the samples expected from each row by hand.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from kvbalance.batch import BatchPlan, ScheduledSeq, StepBreakdown
from kvbalance.perf import profiles
from kvbalance.perf.cost import CostModel, allreduce_time, breakdown_total_s
from kvbalance.perf.engines import get_engine
from kvbalance.perf.fit_errors import BATCH_RANGES, ClassError, error_rows, op_class, operator_errors
from kvbalance.perf.kernels import OpTime
from kvbalance.perf.overlap import OverlapConfig, OverlapStepModel, resource_times_s, step_model
from kvbalance.perf.report import step_cost_report
from kvbalance.request import Request
from kvbalance.specs import LinkSpec, get_gpu, gpu_provenance

# -- overlap --------------------------------------------------------------------------------------------


class StubCost:
    """A cost model with given operator rooflines and a given sequential breakdown (a serial engine: its host
    time is in the sequential breakdown's overhead)."""

    engine = get_engine("vllm-v0")

    def __init__(self, times: dict, seq: StepBreakdown) -> None:
        self.times, self.seq, self.calls = times, seq, []

    def step(self, seqs):
        self.calls.append(list(seqs))
        return self.seq

    def op_times(self, seqs):
        return self.times


def _times(*cm_pairs) -> dict:
    return {
        f"op{i}": OpTime(f"op{i}", "gemm", 10.0 * (i + 1), 100.0 * (i + 1), c, m)
        for i, (c, m) in enumerate(cm_pairs)
    }


def test_resource_times_sum_compute_memory_and_rooflines():
    t = _times((3.0, 1.0), (0.5, 2.0))
    assert resource_times_s(t, 0.25) == (3.5, 3.0, 3.0 + 2.0, 0.25)


def _overlap(times, comp_s, mem_s, comm_s, f=1.0) -> StepBreakdown:
    seq = StepBreakdown(compute_s=comp_s, memory_s=mem_s, overhead_s=0.5, comm_s=comm_s)
    return OverlapStepModel(StubCost(times, seq), OverlapConfig(f)).step([(1, 1, True)])


def test_overlap_books_the_core_to_the_busiest_resource():
    t = _times((3.0, 1.0), (0.0, 4.0))  # sum c = 3, sum m = 5, sequential compute + memory = 3 + 4 = 7
    b = _overlap(t, 3.0, 4.0, 1.0)
    assert (b.compute_s, b.memory_s, b.comm_s, b.overhead_s) == (0.0, 5.0, 0.0, 0.5)  # min(7 + 1, 5)
    assert (b.flops, b.bytes) == (30.0, 300.0)  # 10 + 20 and 100 + 200
    b = _overlap(t, 3.0, 4.0, 10.0, f=1.5)  # the network is busiest: min(7 + 10, 1.5 x 10)
    assert (b.compute_s, b.memory_s, b.comm_s) == (0.0, 0.0, 15.0)
    b = _overlap(t, 3.0, 4.0, 5.0)  # comm equal to the busiest kernel resource: not the network
    assert (b.compute_s, b.memory_s, b.comm_s) == (0.0, 5.0, 0.0)
    even = _times((2.0, 1.0), (2.0, 3.0))  # sum c = sum m = 4: compute wins the tie
    b = _overlap(even, 2.0, 5.0, 0.0)
    assert (b.compute_s, b.memory_s, b.comm_s) == (4.0, 0.0, 0.0)
    b = _overlap(t, 1.0, 1.0, 0.0, f=2.0)  # the sequential sum caps it: min(2, 2 x 5)
    assert (b.memory_s, breakdown_total_s(b)) == (2.0, 2.5)


def test_overlap_of_nothing_and_predict_from_a_plan():
    cm = CostModel("llama-3.1-8b", "a100-80gb")
    ov = OverlapStepModel(cm)
    assert ov.config.interference_factor == 1.10 and ov.step([]) == StepBreakdown()
    req = Request("r", list(range(8)))
    plan = BatchPlan(seqs=[ScheduledSeq(req, 0, 8, True)])
    assert ov.predict(plan) == ov.step([(8, 8, True)]) != StepBreakdown()


def test_step_model_by_mode():
    cm = CostModel("llama-3.1-8b", "a100-80gb")
    assert step_model(cm, "sequential") is cm
    ov = step_model(cm, "overlap", 1.5)
    assert isinstance(ov, OverlapStepModel) and ov.cost_model is cm and ov.config.interference_factor == 1.5
    assert step_model(cm, "overlap").config.interference_factor == 1.10
    with pytest.raises(ValueError, match="^mode: must be 'sequential' or 'overlap', got 'both'$"):
        step_model(cm, "both")
    with pytest.raises(ValueError, match="^interference_factor: must be >= 1, got 0.5$"):
        OverlapConfig(0.5)


# -- step report ------------------------------------------------------------------------------------------


def test_step_cost_report_fields_by_hand():
    r = step_cost_report("llama-2-7b", "a100-80gb", prefill_tokens=100, decode_batch=3, context=50)
    cm = CostModel("llama-2-7b", "a100-80gb")
    seqs = [(1, 50, True)] * 3 + [(100, 100, True)]
    b = cm.step(seqs)
    total = breakdown_total_s(b)
    host = cm.host_time(seqs)
    assert {k: v for k, v in r.items() if k != "ops"} == {
        "model": "llama-2-7b",
        "gpu": "a100-80gb",
        "gpu_fit": gpu_provenance("a100-80gb"),
        "engine": "vllm-v1",
        "gpu_time_s": host.gpu_s,
        "host": host.to_dict(),
        "tp": 1,
        "prefill_tokens": 100,
        "decode_batch": 3,
        "context": 50,
        "step_time_s": total,
        "compute_time_s": b.compute_s,
        "memory_time_s": b.memory_s,
        "overhead_s": b.overhead_s,
        "comm_s": 0.0,
        "flops": b.flops,
        "bytes": b.bytes,
        "tokens_per_s": 103 / total,
        "mfu": b.flops / (total * cm.gpu.peak_flops),
        "gemm_crossover_tokens": cm.gemm_crossover_tokens(),
    }
    assert r["ops"] == {name: t.to_dict() for name, t in cm.op_times(seqs).items()}
    decode = step_cost_report("llama-2-7b", "a100-80gb", decode_batch=2, context=1)  # defaults: no prefill
    assert decode["prefill_tokens"] == 0 and "attn_prefill" not in decode["ops"] and decode["tp"] == 1
    prefill = step_cost_report("llama-2-7b", "a100-80gb", prefill_tokens=4)
    assert prefill["context"] == 0 and prefill["decode_batch"] == 0 and "attn_decode" not in prefill["ops"]


def test_step_cost_report_passes_the_link_and_tp():
    link = LinkSpec("slow", bandwidth_bytes_s=1e9, latency_s=1e-3)
    r = step_cost_report("llama-2-7b", "a100-80gb", 2, prefill_tokens=10, link=link)
    # two all-reduces per layer of 10 tokens x 4096 x 2 bytes, ring over 2 GPUs
    assert r["tp"] == 2 and r["comm_s"] == 2 * 32 * allreduce_time(10 * 4096 * 2, 2, link)


def test_step_cost_report_on_an_infinitely_fast_gpu_reports_zero_rates():
    gpu = dataclasses.replace(
        get_gpu("a100-80gb"),
        peak_flops=math.inf,
        mem_bandwidth_bytes_s=math.inf,
        step_overhead_s=0.0,
        per_layer_overhead_s=0.0,
        kernel_latency_s=0.0,
        host_overhead_per_seq_s=0.0,
        host_overhead_per_token_s=0.0,
        elementwise_curves={},
    )
    # the spec's own host terms (all zero), paid serially: nothing is left
    r = step_cost_report("llama-2-7b", gpu, prefill_tokens=8, decode_batch=1, context=8, engine="hardware")
    assert r["step_time_s"] == 0.0 and r["tokens_per_s"] == 0.0 and r["mfu"] == 0.0


def test_step_cost_report_input_errors_name_the_field():
    for kwargs, msg in (
        ({"prefill_tokens": -1}, "^prefill_tokens: must be a non-negative integer, got -1$"),
        ({"prefill_tokens": True}, "^prefill_tokens: must be a non-negative integer, got True$"),
        ({"decode_batch": 1.0}, "^decode_batch: must be a non-negative integer, got 1.0$"),
        ({"decode_batch": 1, "context": -2}, "^context: must be a non-negative integer, got -2$"),
        ({"decode_batch": 2}, "^context: must be >= 1 when decode_batch > 0, got 0$"),
        ({}, r"^prefill_tokens: give prefill_tokens > 0 or decode_batch > 0 \(the step is empty\)$"),
    ):
        with pytest.raises(ValueError, match=msg):
            step_cost_report("llama-2-7b", "a100-80gb", **kwargs)


# -- profiles ---------------------------------------------------------------------------------------------


def _write(path, header, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([",".join(header)] + [",".join(map(str, r)) for r in rows]) + "\n")


SHAPE_COLS = ["n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp"]


def test_operator_samples_from_a_vidur_compute_csv(tmp_path):
    header = ["time_stats.emb.median", "time_stats.mlp_up_proj.median", "time_stats.add.median"]
    header += SHAPE_COLS + ["num_tokens", "num_tensor_parallel_workers"]
    _write(
        tmp_path / "vidur/compute/g1/org/tiny/mlp.csv",
        header,
        [
            ["0.5", "2", "", 4, 2, 64, 256, 1000, "True", "16.0", 2],
            ["1e-3", "", "0.25", 4, 2, 64, 256, 1000, " false ", 1, 1],
        ],
    )
    (tmp_path / "vidur/compute/g0").mkdir()  # a GPU folder with no profile yet
    (tmp_path / "vidur/compute/notes.txt").write_text("")
    got = profiles.load_operator_samples(tmp_path, "g1")
    gated = profiles.ProfileShape("tiny", 4, 2, 64, 256, 1000, True)
    plain = dataclasses.replace(gated, gated_mlp=False)
    assert got == [
        profiles.OperatorSample("g1", gated, "embedding", "emb", 16, 2, 0.5e-3),
        profiles.OperatorSample("g1", gated, "mlp_up", "mlp_up_proj", 16, 2, 2e-3),
        profiles.OperatorSample("g1", plain, "embedding", "emb", 1, 1, 1e-6),
        profiles.OperatorSample("g1", plain, "residual_add", "add", 1, 1, 0.25e-3),
    ]
    assert profiles.gpu_dirs(tmp_path) == ["g0", "g1"] and profiles.gpu_dirs(tmp_path / "none") == []
    with pytest.raises(
        ValueError, match=r"^profiles: no compute profiles for gpu 'g0' under .* \(found: g0, g1\)$"
    ):
        profiles.load_operator_samples(tmp_path, "g0")
    with pytest.raises(
        ValueError, match=r"^profiles: no compute profiles for gpu 'x' under .* \(found: none\)$"
    ):
        profiles.load_operator_samples(tmp_path / "empty", "x")


def test_profile_shape_model_spec():
    spec = profiles.ProfileShape("tiny", 4, 2, 64, 256, 1000, True).model_spec()
    assert (spec.name, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads) == (
        "tiny",
        1,
        64,
        4,
        2,
    )
    assert (spec.head_dim, spec.intermediate_size, spec.vocab_size, spec.max_context) == (16, 256, 1000, 4096)
    assert spec.arch == "llama"
    assert profiles.ProfileShape("t", 4, 4, 64, 256, 1000, False).model_spec().arch == "opt"


def test_profile_cells_are_checked_by_name(tmp_path):
    header = ["time_stats.emb.median"] + SHAPE_COLS + ["num_tokens", "num_tensor_parallel_workers"]
    cases = (
        (["x", 4, 2, 64, 256, 1000, "True", 1, 1], r"^time_stats.emb.median: not a number \('x'\) in "),
        (
            ["0", 4, 2, 64, 256, 1000, "True", 1, 1],
            r"^time_stats.emb.median: times must be > 0 ms, got '0' in ",
        ),
        (
            ["-1", 4, 2, 64, 256, 1000, "True", 1, 1],
            "^time_stats.emb.median: times must be > 0 ms, got '-1' in ",
        ),
        (["1", "four", 2, 64, 256, 1000, "True", 1, 1], "^n_head: missing or not a number in "),
    )
    for i, (row, msg) in enumerate(cases):
        _write(tmp_path / f"c{i}/vidur/compute/g/o/m/mlp.csv", header, [row])
        with pytest.raises(ValueError, match=msg):
            profiles.load_operator_samples(tmp_path / f"c{i}", "g")
    _write(tmp_path / "d/vidur/compute/g/o/m/mlp.csv", header[:-1], [["1", 4, 2, 64, 256, 1000, "True", 1]])
    with pytest.raises(ValueError, match="^num_tensor_parallel_workers: missing or not a number in "):
        profiles.load_operator_samples(tmp_path / "d", "g")


def test_host_samples_sum_the_serial_parts(tmp_path):
    header = [f"{p}_median" for p in profiles.HOST_PARTS] + [
        "model_name",
        "batch_size",
        "tensor_parallel_degree",
    ]
    path = tmp_path / "vidur/cpu_overheads/a40/cpu_overheads.csv"
    _write(path, header, [["0.5", "0.25", "0.125", "1", "m/x", 8, 1], ["1", "1", "1", "1", "", "16.0", 2]])
    assert profiles.load_host_samples(tmp_path) == [
        profiles.HostSample("m/x", 8, 1, 1.875e-3),
        profiles.HostSample("", 16, 2, 4e-3),
    ]
    with pytest.raises(ValueError, match="^profiles: no host-overhead profile at .*h100"):
        profiles.load_host_samples(tmp_path, "h100")
    _write(path, header, [["0.5", "", "0.125", "1", "m", 8, 1]])
    with pytest.raises(
        ValueError, match=r"^\('schedule', 'sampler_e2e', .*\): a part is missing in a row of "
    ):
        profiles.load_host_samples(tmp_path, "a40")


def test_allreduce_samples(tmp_path):
    header = ["time_stats.all_reduce.median", "num_workers", "size"]
    path = tmp_path / "vidur/network/h100_dgx/all_reduce.csv"
    _write(path, header, [["0.037", 8, 2048], ["", 8, 4096], ["0.5", "2.0", "1e6"]])
    assert profiles.load_allreduce_samples(tmp_path) == [
        profiles.AllReduceSample("h100_dgx", 8, 2048, 0.037e-3),
        profiles.AllReduceSample("h100_dgx", 2, 1_000_000, 0.5e-3),
    ]
    with pytest.raises(ValueError, match="^profiles: no all-reduce profile at .*pairwise"):
        profiles.load_allreduce_samples(tmp_path, "pairwise")


def test_default_profiles_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBALANCE_PROFILES", str(tmp_path))
    assert profiles.default_profiles_dir() == tmp_path
    monkeypatch.setenv("KVBALANCE_PROFILES", "")
    here = profiles.__file__
    assert profiles.default_profiles_dir() == profiles.Path(here).resolve().parents[3] / "shared" / "profiles"
    monkeypatch.delenv("KVBALANCE_PROFILES")
    assert profiles.default_profiles_dir().parts[-2:] == ("shared", "profiles")


# -- fit errors -------------------------------------------------------------------------------------------


def test_op_class_of_profiled_operators():
    llama = profiles.ProfileShape("m", 4, 4, 64, 256, 1000, True)
    opt = dataclasses.replace(llama, gated_mlp=False)
    sample = profiles.OperatorSample("g", llama, "mlp_up", "mlp_up_proj", 1, 1, 1.0)
    assert op_class(sample) == "gemm"
    assert [op_class(dataclasses.replace(sample, op=o)) for o in ("qkv_proj", "o_proj", "mlp_down")] == [
        "gemm"
    ] * 3
    assert op_class(dataclasses.replace(sample, op="norm")) == "norm"
    assert op_class(dataclasses.replace(sample, op="norm", shape=opt)) == "layer_norm"
    assert op_class(dataclasses.replace(sample, op="activation", shape=opt)) == "activation_ungated"


def test_error_rows_by_class_and_range():
    labels = ["a", "a", "a", "b"]
    size = np.array([1, 16, 17, 2000])
    pred = np.array([1.1, 2.0, 3.3, 8.0])
    meas = np.array([1.0, 2.5, 3.0, 4.0])  # relative errors 0.1, 0.2, 0.1, 1.0
    rows = error_rows(labels, size, pred, meas)
    got = [(r.op_class, r.tokens, r.count, round(r.median, 12), round(r.worst, 12)) for r in rows]
    assert got == [
        ("a", "all", 3, 0.1, 0.2),
        ("a", "1-16", 2, 0.15, 0.2),
        ("a", "17-128", 1, 0.1, 0.1),
        ("b", "all", 1, 1.0, 1.0),
        ("b", ">=1025", 1, 1.0, 1.0),
    ]
    batch = error_rows(
        ["x", "x"], np.array([16, 64]), np.array([2.0, 1.0]), np.array([1.0, 1.0]), BATCH_RANGES
    )
    assert [(r.tokens, r.count, r.worst) for r in batch] == [
        ("all", 2, 1.0),
        ("1-16", 1, 1.0),
        ("17-64", 1, 0.0),
    ]
    assert rows[0].to_dict() == {
        "class": "a",
        "tokens": "all",
        "count": 3,
        "median_rel_error": rows[0].median,
        "worst_rel_error": rows[0].worst,
    }


def test_operator_errors_take_times_and_tokens_from_the_samples():
    shape = profiles.ProfileShape("m", 4, 4, 64, 256, 1000, True)
    samples = [
        profiles.OperatorSample("g", shape, "mlp_up", "mlp_up_proj", 8, 1, 2.0),
        profiles.OperatorSample("g", shape, "norm", "input_layernorm", 200, 1, 4.0),
    ]
    rows = operator_errors(samples, np.array([3.0, 2.0]))
    assert rows == [
        ClassError("gemm", "all", 1, 0.5, 0.5),
        ClassError("gemm", "1-16", 1, 0.5, 0.5),
        ClassError("norm", "all", 1, 0.5, 0.5),
        ClassError("norm", "129-1024", 1, 0.5, 0.5),
    ]
