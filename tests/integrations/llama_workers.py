"""Rank workers of test_llama.py: every Llama check of one world size in one spawn. They never import
transformers (each spawned rank would pay its import): the parent builds the Llama state dicts, configs
(as plain attribute objects) and HF's reference numbers once, and the ranks compare against them.

Checks (each returns plain numbers: tensors returned to the parent would need the rank alive):
- layer parity: the Llama block (and RMSNorm with biases and dropout) at t ranks, SP on and off, every
  recompute policy, against one device from the same unsharded weights; policies bitwise identical;
- layer memory: the meter per rank against seqpar.memory.layer_activation_terms, label by label;
- HF: from_llama logits against HF's, to_llama_state_dict round trips, SGD training against HF's losses.
"""
import itertools

import torch
import torch.distributed as dist

import seqpar
from seqpar.memory import ActivationMeter, architecture_kwargs, layer_activation_terms
from seqpar.parallel import sequence_shard

from tests.integrations.hf_workers import POLICIES, logits_errors, round_trips, sgd, train

LLAMA = dict(normalization="rmsnorm", activation="swiglu", position_embedding="rope", add_bias_linear=False)
S, B = 12, 3                      # s/t = 3 at t = 4: odd shards
LAYER_BLOCKS = {                  # id: config (a = 8 heads, 4 k/v groups, d = 8, f = 88)
    "llama": dict(LLAMA, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=88,
                  rope_theta=1000.0),
    "rmsnorm-bias-dropout": dict(LLAMA, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=88,
                                 add_bias_linear=True, hidden_dropout=0.2, attention_dropout=0.2),
    # Qwen3's block: per-head q / k norms (each rank normalises its heads: the weights' gradients are summed),
    # heads 12 wide (the attention 96 wide, h 64)
    "qwen3": dict(LLAMA, hidden_size=64, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=88,
                  kv_channels=12, qk_layernorm=True, rope_theta=1e6),
}
MEMORY = dict(s=64, b=2, h=128, a=8, f=352)


def _gather_seq(y_shard, group):
    if group is None or dist.get_world_size(group) == 1:
        return y_shard
    parts = [torch.empty_like(y_shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, y_shard.contiguous(), group=group)
    return torch.cat(parts)


def _run_layer(layer, x, grad_y):
    seqpar.manual_seed(7)
    x = x.detach().clone().requires_grad_()
    y = layer(x)
    y.backward(grad_y)
    grads = [p.grad.clone() for p in layer.parameters()]
    sgd(layer.parameters(), 1.0)
    return y.detach(), x.grad, grads, layer.full_state_dict()


def _relative_error(got, reference):
    """max |got - reference| over max |reference| (fp32 sums in another order: relative to the scale)."""
    return ((got - reference).abs().max() / reference.abs().max()).item()


def layer_parity(group):
    """{(block, sp, recompute): dict(y, x_grad, params (the SGD updates), errors relative to one device's
    scale; bitwise_vs_none)}."""
    gen = torch.Generator().manual_seed(1234)
    results = {}
    for block, knobs in LAYER_BLOCKS.items():
        x_full = torch.randn(S, B, knobs["hidden_size"], generator=gen)
        grad_full = torch.randn(S, B, knobs["hidden_size"], generator=gen)
        reference = seqpar.TransformerLayer(seqpar.TransformerConfig(**knobs))
        wgen = torch.Generator().manual_seed(99)
        state = {k: torch.randn(shape, generator=wgen) * (0.3 if len(shape) == 2 else 0.1)
                 + (1.0 if k.endswith("layernorm.weight") else 0.0) for k, shape in reference.full_shapes().items()}
        reference.load_full_state_dict(state)
        y_ref, gx_ref, _, sd_ref = _run_layer(reference, x_full, grad_full)
        for sp in (False, True):
            first = None
            for recompute in POLICIES:
                layer = seqpar.TransformerLayer(seqpar.TransformerConfig(**knobs, sequence_parallel=sp,
                                                                         recompute=recompute), tp_group=group)
                layer.load_full_state_dict(state)
                x_in, g_in = (sequence_shard(x_full, group), sequence_shard(grad_full, group)) if sp else \
                    (x_full, grad_full)
                y, gx, grads, sd = _run_layer(layer, x_in, g_in)
                same = None
                if first is None:
                    first = (y, gx, grads)
                else:
                    same = (torch.equal(y, first[0]) and torch.equal(gx, first[1])
                            and all(torch.equal(a, b) for a, b in zip(grads, first[2])))
                y_full = _gather_seq(y, group) if sp else y
                gx_full = _gather_seq(gx, group) if sp else gx
                results[(block, sp, recompute)] = dict(
                    y=_relative_error(y_full, y_ref), x_grad=_relative_error(gx_full, gx_ref),
                    params={k: _relative_error(sd[k] - state[k], v - state[k]) for k, v in sd_ref.items()},
                    bitwise_vs_none=same)
    return results


def layer_memory(group, world_size):
    """{(block, sp, recompute): (measured bytes, formula bytes, measured by label, formula by label, report)},
    bf16 on the torch backend (no dropout: the Llama block, with a or 4 k/v groups, and Qwen3's)."""
    s, b, h, a, f = (MEMORY[k] for k in ("s", "b", "h", "a", "f"))
    out = {}
    seqpar.manual_seed(3)
    blocks = {f"g={a}": dict(num_query_groups=a), "g=4": dict(num_query_groups=4),
              "qwen3 g=4": dict(num_query_groups=4, kv_channels=24, qk_layernorm=True)}
    for block, sp, recompute in itertools.product(blocks, (False, True), POLICIES):
        cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=a, ffn_hidden_size=f, sequence_parallel=sp,
                                       recompute=recompute, params_dtype=torch.bfloat16, backend="torch",
                                       **blocks[block], **LLAMA)
        layer = seqpar.TransformerLayer(cfg, tp_group=group)
        x = torch.randn(s // world_size if sp else s, b, h, dtype=torch.bfloat16, requires_grad=True)
        with ActivationMeter() as meter:
            layer(x)
        terms = layer_activation_terms(s, b, h, a, tp=world_size, sequence_parallel=sp, recompute=recompute,
                                       bytes_per_mask=0, **architecture_kwargs(cfg))
        out[(block, sp, recompute)] = (meter.bytes, sum(terms.values()), meter.by_label(),
                                   {k: v for k, v in terms.items() if v}, meter.report(s * b * h * 2))
    return out


def run_all(group, world_size, cases):
    """Every check at this world size; ``cases``: dict(logit_cases, round_trip_cases, train_case) of HF
    references, each None when transformers is not installed (or not wanted)."""
    seqpar.manual_seed(0)  # the same RNG state on every rank
    results = dict(parity=layer_parity(group), memory=layer_memory(group, world_size))
    try:  # t must divide the k/v groups: checked where t is known, on every rank alike
        seqpar.TransformerLayer(seqpar.TransformerConfig(**{**LAYER_BLOCKS["llama"], "num_query_groups": 1}),
                                tp_group=group)
        results["groups_error"] = None
    except ValueError as error:
        results["groups_error"] = str(error)
    if cases.get("logit_cases"):
        results["logits"] = logits_errors(group, cases["logit_cases"], family="llama")
    if cases.get("round_trip_cases"):
        results["round_trips"] = round_trips(group, cases["round_trip_cases"], family="llama")
    if cases.get("train_case"):
        results["train"] = train(group, **cases["train_case"], family="llama")
    return results


def worker(rank, world_size, cases_path):
    """A spawned rank: ``cases_path`` is the torch.save'd ``cases`` of :func:`run_all`."""
    return run_all(dist.group.WORLD, world_size, torch.load(cases_path))
