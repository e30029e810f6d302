"""Mixing with torch's native tensor parallelism (torch.distributed.tensor): seqpar's modules and ops take
this rank's plain tensors and shard by their own tp_group. A DTensor input ran with its global shape into
their checks and failed deep inside (or, under implicit_replication, came back labelled Replicate with
each rank's shard in it); torch's SequenceParallel style on a layer's norm dropped the fused
bias-dropout-add's arguments and the layer unpacked norm(x) along s (a wrong shape under no_grad)."""
import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.nn import ColumnParallelLinear, RowParallelLinear
from seqpar.ops import add_rms_norm, bias_dropout_add_layer_norm, swiglu


@pytest.fixture
def mesh():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        from torch.distributed.device_mesh import init_device_mesh

        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def test_dtensor_inputs_are_refused_by_name(mesh):
    from torch.distributed.tensor import DTensor, Replicate, Shard

    def dtensor(t, placement=Replicate()):
        return DTensor.from_local(t, mesh, [placement])

    x = dtensor(torch.randn(8, 2, 16), Shard(0))
    hint = r"is a DTensor \(placements \(Shard\(dim=0\),\), global shape \(8, 2, 16\)\).*pass x.to_local\(\)"
    for module in (ColumnParallelLinear(16, 32), RowParallelLinear(16, 8),
                   seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2))):
        with pytest.raises(ValueError, match="x " + hint):
            module(x)
    with pytest.raises(ValueError, match=r"gate_up is a DTensor.*gate_up.to_local\(\)"):
        swiglu(dtensor(torch.randn(4, 8)))
    rows, w = torch.randn(4, 8), torch.ones(8)
    for name, call in (("x", lambda d: add_rms_norm(d, None, w)), ("weight", lambda d: add_rms_norm(rows, rows, d)),
                       ("residual", lambda d: bias_dropout_add_layer_norm(rows, None, d, w, w)),
                       ("ln_weight", lambda d: bias_dropout_add_layer_norm(rows, None, rows, d, w))):
        value = dtensor(w if "weight" in name else rows)
        with pytest.raises(ValueError, match=rf"{name} is a DTensor"):   # (all-DTensor rows ran, Shard-labelled)
            call(value)
    with pytest.raises(ValueError, match=r"x is a DTensor"):
        add_rms_norm(dtensor(rows), dtensor(rows), dtensor(w))
    model = seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2), 1, 20, 8)
    tokens = torch.randint(0, 20, (2, 8))
    with pytest.raises(ValueError, match=r"tokens is a DTensor.*tokens.to_local\(\)"):
        model(dtensor(tokens))
    with pytest.raises(ValueError, match=r"labels is a DTensor"):
        model(tokens, dtensor(tokens))


@pytest.mark.parametrize("grad", [False, True])
def test_a_hook_dropping_the_fused_norm_s_arguments_is_an_error(grad):
    """torch's SequenceParallel style keeps only a module's first input: on post_attention_layernorm the
    layer got norm(x) alone and unpacked it along s (s = 2: a [b, h] output, no error)."""
    layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2))
    layer.post_attention_layernorm.register_forward_pre_hook(lambda module, args: args[:1])
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match="post_attention_layernorm returned one tensor"):
        layer(torch.randn(2, 3, 16))


def test_a_parameter_of_torch_s_tensor_parallelism_is_named(mesh):
    """A model mixing torch's tensor-parallel styles with seqpar: sharded_state_dict / clip_grad_norm_ /
    full_state_dict said "a DTensor with placements (Replicate(),)" without naming the parameter."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from seqpar.nn import clip_grad_norm_, sharded_state_dict

    model = seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2), 1, 20, 8)
    norm = model.final_layernorm
    norm.weight = torch.nn.Parameter(distribute_tensor(norm.weight.detach(), mesh, [Replicate()]))
    match = r"final_layernorm.weight: a DTensor with placements \(Replicate\(\),\).*parallelize_module"
    with pytest.raises(ValueError, match=match):
        sharded_state_dict(model)
    with pytest.raises(ValueError, match=match):
        clip_grad_norm_(model, 1.0)
    with pytest.raises(ValueError, match=match):
        model.full_state_dict()
