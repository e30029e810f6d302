"""seqpar.memory.plan_recompute against brute force over every (n_none, n_selective, n_full) mix."""
import dataclasses
import random

import pytest

from seqpar.memory import (RecomputePlan, evaluate_recompute, layer_activation_bytes, model_activation_bytes,
                           plan_recompute)

CASES = {  # id: (s, b, h, a, L, v, t, pp, sp)
    "L6-t1": (64, 2, 32, 4, 6, 100, 1, 1, False),
    "L7-t2-sp": (64, 1, 32, 4, 7, 128, 2, 1, True),
    "L8-t2-pp2-sp": (48, 2, 48, 6, 8, 96, 2, 2, True),
    "L9-t3-pp3": (96, 1, 24, 6, 9, 90, 3, 3, False),
    "L5-t4-sp-s-gt-h": (128, 1, 16, 4, 5, 64, 4, 1, True),
}


def _extra_flops(s, b, h, t, counts):
    """The contract's extra forward FLOPs per rank: selective 4bs^2h/t, full (24bsh^2 + 4bs^2h)/t per layer."""
    _, n_selective, n_full = counts
    return (n_selective * 4 * b * s * s * h + n_full * (24 * b * s * h * h + 4 * b * s * s * h)) / t


def _policies(counts):
    n_none, n_selective, n_full = counts
    return ["full"] * n_full + ["selective"] * n_selective + ["none"] * n_none


@pytest.mark.parametrize("case", list(CASES))
def test_planner_matches_brute_force(case):
    s, b, h, a, L, v, t, pp, sp = CASES[case]
    n = L // pp
    kw = dict(tp=t, pp=pp, sequence_parallel=sp)

    def memory(policies):  # every stage runs the first stage's policies
        return model_activation_bytes(s, b, h, a, L, v, recompute=list(policies) * pp, **kw)

    mixes = [(n0, n1, n - n0 - n1) for n0 in range(n + 1) for n1 in range(n - n0 + 1)]
    bytes_of = {mix: memory(_policies(mix)) for mix in mixes}
    lo, hi = bytes_of[(0, 0, n)], bytes_of[(n, 0, 0)]
    budgets = sorted(set(bytes_of.values())) + [lo + (hi - lo) * k / 17 for k in range(19)]  # exact ties too
    planned_mixes = set()
    for budget in budgets:
        plan = plan_recompute(s, b, h, a, L, v, budget_bytes=budget, **kw)
        assert isinstance(plan, RecomputePlan) and len(plan.policies) == n
        assert plan.activation_bytes == memory(plan.policies) <= budget
        fitting = [mix for mix in mixes if bytes_of[mix] <= budget]
        best = min(_extra_flops(s, b, h, t, mix) for mix in fitting)
        assert plan.extra_flops == pytest.approx(best, rel=1e-12, abs=0), (budget, plan)
        counts = (plan.counts["none"], plan.counts["selective"], plan.counts["full"])
        assert plan.extra_flops == pytest.approx(_extra_flops(s, b, h, t, counts), rel=1e-12, abs=0)
        planned_mixes.add(counts)
    assert len(planned_mixes) >= 4, planned_mixes  # the budgets exercise real trade-offs
    # fitting the peak: activations plus one recomputed layer's rebuild (selective: the s^2 terms it does
    # not keep; full: everything but its input), against brute force over the same peak
    layer = {p: layer_activation_bytes(s, b, h, a, tp=t, sequence_parallel=sp, recompute=p)
             for p in ("none", "selective", "full")}
    rebuilt = {p: layer["none"] - x for p, x in layer.items()}
    # and the loss backward's bf16 logits gradient beside the saved softmax, on the last
    # stage (with pp > 1 here the first stage's peak stays the larger)
    vocab_shard = min(v, -(-v // (128 * t)) * 128)
    loss = 2 * s * b * vocab_shard if pp == 1 else 0
    rebuilt_of = {mix: max(rebuilt[p] for k, p in zip(mix, ("none", "selective", "full")) if k) for mix in mixes}
    peak_of = {mix: bytes_of[mix] + max(loss, rebuilt_of[mix]) for mix in mixes}
    for budget in sorted(set(peak_of.values())) + [lo + (hi - lo) * k / 17 for k in range(19)]:
        fitting = [mix for mix in mixes if peak_of[mix] <= budget]
        if not fitting:
            with pytest.raises(ValueError, match="peak activation bytes"):
                plan_recompute(s, b, h, a, L, v, budget_bytes=budget, include_working_set=True, **kw)
            continue
        plan = plan_recompute(s, b, h, a, L, v, budget_bytes=budget, include_working_set=True, **kw)
        counts = (plan.counts["none"], plan.counts["selective"], plan.counts["full"])
        assert plan.peak_bytes == pytest.approx(peak_of[counts], rel=1e-12) and plan.peak_bytes <= budget
        assert plan.recompute_working_bytes == pytest.approx(rebuilt_of[counts], rel=1e-12, abs=0)
        assert plan.loss_working_bytes == pytest.approx(2 * s * b * vocab_shard, rel=1e-12)
        best = min(_extra_flops(s, b, h, t, mix) for mix in fitting)
        assert plan.extra_flops == pytest.approx(best, rel=1e-12, abs=0), (budget, plan)
    # which layer takes which policy does not matter under 1F1B
    shuffled = _policies((1, 2, n - 3))
    random.Random(0).shuffle(shuffled)
    assert memory(shuffled) == pytest.approx(bytes_of[(1, 2, n - 3)], rel=1e-12)


def test_plan_extremes_and_extra_fraction():
    s, b, h, a, L, v = 64, 2, 32, 4, 6, 100
    everything = model_activation_bytes(s, b, h, a, L, v, sequence_parallel=True)
    plan = plan_recompute(s, b, h, a, L, v, budget_bytes=everything)
    assert plan.policies == ("none",) * L and plan.extra_flops == 0 and plan.extra_fraction == 0
    selective = model_activation_bytes(s, b, h, a, L, v, sequence_parallel=True, recompute="selective")
    plan = plan_recompute(s, b, h, a, L, v, budget_bytes=selective)
    assert plan.policies == ("selective",) * L
    assert plan == evaluate_recompute("selective", s, b, h, a, L, v) \
        == evaluate_recompute(["selective"] * L, s, b, h, a, L, v)
    # model FLOPs per micro-batch: 3 (L (24bsh^2 + 4bs^2h) + 2bshv) = 72 bLsh^2 (1 + s/(6h) + v/(12hL))
    model_flops = 72 * b * L * s * h * h * (1 + s / (6 * h) + v / (12 * h * L))
    assert plan.extra_flops == L * 4 * b * s * s * h
    assert plan.extra_fraction == pytest.approx(L * 4 * b * s * s * h / model_flops, rel=1e-12)


def test_plan_raises_when_even_full_recompute_does_not_fit():
    s, b, h, a, L, v = 64, 2, 32, 4, 6, 100
    floor = model_activation_bytes(s, b, h, a, L, v, sequence_parallel=True, recompute="full")
    assert plan_recompute(s, b, h, a, L, v, budget_bytes=floor).policies == ("full",) * L
    with pytest.raises(ValueError, match="even with full recompute"):
        plan_recompute(s, b, h, a, L, v, budget_bytes=floor * (1 - 1e-9))


def test_plan_caps_num_layers_before_searching():
    """plan_recompute looped over every layer count before the per-layer policies met their 2**16 cap: a
    num_layers of 1e9 ran on for hours instead of raising as its sibling functions do."""
    with pytest.raises(ValueError, match="num_layers 1000000000 is more than 65536"):
        plan_recompute(64, 2, 32, 4, 10**9, 100, budget_bytes=1e12)


@pytest.mark.parametrize("budget", [0, -5, True, float("inf"), "1e9"], ids=repr)
def test_plan_rejects_bad_budget(budget):
    with pytest.raises(ValueError, match="budget_bytes"):
        plan_recompute(64, 2, 32, 4, 6, 100, budget_bytes=budget)


def test_plan_paper_models_fit_80gb():
    """The paper's 530B and 1T stages (t = 8, SP) at an 80 GiB budget less 18 bytes per parameter: the
    planner finds a mix no costlier than uniform selective recompute, which fits."""
    from seqpar.memory import MODEL_STATE_BYTES_PER_PARAMETER, first_stage_parameters
    for a, h, L, p in ((128, 20480, 105, 35), (160, 25600, 128, 64)):
        budget = 80 * 2**30 - MODEL_STATE_BYTES_PER_PARAMETER * first_stage_parameters(h, L, 51200, 2048, tp=8, pp=p)
        plan = plan_recompute(2048, 1, h, a, L, 51200, budget_bytes=budget, tp=8, pp=p)
        assert plan.counts["full"] == 0 and plan.activation_bytes <= budget
        assert plan.extra_flops <= (L // p) * 4 * 2048 * 2048 * h / 8


def test_first_stage_parameters_by_hand():
    from seqpar.memory import first_stage_parameters
    h, L, v, s = 8, 4, 30, 16                               # v = 30 rows padded to 128 t
    per_layer = 12 * h * h + 13 * h                         # 4h^2 + 2hf + f + 9h at f = 4h
    assert first_stage_parameters(h, L, v, s) == L * per_layer + 128 * h + s * h + 2 * h
    # t = 2: QKV, fc1 (with biases), projection and fc2 weights split; 2 biases + 2 LayerNorms (6h) not
    sharded = (3 * h * h + 3 * h + 4 * h * h + 4 * h + h * h + 4 * h * h) // 2 + 6 * h
    assert first_stage_parameters(h, L, v, s, tp=2, pp=2) == 2 * sharded + 128 * h + s * h
    # Llama: a = 4 heads, g = 2 groups (QKV rows h + 2 g h / a = 2h), SwiGLU f = 24, no biases, RMSNorm,
    # RoPE (no position table), untied head (a second padded vocabulary shard with pp = 1)
    llama = dict(heads=4, num_query_groups=2, ffn_hidden=24, normalization="rmsnorm", activation="swiglu",
                 add_bias_linear=False, position_embedding="rope", share_embeddings_and_output_weights=False)
    per_layer = (2 * h * h + 2 * 24 * h + h * h + 24 * h) // 2 + 2 * h
    assert first_stage_parameters(h, L, v, s, tp=2, **llama) == L * per_layer + 128 * h + h + 128 * h
    with pytest.raises(ValueError, match="pp 3 does not divide num_layers 4"):
        first_stage_parameters(h, L, v, s, pp=3)
    # Qwen3: heads of d = 6 (QKV rows (a + 2g) d = 48, projection h x a d = 8 x 24), q / k RMSNorms of d
    qwen3 = dict(llama, kv_channels=6, qk_layernorm=True)
    per_layer = (48 * h + 2 * 24 * h + 24 * h + 24 * h) // 2 + 2 * h + 2 * 6
    assert first_stage_parameters(h, L, v, s, tp=2, **qwen3) == L * per_layer + 128 * h + h + 128 * h
    for knob in (dict(kv_channels=6), dict(qk_layernorm=True)):
        with pytest.raises(ValueError, match=f"{next(iter(knob))} needs heads"):
            first_stage_parameters(h, L, v, s, **knob)


def test_plan_with_the_llama_block():
    """GQA and SwiGLU change the forward FLOPs full recompute reruns; a flash-style core makes selective
    recompute free and useless, so plans take none or full."""
    s, b, h, a, g, f, L, v, t = 64, 2, 32, 4, 2, 88, 6, 100, 2
    kw = dict(tp=t, sequence_parallel=True, ffn_hidden=f, num_query_groups=g, normalization="rmsnorm",
              activation="swiglu", hidden_dropout=0.0, attention_dropout=0.0)
    forward = 2 * b * s * h * h * (1 + 2 * g / a) + 2 * b * s * h * h + 6 * b * s * h * f + 4 * b * s * s * h
    assert evaluate_recompute("full", s, b, h, a, L, v, **kw).extra_flops == pytest.approx(L * forward / t, rel=1e-12)
    assert evaluate_recompute("selective", s, b, h, a, L, v, **kw).extra_flops == L * 4 * b * s * s * h / t
    # heads of d = 16 (w = a d = 64 = 2h): the QKV, projection and core FLOPs scale with w, the MLP's not
    w, wide = 4 * 16, dict(kw, kv_channels=16, qk_layernorm=True)
    forward = 2 * b * s * h * w * (1 + 2 * g / a) + 2 * b * s * h * w + 6 * b * s * h * f + 4 * b * s * s * w
    assert evaluate_recompute("full", s, b, h, a, L, v, **wide).extra_flops == pytest.approx(L * forward / t, rel=1e-12)
    assert evaluate_recompute("selective", s, b, h, a, L, v, **wide).extra_flops == L * 4 * b * s * s * w / t
    selective = model_activation_bytes(s, b, h, a, L, v, recompute="selective", **kw)
    assert plan_recompute(s, b, h, a, L, v, budget_bytes=selective, **kw).policies == ("selective",) * L
    flash = dict(kw, flash_attention=True)
    assert evaluate_recompute("selective", s, b, h, a, L, v, **flash) == \
        dataclasses.replace(evaluate_recompute("none", s, b, h, a, L, v, **flash), policies=("selective",) * L)
    none = model_activation_bytes(s, b, h, a, L, v, **flash)
    full = model_activation_bytes(s, b, h, a, L, v, recompute="full", **flash)
    plan = plan_recompute(s, b, h, a, L, v, budget_bytes=(none + full) / 2, **flash)
    assert plan.counts["selective"] == 0 and 0 < plan.counts["full"] < L and plan.activation_bytes <= (none + full) / 2


# GPTModels whose per-rank parameter count first_stage_parameters must give (a = 4 heads, pp = 1)
PARAMETER_CASES = {
    "gpt": (dict(), dict()),
    "llama": (dict(normalization="rmsnorm", activation="swiglu", num_query_groups=2, position_embedding="rope",
                   add_bias_linear=False, ffn_hidden_size=88), dict(share_embeddings_and_output_weights=False)),
    "layernorm-swiglu-gqa-bias-learned": (dict(activation="swiglu", num_query_groups=2), dict()),
    "qwen2": (dict(normalization="rmsnorm", activation="swiglu", num_query_groups=2, position_embedding="rope",
                   add_bias_linear=False, add_qkv_bias=True), dict()),
    "qkv-bias-with-all-biases": (dict(add_qkv_bias=True), dict()),
    "qwen3-kv-channels": (dict(normalization="rmsnorm", activation="swiglu", num_query_groups=2, position_embedding="rope",
                               add_bias_linear=False, kv_channels=12, qk_layernorm=True), dict()),
    "layernorm-qk-norm-kv-channels-bias": (dict(kv_channels=6, qk_layernorm=True), dict()),
}


def _parameter_counts(rank, world_size):
    """{case: (parameters this rank's GPTModel holds, first_stage_parameters for it)}."""
    import torch.distributed as dist

    import seqpar
    from seqpar.memory import first_stage_parameters

    group = dist.group.WORLD if world_size > 1 else None
    out = {}
    for case, (knobs, model_kw) in PARAMETER_CASES.items():
        cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                                       attention_dropout=0.0, backend="torch", **knobs)
        model = seqpar.GPTModel(cfg, num_layers=3, vocab_size=300, max_seq_len=16, tp_group=group, **model_kw)
        expected = first_stage_parameters(
            32, 3, 300, 16, tp=world_size, ffn_hidden=cfg.ffn_hidden_size, heads=4,
            num_query_groups=cfg.num_query_groups, normalization=cfg.normalization, activation=cfg.activation,
            add_bias_linear=cfg.add_bias_linear, position_embedding=cfg.position_embedding,
            add_qkv_bias=cfg.add_qkv_bias, kv_channels=cfg.kv_channels, qk_layernorm=cfg.qk_layernorm, **model_kw)
        out[case] = (sum(p.numel() for p in model.parameters()), expected)
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("t", [1, 2])
def test_first_stage_parameters_counts_what_gptmodel_holds(t):
    if t == 1:
        ranks = [_parameter_counts(0, 1)]
    else:
        from tests.distributed.launcher import run_ranks
        ranks = run_ranks(_parameter_counts, t, timeout_s=100)
    for rank in ranks:
        for case, (held, formula) in rank.items():
            assert held == formula, f"{case}: GPTModel holds {held} parameters per rank, formula {formula}"


def test_first_stage_parameters_rejects():
    from seqpar.memory import first_stage_parameters
    for kw, match in ((dict(num_query_groups=2), "needs heads"), (dict(activation="relu"), "unknown activation"),
                      (dict(heads=4, num_query_groups=3), "num_query_groups 3 does not divide heads 4"),
                      (dict(add_bias_linear=1), "add_bias_linear must be a bool"),
                      (dict(add_qkv_bias="True"), "add_qkv_bias must be a bool, got 'True'"),
                      # heads given alone was never checked (0, 2.5, nan and t not dividing it all counted)
                      (dict(heads=0), "heads must be a positive int, got 0"), (dict(heads=2.5), "heads"),
                      (dict(heads=4, tp=8), "tp 8 does not divide heads 4")):
        with pytest.raises(ValueError, match=match):
            first_stage_parameters(32, 2, 100, 16, **kw)


def test_evaluate_recompute_names_the_stage_its_list_covers():
    """evaluate_recompute takes one stage's L/p policies: a whole model's list read "8 per-layer policies
    for 4 layers", which looked wrong for an 8-layer model."""
    with pytest.raises(ValueError, match=r"8 per-layer policies for 4 layers per pipeline stage \(num_layers / pp"):
        evaluate_recompute(["none"] * 8, 64, 1, 32, 4, 8, 100, pp=2)


def test_peak_bytes_follows_the_plan_s_fields():
    """peak_bytes is computed from the fields (dataclasses.replace kept a stale stored value): the most
    loaded stage plus a recomputed layer's rebuild, or the last stage plus the loss backward's working set
    (the logits gradient in bf16, 2 s b v / t bytes), whichever is larger."""
    s, b, h, a, L, v, t = 512, 1, 256, 8, 8, 32000, 2
    for pp in (1, 4):
        plan = evaluate_recompute("selective", s, b, h, a, L, v, tp=t, pp=pp)
        last = plan.last_stage_activation_bytes
        assert plan.loss_working_bytes == 2 * s * b * v / t
        assert last <= plan.activation_bytes and (pp > 1 or last == plan.activation_bytes)
        assert plan.peak_bytes == max(plan.activation_bytes + plan.recompute_working_bytes,
                                      last + max(plan.recompute_working_bytes, plan.loss_working_bytes))
        bare = dataclasses.replace(plan, recompute_working_bytes=0.0, loss_working_bytes=0.0)
        assert bare.peak_bytes == plan.activation_bytes


def test_planner_takes_numpy_integers_as_the_ints_they_are():
    """Sizes from a sweep over a numpy array: they were refused ("must be a positive int"); held as numpy
    int64, the FLOPs multiplied out of them would wrap. Every public planner function gives what Python ints
    give, at sizes whose FLOPs pass 2**63."""
    import numpy as np

    from seqpar import memory as M

    sizes = dict(seq_len=2**17, micro_batch=2**8, hidden=2**15, heads=2**8, num_layers=64, vocab=2**16)
    as_numpy = {k: np.int64(v) for k, v in sizes.items()}
    plain = M.evaluate_recompute(["full"] * 64, **sizes, tp=8)
    assert plain.extra_flops > 2**63
    assert M.evaluate_recompute(["full"] * 64, **as_numpy, tp=np.int64(8)) == plain
    budget = plain.activation_bytes * 2
    assert (M.plan_recompute(**as_numpy, tp=np.int32(8), budget_bytes=np.int64(int(budget)))
            == M.plan_recompute(**sizes, tp=8, budget_bytes=int(budget)))
    layer = dict(seq_len=2048, micro_batch=4, hidden=6144, heads=64)
    layer_np = {k: np.int64(v) for k, v in layer.items()}
    assert M.layer_activation_bytes(**layer_np, tp=np.int64(8)) == M.layer_activation_bytes(**layer, tp=8)
    assert M.layer_activation_terms(**layer_np) == M.layer_activation_terms(**layer)
    assert (M.model_activation_bytes(**layer_np, num_layers=np.int64(4), vocab=np.int64(51200))
            == M.model_activation_bytes(**layer, num_layers=4, vocab=51200))
    assert (M.first_stage_parameters(np.int64(6144), np.int64(48), np.int64(51200), np.int64(2048), tp=np.int64(8))
            == M.first_stage_parameters(6144, 48, 51200, 2048, tp=8))
    with pytest.raises(ValueError, match="heads must be a positive int, got 0"):
        M.layer_activation_bytes(**dict(layer_np, heads=np.int64(0)))
