"""The Llama block end to end on gloo ranks, and seqpar.integrations.hf against HuggingFace transformers'
Llama (random models built from a LlamaConfig, never downloaded).

One spawn per world size runs every multi-rank check (llama_workers.run_all); t = 1 runs in this process
on a one-rank group:
- the Llama layer at t = 1, 2, 4, SP on and off, every recompute policy, against one device (outputs,
  gradients, weights after SGD), the policies bitwise identical, RMSNorm with biases and dropout too;
- its measured activation bytes per rank against seqpar.memory's formula: within [0.95x, 1.05x] and
  equal label by label;
- from_llama logits equal HF's within 2e-5 in fp32 at t = 1, 2 (2 k/v groups) and t = 4 (4 k/v groups),
  SP on and off, every recompute policy, for a Llama, a Llama 3.1 (scaled RoPE) and a Qwen2 (q / k / v
  biases, tied head); bitwise round trips (Qwen2's too); Mistral and Qwen2 at t = 1; 3 SGD steps at t = 2 + SP + selective
  against HF's losses; bad configs and state dicts; the import needs no transformers.
"""
import functools
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

import seqpar
import seqpar.integrations
from seqpar.integrations import hf

from tests.distributed.launcher import run_ranks
from tests.integrations import llama_workers

LLAMA_BLOCK = llama_workers.LLAMA

LAYERS, HIDDEN, HEADS, FFN, VOCAB, POSITIONS = 2, 128, 8, 352, 1000, 64
SEQ, BATCH = 36, 2                 # s/t = 9 at t = 4: odd shards
KV_GROUPS = {1: 2, 2: 2, 4: 4}     # t = 4 needs 4 k/v groups
POLICIES = ("none", "selective", "full")
TRAIN_STEPS, TRAIN_LR = 3, 0.5


def _transformers():
    return pytest.importorskip("transformers")


#: family -> (config class, model class) names in transformers
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
            "phi3": ("Phi3Config", "Phi3ForCausalLM")}


def _llama_config(kv_groups=2, vocab=VOCAB, family="llama", **kw):
    base = dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                num_key_value_heads=kv_groups, intermediate_size=FFN, vocab_size=vocab,
                max_position_embeddings=POSITIONS, rms_norm_eps=1e-6)
    if family == "phi3":
        base["pad_token_id"] = None      # Phi3Config's default 32000 is past this vocabulary
    base.update(kw)
    return getattr(_transformers(), FAMILIES[family][0])(**base)


def _random_llama(kv_groups=2, seed=0, family="llama", **kw):
    """A LlamaForCausalLM (or ``family``'s) whose every weight is random (the RMSNorm weights and Qwen2's
    biases too, so their mapping is tested); the same on every call with the same arguments."""
    transformers = _transformers()
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = getattr(transformers, FAMILIES[family][1])(_llama_config(kv_groups, family=family, **kw))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if name.endswith("norm.weight") else noise * (0.1 if "embed" in name else 0.05))
    return model


def _tokens(vocab=VOCAB, seed=0):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


# Llama 3.1's RoPE ("llama3" scaling) at a size where head dim 16 has frequencies in all three of its bands
# (kept, blended, stretched): original context 64 (the model's is 128, as Llama 3.1's 8192 -> 131072)
LLAMA31_ROPE = dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 64},
                    rope_theta=500000.0, max_position_embeddings=128)


# YaRN (Qwen2.5's long-context RoPE) with its original context below the sequence, so it matters
YARN_ROPE = dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
                 rope_theta=10000.0)


@functools.lru_cache(maxsize=None)
def _logit_case(kv_groups, tied=False, llama31=False, family="llama", yarn=False, **kw):
    """(state dict, config dict, tokens, HF's eval logits [s, b, v])."""
    rope = LLAMA31_ROPE if llama31 else YARN_ROPE if yarn else dict(rope_theta=5000.0)
    llama = _random_llama(kv_groups, tie_word_embeddings=tied, family=family, **rope, **kw).eval()
    tokens = _tokens()
    with torch.no_grad():
        return llama.state_dict(), llama.config.to_dict(), tokens, llama(tokens).logits.transpose(0, 1)


def _round_trip_cases(kv_groups):
    llama = _random_llama(kv_groups, seed=4)
    cases = {str(dtype): ({k: v.to(dtype) for k, v in llama.state_dict().items()}, llama.config.to_dict())
             for dtype in (torch.float32, torch.bfloat16)}
    for family in ("qwen2", "qwen3"):
        source = _random_llama(kv_groups, seed=4, family=family)
        cases[family] = (source.state_dict(), source.config.to_dict())
    return cases


@functools.lru_cache(maxsize=None)
def _train_case():
    """HF's starting state dict, the batch, and HF's own losses and final weights after TRAIN_STEPS SGD
    steps on its labels=input_ids loss (-100 for padding)."""
    llama = _random_llama(2, seed=7).train()
    state_dict = {k: v.clone() for k, v in llama.state_dict().items()}
    tokens = _tokens(seed=1)
    hf_labels = tokens.clone()
    hf_labels[0, -5:] = -100
    losses = []
    for _ in range(TRAIN_STEPS):
        loss = llama(tokens, labels=hf_labels).loss
        loss.backward()
        llama_workers.sgd(llama.parameters(), TRAIN_LR)
        losses.append(loss.item())
    case = dict(state_dict=state_dict, config_dict=llama.config.to_dict(), tokens=tokens, hf_labels=hf_labels,
                steps=TRAIN_STEPS, lr=TRAIN_LR, hf_state_dict=llama.state_dict())
    return case, losses


def _cases(world_size):
    """The HF references a world size checks (None without transformers)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return dict(logit_cases=None, round_trip_cases=None, train_case=None)
    g = KV_GROUPS[world_size]
    return dict(logit_cases={f"g{g}": _logit_case(g), f"g{g}-llama3.1-rope": _logit_case(g, llama31=True),
                             f"g{g}-qwen2-tied": _logit_case(g, tied=True, family="qwen2"),
                             f"g{g}-qwen2-yarn": _logit_case(g, family="qwen2", yarn=True),
                             # q / k norms and heads 24 wide (the attention 192 wide, h 128)
                             f"g{g}-qwen3-head-dim": _logit_case(g, family="qwen3", head_dim=24)},
                round_trip_cases=_round_trip_cases(g),
                train_case=_train_case()[0] if world_size == 2 else None)


_RANK_RESULTS = {}


def ranks(world_size, tmp_path_factory):
    """Every rank's results for this world size, computed once (failures included: each test that
    reads them reports the same failure instead of running again). t = 1 runs here, on a one-rank group."""
    if world_size not in _RANK_RESULTS:
        try:
            if world_size == 1:
                _RANK_RESULTS[1] = [_in_process(_cases(1))]
            else:
                # The references travel as a file: tensors passed to spawned processes directly go through
                # torch's shared-memory hand-off, which needs the parent serving them at the right moment.
                path = tmp_path_factory.mktemp("llama_cases") / "cases.pt"
                torch.save(_cases(world_size), path)
                _RANK_RESULTS[world_size] = run_ranks(llama_workers.worker, world_size, str(path), timeout_s=280)
        except Exception as error:  # noqa: BLE001 - kept and re-raised by every test that asks
            _RANK_RESULTS[world_size] = error
    if isinstance(_RANK_RESULTS[world_size], Exception):
        raise _RANK_RESULTS[world_size]
    return _RANK_RESULTS[world_size]


def _in_process(cases):
    """run_all at t = 1 on a one-rank gloo group in this process, on one thread like a spawned rank."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return llama_workers.run_all(dist.group.WORLD, 1, cases)
    finally:
        torch.set_num_threads(threads)
        dist.destroy_process_group()


WORLDS = pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda t: f"t{t}")


# ------------------------------------------------------------------------------- the layer on t ranks
@pytest.mark.timeout(300)
@WORLDS
def test_llama_layer_parity_with_single_device(world_size, tmp_path_factory):
    for rank_results in ranks(world_size, tmp_path_factory):
        parity = rank_results["parity"]
        assert len(parity) == 3 * 2 * 3
        for (block, sp, recompute), r in parity.items():
            case = f"t={world_size} {block} sp={sp} recompute={recompute}"
            assert r["y"] <= 1e-5, f"{case}: relative output error {r['y']:.2e}"
            assert r["x_grad"] <= 1e-5, f"{case}: relative input-gradient error {r['x_grad']:.2e}"
            worst = max(r["params"], key=r["params"].get)
            assert r["params"][worst] <= 1e-5, f"{case}: {worst}'s SGD update differs by {r['params'][worst]:.2e} (relative)"
            if recompute != "none":
                assert r["bitwise_vs_none"], f"{case}: not bitwise equal to recompute='none'"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda t: f"t{t}")
def test_query_groups_not_divisible_by_t_raise_on_every_rank(world_size, tmp_path_factory):
    for rank_results in ranks(world_size, tmp_path_factory):
        assert rank_results["groups_error"] == (f"num_query_groups 1 is not divisible by the tensor-parallel size "
                                                f"{world_size}")


@pytest.mark.timeout(300)
@WORLDS
def test_llama_layer_memory_per_rank_matches_the_formula(world_size, tmp_path_factory):
    for rank, rank_results in enumerate(ranks(world_size, tmp_path_factory)):
        memory = rank_results["memory"]
        assert len(memory) >= 10, sorted(memory)
        for (block, sp, recompute), (measured, formula, by_label, terms, report) in memory.items():
            case = f"rank {rank} t={world_size} {block} sp={sp} recompute={recompute}"
            assert 0.95 * formula <= measured <= 1.05 * formula, f"{case}: {measured} vs {formula:.0f}\n{report}"
            assert by_label == terms, f"{case}: label by label\n{report}\n{terms}"


# ------------------------------------------------------------------------------- HF Llama
def _check_logits(per_rank, world_size):
    for key in per_rank[0]:
        case = f"t={world_size} {key}"
        bounds = sorted(r[key][:2] for r in per_rank)
        covered = [i for start, end in bounds for i in range(start, end)]
        assert covered == list(range(VOCAB)), f"{case}: the ranks' shards {bounds} do not tile [0, {VOCAB})"
        worst = max(r[key][2] for r in per_rank)
        assert worst <= 2e-5, f"{case}: logits differ from HF's by {worst:.2e}"


@pytest.mark.timeout(300)
@WORLDS
def test_from_llama_logits_match_hf(world_size, tmp_path_factory):
    _transformers()
    per_rank = [r["logits"] for r in ranks(world_size, tmp_path_factory)]
    assert len(per_rank[0]) == 5 * 2 * 3
    _check_logits(per_rank, world_size)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [1, 2, 4], ids=lambda t: f"t{t}")
def test_round_trip_is_bitwise_under_tp(world_size, tmp_path_factory):
    _transformers()
    for rank, rank_result in enumerate(ranks(world_size, tmp_path_factory)):
        assert set(rank_result["round_trips"]) == {"torch.float32", "torch.bfloat16", "qwen2", "qwen3"} and \
            all(rank_result["round_trips"].values()), \
            f"rank {rank}: {rank_result['round_trips']}"


@pytest.mark.timeout(300)
def test_training_t2_sp_selective_matches_hf(tmp_path_factory):
    _transformers()
    _, hf_losses = _train_case()
    assert hf_losses[-1] < hf_losses[0] - 0.05, f"the loss should fall over the SGD steps: {hf_losses}"
    for rank, rank_result in enumerate(ranks(2, tmp_path_factory)):
        losses, errors = rank_result["train"]
        for step, (reference, ours) in enumerate(zip(hf_losses, losses)):
            assert abs(reference - ours) <= 1e-4, f"rank {rank} step {step}: HF loss {reference:.6f} vs {ours:.6f}"
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, f"rank {rank}: {worst} differs from HF's after training by {errors[worst]:.2e}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_from_model_objects_tied_and_untied_and_back(tied):
    """The model-object source without a group; tied heads; a LlamaModel; HF loads the hand-back."""
    transformers = _transformers()
    llama = _random_llama(2, seed=3, tie_word_embeddings=tied, vocab_size=300).eval()
    model = hf.from_llama(llama)
    assert not model.training and model.config.kv_heads == 2 and model.config.rope_theta == 10000.0
    assert (model.output_layer is None) == tied
    tokens = _tokens(300)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), llama(tokens).logits.transpose(0, 1), atol=2e-5, rtol=0)
    expected = llama.state_dict()
    got = hf.to_llama_state_dict(model)
    assert list(got) == list(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    wrapped = hf.to_llama_state_dict(torch.compile(model))    # through the wrapper (it was a ValueError)
    assert all(torch.equal(wrapped[k], v) for k, v in expected.items())
    if tied:
        assert got["lm_head.weight"] is got["model.embed_tokens.weight"]
        bare = llama.model                                    # a LlamaModel: no head, tied
        assert all(torch.equal(a, b) for a, b in zip(hf.from_llama(bare).full_state_dict().values(),
                                                    model.full_state_dict().values()))
    fresh = transformers.LlamaForCausalLM(llama.config)
    fresh.load_state_dict(got, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(tokens).logits, llama(tokens).logits, atol=0, rtol=0)


@pytest.mark.parametrize("family, kw", [("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6)),
                                        ("qwen2", dict(use_sliding_window=True, sliding_window=8,
                                                       max_window_layers=LAYERS)),     # no layer slides
                                        ("qwen2", YARN_ROPE),
                                        ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
                                        ("mistral", dict(sliding_window=None)),
                                        ("mistral", dict(sliding_window=POSITIONS)),   # masks nothing
                                        ("qwen3", dict(head_dim=24, tie_word_embeddings=True, rope_theta=1e6)),
                                        ("qwen3", dict(head_dim=HIDDEN // HEADS)),
                                        ("llama", dict(head_dim=24)),
                                        ("mistral", dict(sliding_window=None, head_dim=8)),
                                        ("phi3", dict(rope_theta=250000.0)),     # Phi-4's theta
                                        ("phi3", dict(head_dim=8, tie_word_embeddings=True))],
                         ids=["qwen2", "qwen2-window-unused", "qwen2-yarn", "llama-linear", "mistral",
                              "mistral-window-past-positions", "qwen3-head-dim-tied", "qwen3", "llama-head-dim",
                              "mistral-nemo-head-dim", "phi3", "phi3-head-dim-tied"])
def test_mistral_and_qwen2_are_the_llama_block(family, kw):
    """Qwen2 (q / k / v biases: add_qkv_bias), Qwen3 (per-head q / k norms: qk_layernorm), Mistral, Phi-3
    (fused qkv_proj and gate_up_proj: Phi-3, Phi-4), and heads of another width than hidden_size /
    num_attention_heads (HF's head_dim: kv_channels; Qwen3-4B's, Mistral Nemo's) convert as the Llama block:
    logits and every gradient (the q / k / v biases' and q / k norms' included) match HF's, HF's model loads
    the hand-back (to_llama_state_dict with the family's model_type), bitwise."""
    transformers = _transformers()
    source = _random_llama(2, seed=6, family=family, **kw).train()
    model = hf.from_llama(source)
    assert model.config.add_qkv_bias == (family == "qwen2") and not model.config.add_bias_linear
    assert model.config.qk_layernorm == (family == "qwen3")
    head_dim = kw.get("head_dim", HIDDEN // HEADS)
    assert model.config.head_dim == head_dim and (model.config.kv_channels is None) == (head_dim * HEADS == HIDDEN)
    assert (model.output_layer is None) == bool(kw.get("tie_word_embeddings"))
    tokens = _tokens()
    labels = hf.shift_labels(tokens)
    loss = model(tokens, labels).sum() / (labels != -100).sum()
    loss.backward()
    reference = source(tokens, labels=tokens).loss
    reference.backward()
    torch.testing.assert_close(loss, reference, atol=2e-6, rtol=0)
    grads = hf.to_llama_state_dict(_grads_as_model(model), model_type=family)
    their_grads = {k: p.grad for k, p in source.named_parameters()}
    assert set(their_grads) <= set(grads)
    for key, their_grad in their_grads.items():
        torch.testing.assert_close(grads[key], their_grad, atol=2e-5 * their_grad.abs().max().item(), rtol=0,
                                   msg=lambda m, key=key: f"{key}: {m}")
    if family == "qwen2":
        assert their_grads["model.layers.0.self_attn.k_proj.bias"].abs().max() > 0   # the biases are trained
    if family == "qwen3":
        assert their_grads["model.layers.0.self_attn.k_norm.weight"].abs().max() > 0   # so are the norms
    got = hf.to_llama_state_dict(model, model_type=family)
    expected = source.state_dict()
    assert list(got) == list(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    fresh = getattr(transformers, FAMILIES[family][1])(source.config)
    fresh.load_state_dict(got, strict=True)


def _grads_as_model(model):
    """A copy of ``model`` whose parameters hold its gradients (to read them out with HF's names)."""
    import copy
    copied = copy.deepcopy(model)
    with torch.no_grad():
        for p, q in zip(model.parameters(), copied.parameters()):
            q.copy_(p.grad)
    return copied


@pytest.mark.parametrize("family, kw, match", [
    ("mistral", dict(sliding_window=16), r"Mistral config sliding_window=16 \(layers \[0, 1\]\) is not supported by "
                                         r"seqpar: its attention is full causal, and a window below the context 64 "
                                         r"\(max_position_embeddings, or max_seq_len\) masks keys \(build the model "
                                         r"with sliding_window=None .* or pass from_llama\(max_seq_len=16\) or less"),
    # Mistral has no use_sliding_window switch: HF slides whatever it says (the refusal's advice offered it)
    ("mistral", dict(sliding_window=16, use_sliding_window=False), r"Mistral config sliding_window=16"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     r"Qwen2 config sliding_window=16 \(layers \[1\]\) is not supported .*use_sliding_window=False, or "
     r"max_window_layers >= num_hidden_layers"),
    ("qwen2", dict(layer_types=["full_attention", "chunked_attention"]), r"Qwen2 config layer_types \['chunked_attention'\]"),
    ("qwen2", dict(hidden_act="gelu"), r"Qwen2 config hidden_act='gelu' is not supported"),
    # Phi-3-mini-4k's 2047 window in a 4096 context: every layer slides
    ("phi3", dict(sliding_window=16), r"Phi-3 config sliding_window=16 \(layers \[0, 1\]\) is not supported .*"
                                      r"build the model with sliding_window=None"),
], ids=["mistral-window", "mistral-no-switch", "qwen2-window", "qwen2-layer-types", "qwen2-act", "phi3-window"])
def test_mistral_and_qwen2_variants_seqpar_does_not_compute_raise(family, kw, match):
    """A sliding window narrower than the context masks keys seqpar's full causal attention sees: HF's
    logits differ from full attention's at s = 36 > 16 (checked here), so the conversion is refused."""
    config = _llama_config(2, family=family, **kw)
    state_dict = _random_llama(2, family=family).state_dict()
    with pytest.raises(ValueError, match=match):
        hf.from_llama(state_dict, config=config)
    if "sliding_window" in kw:
        windowed = _random_llama(2, seed=1, family=family, **kw).eval()
        full = _random_llama(2, seed=1, family=family).eval()
        with torch.no_grad():
            assert (windowed(_tokens()).logits - full(_tokens()).logits).abs().max() > 1e-3


def test_sliding_windows_are_read_as_hf_runs_them():
    """HF's Qwen2 (transformers >= 4.53) fixes which layers slide when the config is built (layer_types) and
    each attention module keeps its window: a use_sliding_window edit afterwards changes nothing in HF's
    forward, and from_llama took it (logits 0.24 apart). A config without layer_types (older transformers)
    slides the layers from max_window_layers on: all-full ones were refused."""
    sliding = dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    qwen2 = _random_llama(2, family="qwen2", **sliding)
    qwen2.config.use_sliding_window = False
    with pytest.raises(ValueError, match=r"Qwen2 config sliding_window=16 \(layers \[0, 1\]\)"):
        hf.from_llama(qwen2)
    qwen2.config.layer_types = ["full_attention"] * LAYERS       # the modules still slide
    with pytest.raises(ValueError, match=r"the model's model.layers.0.self_attn.sliding_window is 16, below the "
                                         r"context 64 .* or pass from_llama\(max_seq_len=16\) or less"):
        hf.from_llama(qwen2)
    assert hf.from_llama(qwen2, max_seq_len=16).max_seq_len == 16
    old = {k: v for k, v in _llama_config(2, family="qwen2").to_dict().items() if k != "layer_types"}
    state_dict = _random_llama(2, family="qwen2").state_dict()
    for max_window_layers, refused in ((LAYERS, False), (1, True)):
        config = types.SimpleNamespace(**{**old, "use_sliding_window": True, "sliding_window": 16,
                                          "max_window_layers": max_window_layers})
        if refused:
            with pytest.raises(ValueError, match=r"sliding_window=16 \(layers \[1\]\)"):
                hf.from_llama(state_dict, config=config)
        else:
            hf.from_llama(state_dict, config=config)


@pytest.mark.parametrize("family, kw", [("mistral", dict(sliding_window=16)), ("phi3", dict(sliding_window=16)),
                                        ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0))],
                         ids=["mistral-v0.1", "phi3-mini-4k", "qwen2"])
def test_a_sliding_window_converts_for_sequences_it_does_not_reach(family, kw):
    """Mistral 7B v0.1 (window 4096 of 32768) and Phi-3-mini-4k (2047 of 4096) were refused outright; with
    max_seq_len at most the window, HF's window masks nothing in the sequences the model runs (logits equal at
    s = 16), and a longer sequence is the model's ValueError, where HF would mask."""
    source = _random_llama(2, seed=3, family=family, **kw).eval()
    model = hf.from_llama(source, max_seq_len=16)
    assert model.max_seq_len == 16
    tokens = _tokens()[:, :16]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), source(tokens).logits.transpose(0, 1), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="sequence length 36 exceeds max_seq_len 16"):
        model(_tokens())
    with pytest.raises(ValueError, match=r"sliding_window=16 .* from_llama\(max_seq_len=16\) or less"):
        hf.from_llama(source, max_seq_len=17)


def test_max_seq_len_of_a_converted_llama():
    """max_seq_len sets the context the model runs, longer or shorter than max_position_embeddings (with RoPE
    nothing is sized by it), and is checked by name."""
    llama = _random_llama(2).eval()
    assert hf.from_llama(llama).max_seq_len == POSITIONS
    assert hf.from_llama(llama, max_seq_len=np.int64(2 * POSITIONS)).max_seq_len == 2 * POSITIONS
    for bad in (0, 16.0, True, "64"):
        with pytest.raises(ValueError, match=f"max_seq_len must be None or a positive int, got {bad!r}"):
            hf.from_llama(llama, max_seq_len=bad)


def test_qwen2_state_dicts_need_their_biases():
    qwen2 = _random_llama(2, family="qwen2")
    state_dict = dict(qwen2.state_dict())
    state_dict.pop("model.layers.1.self_attn.v_proj.bias")
    with pytest.raises(ValueError, match=r"Qwen2 state dict .*missing \['layers.1.self_attn.v_proj.bias'\]"):
        hf.from_llama(state_dict, config=qwen2.config)
    llama = _random_llama(2)
    with pytest.raises(ValueError, match=r"Llama state dict .*unexpected \['layers.0.self_attn.q_proj.bias'"):
        hf.from_llama({**llama.state_dict(), "model.layers.0.self_attn.q_proj.bias": torch.zeros(HIDDEN)},
                      config=llama.config)


@pytest.mark.parametrize("pad_token_id", [2, -1], ids=["pad2", "pad-last"])
def test_pad_token_row_gets_no_lookup_gradient_as_in_hf(pad_token_id):
    """HF builds embed_tokens with padding_idx = pad_token_id (negative: from the end): that row's lookups
    add nothing to its gradient. With the pad token inside the sequence (pad = eos, packed data) the
    gradients match HF's, that row's included."""
    _transformers()
    llama = _random_llama(1, seed=5, vocab_size=300, pad_token_id=pad_token_id, tie_word_embeddings=False)
    model = hf.from_llama(llama)
    pad = pad_token_id % 300
    assert model.embedding.word_embeddings.padding_idx == pad
    tokens = _tokens(300)
    tokens[:, 3] = pad
    labels = hf.shift_labels(tokens)
    (model(tokens, labels).sum() / (labels != -100).sum()).backward()
    llama(tokens, labels=tokens).loss.backward()
    ours, theirs = model.embedding.word_embeddings.weight.grad[:300], llama.model.embed_tokens.weight.grad
    assert torch.equal(theirs[pad], torch.zeros_like(theirs[pad])) and torch.equal(ours[pad], theirs[pad])
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)

@pytest.mark.parametrize("built_with, set_after", [(None, 2), (2, None), (0, 300)],
                         ids=["set-after", "cleared-after", "set-past-the-vocabulary-after"])
def test_pad_token_is_the_embedding_modules_not_the_configs(built_with, set_after):
    """HF reads pad_token_id when it builds embed_tokens; `model.config.pad_token_id = tokenizer.eos_token_id`
    afterwards changes nothing in HF's training. from_llama read the config: it froze a row HF trains (or
    trained one HF freezes). A state-dict source has only its config, which it follows."""
    _transformers()
    llama = _random_llama(1, seed=5, vocab_size=300, pad_token_id=built_with, tie_word_embeddings=False)
    llama.config.pad_token_id = set_after
    model = hf.from_llama(llama)
    assert model.embedding.word_embeddings.padding_idx == llama.model.embed_tokens.padding_idx == built_with
    tokens = _tokens(300)
    tokens[:, 3] = 2
    labels = hf.shift_labels(tokens)
    (model(tokens, labels).sum() / (labels != -100).sum()).backward()
    llama(tokens, labels=tokens).loss.backward()
    ours, theirs = model.embedding.word_embeddings.weight.grad[:300], llama.model.embed_tokens.weight.grad
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    if set_after == 300:     # a state dict has only its config, whose id is past the vocabulary
        with pytest.raises(ValueError, match="Llama config pad_token_id=300 is not a token id of its vocab_size 300"):
            hf.from_llama(llama.state_dict(), config=llama.config)
    else:
        assert hf.from_llama(llama.state_dict(), config=llama.config).embedding.word_embeddings.padding_idx == \
            set_after


def test_eps_and_rope_are_the_modules_not_a_config_changed_since():
    """HF reads rms_norm_eps and the RoPE settings when it builds the norms and the rotary module: a config
    edited afterwards changes nothing in HF's forward, but from_llama read the config (logits 0.54 apart
    with theta 5e5 / eps 0.1 set after a 1e4 / 1e-6 build), and a Llama-3.1 model whose rope type was
    rewritten to "default" to pass the refusal converted with unscaled frequencies. Now the eps is the
    modules' and frequencies that are not the config's default RoPE are a ValueError; eps 0 (HF takes it,
    seqpar's fp32 statistics don't) is refused by its Llama name."""
    llama = _random_llama(2).eval()
    llama.config.rms_norm_eps = 0.1
    with torch.no_grad():
        torch.testing.assert_close(hf.from_llama(llama)(_tokens()), llama(_tokens()).logits.transpose(0, 1),
                                   atol=2e-5, rtol=0)
    rope = getattr(llama.config, "rope_parameters", None)
    if rope is not None:   # transformers >= 5
        llama.config.rope_parameters = {**rope, "rope_theta": 5e5}
    else:
        llama.config.rope_theta = 5e5
    with pytest.raises(ValueError, match=r"rotary_emb.inv_freq \(rope_type 'default'\) is not the 'default' RoPE of "
                                         r"its config's rope_theta 500000.0"):
        hf.from_llama(llama)
    scaled = _random_llama(2, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8})
    if getattr(scaled.config, "rope_parameters", None) is not None:
        scaled.config.rope_parameters = {"rope_type": "default", "rope_theta": scaled.config.rope_parameters["rope_theta"]}
    else:
        scaled.config.rope_scaling = None
    with pytest.raises(ValueError, match=r"inv_freq \(rope_type 'llama3'\) is not the 'default' RoPE"):
        hf.from_llama(scaled)
    scaled = _random_llama(2, **LLAMA31_ROPE)     # its factor edited after the build: HF still runs factor 8
    if getattr(scaled.config, "rope_parameters", None) is not None:
        scaled.config.rope_parameters = {**scaled.config.rope_parameters, "factor": 16.0}
    else:
        scaled.config.rope_scaling = {**scaled.config.rope_scaling, "factor": 16.0}
    with pytest.raises(ValueError, match=r"inv_freq \(rope_type 'llama3'\) is not the 'llama3' RoPE of its config's "
                                         r"rope_theta 500000.0 and RopeScaling\(factor=16.0"):
        hf.from_llama(scaled)
    scaled = _random_llama(2, **LLAMA31_ROPE)     # an edit that moves the blended frequencies by under 1%
    if getattr(scaled.config, "rope_parameters", None) is not None:
        scaled.config.rope_parameters = {**scaled.config.rope_parameters, "high_freq_factor": 4.02}
    else:
        scaled.config.rope_scaling = {**scaled.config.rope_scaling, "high_freq_factor": 4.02}
    with pytest.raises(ValueError, match=r"and RopeScaling\(.*high_freq_factor=4.02"):
        hf.from_llama(scaled)
    with pytest.raises(ValueError, match=r"Llama config rms_norm_eps must be a finite float >= .*, got 0.0"):
        hf.from_llama(_random_llama(2).state_dict(), config=_llama_config(2, rms_norm_eps=0.0))


def test_settings_follow_the_config_and_arguments():
    llama = _random_llama(2, rope_theta=123456.0, rms_norm_eps=1e-5, attention_dropout=0.1).train()
    model = hf.from_llama(llama, recompute="full", backend="torch", params_dtype=torch.bfloat16,
                          sequence_parallel=True)
    cfg = model.config
    assert (cfg.rope_theta, cfg.layernorm_epsilon, cfg.attention_dropout, cfg.hidden_dropout) == (123456.0, 1e-5, 0.1, 0.0)
    assert (cfg.normalization, cfg.activation, cfg.position_embedding, cfg.add_bias_linear) == \
        ("rmsnorm", "swiglu", "rope", False)
    assert (cfg.recompute, cfg.backend, cfg.sequence_parallel, cfg.num_query_groups) == ("full", "torch", True, 2)
    assert (model.max_seq_len, model.vocab_size, model.embedding_dropout, model.training) == (POSITIONS, VOCAB, 0.0, True)
    assert model.embedding.word_embeddings.weight.dtype == torch.bfloat16
    with torch.no_grad():   # rope_theta and eps reach the math
        torch.testing.assert_close(hf.from_llama(llama.eval())(_tokens()), llama(_tokens()).logits.transpose(0, 1),
                                   atol=2e-5, rtol=0)


def test_one_recompute_policy_per_layer():
    """recompute as GPTModel takes it, one policy per layer (a list was "unknown recompute"); the model
    computes what HF's does, and a list of the wrong length is GPTModel's ValueError."""
    llama = _random_llama(2).eval()
    layers = llama.config.num_hidden_layers
    policies = ["selective", "full", "none"][:layers]
    model = hf.from_llama(llama, recompute=policies)
    assert [layer.config.recompute for layer in model.layers] == policies
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), llama(_tokens()).logits.transpose(0, 1), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="recompute"):
        hf.from_llama(llama, recompute=policies + ["full"])


@pytest.mark.parametrize("kwargs, match", [
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type 'dynamic'"),
    (dict(rope_scaling={"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 32,
                        "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
     "rope type 'longrope' .* it implements the RoPE types \\('default', 'linear', 'llama3', 'yarn'\\)"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 32}),
     r"rope type 'yarn': YarnScaling.factor must be a finite float >= 1"),
    (dict(partial_rotary_factor=0.5), r"partial_rotary_factor=0.5 is not supported by seqpar"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 32}),
     r"rope type 'llama3': RopeScaling.low_freq_factor \(4.0\) must be below high_freq_factor \(1.0\)"),
    (dict(attention_bias=True), "attention_bias=True"), (dict(mlp_bias=True), "mlp_bias=True"),
    (dict(head_dim=0), "head_dim=0 must be a positive int"), (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    # heads of 32 channels (a supported head_dim), for a state dict of 16-channel heads: the shapes differ
    (dict(head_dim=32), r"layers.0.self_attn.q_proj.weight must have shape \(256, 128\) for this config, got \(128, 128\)"),
], ids=["rope-dynamic", "rope-longrope", "rope-yarn-factor", "rope-partial", "rope-llama3-crossed-bands", "attention-bias",
        "mlp-bias", "head-dim-zero", "hidden-act", "head-dim-of-other-weights"])
def test_unsupported_llama_variants_raise(kwargs, match):
    state_dict = _random_llama(2).state_dict()
    with pytest.raises(ValueError, match=match):
        hf.from_llama(state_dict, config=_llama_config(2, **kwargs))


def test_qwen3_variants_seqpar_does_not_compute_raise():
    """Qwen3 with attention_bias (biases on q, k, v and o: the projection's has no seqpar field), and a
    hand-back of a block no HF family has (q / k / v biases and q / k norms)."""
    qwen3 = _random_llama(2, family="qwen3", head_dim=16)
    with pytest.raises(ValueError, match=r"Qwen3 config attention_bias=True is not supported by seqpar"):
        hf.from_llama(qwen3.state_dict(), config=_llama_config(2, family="qwen3", head_dim=16, attention_bias=True))
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, add_qkv_bias=True, qk_layernorm=True,
                                   **LLAMA_BLOCK)
    for export in (hf.to_llama_state_dict, hf.to_llama_config):
        with pytest.raises(ValueError, match="both add_qkv_bias and qk_layernorm: no HF Llama-family model has both"):
            export(seqpar.GPTModel(cfg, 1, 50, 8))


def test_phi3_residual_dropout_and_export_by_model_type():
    """Phi-3's resid_pdrop is seqpar's hidden dropout (HF drops the attention and MLP outputs before the
    residual adds, as seqpar does; the masks are seqpar's own, so only eval logits compare) and comes back
    as resid_pdrop; an export names its family by model_type, checked against the block."""
    transformers = _transformers()
    phi3 = _random_llama(2, family="phi3", resid_pdrop=0.1).eval()
    model = hf.from_llama(phi3)
    assert (model.config.hidden_dropout, model.config.attention_dropout) == (0.1, 0.0)
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), phi3(_tokens()).logits.transpose(0, 1), atol=2e-5, rtol=0)
    config = hf.to_llama_config(model, model_type="phi3")
    assert (config["model_type"], config["resid_pdrop"], config["sliding_window"]) == ("phi3", 0.1, None)
    exported = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    exported.load_state_dict(hf.to_llama_state_dict(model, model_type="phi3"), strict=True)
    assert type(exported).__name__ == "Phi3ForCausalLM" and hf.from_llama(exported).config == model.config
    mistral = hf.to_llama_config(model, model_type="mistral")      # MistralConfig's default window: none here
    assert mistral["sliding_window"] is None and "resid_pdrop" not in mistral
    assert list(hf.to_llama_state_dict(model)) == list(hf.to_llama_state_dict(model, model_type="llama"))
    qwen3 = hf.from_llama(_random_llama(2, family="qwen3", head_dim=16))
    with pytest.raises(ValueError, match=r"model has qk_layernorm=True, but a Llama has no per-head q / k norms "
                                         r"\(model_type='llama'\)"):
        hf.to_llama_state_dict(qwen3, model_type="llama")
    with pytest.raises(ValueError, match=r"model has add_qkv_bias=False, but a Qwen2 has q / k / v biases"):
        hf.to_llama_config(model, model_type="qwen2")
    with pytest.raises(ValueError, match=r"model_type must be None or one of \('llama', .*\), got 'gpt2'"):
        hf.to_llama_config(model, model_type="gpt2")
    # Phi3Config holds only the default RoPE and longrope (it reads "su" and "yarn" as longrope): a scaled
    # model's export failed inside HF, and a config.json read as a namespace converted "yarn" as YaRN
    scaled = hf.from_llama(_random_llama(2, rope_scaling={"rope_type": "linear", "factor": 4.0}))
    for export in (hf.to_llama_config, hf.to_llama_state_dict):
        with pytest.raises(ValueError, match=r"model has rope_scaling=LinearScaling\(factor=4.0\), but a Phi-3 config "
                                             r"holds the RoPE types \('default',\)"):
            export(scaled, model_type="phi3")
    config = types.SimpleNamespace(**{**phi3.config.to_dict(), "rope_parameters": None, "rope_scaling": {
        "type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}})
    with pytest.raises(ValueError, match=r"Phi-3 config rope type 'yarn' .* RoPE types \('default',\) for a Phi-3"):
        hf.from_llama(phi3.state_dict(), config=config)


def test_a_float_original_context_is_taken_as_hf_takes_it():
    """HF warns about original_max_position_embeddings=64.0 (a config.json written by hand) and computes with
    it; from_llama refused it. Now the integral float is that int: the frequencies and logits are HF's."""
    rope = {**LLAMA31_ROPE, "rope_scaling": {**LLAMA31_ROPE["rope_scaling"], "original_max_position_embeddings": 64.0}}
    llama = _random_llama(2, **rope).eval()
    model = hf.from_llama(llama)
    assert model.config.rope_scaling.original_max_position_embeddings == 64
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), llama(_tokens()).logits.transpose(0, 1), atol=2e-5, rtol=0)
    half = {**rope["rope_scaling"], "original_max_position_embeddings": 64.5}
    with pytest.raises(ValueError, match="original_max_position_embeddings must be a positive int, got 64.5"):
        hf.from_llama(llama.state_dict(), config=_llama_config(2, **{**rope, "rope_scaling": half}))


def test_yarn_frequencies_and_attention_factor_are_the_modules():
    """A YaRN model whose factor or attention factor was edited after the build: HF runs the modules'
    frequencies and attention scaling (fixed at the build), which seqpar would not: refused. transformers 5's
    defaults (the original context from max_position_embeddings, DeepSeek's mscale ratio) convert to HF's
    numbers."""
    def edited(**change):
        qwen2 = _random_llama(2, family="qwen2", **YARN_ROPE)
        qwen2.config.rope_parameters = {**qwen2.config.rope_parameters, **change}
        return qwen2
    with pytest.raises(ValueError, match=r"inv_freq \(rope_type 'yarn'\) is not the 'yarn' RoPE .*factor=8.0"):
        hf.from_llama(edited(factor=8.0))
    with pytest.raises(ValueError, match=r"model.rotary_emb.attention_scaling 1.138.* is not the 1.5 of its config's "
                                         r"YarnScaling\(.*attention_factor=1.5"):    # its frequencies are right
        hf.from_llama(edited(attention_factor=1.5))
    # Qwen2.5's recipe: max_position_embeddings stays the original context, YaRN runs factor x it in HF;
    # GPTModel's max_seq_len refused those sequences
    qwen25 = _random_llama(2, family="qwen2", rope_scaling={**YARN_ROPE["rope_scaling"]}, rope_theta=1e6,
                           max_position_embeddings=16).eval()
    model = hf.from_llama(qwen25)
    assert model.max_seq_len == 64 and _tokens().shape[1] > 16
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens()), qwen25(_tokens()).logits.transpose(0, 1), atol=2e-5, rtol=0)
    # transformers 5 reads a None factor as max_position_embeddings / the original context, a None truncate
    # as False: converted as HF runs them (they were refused)
    for change in (dict(factor=None), dict(truncate=None)):
        qwen2 = _random_llama(2, family="qwen2", rope_scaling={**YARN_ROPE["rope_scaling"], **change},
                              rope_theta=YARN_ROPE["rope_theta"]).eval()
        with torch.no_grad():
            torch.testing.assert_close(hf.from_llama(qwen2)(_tokens()), qwen2(_tokens()).logits.transpose(0, 1),
                                       atol=2e-5, rtol=0)
    for params, length in ((dict(factor=4.0), POSITIONS),
                           (dict(factor=4.0, original_max_position_embeddings=16, mscale=0.8, mscale_all_dim=1.0), 16)):
        qwen2 = _random_llama(2, family="qwen2", rope_scaling={"rope_type": "yarn", **params}).eval()
        model = hf.from_llama(qwen2)
        assert model.config.rope_scaling.original_max_position_embeddings == length
        with torch.no_grad():
            torch.testing.assert_close(model(_tokens()), qwen2(_tokens()).logits.transpose(0, 1), atol=2e-5, rtol=0)


@pytest.mark.parametrize("knobs, model_kw, hf_class", [
    (dict(rope_theta=5e5, rope_scaling=seqpar.ops.RopeScaling(8.0, 1.0, 4.0, 16)),
     dict(share_embeddings_and_output_weights=False, padding_idx=3), "LlamaForCausalLM"),
    (dict(add_qkv_bias=True, rope_theta=1e6, rope_scaling=seqpar.ops.YarnScaling(4.0, 16), attention_dropout=0.1),
     {}, "Qwen2ForCausalLM"),
    (dict(rope_scaling=seqpar.ops.YarnScaling(2.0, 16, beta_fast=16.0, attention_factor=1.3, truncate=False)),
     dict(share_embeddings_and_output_weights=False), "LlamaForCausalLM"),
    (dict(num_query_groups=None, params_dtype=torch.bfloat16), {}, "LlamaForCausalLM"),
    (dict(rope_theta=1e5, rope_scaling=seqpar.ops.LinearScaling(4.0)), {}, "LlamaForCausalLM"),
    (dict(qk_layernorm=True, kv_channels=24, rope_theta=1e6), {}, "Qwen3ForCausalLM"),
    (dict(kv_channels=8), dict(share_embeddings_and_output_weights=False), "LlamaForCausalLM"),
    # HF's Qwen2 reads a head_dim its config holds (Qwen2Config has no such field): exported, not refused
    (dict(add_qkv_bias=True, kv_channels=32), {}, "Qwen2ForCausalLM"),
], ids=["llama3.1-untied-pad", "qwen2-yarn-tied", "llama-yarn-fields", "llama-mha-bf16", "llama-linear", "qwen3-head-dim",
        "llama-head-dim", "qwen2-head-dim"])
def test_a_model_trained_from_scratch_exports_to_hf(knobs, model_kw, hf_class):
    """to_llama_config + to_llama_state_dict make an HF model (a Qwen2 with the QKV biases) of a GPTModel
    seqpar built: HF's logits are seqpar's, and from_llama of it gives back the same config (the dtype, and
    num_query_groups None for multi-head attention, too: they came back fp32 and 4). No bos / eos ids: HF's
    defaults (1, 2) ended a generation at token 2."""
    transformers = _transformers()
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, backend="torch",
                                   **{**LLAMA_BLOCK, "num_query_groups": 2, **knobs})
    model = seqpar.GPTModel(cfg, 2, 300, 64, **model_kw).eval()
    with torch.no_grad():   # norms and biases off their init values, so their mapping counts
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    config = transformers.AutoConfig.for_model(**hf.to_llama_config(model))
    source = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert type(source).__name__ == hf_class and next(source.parameters()).dtype == cfg.params_dtype
    assert config.eos_token_id is None and source.generation_config.eos_token_id is None
    source.load_state_dict(hf.to_llama_state_dict(model), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(source(_tokens(300)).logits.transpose(0, 1), model(_tokens(300)),
                                   atol=2e-5 if cfg.params_dtype == torch.float32 else 0.05, rtol=0)
    back = hf.from_llama(source, backend="torch")
    assert back.config == model.config and (back.max_seq_len, back.vocab_size) == (64, 300)
    assert back.embedding.word_embeddings.padding_idx == model_kw.get("padding_idx")


def test_a_config_json_read_as_a_namespace_has_hf_s_defaults():
    """A config.json read without transformers (a namespace of its keys) leaves keys out that HF's config
    class fills in: Mistral's 4096 window (taken as no window: logits 14 off past position 4096), Qwen2's
    max_window_layers 28 (0: a 2-layer model that slides nothing was refused), Llama's 2048 positions (None:
    an error not naming the key), GPT-2's 0.1 dropouts; and a rope_theta at the top beside rope_parameters
    without one, which transformers 5 folds in (10000 was taken: logits 4e-3 off)."""
    def namespace(model, drop=(), **change):
        keys = {k: v for k, v in model.config.to_dict().items() if k not in drop}
        return types.SimpleNamespace(**{**keys, **change})
    mistral = _random_llama(2, family="mistral", sliding_window=None)
    with pytest.raises(ValueError, match=r"Mistral config sliding_window=4096 \(layers \[0, 1\]\)"):
        hf.from_llama(mistral.state_dict(), config=namespace(mistral, drop=("sliding_window",),
                                                             max_position_embeddings=8192))
    qwen2 = _random_llama(2, family="qwen2")
    config = namespace(qwen2, drop=("layer_types", "max_window_layers"), use_sliding_window=True, sliding_window=16)
    assert hf.from_llama(qwen2.state_dict(), config=config).max_seq_len == POSITIONS   # layers 28+ slide: none
    llama = _random_llama(2, rope_theta=5e5).eval()
    assert hf.from_llama(llama.state_dict(), config=namespace(llama, drop=("max_position_embeddings",))).max_seq_len \
        == 2048
    config = namespace(llama, rope_parameters={"rope_type": "default"}, rope_theta=5e5)
    with torch.no_grad():
        torch.testing.assert_close(hf.from_llama(llama.state_dict(), config=config)(_tokens()),
                                   llama(_tokens()).logits.transpose(0, 1), atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match=r"Llama config pad_token_id=1000 is not a token id of its vocab_size 1000"):
        hf.from_llama(llama.state_dict(), config=namespace(llama, pad_token_id=VOCAB))


def test_a_linear_scaling_without_its_factor_names_it():
    """(HF's own config refuses it; a config read from elsewhere reaches from_llama.)"""
    config = {**_llama_config(2).to_dict(), "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0}}
    with pytest.raises(ValueError, match=r"Llama config rope type 'linear': without \['factor'\]"):
        hf.from_llama(_random_llama(2).state_dict(), config=types.SimpleNamespace(**config))


def test_hidden_act_swish_is_silu():
    """HF maps hidden_act "swish" to the same nn.SiLU as "silu": from_llama takes it, logits match HF."""
    llama = _random_llama(2, hidden_act="swish").eval()
    with torch.no_grad():
        torch.testing.assert_close(hf.from_llama(llama)(_tokens()), llama(_tokens()).logits.transpose(0, 1),
                                   atol=2e-5, rtol=0)


def _drop(key):
    return lambda sd: sd.pop(key)


@pytest.mark.parametrize("change, match, tied", [
    (_drop("model.layers.1.mlp.up_proj.weight"), r"missing \['layers.1.mlp.up_proj.weight'\]", False),
    (lambda sd: sd.update({"model.layers.2.input_layernorm.weight": torch.ones(HIDDEN)}),
     r"unexpected \['layers.2.input_layernorm.weight'\]", False),
    (lambda sd: sd.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(HIDDEN, HIDDEN)}),
     r"layers.0.self_attn.k_proj.weight must have shape \(32, 128\) for this config, got \(128, 128\)", False),
    (_drop("lm_head.weight"), "no lm_head.weight but the config has tie_word_embeddings=False", False),
    (lambda sd: sd.update({"lm_head.weight": torch.zeros(VOCAB + 1, HIDDEN)}), r"lm_head.weight must have shape", False),
    (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"].long()}),
     "Llama state dict lm_head.weight must be a floating-point tensor with data, got torch.int64", False),
    (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"] + 1}), "differs from model.embed_tokens.weight", True),
    (lambda sd: sd.update({"norm.weight": sd["model.norm.weight"]}), "mixes 'model.'-prefixed keys", False),
], ids=["missing", "unexpected", "kv-shape", "no-head", "head-shape", "head-dtype", "untied-head-in-tied-config",
        "mixed-prefix"])
def test_bad_state_dicts_raise_naming_the_key(change, match, tied):
    state_dict = dict(_random_llama(2, tie_word_embeddings=tied).state_dict())
    change(state_dict)
    with pytest.raises(ValueError, match=match):
        hf.from_llama(state_dict, config=_llama_config(2, tie_word_embeddings=tied))


def test_other_models_configs_and_layouts_raise():
    transformers = _transformers()
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not one of the Llama family seqpar converts "
                                         r"\('llama', 'mistral', 'qwen2', 'qwen3', 'phi3'\)"):
        hf.from_llama({}, config=transformers.GPT2Config())
    with pytest.raises(ValueError, match="needs config="):
        hf.from_llama(_random_llama(2).state_dict())
    with pytest.raises(ValueError, match="config= is only for a state-dict source"):
        hf.from_llama(_random_llama(2), config=_llama_config())
    with pytest.raises(ValueError, match="source must be .* got str"):
        hf.from_llama("meta-llama/Llama-3.2-1B")
    gpt = seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4), 1, 50, 8)
    for export in (hf.to_llama_state_dict, hf.to_llama_config):
        with pytest.raises(ValueError, match="model is not a Llama: its config has .*'normalization': 'layernorm'"):
            export(gpt)
    with pytest.raises(ValueError, match=r"model must be a seqpar.GPTModel \(or one wrapped by DDP / torch.compile\), got LlamaForCausalLM"):
        hf.to_llama_state_dict(_random_llama(2))


def test_old_checkpoints_rope_buffers_are_ignored():
    """transformers releases before 4.31 saved each layer's rotary_emb.inv_freq in state dicts."""
    llama = _random_llama(2)
    state_dict = dict(llama.state_dict())
    for i in range(LAYERS):
        state_dict[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    got = hf.to_llama_state_dict(hf.from_llama(state_dict, config=llama.config))
    assert all(torch.equal(got[k], v) for k, v in llama.state_dict().items())


@pytest.mark.gpu
@pytest.mark.parametrize("family, kw", [("llama", {}), ("qwen2", YARN_ROPE), ("qwen3", dict(head_dim=32))],
                         ids=["llama", "qwen2-yarn", "qwen3-head-dim"])
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_bf16_logits_on_gpu(backend, recompute, family, kw):
    """bf16 on the device: seqpar's logits error vs HF fp32 is at most 2x HF bf16's own error (a Qwen2 with
    YaRN: its q / k / v biases, and its attention factor in the kernels' softmax scale; a Qwen3: its q / k
    RMSNorms on the kernels over rows of 32 channels, the attention 256 wide with h 128)."""
    llama = _random_llama(2, vocab_size=32000, family=family, **kw).eval().cuda()
    tokens = _tokens(32000).cuda()
    with torch.no_grad():
        reference = llama(tokens).logits.transpose(0, 1)
        hf_bf16 = llama.to(torch.bfloat16)(tokens).logits.transpose(0, 1)
        model = hf.from_llama(llama, recompute=recompute, backend=backend)          # bf16 like the source
        logits = model(tokens)
    assert logits.dtype == torch.bfloat16 and logits.shape == reference.shape
    error = (logits.float() - reference).abs().max().item()
    hf_error = (hf_bf16.float() - reference).abs().max().item()
    assert error <= 2 * hf_error + 1e-3, f"seqpar bf16 error {error:.3e} vs HF bf16 error {hf_error:.3e}"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_hand_back_refuses_parameters_hf_has_no_slot_for(family):
    """LoRA factors held as submodules of a seqpar linear are in full_state_dict(); the hand-back picked out
    the keys it knew and dropped them, silently (HF got the unmerged base: another model)."""
    kw = dict(hidden_size=32, num_attention_heads=4, backend="torch")
    if family == "llama":
        kw.update(hf.LLAMA_BLOCK, num_query_groups=2)
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(seqpar.TransformerConfig(**kw), 1, 64, 16)
    hand_back = hf.to_llama_state_dict if family == "llama" else hf.to_gpt2_state_dict
    assert hand_back(model)   # the model as built hands back
    model.layers[0].self_attention.query_key_value.lora_A = torch.nn.Linear(32, 4, bias=False)
    with pytest.raises(ValueError, match=r"has no slot for: \['layers.0.self_attention.query_key_value.lora_A.weight'\]"):
        hand_back(model)
