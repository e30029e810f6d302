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


def _explicit_chunk_plan_results(rank, world_size):
    """The comm GEMMs compiled with fullgraph=True and an explicit ChunkPlan(t): while capturing they take
    the plain path, as overlap=True does (an explicit plan raised torch's "P2P compilation disabled").
    Compiled forward and gradients equal the eager chunked call's (which sums in another order: close)."""
    from seqpar.ops import all_gather_matmul, matmul_reduce_scatter
    from seqpar.parallel.overlap import ChunkPlan

    results = []
    for op, shape in ((all_gather_matmul, (3, 2, 8)), (matmul_reduce_scatter, (4, 2, 8))):
        g = torch.Generator().manual_seed(rank)
        x, w = torch.randn(*shape, generator=g), torch.randn(6, 8, generator=g)
        runs = []
        for run in (torch.compile(lambda a, b: op(a, b, group=dist.group.WORLD, overlap=ChunkPlan(world_size)),
                                  backend=lookup_backend("aot_eager"), fullgraph=True),
                    lambda a, b: op(a, b, group=dist.group.WORLD, overlap=ChunkPlan(world_size))):
            x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
            y = run(x_leaf, w_leaf)
            y.square().sum().backward()
            runs.append((y.detach(), x_leaf.grad, w_leaf.grad))
        torch._dynamo.reset()
        results.append(all(torch.allclose(a, b, rtol=1e-5, atol=1e-5) for a, b in zip(*runs)))
    return results


FROZEN = {"norms": lambda name: "norm" in name, "embedding": lambda name: name.startswith("embedding"),
          "lower": lambda name: name.startswith(("embedding", "layers.0.")),
          "norm weights (BitFit)": lambda name: "norm" in name and name.endswith("weight")}


def _frozen_results():
    """PEFT-style freezing under SP: a model whose norms, embedding or lower layers are frozen compiles and
    equals eager (loss and every trainable gradient). Dynamo failed ("unregistered member on an
    OpaqueObject ... ProcessGroup") on f / the scatter applied to tensors without grad: it inlines such a
    Function's forward. With only the norms' weights frozen the backend computes no weight column sums
    (f made every output require grad once one input did)."""
    from seqpar.ops import registry

    results = {}
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, backend="torch", sequence_parallel=True)
    tokens = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    for case, frozen in FROZEN.items():
        seqpar.manual_seed(0)
        model = seqpar.GPTModel(cfg, 2, 50, 8, tp_group=dist.group.WORLD)
        model.check_rank_inputs = False
        for name, p in model.named_parameters():
            p.requires_grad_(not frozen(name))
        runs = []
        for run in (torch.compile(model, backend=lookup_backend("aot_eager")), model):
            model.zero_grad(set_to_none=True)
            loss = run(tokens, tokens).sum()
            loss.backward()
            runs.append([loss.detach()] + [p.grad for p in model.parameters() if p.requires_grad])
        torch._dynamo.reset()
        results[case] = all(torch.equal(a, b) for a, b in zip(*runs))
    asked = []
    impl = registry.get("bias_dropout_add_layer_norm", "torch")
    real = impl.backward
    try:
        object.__setattr__(impl, "backward", lambda *args: asked.append(tuple(args[-1])) or real(*args))
        model.zero_grad(set_to_none=True)
        model(tokens, tokens).sum().backward()
    finally:
        object.__setattr__(impl, "backward", real)
    results["column sums asked (BitFit)"] = sorted(set(asked))
    # Ranks that froze differently (a norm's weight, or a whole norm, on one rank only): the per-forward rank
    # check says so on every rank. Without it f's all-reduce summed partial gradients silently, aborted
    # (gloo: "Received data size doesn't match"), or waited for a rank that froze the norm whole.
    model.check_rank_inputs = True
    for frozen in (("final_layernorm.weight",), ("final_layernorm.weight", "final_layernorm.bias")):
        for name, p in model.named_parameters():
            p.requires_grad_(not (name in frozen and dist.get_rank() == 0))
        try:
            model(tokens, tokens)
            results[f"ranks froze {frozen} differently"] = "no error"
        except ValueError as exc:
            results[f"ranks froze {frozen} differently"] = str(exc)
    return results


def _worker(rank, world_size):
    return (_layer_results(rank), _model_results(), _inference_results(rank), _steps_with_the_check_results(),
            _explicit_chunk_plan_results(rank, world_size), _frozen_results())


@pytest.mark.timeout(240)
def test_compiled_sequence_parallel_layer_and_model_are_one_graph_and_match_eager():
    """The layer: one graph, and two compiled training steps with dropout equal eager bitwise. The model:
    GPTModel's per-forward rank check runs outside the graph (one break); without it one graph, equal to
    eager. The layer compiled for inference (eval, no_grad / inference_mode) equals eager.
    With dropout and the rank checks on, the model compiles in its first two steps only. The comm GEMMs
    with an explicit ChunkPlan compile with fullgraph=True (plain while capturing). Models with frozen
    parts compile (_frozen_results).
    (One launch for all: each launch costs two Pythons importing torch.)"""
    for rank, (layer, (counts, equal), inference, per_step, explicit_plan, frozen) in enumerate(
            run_ranks(_worker, 2, timeout_s=200)):
        assert (layer["graphs"], layer["breaks"]) == (1, 0) and layer["steps equal"] == [True, True], (rank, layer)
        assert counts == [(2, 1), (1, 0)] and equal, (rank, counts, equal)
        assert inference == [True, True], (rank, inference)
        assert per_step[3] == per_step[1], (rank, per_step)
        assert explicit_plan == [True, True], (rank, explicit_plan)
        assert all(frozen[case] for case in FROZEN), (rank, frozen)
        assert frozen["column sums asked (BitFit)"] == [(False, True, True)], (rank, frozen)   # (ln_weight, ln_bias, bias)
        for key in [k for k in frozen if k.startswith("ranks froze")]:
            assert "parameters requiring grad (freeze the same ones on every rank) differs" in frozen[key], frozen[key]
