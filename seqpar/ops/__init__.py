"""Fused ops. Each has a torch reference (the test oracle), optional triton / cuda backends chosen by
:mod:`seqpar.ops.registry`, and one autograd function."""
from .attention_core import attention_core, select_backend as select_attention_backend
from .bias_dropout_add_layer_norm import bias_dropout_add_layer_norm
from .comm_matmul import all_gather_matmul, matmul_reduce_scatter
from .dropout import DropoutSpec, bias_dropout_add, dropout
from .rms_norm import add_rms_norm
from .rotary import LinearScaling, RopeScaling, YarnScaling, rotary_embedding
from .swiglu import swiglu
from . import registry

__all__ = ["attention_core", "select_attention_backend", "bias_dropout_add_layer_norm", "all_gather_matmul",
           "matmul_reduce_scatter", "DropoutSpec", "bias_dropout_add", "dropout", "add_rms_norm", "rotary_embedding",
           "LinearScaling", "RopeScaling", "YarnScaling", "swiglu", "registry"]
