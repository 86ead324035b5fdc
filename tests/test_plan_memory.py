"""The planner's memory terms against the rules of thumb of the field (shared/REFERENCE.md)."""

import pytest

from strata.model.presets import get_preset
from strata.plan.hardware import DEVICES, get_device
from strata.plan.memory import activation_bytes_per_layer, largest_model, model_state_bytes

TB, GB = 10**12, 10**9


def test_gpt3_fp32_adam_needs_2_8_tb_of_model_states():
    psi = get_preset("gpt3-175b").num_params()  # 174.6 B
    states = model_state_bytes(psi, precision="fp32")
    assert states.weights == pytest.approx(700 * GB, rel=0.01)
    assert states.grads == pytest.approx(700 * GB, rel=0.01)
    assert states.optimizer == pytest.approx(1.4 * TB, rel=0.01)
    assert states.total == pytest.approx(2.8 * TB, rel=0.01)


def test_one_80gb_device_serves_40b_and_trains_5b():
    device = get_device("A100-80G")
    assert largest_model(device.memory_bytes, 2) == pytest.approx(40e9)  # 16-bit inference
    assert largest_model(device.memory_bytes, model_state_bytes(1).total) == pytest.approx(5e9)  # mixed Adam


@pytest.mark.parametrize("zero,expected", [(0, 16), (1, 4 + 12 / 64), (2, 2 + 14 / 64), (3, 16 / 64)])
def test_zero_stages_split_the_sixteen_bytes(zero, expected):
    assert model_state_bytes(1.0, zero, dp=64).total == pytest.approx(expected)


def test_activation_terms_follow_korthikanti_table_2():
    s, b, h, a = 2048, 1, 12288, 96  # GPT-3 175B
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == pytest.approx(sbh * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, b, h, a, tp=8) == pytest.approx(sbh * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    sp = activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True)
    assert sp == pytest.approx(sbh * (34 / 8 + 5 * a * s / (h * 8)))
    assert activation_bytes_per_layer(s, b, h, a, tp=8, sequence_parallel=True, checkpointing="selective") \
        == pytest.approx(34 * sbh / 8)
    assert activation_bytes_per_layer(s, b, h, a, checkpointing="full") == pytest.approx(2 * sbh)


def test_device_table_has_the_cards_users_ask_about():
    for name in ("V100-32G", "A100-40G", "A100-80G", "A800-80G", "H100-80G", "H200", "RTX-4090"):
        assert DEVICES[name].memory_bytes > 0 and max(DEVICES[name].peak_flops.values()) > 0
    assert get_device("H200").memory_bandwidth / get_device("H100-80G").memory_bandwidth == pytest.approx(4.8 / 3.35)
    assert get_device("RTX-4090").nvlink_bandwidth is None
    with pytest.raises(KeyError, match="valid"):
        get_device("TPU")


def test_sgd_with_momentum_keeps_one_moment_instead_of_two():
    assert model_state_bytes(1.0, optimizer="sgd").total == 12  # 2 + 2 + fp32 master 4 + momentum 4
    assert model_state_bytes(1.0, precision="fp32", optimizer="sgd").total == 12  # 4 + 4 + 4
