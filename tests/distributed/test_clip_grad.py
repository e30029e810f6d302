"""seqpar.nn.clip_grad_norm_ under tensor + sequence parallelism against torch.nn.utils.clip_grad_norm_ on
a single-device model built from the same weights and batch: the same norm on every rank, and the same
clipped gradients (compared through one SGD step and full_state_dict()). Torch's own clipping on a
rank's shards gets another norm on each rank (the trap it replaces). seqpar.nn.TensorParallelGradScaler:
an overflow on one rank skips the step on every rank, where torch's GradScaler lets the ranks part."""
import copy
import math

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.nn import clip_grad_norm_

from launcher import run_ranks

VOCAB, S, B = 50, 8, 2


def _model(group):
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, num_query_groups=2, normalization="rmsnorm",
                                   activation="swiglu", add_bias_linear=False, position_embedding="rope",
                                   sequence_parallel=group is not None, backend="torch")
    return seqpar.GPTModel(cfg, 2, VOCAB, S, tp_group=group, share_embeddings_and_output_weights=False)


def _backward(model):
    tokens = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(3))
    model(tokens[:, :-1], tokens[:, 1:]).mean().backward()


def _step(model):
    with torch.no_grad():
        for p in model.parameters():
            p -= p.grad


def _worker(rank, world_size, norm_type, max_norm):
    sharded, reference = _model(dist.group.WORLD), _model(None)
    _backward(sharded)
    _backward(reference)
    naive = float(torch.nn.utils.clip_grad_norm_(sharded.parameters(), math.inf))   # max_norm inf: no change
    norm = clip_grad_norm_(sharded, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
    _step(sharded)
    _step(reference)
    ours, theirs = sharded.full_state_dict(), reference.full_state_dict()
    worst = max(float((ours[k] - theirs[k]).abs().max()) for k in theirs)
    _backward(sharded)
    if rank == 1:   # a NaN in one rank's shard of a split weight: a MAX all-reduce dropped it (inf-norm)
        sharded.layers[0].mlp.dense_h_to_4h.weight.grad[0, 0] = float("nan")
    nan_norm = float(clip_grad_norm_(sharded, max_norm, norm_type))
    # A NaN in one rank's copy of a replicated gradient (every rank should hold it alike): the norm was NaN on
    # that rank only, and error_if_nonfinite raised there alone (the other rank went on to its collectives)
    sharded.zero_grad(set_to_none=True)
    _backward(sharded)
    if rank == 1:
        sharded.final_layernorm.weight.grad[0] = float("nan")
    try:
        clip_grad_norm_(sharded, max_norm, norm_type, error_if_nonfinite=True)
        replicated_nan = "no error"
    except RuntimeError as exc:
        replicated_nan = str(exc)
    # A finite replicated gradient whose |g|^p overflows: inf on every rank, the gradients zeroed, as at t = 1
    # (the day's first version of the carrier, part - part, made it inf - inf = NaN: every gradient NaN)
    sharded.zero_grad(set_to_none=True)
    _backward(sharded)
    sharded.final_layernorm.weight.grad.fill_(1e20 if norm_type == 2.0 else math.inf)
    overflow = float(clip_grad_norm_(sharded, max_norm, norm_type))
    overflow_finite = all(torch.isfinite(p.grad).all() for p in sharded.parameters() if p.grad is not None)
    return float(norm), float(expected), worst, naive, nan_norm, replicated_nan, (overflow, overflow_finite)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_clipping_uses_the_unsharded_norm_on_every_rank(norm_type):
    max_norm = 0.05   # below the gradients' norm: the factor is < 1
    results = run_ranks(_worker, 2, norm_type, max_norm, timeout_s=150)
    for rank, (norm, expected, worst, _, nan_norm, replicated_nan, overflow) in enumerate(results):
        assert norm > max_norm and math.isclose(norm, expected, rel_tol=1e-5), (rank, norm, expected)
        assert worst < 1e-6, (rank, worst)   # the clipped gradients, stepped: the reference's weights
        assert math.isnan(nan_norm), (rank, nan_norm)   # as torch's on the unsharded gradients
        assert "gradients is nan: non-finite" in replicated_nan, (rank, replicated_nan)
        assert math.isinf(overflow[0]) and (overflow[1] or norm_type != 2.0), (rank, overflow)
    if norm_type == 2.0:
        assert results[0][3] != results[1][3]   # torch's clip on each rank's shards: a norm per rank


def _missing_grads_worker(rank, world_size):
    from seqpar.nn.state_dict import prepare_parameters

    model = _model(dist.group.WORLD)
    _backward(model)
    split = [param for _, param, placement in prepare_parameters(model, "test").entries if placement.layout]
    if rank == 1:   # e.g. frozen or unused there: no gradient for any split parameter on one rank
        for param in split:
            param.grad = None
    missing = float(clip_grad_norm_(model, math.inf))
    if rank == 1:
        for param in split:
            param.grad = torch.zeros_like(param)
    return missing, float(clip_grad_norm_(model, math.inf))


@pytest.mark.timeout(120)
def test_a_rank_without_split_gradients_still_joins_the_reduction():
    """The ranks run the same all-reduces whichever gradients each holds: a rank without any split
    parameter's gradient skipped its group's reduction, and the other rank waited in it for good. A
    missing gradient counts as a zero one."""
    results = run_ranks(_missing_grads_worker, 2, timeout_s=90)
    (missing_0, zeros_0), (missing_1, zeros_1) = results
    assert missing_0 == zeros_0 == missing_1 == zeros_1 > 0, results


def _pipeline_worker(rank, world_size, norm_type):
    """Two pipeline stages of one model (t = 1 each): rank 0 holds the embeddings and layer 0, rank 1
    layer 1, the final norm and the (untied) head."""
    whole, reference = _model(None), _model(None)
    _backward(whole)
    _backward(reference)
    stage = torch.nn.ModuleList([whole.embedding, whole.layers[0]] if rank == 0 else
                                [whole.layers[1], whole.final_layernorm, whole.output_layer])
    alone = float(clip_grad_norm_(stage, math.inf, norm_type))   # max_norm inf: no change
    norm = clip_grad_norm_(stage, 0.05, norm_type, pipeline_group=dist.group.WORLD)
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_type)
    mine = {id(p) for p in stage.parameters()}
    worst = max(float((a.grad - b.grad).abs().max()) for a, b in zip(whole.parameters(), reference.parameters())
                if id(a) in mine)
    return float(norm), float(expected), alone, worst


@pytest.mark.timeout(120)
@pytest.mark.parametrize("norm_type", [2.0, math.inf])
def test_pipeline_stages_clip_by_the_whole_models_norm(norm_type):
    """Each stage alone clipped by its own gradients' norm; with pipeline_group every stage gets the whole
    model's (torch's on the unsplit model) and clips its gradients by the same factor."""
    results = run_ranks(_pipeline_worker, 2, norm_type, timeout_s=90)
    for norm, expected, alone, worst in results:
        assert math.isclose(norm, expected, rel_tol=1e-6) and norm > 0.05, results
        assert alone <= norm and worst < 1e-7, results
    assert min(alone for _, _, alone, _ in results) < results[0][0]   # a stage alone: a smaller norm


def _uneven_stages_worker(rank, world_size):
    """Stage 0 an fp64 linear with gradients of ones; stage 1 an fp32 one, then no parameters at all."""
    norms = []
    for last_stage in (torch.nn.Linear(4, 4), torch.nn.Module()):
        stage = torch.nn.Linear(4, 4, dtype=torch.float64) if rank == 0 else last_stage
        for param in stage.parameters():
            param.grad = torch.ones_like(param)
        norms.append(float(clip_grad_norm_(stage, 1e9, pipeline_group=dist.group.WORLD)))
    return norms


@pytest.mark.timeout(120)
def test_pipeline_stages_of_different_dtypes_or_without_parameters_agree():
    """Each stage reduced in its own dtype (fp64 parameters, or fp32 for none): gloo aborted on the size
    mismatch. The stages' totals are reduced in fp64 on every stage."""
    for norms in run_ranks(_uneven_stages_worker, 2, timeout_s=90):
        assert norms == pytest.approx([40 ** 0.5, 20 ** 0.5], rel=1e-6), norms


def test_one_rank_is_torchs_clip_and_bad_arguments_are_value_errors():
    ours, theirs = _model(None), _model(None)
    _backward(ours)
    _backward(theirs)
    norm = clip_grad_norm_(ours, 0.1)
    assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1))
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters()))
    for bad in (0, -1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="max_norm"):
            clip_grad_norm_(ours, bad)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm_(ours, 1.0, norm_type=0)
    with pytest.raises(ValueError, match="not model.parameters"):
        clip_grad_norm_(ours.parameters(), 1.0)
    # torch's signature and scalar types: foreach= was a TypeError, numpy and 0-d tensor scalars ValueErrors
    import numpy as np
    for max_norm, norm_type in ((np.float32(1e9), np.float64(2.0)), (torch.tensor(1e9), torch.tensor(2.0))):
        torch.testing.assert_close(clip_grad_norm_(ours, max_norm, norm_type, foreach=True),
                                   torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type))
    assert torch.equal(clip_grad_norm_(ours, 1e9, norm_type="inf"),
                       torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1e9, norm_type="inf"))
    next(ours.parameters()).grad[0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="non-finite"):
        clip_grad_norm_(ours, 1.0, error_if_nonfinite=True)


def test_fp64_gradients_clip_as_torchs():
    """fp64 gradients: the norm in fp64, as torch's (_foreach_norm refused to narrow them to fp32: a
    RuntimeError), alone and beside fp32 ones."""
    torch.manual_seed(0)
    ours = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3)).double()
    theirs = copy.deepcopy(ours)
    for m in (ours, theirs):
        m(torch.ones(2, 5, dtype=torch.float64)).square().sum().backward()
    norm = clip_grad_norm_(ours, 0.1)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    assert norm.dtype == torch.float64 and torch.allclose(norm, want, rtol=1e-12, atol=0)
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-12, atol=0) for a, b in zip(ours.parameters(), theirs.parameters()))
    mixed = torch.nn.Sequential(torch.nn.Linear(3, 2).double(), torch.nn.Linear(2, 1))
    for p in mixed.parameters():
        p.grad = torch.ones_like(p)
    assert torch.allclose(clip_grad_norm_(mixed, 1e9), torch.tensor(11.0, dtype=torch.float64).sqrt())


def _scaler_worker(rank, world_size, tensor_parallel, fused=False):
    model = _model(dist.group.WORLD)
    # fused: the optimizer unscales in its own step (GradScaler's _check_inf_per_device path) and skips it
    # only for a flag of exactly 1.0
    optimizer = (torch.optim.AdamW(model.parameters(), lr=0.1, fused=True) if fused
                 else torch.optim.SGD(model.parameters(), lr=0.1))
    make = seqpar.nn.TensorParallelGradScaler if tensor_parallel else torch.amp.GradScaler
    scaler = make("cpu", init_scale=256.0, **({"tp_group": dist.group.WORLD} if tensor_parallel else {}))
    tokens = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(3))
    scaler.scale(model(tokens[:, :-1], tokens[:, 1:]).mean()).backward()
    if rank == 1:   # an overflow in one rank's shard of a split weight only
        model.layers[0].mlp.dense_h_to_4h.weight.grad[0, 0] = float("inf")
    if fused:       # and in a replicated gradient on every rank (an overflow there shows on all of them)
        model.final_layernorm.weight.grad[0] = float("inf")
    layer_norm, norm = model.final_layernorm.weight.detach().clone(), None   # replicated on both ranks
    if tensor_parallel and not fused:
        scaler.unscale_(optimizer)                   # the usual place for clipping
        norm = float(clip_grad_norm_(model, 1.0))
    scaler.step(optimizer)
    scaler.update()
    copied = copy.deepcopy(scaler)   # (an EMA / checkpointing habit) shares the group, as the modules' copies do
    assert copied.get_scale() == scaler.get_scale() and copied.state_dict() == scaler.state_dict()
    assert getattr(copied, "tp_group", None) is getattr(scaler, "tp_group", None)
    return {"stepped": not torch.equal(model.final_layernorm.weight, layer_norm), "scale": scaler.get_scale(),
            "norm": norm}


@pytest.mark.timeout(180)
def test_grad_scaler_skips_the_step_on_every_rank_when_one_rank_overflows():
    ours = run_ranks(_scaler_worker, 2, True, timeout_s=150)
    assert [r["stepped"] for r in ours] == [False, False] and [r["scale"] for r in ours] == [128.0, 128.0], ours
    assert all(math.isinf(r["norm"]) for r in ours), ours         # the clip saw rank 1's inf on both ranks
    theirs = run_ranks(_scaler_worker, 2, False, timeout_s=150)    # torch's: the ranks part
    assert [r["stepped"] for r in theirs] == [True, False] and [r["scale"] for r in theirs] == [256.0, 128.0], theirs
    fused = run_ranks(_scaler_worker, 2, True, True, timeout_s=150)  # the flag summed to 2.0 stepped into NaN
    assert [r["stepped"] for r in fused] == [False, False] and [r["scale"] for r in fused] == [128.0, 128.0], fused


def _reparametrized_worker(rank, world_size):
    """clip_grad_norm_, sharded_state_dict and the forward of a layer whose column-parallel weight is
    reparametrized (one rewrite per kind), at t = 2 and at t = 1; and the loss of a t = 2 layer under
    FSDP1 (use_orig_params=False lends the linears plain views of its flat parameter: not a rewrite)."""
    import torch.nn.utils.parametrize as parametrize
    from torch.nn.utils import prune
    from torch.nn.utils.parametrizations import weight_norm

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    rewrites = {"parametrize": lambda m: parametrize.register_parametrization(m, "weight", Double()),
                "weight_norm": weight_norm, "prune": lambda m: prune.l1_unstructured(m, "weight", amount=0.0)}
    errors, t1_norms = {}, {}
    for kind, rewrite in rewrites.items():
        for group in (dist.group.WORLD, None):
            seqpar.manual_seed(0)
            layer = seqpar.TransformerLayer(seqpar.TransformerConfig(
                hidden_size=16, num_attention_heads=2, backend="torch", sequence_parallel=group is not None),
                tp_group=group)
            rewrite(layer.mlp.dense_h_to_4h)
            if group is None:
                layer(torch.randn(4, 2, 16)).square().sum().backward()
                t1_norms[kind] = float(clip_grad_norm_(layer, 1e9))
                continue
            for autocast in (False, True):
                try:
                    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                        layer(torch.randn(2, 2, 16))
                    errors[kind, "forward", autocast] = None
                except ValueError as e:
                    errors[kind, "forward", autocast] = str(e)
            for name, call in (("clip", lambda: clip_grad_norm_(layer, 1e9)),
                               ("sharded", lambda: seqpar.nn.sharded_state_dict(layer))):
                try:
                    call()
                    errors[kind, name] = None
                except ValueError as e:
                    errors[kind, name] = str(e)
    from torch.distributed.fsdp import FullyShardedDataParallel
    own_groups = [dist.new_group([r]) for r in range(world_size)]   # data-parallel groups of one rank
    seqpar.manual_seed(0)
    config = seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, backend="torch", sequence_parallel=True)
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(rank))
    plain = seqpar.TransformerLayer(config, tp_group=dist.group.WORLD)
    wrapped = FullyShardedDataParallel(copy.deepcopy(plain), process_group=own_groups[rank], use_orig_params=False,
                                       device_id=torch.device("cpu"))
    fsdp1 = (float(plain(x).square().sum()), float(wrapped(x).square().sum()))
    return errors, t1_norms, fsdp1


@pytest.mark.timeout(180)
def test_a_reparametrized_split_weight_is_refused_under_tensor_parallelism():
    """A split weight under parametrize / weight_norm / prune keeps its shard under another name, which
    has no layout: clip_grad_norm_ counted it as replicated (each rank returned another norm, so the
    ranks clipped by different factors) and sharded_state_dict saved one rank's shard for both. Now both
    raise a ValueError naming the part on every rank; at t = 1 (nothing split) clipping still runs. The
    forward refuses it too, with and without autocast: a parametrization computed from one rank's shard
    (PEFT's target_parameters LoRA: an adapter per rank) trained another model than t = 1 silently."""
    for errors, t1_norms, (plain, fsdp1) in run_ranks(_reparametrized_worker, 2, timeout_s=150):
        assert fsdp1 == plain, (fsdp1, plain)
        assert set(t1_norms) == {"parametrize", "weight_norm", "prune"}
        assert all(math.isfinite(n) and n > 0 for n in t1_norms.values())
        assert len(errors) == 3 * 4, errors
        for (kind, name, *_), error in errors.items():
            start = {"clip": "clip_grad_norm_: mlp.dense_h_to_4h.weight",
                     "sharded": "sharded_state_dict: mlp.dense_h_to_4h.weight",
                     "forward": "ColumnParallelLinear: weight"}[name]
            # torch.nn.utils.parametrize renames the class ParametrizedColumnParallelLinear
            assert error is not None and error.removeprefix("Parametrized").startswith(f"{start} is not a parameter"), \
                (kind, name, error)
            if name == "forward":
                assert "this rank's shard" in error and "hooks" in error, error
