"""What the `gpu`-marked kernel tests share: the dtypes they sweep and the skip (with the reason) when a
kernel backend can't run on this machine's CUDA device."""
import pytest
import torch

GPU_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def skip_unless_backend_runs(backend: str) -> None:
    """pytest.skip with the package's own reason unless ``backend`` ("cuda" or "triton") runs on cuda."""
    from seqpar import _ext

    device = torch.device("cuda")
    reason = _ext.cuda_unavailable_reason(device) if backend == "cuda" else _ext.triton_unavailable_reason(device)
    if reason:
        pytest.skip(reason)
