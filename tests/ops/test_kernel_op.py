"""``registry.kernel_op``: eager calls of the fused ops run their kernel launchers directly, without the
``torch.library`` custom-op dispatch (its per-call cost dominated the ops at sequence-parallel shard
sizes), while graph capture (torch.compile, FakeTensorMode) goes through the custom ops and their fake
implementations. Results are identical both ways."""
import pytest
import torch
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._library.custom_ops import CustomOpDef
from torch._subclasses.fake_tensor import FakeTensorMode

from seqpar._custom_op import tracing
from seqpar.ops import add_rms_norm, attention_core, bias_dropout_add_layer_norm, registry, rotary_embedding, swiglu

LAUNCHES = []


@registry.kernel_op("seqpar_test::double")
def _double(x: torch.Tensor) -> torch.Tensor:
    LAUNCHES.append(x.shape)
    return x * 2


@_double.register_fake
def _(x):
    return torch.empty_like(x)


@pytest.fixture
def custom_op_calls(monkeypatch):
    """The seqpar custom ops called through their ``CustomOpDef`` (how kernel_op dispatches them)."""
    calls = []
    real = CustomOpDef.__call__

    def counted(self, *args, **kwargs):
        calls.append(self._qualname)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CustomOpDef, "__call__", counted)
    return calls


def test_eager_runs_the_launcher_without_the_custom_op(custom_op_calls):
    LAUNCHES.clear()
    x = torch.randn(3)
    assert not tracing()
    torch.testing.assert_close(_double(x), x * 2, rtol=0, atol=0)
    assert LAUNCHES == [(3,)] and not custom_op_calls
    torch.testing.assert_close(_double.op(x), x * 2, rtol=0, atol=0)   # the registered op, for contrast
    assert custom_op_calls == ["seqpar_test::double"] and len(LAUNCHES) == 2
    assert torch.ops.seqpar_test.double.default is not None and _double.launcher.__name__ == "_double"


def test_profiles_name_the_direct_launch_after_the_op(custom_op_calls):
    """bench/profile_kernels.py attributes time to the ``seqpar::`` names, as it did with the dispatch."""
    with torch.autograd.profiler.profile() as prof:
        _double(torch.randn(3))
    assert "seqpar_test::double" in {event.name for event in prof.function_events} and not custom_op_calls


def test_fake_tensor_mode_gets_the_fake_implementation():
    LAUNCHES.clear()
    with FakeTensorMode():
        x = torch.empty(4, 5)
        assert tracing()
        y = _double(x)
    assert y.shape == (4, 5) and not LAUNCHES


def _fused_ops(x, res, w, b, gate_up, q, k):
    y, ro = bias_dropout_add_layer_norm(x, None, res, w, b, p=0.1, seed=7, backend="triton", row_offset=3)
    y2, ro2 = add_rms_norm(y, ro, w, backend="triton")
    q_rot, k_rot = rotary_embedding(q, k, position_offset=2, backend="triton")
    return y2, ro2, swiglu(gate_up, backend="triton"), q_rot, k_rot


def _leaves():
    torch.manual_seed(0)
    leaves = [torch.randn(3, 5, 32), torch.randn(3, 5, 32), torch.randn(32), torch.randn(32),
              torch.randn(3, 5, 2 * 24), torch.randn(4, 1, 2, 16), torch.randn(4, 1, 2, 16)]
    return [t.requires_grad_() for t in leaves]


def _outputs_and_grads(fn, leaves):
    outs = fn(*leaves)
    loss = sum((o.float() * (i + 1)).square().sum() for i, o in enumerate(outs))
    return tuple(outs) + torch.autograd.grad(loss, leaves)


def test_fused_ops_skip_the_custom_ops_in_eager(custom_op_calls):
    """Eager forward + backward of the fused row ops on their Triton backends call no seqpar custom op."""
    _outputs_and_grads(_fused_ops, _leaves())
    assert not custom_op_calls


def test_fused_ops_compiled_trace_the_custom_ops_and_match_eager():
    """torch.compile (fullgraph) puts the custom ops in its forward and backward graphs; outputs and
    gradients equal the eager ones bit for bit."""
    leaves = _leaves()
    eager = _outputs_and_grads(_fused_ops, leaves)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    fn = torch.compile(_fused_ops, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep), fullgraph=True)
    compiled = _outputs_and_grads(fn, leaves)
    traced = {str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"}
    for name in ("bias_dropout_add_layer_norm_triton_fwd", "bias_dropout_add_layer_norm_triton_bwd",
                 "add_rms_norm_triton_fwd", "add_rms_norm_triton_bwd", "swiglu_triton_fwd", "swiglu_triton_bwd",
                 "rotary_embedding_triton"):
        assert f"seqpar.{name}.default" in traced, (name, sorted(traced))
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_attention_core_eager_skips_the_custom_ops(custom_op_calls):
    q, k, v = (torch.randn(1, 2, 16, 16, requires_grad=True) for _ in range(3))
    o = attention_core(q, k, v, is_causal=True, dropout_p=0.1, seed=5, backend="triton")
    out = (o,) + torch.autograd.grad(o.square().sum(), (q, k, v))
    assert not custom_op_calls
    with torch.no_grad():  # the custom ops themselves give the same results
        o, lse = torch.ops.seqpar.attention_core_triton_fwd(q, k, v, True, 0.25, 26, 5, 0)
    torch.testing.assert_close(out[0], o, rtol=0, atol=0)


def test_once_differentiable_refuses_a_create_graph_backward():
    """registry.once_differentiable runs the backward as is when grad mode is off; a backward with
    create_graph raises at once, naming the Function, whether or not the incoming gradient requires grad
    (torch's wrapper returned gradients whose second derivatives were silently missing)."""
    x = torch.randn(4, 2 * 8, requires_grad=True)
    y = swiglu(x, backend="torch")
    (g,) = torch.autograd.grad(y, x, torch.randn_like(y), retain_graph=True)
    assert not g.requires_grad
    for gy in (torch.randn_like(y).requires_grad_(), torch.ones_like(y)):
        with pytest.raises(RuntimeError, match=r"differentiate twice .*\(_SwiGLU.backward\)"):
            torch.autograd.grad(y, x, gy, create_graph=True, retain_graph=True)


def _r(*shape):
    return torch.randn(*shape, requires_grad=True)


REFERENCE_CASES = {
    "bdaln_3d": (lambda x, bias, r, w, b: bias_dropout_add_layer_norm(x, bias, r, w, b, p=0.1, seed=3, backend="torch"),
                 lambda: [_r(3, 5, 32), _r(32), _r(3, 5, 32), _r(32), _r(32)]),
    "bdaln_2d": (lambda x, r, w, b: bias_dropout_add_layer_norm(x, None, r, w, b, backend="torch"),
                 lambda: [_r(15, 32), _r(15, 32), _r(32), _r(32)]),
    "rms_2d": (lambda x, r, w: add_rms_norm(x, r, w, backend="torch"), lambda: [_r(15, 32), _r(15, 32), _r(32)]),
    "rms_3d_no_residual": (lambda x, w: add_rms_norm(x, None, w, backend="torch"), lambda: [_r(3, 5, 32), _r(32)]),
    "swiglu_2d": (lambda g: (swiglu(g, backend="torch"),), lambda: [_r(15, 48)]),
    "rotary": (lambda q, k: rotary_embedding(q, k, position_offset=3, backend="torch"),
               lambda: [_r(6, 2, 4, 16), _r(6, 2, 2, 16)]),
    "attention": (lambda q, k, v: (attention_core(q, k, v, is_causal=True, dropout_p=0.1, seed=3, backend="torch"),),
                  lambda: [_r(1, 2, 8, 16), _r(1, 2, 8, 16), _r(1, 2, 8, 16)]),
}


@pytest.mark.parametrize("case", list(REFERENCE_CASES))
def test_torch_references_compile_with_the_eager_gradients(case):
    """fp32 torch backends under torch.compile: the same outputs and gradients as eager. (torch 2.11 lost
    the gradient of an output that went through a no-op ``.to`` / ``.float()`` in an autograd.Function's
    forward: registry.cast.)"""
    op, make_leaves = REFERENCE_CASES[case]
    torch.manual_seed(0)
    leaves = make_leaves()

    def f(*args):
        return tuple(o * 2.0 + 1.0 for o in op(*args))

    torch._dynamo.reset()
    compiled = _outputs_and_grads(torch.compile(f, backend="aot_eager", fullgraph=True), leaves)
    eager = _outputs_and_grads(f, leaves)
    for got, want in zip(compiled, eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
