"""Dropout seeds and rank agreement on 2 gloo ranks (one spawn for everything, the cases run in turn):
external checkpointing of SP layers and of GPTModel's layers replays the masks; ranks that disagree
on config or RNG state, pass uneven sequence shards or inputs only one rank rejects, or use a group
they are not in, get a ValueError on every rank (and the group stays usable); double backward through
the f / g mappings raises."""
import functools
import re

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                         apply_activation_checkpointing,
                                                                         checkpoint_wrapper)
from torch.utils.checkpoint import checkpoint

import seqpar
from seqpar.parallel import (copy_to_tensor_region, copy_to_tensor_region_coalesced, gather_from_sequence_region,
                             reduce_from_tensor_region, reduce_scatter_to_sequence_region,
                             scatter_to_sequence_region, sequence_shard)

from launcher import run_ranks

S, B, H, A = 14, 2, 32, 4          # s/t = 7: odd shards
RECOMPUTE = ("none", "selective", "full")
WRAPPERS = {
    "torch-checkpoint": lambda layer, x: checkpoint(layer, x, use_reentrant=False),
    "torch-checkpoint-reentrant": lambda layer, x: checkpoint(layer, x, use_reentrant=True),
    "checkpoint_wrapper": lambda layer, x: checkpoint_wrapper(layer)(x),
    "hf-style": lambda layer, x: functools.partial(checkpoint, use_reentrant=True)(layer.__call__, x),
}


def _cfg(**kw):
    return seqpar.TransformerConfig(**{**dict(hidden_size=H, num_attention_heads=A, hidden_dropout=0.2,
                                              attention_dropout=0.2, sequence_parallel=True), **kw})


def _grads(module, call, seed=5):
    seqpar.manual_seed(seed)
    y, x = call()
    y.backward(torch.linspace(-1, 1, y.numel()).view_as(y))
    out = [y.detach()] + ([x.grad] if x is not None else [])
    out += [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def _checkpoint_cases(group):
    """{(what, recompute, wrapper): bitwise equal to the unwrapped run from the same seed}."""
    out = {}
    x_full = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1))
    x_shard = sequence_shard(x_full, group)
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(2))

    def leaf():
        return x_shard.clone().requires_grad_()

    for recompute in RECOMPUTE:
        seqpar.manual_seed(0)
        layer = seqpar.TransformerLayer(_cfg(recompute=recompute), tp_group=group)

        def run(wrap=None):
            x = leaf()
            return (layer(x) if wrap is None else wrap(layer, x)), x

        ref = _grads(layer, run)
        for name, wrap in WRAPPERS.items():
            out[("layer", recompute, name)] = _same(_grads(layer, functools.partial(run, wrap)), ref)

        def gpt():
            seqpar.manual_seed(0)
            return seqpar.GPTModel(_cfg(recompute=recompute), num_layers=2, vocab_size=64, max_seq_len=S,
                                   tp_group=group)

        def loss(model):
            return model(tokens, tokens.roll(-1, 1)).mean(), None

        model = gpt()
        ref = _grads(model, functools.partial(loss, model))
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, seqpar.TransformerLayer))
        out[("gpt", recompute, "apply_activation_checkpointing")] = _same(
            _grads(model, functools.partial(loss, model)), ref)
        model = gpt()
        for i, layer_i in enumerate(model.layers):
            model.layers[i] = checkpoint_wrapper(layer_i, checkpoint_impl=CheckpointImpl.REENTRANT)
        out[("gpt", recompute, "checkpoint_wrapper-reentrant")] = _same(
            _grads(model, functools.partial(loss, model)), ref)
    return out


def _on_device(device, build):
    with torch.device(device):
        return build()


def _construction_cases(rank):
    """name -> a callable building something that must raise on every rank."""
    def layer(**kw):
        return seqpar.TransformerLayer(_cfg(**kw), tp_group=dist.group.WORLD)

    def seeded(seed, build):
        seqpar.manual_seed(seed)
        return build()

    def drew_after_seed():
        seqpar.manual_seed(1)
        if rank == 1:
            torch.rand(1)          # e.g. rank-dependent data augmentation from torch's CPU generator
        return layer()

    world = dist.group.WORLD
    return {
        "seed": lambda: seeded(rank, layer),
        "torch-rng": drew_after_seed,
        "sp-one-rank": lambda: layer(sequence_parallel=rank == 0),
        "ffn": lambda: layer(ffn_hidden_size=128 if rank == 0 else 64),
        "dropout": lambda: layer(hidden_dropout=0.1 if rank == 0 else 0.2),
        "layer-number": lambda: seqpar.TransformerLayer(_cfg(), tp_group=world, layer_number=rank),
        "gpt-vocab": lambda: seqpar.GPTModel(_cfg(), num_layers=2, vocab_size=64 if rank == 0 else 32,
                                             max_seq_len=16, tp_group=world),
        "gpt-seed": lambda: seeded(rank, lambda: seqpar.GPTModel(_cfg(), num_layers=3, vocab_size=64,
                                                                 max_seq_len=16, tp_group=world)),
        # materialised on one rank only (FSDP's habit): the real rank's init collectives met none, and the
        # error blamed the model ("different numbers of split parameters")
        "meta-on-one-rank": lambda: seqpar.GPTModel(_cfg(), num_layers=1, vocab_size=64, max_seq_len=16,
                                                    tp_group=world, device="meta" if rank else "cpu"),
        "layer-meta-context-on-one-rank": lambda: _on_device("meta" if rank else "cpu", layer),
        # the same invalid arguments on every rank: every rank raises the same error
        "heads-indivisible": lambda: layer(hidden_size=48, num_attention_heads=3),
        "ffn-indivisible": lambda: layer(ffn_hidden_size=91),
    }


def _randn(*shape, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0), dtype=dtype)


def _forward_cases(rank):
    world = dist.group.WORLD
    seqpar.manual_seed(3)
    sp_layer = seqpar.TransformerLayer(_cfg(), tp_group=world)
    plain_layer = seqpar.TransformerLayer(_cfg(sequence_parallel=False), tp_group=world)
    no_dropout_layer = seqpar.TransformerLayer(_cfg(hidden_dropout=0.0, attention_dropout=0.0), tp_group=world)
    gpt = seqpar.GPTModel(_cfg(), num_layers=1, vocab_size=64, max_seq_len=128, tp_group=world)

    def diverged_seed():
        seqpar.manual_seed(4)
        if rank == 1:
            torch.rand(1)
        return sp_layer(_randn(7, B, H))

    def gpt_modes():
        gpt.train(rank == 0)
        try:
            return gpt(torch.zeros(2, 8, dtype=torch.int64))
        finally:
            gpt.train()

    def misshapen_state_dict():
        full = plain_layer.full_state_dict()
        if rank == 1:
            full["input_layernorm.weight"] = torch.ones(5)
        plain_layer.load_full_state_dict(full)

    def none_on_rank_1():
        full = plain_layer.full_state_dict()      # a collective: every rank gathers
        plain_layer.load_full_state_dict(full if rank == 0 else None)

    def layer_modes():
        sp_layer.train(rank == 0)
        try:
            return sp_layer(_randn(7, B, H))
        finally:
            sp_layer.train()

    def no_grad_on_rank_1(module, x):
        with torch.set_grad_enabled(rank == 0):
            return module(x)

    def on_meta(build, x):
        with torch.device("meta"):
            module = build()
        return module(x)

    tokens = torch.zeros(2, 8, dtype=torch.int64)
    other_tokens = torch.arange(16).view(2, 8)
    return {
        # s = 127 at t = 2: shards of 64 and 63 rows (gloo aborts the process in the all-gather)
        "uneven-sp-shards": lambda: sp_layer(_randn(64 if rank == 0 else 63, B, H)),
        "different-s-without-sp": lambda: plain_layer(_randn(8 if rank == 0 else 9, B, H)),
        # without dropout the hint leaves out diverged generators (it always named them)
        "different-s-no-dropout": lambda: no_dropout_layer(_randn(7 if rank == 0 else 8, B, H)),
        "different-batch": lambda: sp_layer(_randn(7, 2 if rank == 0 else 3, H)),
        "gpt-s127": lambda: gpt(torch.zeros(2, 127, dtype=torch.int64)),
        "rank0-bad-hidden": lambda: sp_layer(_randn(7, B, 33 if rank == 0 else H)),
        "rank1-bad-dtype": lambda: sp_layer(_randn(7, B, H, dtype=torch.float64 if rank == 1 else torch.float32)),
        "diverged-torch-rng": diverged_seed,
        # GPTModel turns its layers' per-forward check off and checks its own inputs instead
        "gpt-different-batch": lambda: gpt(torch.zeros(2 if rank == 0 else 3, 8, dtype=torch.int64)),
        "gpt-labels-on-one-rank": lambda: gpt(tokens, tokens if rank == 0 else None),
        "gpt-rank1-bad-token": lambda: gpt(tokens if rank == 0 else tokens + 99),
        "gpt-train-and-eval": gpt_modes,
        # a train / eval mix was reported as differing dropout seeds
        "layer-train-and-eval": layer_modes,
        # a rank under no_grad runs no backward: the others' backward waited for it until the timeout
        "layer-no-grad-on-rank1": lambda: no_grad_on_rank_1(sp_layer, _randn(7, B, H)),
        "gpt-no-grad-on-rank1": lambda: no_grad_on_rank_1(gpt, tokens),
        # same shapes, other values (a sampler over the world instead of the data-parallel ranks): the
        # loss silently mixed the two ranks' batches
        "gpt-different-token-values": lambda: gpt(tokens if rank == 0 else other_tokens),
        "gpt-different-label-values": lambda: gpt(tokens, tokens if rank == 0 else other_tokens),
        "gpt-tokens-in-another-order": lambda: gpt(other_tokens if rank == 0 else other_tokens.flip(1)),
        # parameters on meta (to_empty not called yet): torch's "Cannot copy out of meta tensor" from the
        # rank check's control tensor, placed on the parameters' device
        "layer-on-meta": lambda: on_meta(lambda: seqpar.TransformerLayer(_cfg(), tp_group=world), _randn(7, B, H)),
        "gpt-on-meta": lambda: on_meta(lambda: seqpar.GPTModel(_cfg(), num_layers=1, vocab_size=64, max_seq_len=128,
                                                               tp_group=world), tokens),
        "state-dict-rank1-misshapen": misshapen_state_dict,
        # the checkpoint read on rank 0 only: rank 1's TypeError escaped the agreement, rank 0 waited
        "state-dict-none-on-rank1": none_on_rank_1,
    }


def _raises(build):
    """``build()`` after seqpar.manual_seed(1) on every rank -> its ValueError's text (None: no error)."""
    seqpar.manual_seed(1)
    try:
        build()
    except ValueError as error:
        return str(error)
    return None


def _double_backward_mappings(rank, group):
    """Each mapping: y = op(x); HVP-style double backward -> the error text (None if it did not raise)."""
    ops = {"f": copy_to_tensor_region, "f_bar": reduce_from_tensor_region, "g": gather_from_sequence_region,
           "g_bar": reduce_scatter_to_sequence_region, "scatter": scatter_to_sequence_region,
           "f_coalesced": lambda x, g: copy_to_tensor_region_coalesced([x], g)[0]}
    out = {}
    for name, op in ops.items():
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank)).requires_grad_()
        y = op(x, group)
        try:
            (grad,) = torch.autograd.grad((y ** 2).sum(), x, create_graph=True)
            grad.sum().backward()
            out[name] = None
        except RuntimeError as error:
            out[name] = str(error)
    return out


def _agreement_worker(rank, world_size):
    group = dist.group.WORLD
    results = {"checkpoint": _checkpoint_cases(group)}
    results["construction"] = {name: _raises(build) for name, build in _construction_cases(rank).items()}
    results["forward"] = {name: _raises(run) for name, run in _forward_cases(rank).items()}
    # a rejected input, caught, leaves torch's generator as it was (as at t = 1): the seeds were drawn before
    # the ranks' check, so the next forward's masks differed from a t = 1 run's
    seqpar.manual_seed(6)
    layer = seqpar.TransformerLayer(_cfg(), tp_group=group)
    state = torch.get_rng_state()
    try:
        layer(_randn(7, B, H, dtype=torch.float64))
        results["rejected-keeps-rng"] = False
    except ValueError:
        results["rejected-keeps-rng"] = torch.equal(torch.get_rng_state(), state)
    # a group without this rank: ValueError on rank 1 for every module; rank 0 (its only member) builds
    solo = dist.new_group([0])
    results["non-member"] = {
        "TransformerLayer": _raises(lambda: seqpar.TransformerLayer(_cfg(), tp_group=solo)),
        "GPTModel": _raises(lambda: seqpar.GPTModel(_cfg(), num_layers=1, vocab_size=64, max_seq_len=16,
                                                    tp_group=solo)),
        "LayerNorm": _raises(lambda: seqpar.nn.LayerNorm(H, tp_group=solo, sequence_parallel=True)),
        "ColumnParallelLinear": _raises(lambda: seqpar.nn.ColumnParallelLinear(H, H, tp_group=solo)),
        "RowParallelLinear": _raises(lambda: seqpar.nn.RowParallelLinear(H, H, tp_group=solo)),
    }
    results["double-backward"] = _double_backward_mappings(rank, group)
    # after all of the above, the group still works: a full SP step, identical on both ranks
    seqpar.manual_seed(8)
    layer = seqpar.TransformerLayer(_cfg(recompute="selective"), tp_group=group)
    x = torch.randn(S // world_size, B, H, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    layer(x).sum().backward()
    grad = layer.input_layernorm.weight.grad.clone()
    peer = [torch.empty_like(grad) for _ in range(world_size)]
    dist.all_gather(peer, grad, group=group)
    results["usable-after"] = all(torch.equal(p, peer[0]) for p in peer) and bool(grad.abs().sum() > 0)
    return results


@functools.lru_cache(maxsize=None)
def agreement():
    return run_ranks(_agreement_worker, 2, timeout_s=150)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("what", ["layer", "gpt"])
def test_external_checkpoint_replays_masks_t2_sp(what):
    for rank, results in enumerate(agreement()):
        cases = {k: v for k, v in results["checkpoint"].items() if k[0] == what}
        assert cases and all(cases.values()), f"rank {rank}: not bitwise equal: {[k for k, v in cases.items() if not v]}"


CONSTRUCTION = {  # case -> what every rank's ValueError must name
    "seed": r"seqpar seed \(seqpar.manual_seed\) differs \(rank 0: 0, rank 1: 1\)",
    "torch-rng": r"torch default CPU generator state differs \(ranks \[0\] vs ranks \[1\]\)",
    "sp-one-rank": r"config.sequence_parallel differs \(ranks \[0\] vs ranks \[1\]; rank \d has (True|False)\)",
    "ffn": r"config.ffn_hidden_size differs \(rank 0: 128, rank 1: 64\)",
    "dropout": r"config.hidden_dropout differs \(ranks \[0\] vs ranks \[1\]; rank \d has 0.[12]\)",
    "layer-number": r"layer_number differs \(rank 0: 0, rank 1: 1\)",
    "gpt-vocab": r"GPTModel: .*vocab_size differs \(rank 0: 64, rank 1: 32\)",
    "gpt-seed": r"GPTModel: .*seqpar seed",
    "meta-on-one-rank": r"GPTModel: .*on_meta_device differs",
    "layer-meta-context-on-one-rank": r"TransformerLayer\(layer_number=0\): .*on_meta_device differs",
    "heads-indivisible": r"num_attention_heads 3 is not divisible by the tensor-parallel size 2",
    "ffn-indivisible": r"ffn_hidden_size 91 is not divisible",
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(CONSTRUCTION))
def test_ranks_that_disagree_raise_at_construction(case):
    for rank, results in enumerate(agreement()):
        message = results["construction"][case]
        assert message is not None, f"rank {rank}: {case} built without error"
        assert re.search(CONSTRUCTION[case], message), f"rank {rank}: {message}"


FORWARD = {  # case -> (rank 0's message, rank 1's message)
    "uneven-sp-shards": (r"x.shape\[0\] \(s_local\) differs \(rank 0: 64, rank 1: 63\).*s/t positions",) * 2,
    "different-s-without-sp": (r"x.shape\[0\] \(s\) differs \(rank 0: 8, rank 1: 9\)",) * 2,
    "different-s-no-dropout": (r"^(?!.*dropout seeds).*s_local\) differs \(rank 0: 7, rank 1: 8\)",) * 2,
    "different-batch": (r"x.shape\[1\] \(b\) differs \(rank 0: 2, rank 1: 3\)",) * 2,
    "gpt-s127": (r"sequence length 127 is not divisible by the tensor-parallel size 2",) * 2,
    "rank0-bad-hidden": (r"x must be a floating \[s_local, b, 32\] tensor, got torch.float32 \(7, 2, 33\)",
                         r"rank\(s\) \[0\] rejected their arguments"),
    "rank1-bad-dtype": (r"rank\(s\) \[1\] rejected their arguments", r"x dtype torch.float64 != params_dtype"),
    "diverged-torch-rng": (r"torch default CPU generator state differs",) * 2,
    "gpt-different-batch": (r"GPTModel input: .*tokens.shape\[0\] \(b\) differs \(rank 0: 2, rank 1: 3\)",) * 2,
    "gpt-labels-on-one-rank": (r"labels given differs \(rank 0: 1, rank 1: 0\)",) * 2,
    "gpt-rank1-bad-token": (r"GPTModel input: tensor-parallel rank\(s\) \[1\] rejected",
                            r"token id 99 at \[0, 0\] is outside the vocabulary"),
    "gpt-train-and-eval": (r"training differs \(rank 0: 1, rank 1: 0\)",) * 2,
    "layer-train-and-eval": (r"TransformerLayer\(layer_number=0\) input: .*training differs \(rank 0: 1, rank 1: 0\)",) * 2,
    "layer-no-grad-on-rank1": (r"grad mode differs \(rank 0: 1, rank 1: 0\).*under torch.no_grad or not",) * 2,
    "gpt-no-grad-on-rank1": (r"GPTModel input: .*grad mode differs \(rank 0: 1, rank 1: 0\)",) * 2,
    "gpt-different-token-values": (r"token and label values \(checksum\) differs",) * 2,
    "gpt-different-label-values": (r"token and label values \(checksum\) differs",) * 2,
    "gpt-tokens-in-another-order": (r"token and label values \(checksum\) differs",) * 2,
    "layer-on-meta": (r"x is on cpu but the layer's parameters are on meta",) * 2,
    "gpt-on-meta": (r"tokens are on cpu but the model's parameters are on meta \(build on meta, then to_empty",) * 2,
    "state-dict-rank1-misshapen": (r"load_full_state_dict: tensor-parallel rank\(s\) \[1\] rejected",
                                   r"input_layernorm.weight must have shape \(32,\)"),
    "state-dict-none-on-rank1": (r"load_full_state_dict: tensor-parallel rank\(s\) \[1\] rejected",
                                 r"state dict must be a mapping of names to tensors, got NoneType"),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("case", list(FORWARD))
def test_bad_forward_inputs_raise_on_every_rank(case):
    for rank, results in enumerate(agreement()):
        message = results["forward"][case]
        assert message is not None, f"rank {rank}: {case} ran without error"
        assert re.search(FORWARD[case][rank], message), f"rank {rank}: {message}"


@pytest.mark.timeout(240)
def test_a_rejected_input_leaves_the_generator_as_it_was():
    assert all(results["rejected-keeps-rng"] for results in agreement())


@pytest.mark.timeout(240)
def test_group_without_this_rank_raises_and_group_stays_usable():
    results = agreement()
    for module, message in results[1]["non-member"].items():
        assert message is not None and "not a member of the tp_group" in message, (module, message)
    assert all(message is None for message in results[0]["non-member"].values()), results[0]["non-member"]
    assert all(r["usable-after"] for r in results)


@pytest.mark.timeout(240)
def test_double_backward_through_mappings_raises():
    for rank, results in enumerate(agreement()):
        for name, message in results["double-backward"].items():
            assert message is not None and "differentiate twice" in message, f"rank {rank} {name}: {message}"


def _strided_group_worker(rank, world_size):
    """tp groups {0, 2} and {1, 3}; global rank 2 passes a shorter shard."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, sequence_parallel=True)
    layer = seqpar.TransformerLayer(cfg, tp_group=groups[rank % 2])
    linear = seqpar.nn.ColumnParallelLinear(32, 8, tp_group=groups[rank % 2])
    messages = []
    for run in (lambda: layer(torch.randn(3 if rank == 2 else 4, 1, 32)),          # an int value differs
                lambda: linear(torch.randn(4, 2 if rank == 2 else 1, 32))):       # a hashed value differs
        try:
            run()
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    return messages


@pytest.mark.timeout(120)
def test_disagreement_in_a_strided_group_names_the_global_ranks():
    """In the group {0, 2} its rank 1 is global rank 2: the messages say so (they named group ranks only)."""
    messages = run_ranks(_strided_group_worker, 4, timeout_s=100)
    for rank in (0, 2):
        assert "s_local) differs (rank 0: 4, rank 1 (global rank 2): 3)" in messages[rank][0], messages[rank]
        assert "differs (ranks [0] vs ranks [1] (global [2])" in messages[rank][1], messages[rank]
    assert messages[1] == messages[3] == [None, None]
