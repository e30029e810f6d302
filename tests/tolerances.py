"""dtype -> (atol, rtol) for elementwise comparisons against an fp32/fp64 reference, and the
"kernel error at most 2x the same-dtype torch error" rule for reductions."""
import torch

TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def assert_close(actual, expected, dtype=None, msg=""):
    atol, rtol = TOLERANCES[dtype or actual.dtype]
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol, msg=msg or None)


def assert_error_within(kernel, torch_same_dtype, reference, factor=2.0, floor=1e-6, name=""):
    """max|kernel - reference| <= factor * max|torch_same_dtype - reference| (+ floor)."""
    kernel_err = (kernel.double() - reference.double()).abs().max().item()
    torch_err = (torch_same_dtype.double() - reference.double()).abs().max().item()
    assert kernel_err <= factor * torch_err + floor, (
        f"{name}: kernel error {kernel_err:.3e} > {factor} x torch error {torch_err:.3e}")


def assert_fp32_outputs(names, got, torch_fp32, ref64, reductions):
    """A kernel's fp32 outputs ``got`` against the torch backend's (``torch_fp32``) and the fp64 reference.

    Elementwise outputs: within the fp32 tolerance of torch's. The outputs named in ``reductions``
    (column sums over every row: the parameter gradients): within 2x torch's own error from ``ref64``
    (:func:`assert_error_within`, floor 1e-6 of the largest sum). Two fp32 summation orders over n rows
    differ by about sqrt(n) * eps * max|term|: where a column's sum cancels to near zero that exceeds
    any elementwise tolerance even when both sums are as close to the exact one as fp32 allows (kernel
    vs torch on 615 rows of 768 columns: 2.3e-5 apart, each 1.5e-5 from fp64). A row the kernel drops
    or counts twice moves a sum by a whole term, far outside either bound.

    Compared on ``got``'s device (``torch_fp32`` and ``ref64`` moved there if they are elsewhere): a
    20000 x 6144 comparison on the host is seconds of single-threaded work per output."""
    for name, a, t, e in zip(names, got, torch_fp32, ref64):
        if t is None:
            assert a is None, name
            continue
        assert not torch.isnan(a).any(), f"{name}: NaN (unwritten output?)"
        a, t = a.detach(), t.detach().to(a.device)
        if name in reductions:
            e = e.detach().to(a.device)
            assert_error_within(a, t, e, floor=1e-6 * max(1.0, e.abs().max().item()), name=name)
        else:
            assert_close(a.float(), t.float(), dtype=torch.float32, msg=name)
