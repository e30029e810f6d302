"""seqpar.memory: the paper's Table 2 formulas and the ActivationMeter's accounting."""
import pytest
import torch

from seqpar.memory import ActivationMeter, layer_activation_bytes, saved_as

S, B, H, A = 2048, 4, 6144, 64  # 22B model layer (paper.md)


@pytest.mark.parametrize("t", [1, 2, 8])
def test_table2_rows(t):
    sbh, x = S * B * H, 5 * A * S / H
    assert layer_activation_bytes(S, B, H, A) == pytest.approx(sbh * (34 + x))
    assert layer_activation_bytes(S, B, H, A, tp=t) == pytest.approx(sbh * (10 + 24 / t + x / t))
    assert layer_activation_bytes(S, B, H, A, tp=t, sequence_parallel=True) == pytest.approx(sbh / t * (34 + x))
    assert layer_activation_bytes(S, B, H, A, tp=t, recompute="selective") == pytest.approx(sbh * (10 + 24 / t))
    assert layer_activation_bytes(S, B, H, A, tp=t, sequence_parallel=True, recompute="selective") == \
        pytest.approx(34 * sbh / t)
    assert layer_activation_bytes(S, B, H, A, tp=t, recompute="full") == pytest.approx(2 * sbh)
    assert layer_activation_bytes(S, B, H, A, tp=t, sequence_parallel=True, recompute="full") == \
        pytest.approx(2 * sbh / t)


def test_generalised_elements_and_ffn():
    # paper.md: attention block 5E sbh + M sbh + (2E + M) as^2b, MLP (2f/h + 1) E sbh + M sbh, LNs 2E sbh.
    s, b, h, a, f, e, m = 128, 2, 64, 4, 96, 4, 0.5
    sbh, as2b = s * b * h, a * s * s * b
    direct = (5 * e + m) * sbh + (2 * e + m) * as2b + ((2 * f / h + 1) * e + m) * sbh + 2 * e * sbh
    assert layer_activation_bytes(s, b, h, a, ffn_hidden=f, bytes_per_element=e, bytes_per_mask=m) == \
        pytest.approx(direct)
    # f = 4h reduces to the paper's 16 sbh E + 2 sbh M + 2 as^2b E + as^2b M
    assert layer_activation_bytes(s, b, h, a, bytes_per_element=e, bytes_per_mask=m) == \
        pytest.approx(16 * sbh * e + 2 * sbh * m + 2 * as2b * e + as2b * m)


def test_paper_selective_saving():
    # 5as/h = 80 for GPT-3 (a=96, h=12288, s=2048): selective drops 80/(34+80) = 70% of the memory.
    full = layer_activation_bytes(2048, 1, 12288, 96)
    sel = layer_activation_bytes(2048, 1, 12288, 96, recompute="selective")
    assert 1 - sel / full == pytest.approx(0.70, abs=0.01)


@pytest.mark.parametrize("kwargs, match", [
    (dict(seq_len=0), "seq_len"), (dict(tp=1.5), "tp"), (dict(recompute="some"), "recompute")])
def test_formula_rejects(kwargs, match):
    args = dict(seq_len=8, micro_batch=1, hidden=8, heads=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        layer_activation_bytes(**args)


def test_meter_counts_storages_once_and_skips_parameters():
    w = torch.nn.Parameter(torch.randn(16, 16))
    x = torch.randn(8, 16, requires_grad=True)
    with ActivationMeter() as meter:
        with saved_as("matmul input"):
            y = x @ w            # saves x (64 floats) and w (a parameter: excluded)
        z = (y * y[:, :8].repeat(1, 2)).sum()  # saves y and a repeat copy
    assert meter.by_label()["matmul input"] == x.numel() * 4
    assert meter.bytes == (8 * 16 + 8 * 16 + 8 * 16) * 4
    z.backward()
    x_ref = x.detach().requires_grad_()
    y_ref = x_ref @ w.detach()
    (y_ref * y_ref[:, :8].repeat(1, 2)).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)  # the hooks do not change what backward computes
