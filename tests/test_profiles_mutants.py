"""perf/profiles.py error messages name the column and the file; host samples keep the model column as read.

Vidur CSVs written in a temporary folder (milliseconds each); see tests/test_cost_mutants.py for the samples.
"""

from __future__ import annotations

import re

import pytest

from kvbalance.perf import profiles


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())


HOST = ",".join(f"{p}_median" for p in profiles.HOST_PARTS)


def test_host_errors_name_the_column_and_the_file(tmp_path):
    path = tmp_path / "vidur/cpu_overheads/a40/cpu_overheads.csv"
    for row, col in (("1,1,1,1,x,1", "batch_size"), ("1,1,1,1,8,x", "tensor_parallel_degree")):
        _write(path, f"{HOST},batch_size,tensor_parallel_degree\n{row}\n")
        with pytest.raises(ValueError, match=f"^{col}: missing or not a number in {re.escape(str(path))}$"):
            profiles.load_host_samples(tmp_path)
    _write(path, f"{HOST},batch_size,tensor_parallel_degree\nx,1,1,1,8,1\n")
    with pytest.raises(
        ValueError, match=rf"^schedule_median: not a number \('x'\) in {re.escape(str(path))}$"
    ):
        profiles.load_host_samples(tmp_path)


def test_host_model_name_is_optional_and_kept_verbatim(tmp_path):
    path = tmp_path / "vidur/cpu_overheads/a40/cpu_overheads.csv"
    _write(path, f"{HOST},batch_size,tensor_parallel_degree\n1,1,1,1,8,1\n")
    assert profiles.load_host_samples(tmp_path)[0].model == ""  # no model column
    # a quoted cell keeps its line break exactly (the reader opens the file with newline="", as csv wants)
    _write(path, f'{HOST},batch_size,tensor_parallel_degree,model_name\r\n1,1,1,1,8,1,"a\r\nb"\r\n')
    assert profiles.load_host_samples(tmp_path)[0].model == "a\r\nb"


def test_allreduce_and_compute_errors_name_the_file(tmp_path):
    path = tmp_path / "vidur/network/h100_dgx/all_reduce.csv"
    for row, col in (("0.5,x,2048", "num_workers"), ("0.5,8,x", "size")):
        _write(path, f"time_stats.all_reduce.median,num_workers,size\n{row}\n")
        with pytest.raises(ValueError, match=f"^{col}: missing or not a number in {re.escape(str(path))}$"):
            profiles.load_allreduce_samples(tmp_path)
    _write(path, "time_stats.all_reduce.median,num_workers,size\n0,8,2048\n")
    with pytest.raises(
        ValueError,
        match=f"^time_stats.all_reduce.median: times must be > 0 ms, got '0' in {re.escape(str(path))}$",
    ):
        profiles.load_allreduce_samples(tmp_path)
    mlp = tmp_path / "vidur/compute/g/o/m/mlp.csv"
    _write(
        mlp,
        "n_head,n_kv_head,n_embd,n_expanded_embd,vocab_size,num_tokens,num_tensor_parallel_workers\nx,1,1,1,1,1,1\n",
    )
    with pytest.raises(ValueError, match=f"^n_head: missing or not a number in {re.escape(str(mlp))}$"):
        profiles.load_operator_samples(tmp_path, "g")
