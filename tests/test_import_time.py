"""``import seqpar`` leaves torch.compile's stack (torch._dynamo, sympy), FSDP2 and DTensor unloaded: they
were 1.2 s of it, paid by every spawned rank and CLI run. What stands in for them at import
(seqpar._custom_op.outside_compile, assume_constant_result; FSDP_UNIT; registry.is_dtensor) must act
as torch's own once they are loaded."""
import subprocess
import sys
import textwrap

import pytest
import torch

import seqpar
from seqpar import _custom_op
from seqpar.nn.state_dict import FSDP_UNIT

#: Loaded on demand only: none is needed to build or run a model eagerly.
HEAVY = ("torch._dynamo", "sympy", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._inductor")


def _run(code: str) -> None:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_import_and_eager_use_load_no_heavy_module_and_compile_still_works():
    _run(f"""
        import sys
        import pytest, torch
        import seqpar
        HEAVY = {HEAVY!r}
        assert not [m for m in HEAVY if m in sys.modules], [m for m in HEAVY if m in sys.modules]
        # an eager training step with dropout (seed draws, which run outside torch.compile) needs none
        layer = seqpar.TransformerLayer(seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4,
                                                                 hidden_dropout=0.1, backend="torch"))
        x = torch.randn(8, 2, 32, requires_grad=True)
        layer(x).sum().backward()
        assert not [m for m in HEAVY if m in sys.modules], [m for m in HEAVY if m in sys.modules]
        # torch.compile loads Dynamo: the seed draw is still a graph break, with seqpar's reason
        with pytest.raises(Exception, match="pass seed= to the functional ops"):
            torch.compile(layer, backend="eager", fullgraph=True)(x)
        seqpar.manual_seed(3)
        expected = layer(x)
        seqpar.manual_seed(3)
        torch.testing.assert_close(torch.compile(layer, backend="eager")(x), expected)
        """)


def test_fsdp_unit_is_fsdp_module_eagerly_and_under_compile(tmp_path):
    """FSDP_UNIT checks isinstance without importing FSDP2; Dynamo asks issubclass of a module's type (a
    metaclass __instancecheck__ alone read False under torch.compile)."""
    _run(f"""
        import sys
        import torch
        import torch.distributed as dist
        from torch import nn
        from seqpar.nn.state_dict import FSDP_UNIT
        assert "torch.distributed.fsdp" not in sys.modules
        plain = nn.Linear(4, 4)
        assert FSDP_UNIT and not isinstance(plain, FSDP_UNIT)
        dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1)
        from torch.distributed.fsdp import fully_shard
        unit = fully_shard(nn.Sequential(nn.Linear(4, 4)))
        assert isinstance(unit, FSDP_UNIT) and not isinstance(plain, FSDP_UNIT)
        f = torch.compile(lambda m, x: x + 1 if isinstance(m, FSDP_UNIT) else x, backend="eager", fullgraph=True)
        assert f(unit, torch.zeros(1)).item() == 1 and f(plain, torch.zeros(1)).item() == 0
        dist.destroy_process_group()
        """)


def _compiled_call(wrapper, x):
    """Compile a function calling ``wrapper`` (a graph break); return the result, Dynamo's frame counts,
    and whether the function under the wrapper saw itself compiled."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    out = torch.compile(lambda t: wrapper(t.sin()).cos(), backend="eager")(x)
    out = torch.compile(lambda t: wrapper(t.sin()).cos(), backend="eager")(x)   # a second call: no new frame
    return out, dict(counters["frames"])


def test_outside_compile_acts_as_torch_compiler_disable():
    seen = []

    def body(t):
        seen.append(torch.compiler.is_compiling())   # the function and what it calls run eagerly
        return t * 2

    reason = "seqpar's reason for the graph break"
    ours, torchs = _custom_op.outside_compile(reason)(body), torch.compiler.disable(body, reason=reason)
    # the attributes Dynamo reads on a disabled function: a new one in torch needs adding to outside_compile
    assert sorted(k for k in vars(ours) if k.startswith("_torchdynamo")) == \
        sorted(k for k in vars(torchs) if k.startswith("_torchdynamo"))
    x = torch.ones(3)
    out, frames = _compiled_call(ours, x)
    expected, expected_frames = _compiled_call(torchs, x)
    torch.testing.assert_close(out, expected)
    # the wrapper's own frame is skipped as torch's is (it was compiled on every call: one frame more)
    assert frames == expected_frames
    assert seen and not any(seen)
    for wrapper in (ours, torchs):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=reason):
            torch.compile(lambda t: wrapper(t) + 1, backend="eager", fullgraph=True)(x)


def test_assume_constant_result_marks_the_function_as_torch_does():
    def a():
        return 1

    def b():
        return 1

    import torch._dynamo

    assert torch._dynamo.assume_constant_result(a) is a and _custom_op.assume_constant_result(b) is b
    assert vars(a) == vars(b) == {"_dynamo_marked_constant": True}


def test_is_dtensor_without_importing_dtensor():
    assert not seqpar.ops.registry.is_dtensor(torch.ones(1))
    assert FSDP_UNIT   # torch here is built with distributed
