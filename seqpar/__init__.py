"""seqpar: sequence parallelism and selective activation recomputation for PyTorch transformers
(Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", MLSys 2023).

Public API: :class:`TransformerConfig`, :class:`TransformerLayer`,
:class:`GPTModel`, :func:`manual_seed`, :mod:`seqpar.ops` (fused ops), :mod:`seqpar.memory`
(paper formulas and :class:`~seqpar.memory.ActivationMeter`), :mod:`seqpar.parallel` (mappings).
"""
__version__ = "0.1.0"

from . import memory, ops, parallel, random  # noqa: E402
from .config import TransformerConfig  # noqa: E402
from .nn import GPTModel, TransformerLayer  # noqa: E402
from .random import manual_seed  # noqa: E402

__all__ = ["__version__", "GPTModel", "TransformerConfig", "TransformerLayer", "manual_seed", "memory", "ops",
           "parallel", "random"]
