"""TransformerLayer / GPTModel on 1, 2, 4 gloo ranks against a single-device reference built from the
same unsharded weights: outputs, input gradients, every parameter gradient (through an SGD step and
full_state_dict()), dropout masks across layouts, activation memory per rank vs Table 2 (bad input and
configurations that differ across ranks: test_rng_agreement.py)."""
import functools
import itertools

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.memory import ActivationMeter, layer_activation_bytes
from seqpar.parallel import sequence_shard

from launcher import run_ranks

S, B, H, A = 12, 3, 48, 4          # s/t = 3 at t = 4: odd shards
RECOMPUTE = ("none", "selective", "full")


def _sgd(module, lr=1.0):
    with torch.no_grad():
        for p in module.parameters():
            p -= lr * p.grad


def _gather_seq(y_shard, group):
    parts = [torch.empty_like(y_shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y_shard.contiguous(), group=group)
    return torch.cat(parts)


def _random_state_dict(layer, gen):
    return {k: torch.randn(shape, generator=gen) * (0.3 if len(shape) == 2 else 0.1)
            + (1.0 if k.endswith("layernorm.weight") else 0.0) for k, shape in layer.full_shapes().items()}


def _run_layer(layer, x, grad_y, seed):
    seqpar.manual_seed(seed)
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(grad_y)
    return y.detach(), x.grad


def _parity_worker(rank, world_size):
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(1234)
    x_full, grad_full = torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)
    results = {}
    for dropout in (0.0, 0.2):
        base = dict(hidden_size=H, num_attention_heads=A, hidden_dropout=dropout, attention_dropout=dropout)
        reference = seqpar.TransformerLayer(seqpar.TransformerConfig(**base))
        state = _random_state_dict(reference, torch.Generator().manual_seed(99))
        reference.load_full_state_dict(state)
        y_ref, gx_ref = _run_layer(reference, x_full, grad_full, seed=7)
        grad_scale = {k: max(1.0, p.grad.abs().max().item()) for k, p in reference.named_parameters()}
        _sgd(reference)
        sd_ref = reference.full_state_dict()
        for sp in (False, True):
            bitwise = None
            for recompute in RECOMPUTE:
                cfg = seqpar.TransformerConfig(**base, sequence_parallel=sp, recompute=recompute)
                layer = seqpar.TransformerLayer(cfg, tp_group=group)
                layer.load_full_state_dict(state)
                x_in = sequence_shard(x_full, group) if sp else x_full
                g_in = sequence_shard(grad_full, group) if sp else grad_full
                y, gx = _run_layer(layer, x_in, g_in, seed=7)
                grads = [p.grad.clone() for p in layer.parameters()]
                _sgd(layer)
                sd = layer.full_state_dict()
                y_full = _gather_seq(y, group) if sp else y
                gx_full = _gather_seq(gx, group) if sp else gx
                same = None
                if bitwise is None:
                    bitwise = (y, gx, grads)
                else:
                    same = (torch.equal(y, bitwise[0]) and torch.equal(gx, bitwise[1])
                            and all(torch.equal(a, b) for a, b in zip(grads, bitwise[2])))
                results[(dropout, sp, recompute)] = dict(
                    y=(y_full - y_ref).abs().max().item(), x_grad=(gx_full - gx_ref).abs().max().item(),
                    params={k: (sd[k] - sd_ref[k]).abs().max().item() / grad_scale[k] for k in sd_ref},
                    bitwise_vs_none=same)
    return results


def _memory_worker(rank, world_size):
    s, b, h, a = 256, 2, 128, 4
    out = {}
    seqpar.manual_seed(3)  # dropout seeds come from torch's CPU generator: the same state on every rank
    for sp, recompute in itertools.product((False, True), RECOMPUTE):
        cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=a, hidden_dropout=0.1,
                                       attention_dropout=0.1, sequence_parallel=sp, recompute=recompute,
                                       params_dtype=torch.bfloat16, backend="torch")
        layer = seqpar.TransformerLayer(cfg, tp_group=dist.group.WORLD)
        x = torch.randn(s // world_size if sp else s, b, h, dtype=torch.bfloat16, requires_grad=True)
        with ActivationMeter() as meter:
            layer(x)
        kw = dict(tp=world_size, sequence_parallel=sp, recompute=recompute)
        out[(sp, recompute)] = (meter.bytes, layer_activation_bytes(s, b, h, a, bytes_per_mask=0, **kw),
                                1.05 * layer_activation_bytes(s, b, h, a, **kw), meter.report(s * b * h))
    return out


@functools.lru_cache(maxsize=None)
def parity(world_size):
    return run_ranks(_parity_worker, world_size, timeout_s=240)


@functools.lru_cache(maxsize=None)
def memory(world_size):
    return run_ranks(_memory_worker, world_size, timeout_s=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda t: f"t{t}")
def test_layer_parity_with_single_device(world_size):
    for rank_results in parity(world_size):
        for (dropout, sp, recompute), r in rank_results.items():
            case = f"t={world_size} sp={sp} recompute={recompute} dropout={dropout}"
            assert r["y"] <= 2e-4, f"{case}: output error {r['y']:.2e}"
            assert r["x_grad"] <= 2e-4, f"{case}: input-gradient error {r['x_grad']:.2e}"
            # After one SGD step (lr 1) a parameter differs by its gradient's error. The gradients here range
            # from 11 to 280 (input_layernorm.weight), so the bound is relative to each one's largest
            # |gradient|: 3e-6, about 50 fp32 ulps (the worst seen is 1e-6, t = 2; an absolute 2e-4 was 7e-7
            # of the LayerNorm weight's gradient and 2e-5 of the smallest one's).
            worst = max(r["params"], key=r["params"].get)
            assert r["params"][worst] <= 3e-6, \
                f"{case}: {worst} after SGD differs by {r['params'][worst]:.2e} of its largest gradient"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda t: f"t{t}")
def test_recompute_policies_bitwise_identical_with_dropout(world_size):
    for rank_results in parity(world_size):
        for (dropout, sp, recompute), r in rank_results.items():
            if recompute != "none":
                assert r["bitwise_vs_none"], f"t={world_size} sp={sp} dropout={dropout}: {recompute} != none"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda t: f"t{t}")
def test_memory_per_rank_within_table2_bounds(world_size):
    for rank, rank_results in enumerate(memory(world_size)):
        for (sp, recompute), (measured, lower, upper, report) in rank_results.items():
            assert lower <= measured <= upper, (
                f"rank {rank} t={world_size} sp={sp} recompute={recompute}: {measured} not in "
                f"[{lower:.0f}, {upper:.0f}]\n{report}")


def _gpt_worker(rank, world_size, steps):
    group = dist.group.WORLD
    base = dict(hidden_size=32, num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1)
    seqpar.manual_seed(21)
    reference = seqpar.GPTModel(seqpar.TransformerConfig(**base), num_layers=2, vocab_size=64, max_seq_len=16)
    seqpar.manual_seed(21)
    model = seqpar.GPTModel(seqpar.TransformerConfig(**base, sequence_parallel=True, recompute="selective"),
                            num_layers=2, vocab_size=64, max_seq_len=16, tp_group=group)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 64, (3, 16), generator=gen)   # one batch: the loss must fall on it
    labels = tokens.roll(-1, dims=1)
    losses = []
    for step in range(steps):
        pair = []
        for m in (reference, model):
            seqpar.manual_seed(100 + step)
            m.zero_grad()
            loss = m(tokens, labels).mean()
            loss.backward()
            _sgd(m, lr=0.5)
            pair.append(loss.item())
        losses.append(pair)
    return losses


@pytest.mark.timeout(240)
def test_gpt_training_t2_sp_selective_matches_t1():
    losses = run_ranks(_gpt_worker, 2, 4, timeout_s=200)
    for rank_losses in losses:
        for step, (ref, tp) in enumerate(rank_losses):
            assert abs(ref - tp) <= 1e-4, f"step {step}: t=1 loss {ref:.6f} vs t=2+SP+selective {tp:.6f}"
    first, last = losses[0][0][0], losses[0][-1][0]
    assert last < first, "the loss should fall over a few SGD steps"


def _gather_logits_worker(rank, world_size, vocab):
    """A loss of the user's own (label smoothing) on gather_logits at t = world_size with sequence
    parallelism vs the same loss on the t = 1 model's logits: loss, and every weight after one SGD step."""
    base = dict(hidden_size=32, num_attention_heads=4)
    seqpar.manual_seed(8)
    reference = seqpar.GPTModel(seqpar.TransformerConfig(**base), num_layers=1, vocab_size=vocab, max_seq_len=8)
    seqpar.manual_seed(8)
    model = seqpar.GPTModel(seqpar.TransformerConfig(**base, sequence_parallel=True), num_layers=1,
                            vocab_size=vocab, max_seq_len=8, tp_group=dist.group.WORLD)
    tokens = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(3))
    labels = tokens.roll(-1, dims=1).t().reshape(-1)           # [s * b], the logits' [s, b] order
    losses = []
    for m, gather in ((reference, lambda z: z), (model, model.gather_logits)):
        logits = gather(m(tokens))
        logits /= 0.9   # in place (a temperature): the t = 2 result was a view of the gather, which refused it
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), labels, label_smoothing=0.1)
        loss.backward()
        _sgd(m)
        losses.append(loss.item())
    ref_sd, sd = reference.full_state_dict(), model.full_state_dict()
    try:   # rank 1 gathers the last position only: gloo aborted the process in the all-gather
        with torch.no_grad():
            logits_local = model(tokens)
            model.gather_logits(logits_local[-1:] if rank else logits_local)
        mismatch = None
    except ValueError as exc:
        mismatch = str(exc)
    return losses, max((ref_sd[k] - sd[k]).abs().max().item() for k in ref_sd), tuple(logits.shape), mismatch


@pytest.mark.timeout(120)
@pytest.mark.parametrize("vocab", [130, 100], ids=["uneven_shards", "empty_shard"])
def test_gather_logits_custom_loss_t2_matches_t1(vocab):
    """At t = 2 the padded vocabulary has 128 rows a rank: 130 real ids split 128 / 2, and 100 leave rank 1
    none. The gathered logits' gradient keeps each rank's columns (all_gather's summed backward doubled it);
    they take an in-place edit as at t = 1; ranks gathering different positions get a ValueError."""
    for (ref, tp), weight_diff, shape, mismatch in run_ranks(_gather_logits_worker, 2, vocab, timeout_s=100):
        assert abs(ref - tp) <= 1e-6 and weight_diff <= 1e-6 and shape == (8, 2, vocab), (ref, tp, weight_diff)
        assert "GPTModel.gather_logits" in mismatch and "logits_local.shape[:-1]" in mismatch, mismatch


def _fused_ln_shard_worker(rank, world_size):
    """FusedBiasDropoutAddLayerNorm under sequence parallelism with the default row_offset: each rank's
    shard draws the unsharded tensor's mask (row_offset 0 gave every shard the same one)."""
    from seqpar.nn import FusedBiasDropoutAddLayerNorm

    gen = torch.Generator().manual_seed(4)
    x, res = torch.randn(8, 3, 16, generator=gen), torch.randn(8, 3, 16, generator=gen)
    whole = FusedBiasDropoutAddLayerNorm(16, p=0.5)
    sharded = FusedBiasDropoutAddLayerNorm(16, p=0.5, tp_group=dist.group.WORLD, sequence_parallel=True)
    _, ro_whole = whole(x, None, res, seed=11)
    mine = sequence_shard(x, dist.group.WORLD), sequence_shard(res, dist.group.WORLD)
    _, ro_shard = sharded(mine[0], None, mine[1], seed=11)
    try:                # the input check comes before the shard's offset is worked out (an IndexError)
        sharded(torch.tensor(1.0), None, torch.tensor(1.0))
        return "a 0-d x passed"
    except ValueError:
        pass
    return torch.equal(ro_shard, sequence_shard(ro_whole, dist.group.WORLD))


@pytest.mark.timeout(60)
def test_fused_layer_norm_module_shards_draw_the_unsharded_mask():
    assert run_ranks(_fused_ln_shard_worker, 2, timeout_s=50) == [True, True]
