"""Model, GPU and link presets: real shapes, derived sizes, lookups with clear errors, serialisation."""

import dataclasses
import json

import pytest

from kvbalance.specs import (
    GPUS,
    MEASURED_OVERRIDES,
    HardwareSpec,
    LinkSpec,
    ModelSpec,
    get_gpu,
    get_link,
    get_model,
    list_gpus,
    list_models,
    load_hardware,
)


def test_kv_bytes_per_token_matches_config_shapes():
    assert get_model("llama-2-7b").kv_bytes_per_token == 524288  # 2 * 32 * 32 * 128 * 2
    assert get_model("llama-3-8b").kv_bytes_per_token == 131072  # GQA: 8 KV heads
    assert get_model("llama-2-13b").kv_bytes_per_token == 819200
    assert get_model("qwen2.5-7b").kv_bytes_per_token == 2 * 28 * 4 * 128 * 2


def test_parameter_counts_match_published_sizes():
    assert get_model("llama-2-7b").num_params == 6_738_415_616
    assert get_model("llama-2-7b").weight_bytes == 2 * 6_738_415_616
    expected_billions = {
        "llama-13b": 13.02,
        "opt-13b": 12.85,
        "llama-3-8b": 8.03,
        "llama-3.1-70b": 70.55,
        "qwen2.5-7b": 7.62,
        "qwen2.5-32b": 32.76,
        "qwen2.5-72b": 72.71,
        "smollm2-135m": 0.1345,
    }
    for name, b in expected_billions.items():
        assert get_model(name).num_params / 1e9 == pytest.approx(b, rel=0.005), name


def test_smollm2_shape_is_the_published_config():
    m = get_model("smollm2-135m")
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (30, 576, 9, 3, 64)
    assert (m.intermediate_size, m.vocab_size, m.max_context) == (1536, 49152, 8192)
    assert m.tie_word_embeddings and m.rope_theta == 100000 and m.rms_norm_eps == 1e-5


def test_arch_specific_fields():
    assert get_model("qwen2.5-72b").qkv_bias
    opt = get_model("opt-13b")
    assert opt.arch == "opt" and opt.linear_bias and opt.tie_word_embeddings
    assert get_model("llama-3.1-8b").rope_scaling["rope_type"] == "llama3"
    assert get_model("llama-3-8b").rope_scaling is None
    assert (
        get_model("tiny-llama").tie_word_embeddings and not get_model("tiny-llama-untied").tie_word_embeddings
    )
    assert get_model("tiny-llama-untied").num_params > get_model("tiny-llama").num_params


def test_lookup_is_case_insensitive_with_aliases():
    assert get_model("LLaMA-2-7B").name == "llama-2-7b"
    assert get_model("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert get_gpu("H100").name == "h100-sxm"
    assert get_gpu("a100_80gb").name == "a100-80gb"
    assert get_link("NVLink").bandwidth_bytes_s == 300e9
    m = get_model("llama-3-8b")
    assert get_model(m) is m
    assert {m.name for m in map(get_model, list_models())} == set(list_models())
    assert set(list_gpus()) == {"a100-40gb", "a100-80gb", "h100-sxm", "h200", "l40s", "a40"}


@pytest.mark.parametrize(
    "lookup, field",
    [(get_model, "model"), (get_gpu, "gpu"), (get_link, "link")],
    ids=["model", "gpu", "link"],
)
def test_unknown_name_error_names_the_field_and_lists_known(lookup, field):
    with pytest.raises(ValueError) as e:
        lookup("foo")
    msg = str(e.value)
    assert msg.startswith(f"{field}: unknown 'foo'") and "known:" in msg


def test_unknown_model_lists_presets():
    with pytest.raises(ValueError, match="llama-2-7b"):
        get_model("gpt-5")


def test_gpu_presets_use_datasheet_peaks():
    a100 = get_gpu("a100-80gb")
    assert a100.peak_flops == 312e12 and a100.mem_bandwidth_bytes_s == 2039e9
    assert get_gpu("a100-40gb").mem_bandwidth_bytes_s == 1555e9
    assert get_gpu("h100-sxm").peak_flops == 989e12 and get_gpu("h100-sxm").mem_bandwidth_bytes_s == 3.35e12
    assert get_gpu("h200").mem_bandwidth_bytes_s == 4.8e12 and get_gpu("h200").mem_capacity_bytes > 140e9
    assert get_gpu("l40s").peak_flops == 362e12 and get_gpu("l40s").tp_link.name == "pcie4"
    assert get_gpu("a40").peak_flops == 149.7e12 and get_gpu("a40").mem_bandwidth_bytes_s == 696e9
    for g in GPUS.values():  # fitted: GEMMs saturate at 70-80% of peak, weight streams at 75-97% of bandwidth
        assert "Fit: " in g.source and 0.7 <= g.compute_eff_max <= 0.85 and 0.7 <= g.memory_eff_max <= 1.0


def test_presets_take_their_fractions_from_the_closest_fit():
    h100, h200, a40 = get_gpu("h100-sxm"), get_gpu("h200"), get_gpu("a40")
    assert "fitted" in h100.source and h100.tp_link.name == "nvlink4-fitted"
    for field in ("compute_eff_max", "memory_eff_max", "kernel_latency_s", "elementwise_curves"):
        assert getattr(h200, field) == getattr(h100, field)
        for name in ("a100-40gb", "a100-80gb", "l40s"):
            want = MEASURED_OVERRIDES.get(name, {}).get(field, getattr(a40, field))
            assert getattr(get_gpu(name), field) == want, name
    # the A100s' own measured value: HBM2e streams at 0.88 of peak where the A40's GDDR6 fit gives 0.77
    assert (
        get_gpu("a100-80gb").memory_eff_max
        == get_gpu("a100-40gb").memory_eff_max
        == 0.88
        != a40.memory_eff_max
    )
    assert get_gpu("l40s").memory_eff_max == a40.memory_eff_max
    assert h200.mem_bandwidth_bytes_s == 4.8e12 and h200.tp_link == h100.tp_link
    assert "A40 fit" in get_gpu("a100-80gb").source and "H100 fit" in h200.source


def test_links_are_per_direction():
    assert get_link("nvlink4").bandwidth_bytes_s == 450e9
    assert get_link("net-100g").bandwidth_bytes_s == 12.5e9
    assert get_link("net-400g").bandwidth_bytes_s == 50e9
    assert get_link("pcie4").bandwidth_bytes_s < 32e9


def test_bad_model_shape_names_the_field():
    base = get_model("tiny-llama")
    with pytest.raises(ValueError, match="^num_kv_heads"):
        dataclasses.replace(base, num_kv_heads=3)
    with pytest.raises(ValueError, match="^arch"):
        dataclasses.replace(base, arch="gpt2")
    with pytest.raises(ValueError, match="^hidden_size"):
        dataclasses.replace(base, hidden_size=0)


def test_bad_hardware_names_the_field():
    with pytest.raises(ValueError, match="^compute_eff_max"):
        get_gpu("a100-80gb").with_(compute_eff_max=1.5)
    with pytest.raises(ValueError, match="^bandwidth_bytes_s"):
        LinkSpec("x", 0)


def test_specs_are_hashable():
    assert len({get_model("llama-3.1-8b"), get_model("llama-3.1-8b")}) == 1
    assert len({get_gpu("h200"), get_gpu("h200")}) == 1


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_hardware_round_trips_through_a_file(tmp_path, suffix):
    hw = get_gpu("h100").with_(name="h100-fitted", compute_eff_max=0.61, step_overhead_s=1.7e-3)
    path = tmp_path / f"hw{suffix}"
    hw.save(path)
    assert load_hardware(path) == hw
    assert HardwareSpec.from_dict(json.loads(hw.to_json())) == hw


def test_hardware_from_dict_rejects_unknown_fields():
    d = get_gpu("l40s").to_dict()
    d["tflops"] = 1
    with pytest.raises(ValueError, match="tflops"):
        HardwareSpec.from_dict(d)


def test_hardware_can_describe_a_cpu():
    cpu = HardwareSpec("my-cpu", 1e12, 50e9, 64 << 30, kind="cpu", tp_link=get_link("pcie4"))
    assert HardwareSpec.from_dict(cpu.to_dict()) == cpu
    d = cpu.to_dict()
    d["tp_link"] = "pcie5"
    assert HardwareSpec.from_dict(d).tp_link.name == "pcie5"


def test_model_spec_is_plain_data():
    m = ModelSpec("custom", 4, 128, 4, 4, 32, 256, 1000, 2048)
    assert m.kv_bytes_per_token == 2 * 4 * 4 * 32 * 2
