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
