"""GPTModel's measured activation memory per rank against seqpar.memory.model_activation_bytes, with
per-layer recompute policies from plan_recompute (gloo, t = 1 and 2, sequence parallel): the meter over
the whole forward stays within [0.95x the figure without masks (seqpar regenerates them), 1.05x the
figure with 1-byte masks], and mixed policies give the losses and gradients of uniform ones."""
import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.memory import ActivationMeter, model_activation_bytes, plan_recompute

from launcher import run_ranks

S, B, H, A, L, V = 32, 2, 64, 4, 4, 256  # V a multiple of 128 t: no vocabulary padding
E = 4  # fp32


def _sizes(t):
    return dict(seq_len=S, micro_batch=B, hidden=H, heads=A, num_layers=L, vocab=V)


def _plans(t):
    """Two plans on budgets between the uniform figures: one mixing none + selective, one with full."""
    common = dict(tp=t, sequence_parallel=True, bytes_per_element=E, bytes_per_mask=0)
    uniform = {p: model_activation_bytes(**_sizes(t), recompute=p, **common) for p in ("none", "selective", "full")}
    budgets = [(uniform["none"] + uniform["selective"]) / 2, (uniform["selective"] + uniform["full"]) / 2]
    return [plan_recompute(**_sizes(t), budget_bytes=budget, **common) for budget in budgets]


def _worker(rank, world_size, policy_lists):
    group = dist.group.WORLD if world_size > 1 else None
    gen = torch.Generator().manual_seed(5)
    tokens, labels = torch.randint(0, V, (B, S), generator=gen), torch.randint(0, V, (B, S), generator=gen)
    out = []
    for policies in policy_lists:
        seqpar.manual_seed(21)
        cfg = seqpar.TransformerConfig(hidden_size=H, num_attention_heads=A, hidden_dropout=0.1,
                                       attention_dropout=0.1, sequence_parallel=True, backend="torch")
        model = seqpar.GPTModel(cfg, L, V, S, tp_group=group, recompute=policies)
        with ActivationMeter() as meter:
            loss = model(tokens, labels)
        loss.sum().backward()
        # numpy: tensors sent back from a rank that exits can't go through shared memory
        out.append(dict(bytes=meter.bytes, labels=meter.by_label(), report=meter.report(S * B * H * E),
                        loss=loss.detach().numpy(),
                        grads={name: p.grad.numpy() for name, p in model.named_parameters()}))
    return out


@pytest.mark.parametrize("t", [1, 2], ids=["t1", "t2-sp"])
def test_gpt_memory_with_planned_policies(t):
    plans = _plans(t)
    assert {"none", "selective"} <= set(plans[0].policies), plans[0]
    assert "full" in plans[1].policies and len(set(plans[1].policies)) > 1, plans[1]
    policy_lists = [list(plan.policies) for plan in plans] + [["none"] * L]
    if t == 1:  # in this process, on one thread like the spawned ranks (tiny GEMMs: threads only contend)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            ranks = [_worker(0, 1, policy_lists)]
        finally:
            torch.set_num_threads(threads)
    else:
        ranks = run_ranks(_worker, t, policy_lists, timeout_s=180)
    for results in ranks:
        for policies, got in zip(policy_lists, results):
            kwargs = dict(tp=t, sequence_parallel=True, recompute=policies, bytes_per_element=E)
            lower = 0.95 * model_activation_bytes(**_sizes(t), bytes_per_mask=0, **kwargs)
            upper = 1.05 * model_activation_bytes(**_sizes(t), bytes_per_mask=1, **kwargs)
            assert lower <= got["bytes"] <= upper, f"{policies}: {lower} <= {got['bytes']} <= {upper}\n{got['report']}"
            # The output side exactly (the 5% above would hide it): with SP the output layer keeps only this
            # rank's sequence shard, as its formula term sbhE/t says (not the gathered [s, b, h]).
            assert got["labels"]["output layer input"] == S * B * H * E // t, got["report"]
            assert got["labels"]["cross-entropy (fp32 softmax, label ids)"] >= 4 * S * B * V // t, got["report"]
        uniform = results[-1]
        for mixed in results[:-1]:  # recompute replays the same dropout masks: same numbers
            torch.testing.assert_close(torch.from_numpy(mixed["loss"]), torch.from_numpy(uniform["loss"]),
                                       rtol=1e-5, atol=1e-6)
            for name, grad in uniform["grads"].items():
                torch.testing.assert_close(torch.from_numpy(mixed["grads"][name]), torch.from_numpy(grad),
                                           rtol=1e-4, atol=1e-6, msg=name)
    for plan in plans:  # the plan's figure is the formula's for its policies, within the budget
        assert plan.activation_bytes == model_activation_bytes(
            **_sizes(t), tp=t, sequence_parallel=True, recompute=list(plan.policies), bytes_per_element=E,
            bytes_per_mask=0)
