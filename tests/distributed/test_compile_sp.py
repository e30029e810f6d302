"""torch.compile of a sequence-parallel layer on 2 gloo ranks: while tracing, the collectives are
functional collectives (graph nodes), where the c10d calls were a graph break each (13 graphs per layer
forward), and the comm GEMMs take their plain path. Compiled steps equal eager ones bitwise, backward's
collectives included."""
import pytest
import torch
import torch.distributed as dist
from torch._dynamo import lookup_backend

import seqpar
from launcher import run_ranks


def _layer(dropout):
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, hidden_dropout=dropout,
                                   attention_dropout=dropout, backend="torch", sequence_parallel=True,
                                   recompute="selective")
    layer = seqpar.TransformerLayer(cfg, tp_group=dist.group.WORLD)
    layer.check_rank_inputs = False   # its per-forward check reads a collective's result: a graph break
    return layer


def _layer_results(rank):
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(rank))
    explanation = torch._dynamo.explain(_layer(0.0))(x)
    torch._dynamo.reset()
    layer = _layer(0.1)
    compiled = torch.compile(layer, backend=lookup_backend("aot_eager"))
    steps_equal = []
    for _ in range(2):
        state, results = torch.get_rng_state(), []
        for run in (compiled, layer):
            torch.set_rng_state(state)
            x_leaf = x.clone().requires_grad_()
            y = run(x_leaf)
            y.square().sum().backward()
            results.append([y.detach(), x_leaf.grad] + [p.grad.clone() for p in layer.parameters()])
            layer.zero_grad()
        steps_equal.append(all(torch.equal(a, b) for a, b in zip(*results)))
    torch._dynamo.reset()
    return {"graphs": explanation.graph_count, "breaks": explanation.graph_break_count, "steps equal": steps_equal}


def _model_results():
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, backend="torch", sequence_parallel=True)
    model = seqpar.GPTModel(cfg, 2, 50, 8, tp_group=dist.group.WORLD)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    counts = []
    for check in (True, False):
        model.check_rank_inputs = check
        explanation = torch._dynamo.explain(model)(tokens, tokens)
        torch._dynamo.reset()
        counts.append((explanation.graph_count, explanation.graph_break_count))
    compiled = torch.compile(model, backend=lookup_backend("aot_eager"))
    equal = torch.equal(compiled(tokens, tokens), model(tokens, tokens))
    torch._dynamo.reset()
    return counts, equal


def _steps_with_the_check_results():
    """Graphs compiled after each training step of the SP model with dropout and its per-forward rank check
    on: the check compared torch's generator state, traced, which guarded the code after its graph break
    and changed every step (a recompile per step, then that code ran eagerly past the recompile limit)."""
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1,
                                   backend="torch", sequence_parallel=True)
    model = seqpar.GPTModel(cfg, 2, 50, 8, tp_group=dist.group.WORLD)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    graphs, counts = [], []

    def counting(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)
    compiled = torch.compile(model, backend=counting)
    for _ in range(4):
        compiled(tokens, tokens).sum().backward()
        counts.append(len(graphs))
    torch._dynamo.reset()
    return counts


def _inference_results(rank):
    """The compiled SP layer in eval mode under no_grad and inference_mode (Dynamo failed tracing the
    LayerNorm parameters' f mapping there: "Attempted to access unregistered member on an OpaqueObject")."""
    layer = _layer(0.1).eval()
    x = torch.randn(4, 2, 32, generator=torch.Generator().manual_seed(rank))
    compiled = torch.compile(layer, backend=lookup_backend("aot_eager"))
    equal = []
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            equal.append(torch.equal(compiled(x), layer(x)))
    torch._dynamo.reset()
    return equal


def _worker(rank, world_size):
    return _layer_results(rank), _model_results(), _inference_results(rank), _steps_with_the_check_results()


@pytest.mark.timeout(240)
def test_compiled_sequence_parallel_layer_and_model_are_one_graph_and_match_eager():
    """The layer: one graph, and two compiled training steps with dropout equal eager bitwise. The model:
    GPTModel's per-forward rank check runs outside the graph (one break); without it one graph, equal to
    eager. The layer compiled for inference (eval, no_grad / inference_mode) equals eager.
    With dropout and the rank checks on, the model compiles in its first two steps only.
    (One launch for all: each launch costs two Pythons importing torch.)"""
    for rank, (layer, (counts, equal), inference, per_step) in enumerate(run_ranks(_worker, 2, timeout_s=200)):
        assert (layer["graphs"], layer["breaks"]) == (1, 0) and layer["steps equal"] == [True, True], (rank, layer)
        assert counts == [(2, 1), (1, 0)] and equal, (rank, counts, equal)
        assert inference == [True, True], (rank, inference)
        assert per_step[3] == per_step[1], (rank, per_step)
