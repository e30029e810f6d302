"""seqpar: sequence parallelism and selective activation recomputation for PyTorch transformers
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023)."""
__version__ = "0.1.0"

from . import ops, parallel, random  # noqa: E402
from .random import manual_seed  # noqa: E402

__all__ = ["__version__", "ops", "parallel", "random", "manual_seed"]
