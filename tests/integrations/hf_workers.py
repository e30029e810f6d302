"""Rank workers of test_hf_gpt2.py (and the family-independent ones of test_llama.py). They never import transformers (each spawned rank would pay its
import): the parent builds the GPT-2 state dicts, configs (as plain attribute objects) and HF's
reference numbers once, and the ranks compare against them."""
import itertools
import types

import torch
import torch.distributed as dist

import seqpar
from seqpar.integrations import hf

POLICIES = ("none", "selective", "full")


def hf_config(config_dict):
    """A GPT2Config's (or LlamaConfig's) attributes without transformers (from_gpt2 / from_llama read
    attributes only)."""
    return types.SimpleNamespace(**config_dict)


#: family -> (HF model -> GPTModel, GPTModel -> HF state dict)
FAMILIES = {"gpt2": (hf.from_gpt2, hf.to_gpt2_state_dict), "llama": (hf.from_llama, hf.to_llama_state_dict)}


def logits_errors(group, cases, family="gpt2"):
    """{(case, sp, recompute): (vocab_start, vocab_end, max |logits - HF logits| on that shard)}.

    ``cases``: {case: (state_dict, config_dict, tokens, HF logits [s, b, v])}."""
    load = FAMILIES[family][0]
    out = {}
    for case, (state_dict, config_dict, tokens, reference) in cases.items():
        for sp, recompute in itertools.product((False, True), POLICIES):
            model = load(state_dict, config=hf_config(config_dict), tp_group=group,
                         sequence_parallel=sp, recompute=recompute).eval()
            with torch.no_grad():
                local = model(tokens)
            start, end = model.vocab_start, model.vocab_end
            assert local.shape == reference.shape[:2] + (end - start,), (local.shape, start, end)
            error = (local - reference[..., start:end]).abs().max().item() if end > start else 0.0
            out[(case, sp, recompute)] = (start, end, error)
    return out


def round_trips(group, cases, family="gpt2"):
    """{name: to_<family>_state_dict(from_<family>(sd)) equals sd bitwise (keys in order, dtypes, values)}."""
    load, save = FAMILIES[family]
    out = {}
    for name, (state_dict, config_dict) in cases.items():
        got = save(load(state_dict, config=hf_config(config_dict), tp_group=group, sequence_parallel=True))
        out[name] = (list(got) == list(state_dict)
                     and all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in state_dict.items()))
    return out


def sgd(params, lr):
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad = None


def train(group, state_dict, config_dict, tokens, hf_labels, steps, lr, hf_state_dict, family="gpt2"):
    """SGD on seqpar's model of ``family`` at this group + SP + selective recompute with HF's loss
    convention: (losses per step, {key: max |to_<family>_state_dict afterwards - HF's trained weights|}).
    Plain numbers: tensors returned to the parent would need this process alive to hand them over."""
    load, save = FAMILIES[family]
    model = load(state_dict, config=hf_config(config_dict), tp_group=group, sequence_parallel=True,
                 recompute="selective")
    labels = hf.shift_labels(hf_labels)
    losses = []
    for _ in range(steps):
        loss = model(tokens, labels).sum() / (labels != -100).sum()
        loss.backward()
        sgd(model.parameters(), lr)
        losses.append(loss.item())
    trained = save(model)
    return losses, {k: (trained[k] - v).abs().max().item() for k, v in hf_state_dict.items()}


def padded_vocab_shards(group):
    """GPTModel with vocabularies whose padding leaves a rank few or no real rows, -100 labels, t ranks
    + SP vs one device: {vocab: (real rows here, loss error, real-row grad error, padded-row grad nonzeros)}."""
    out = {}
    for vocab in (300, 1000):
        cfg = dict(hidden_size=32, num_attention_heads=4)
        seqpar.manual_seed(5)
        reference = seqpar.GPTModel(seqpar.TransformerConfig(**cfg), 2, vocab, 16)
        seqpar.manual_seed(5)                                  # the same initial model for any t
        model = seqpar.GPTModel(seqpar.TransformerConfig(**cfg, sequence_parallel=True, recompute="selective"),
                                2, vocab, 16, tp_group=group)
        tokens = torch.randint(0, vocab, (3, 12), generator=torch.Generator().manual_seed(vocab))
        labels = tokens.roll(-1, 1)
        labels[:, -1] = -100
        labels[1, 2:6] = -100
        losses = [m(tokens, labels) for m in (reference, model)]
        for loss in losses:
            loss.sum().backward()
        start, end = model.vocab_start, model.vocab_end
        grad = model.embedding.word_embeddings.weight.grad
        grad_ref = reference.embedding.word_embeddings.weight.grad[start:end]
        grad_error = (grad[:end - start] - grad_ref).abs().max().item() if end > start else 0.0
        out[vocab] = (end - start, (losses[0] - losses[1]).abs().max().item(), grad_error,
                      int(torch.count_nonzero(grad[end - start:])))
    return out


def rejected_on_every_rank(group, rank, cases):
    """from_gpt2 of a state dict only rank 0 rejects (a misshapen bias): this rank's ValueError, or None.
    The other ranks used to wait in the model's first collective until the group's timeout."""
    state_dict, config_dict = next(iter(cases.values()))[:2]
    state_dict = dict(state_dict)
    if rank == 0:
        key = next(k for k in state_dict if k.endswith("h.0.mlp.c_fc.bias"))
        state_dict[key] = state_dict[key][:-1]
    try:
        hf.from_gpt2(state_dict, config=hf_config(config_dict), tp_group=group)
    except ValueError as exc:
        return str(exc)
    return None


def worker(rank, world_size, cases_path):
    """Every check on this rank; ``cases_path``: torch.save'd dict(logit_cases, round_trip_cases,
    train_case (None: no training check))."""
    seqpar.manual_seed(0)  # the same RNG state on every rank (GPT-2's default dropouts are on)
    cases = torch.load(cases_path)
    logit_cases, round_trip_cases, train_case = cases["logit_cases"], cases["round_trip_cases"], cases["train_case"]
    group = dist.group.WORLD
    results = dict(logits=logits_errors(group, logit_cases), round_trips=round_trips(group, round_trip_cases),
                   padded=padded_vocab_shards(group), rejected=rejected_on_every_rank(group, rank, logit_cases))
    if train_case is not None:
        results["train"] = train(group, **train_case)
    return results
