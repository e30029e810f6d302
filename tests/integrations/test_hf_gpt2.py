"""seqpar.integrations.hf against HuggingFace transformers' GPT-2 (random models built from a
GPT2Config, never downloaded): logits at t = 1, 2, 4 with and without SP under every recompute
policy, training parity, bitwise round trips, bad input, the loss mapping, the padded vocabulary's
shards on several ranks, and the fine-tuning example under torchrun."""
import functools
import importlib
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import seqpar
import seqpar.integrations
from seqpar.integrations import hf

from tests.distributed.launcher import run_ranks
from tests.integrations import hf_workers

transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, POSITIONS = 2, 128, 4, 64
SEQ, BATCH = 36, 2                  # s/t = 9 at t = 4: odd shards
VOCABS = (1000, 50257)
POLICIES = ("none", "selective", "full")
ROOT = Path(__file__).resolve().parents[2]


def _gpt2_config(vocab=1000, **kw):
    base = dict(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=vocab, n_positions=POSITIONS,
                bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return transformers.GPT2Config(**base)


def _random_gpt2(vocab=1000, seed=0, **kw):
    """A GPT-2 whose every weight is random (biases and LayerNorms too, so their mapping is tested);
    the same on every rank that calls it with the same arguments."""
    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(_gpt2_config(vocab, **kw))
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():   # the tied lm_head appears once, as wte
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1 + 0.2 * noise)
            else:
                p.copy_(noise * (0.1 if p.dim() == 1 or "wte" in name or "wpe" in name else 0.05))
    return model


def _tokens(vocab, seed=0):
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


@functools.lru_cache(maxsize=None)
def _logit_cases():
    """{vocab: (GPT-2 state dict, config dict, tokens, HF's eval logits [s, b, v])}."""
    cases = {}
    for vocab in VOCABS:
        gpt2 = _random_gpt2(vocab).eval()
        tokens = _tokens(vocab)
        with torch.no_grad():
            cases[vocab] = (gpt2.state_dict(), gpt2.config.to_dict(), tokens, gpt2(tokens).logits.transpose(0, 1))
    return cases


def _round_trip_cases():
    gpt2 = _random_gpt2(1000, seed=4)
    return {str(dtype): ({k: v.to(dtype) for k, v in gpt2.state_dict().items()}, gpt2.config.to_dict())
            for dtype in (torch.float32, torch.bfloat16)}


TRAIN_STEPS, TRAIN_LR = 3, 0.5


@functools.lru_cache(maxsize=None)
def _train_case():
    """Dropout 0: the HF model's starting state dict, the batch, and HF's own losses and final weights
    after TRAIN_STEPS SGD steps on its labels=input_ids loss (-100 for padding)."""
    gpt2 = _random_gpt2(1000, seed=7, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0).train()
    state_dict = {k: v.clone() for k, v in gpt2.state_dict().items()}
    tokens = _tokens(1000, seed=1)
    hf_labels = tokens.clone()
    hf_labels[0, -5:] = -100                                   # padding, as a data collator marks it
    losses = []
    for _ in range(TRAIN_STEPS):
        loss = gpt2(tokens, labels=hf_labels).loss
        loss.backward()
        hf_workers.sgd(gpt2.parameters(), TRAIN_LR)
        losses.append(loss.item())
    case = dict(state_dict=state_dict, config_dict=gpt2.config.to_dict(), tokens=tokens, hf_labels=hf_labels,
                steps=TRAIN_STEPS, lr=TRAIN_LR, hf_state_dict=gpt2.state_dict())
    return case, losses


_RANK_RESULTS = {}


def ranks(world_size, tmp_path_factory):
    """Every rank's results for this world size: spawned once, failures included (each test that
    reads them reports the same failure instead of spawning again)."""
    if world_size not in _RANK_RESULTS:
        # The references travel as a file: tensors passed to spawned processes directly go through
        # torch's shared-memory hand-off, which needs the parent serving them at the right moment.
        cases = tmp_path_factory.mktemp("hf_cases") / "cases.pt"
        torch.save(dict(logit_cases=_logit_cases(), round_trip_cases=_round_trip_cases(),
                        train_case=_train_case()[0] if world_size == 2 else None), cases)
        try:
            _RANK_RESULTS[world_size] = run_ranks(hf_workers.worker, world_size, str(cases), timeout_s=240)
        except Exception as error:  # noqa: BLE001 - kept and re-raised by every test that asks
            _RANK_RESULTS[world_size] = error
    if isinstance(_RANK_RESULTS[world_size], Exception):
        raise _RANK_RESULTS[world_size]
    return _RANK_RESULTS[world_size]


@pytest.fixture
def one_rank_group():
    """A one-rank gloo group in this process: t = 1 with SP then runs on a real group."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def _check_logits(per_rank, world_size):
    for (vocab, sp, recompute) in per_rank[0]:
        case = f"t={world_size} vocab={vocab} sp={sp} recompute={recompute}"
        bounds = sorted(r[(vocab, sp, recompute)][:2] for r in per_rank)
        covered = [i for start, end in bounds for i in range(start, end)]
        assert covered == list(range(vocab)), f"{case}: the ranks' shards {bounds} do not tile [0, {vocab})"
        worst = max(r[(vocab, sp, recompute)][2] for r in per_rank)
        assert worst <= 2e-5, f"{case}: logits differ from HF's by {worst:.2e}"


@pytest.mark.timeout(120)
def test_logits_match_hf_t1(one_rank_group):
    _check_logits([hf_workers.logits_errors(one_rank_group, _logit_cases())], 1)


@pytest.mark.parametrize("vocab", VOCABS, ids=lambda v: f"v{v}")
def test_logits_match_hf_from_model_without_group(vocab):
    """The model-object source (here and in other tests; the ranks use state dicts), tp_group None."""
    gpt2 = _random_gpt2(vocab).eval()
    model = hf.from_gpt2(gpt2)
    assert not model.training, "from_gpt2 keeps the source's eval mode"
    tokens = _tokens(vocab)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), gpt2(tokens).logits.transpose(0, 1), atol=2e-5, rtol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda t: f"t{t}")
def test_logits_match_hf(world_size, tmp_path_factory):
    _check_logits([r["logits"] for r in ranks(world_size, tmp_path_factory)], world_size)


@pytest.mark.timeout(300)
def test_training_t2_sp_selective_matches_hf(tmp_path_factory):
    _, hf_losses = _train_case()
    assert hf_losses[-1] < hf_losses[0] - 0.05, f"the loss should fall over the SGD steps: {hf_losses}"
    for rank, rank_result in enumerate(ranks(2, tmp_path_factory)):
        losses, errors = rank_result["train"]
        for step, (reference, ours) in enumerate(zip(hf_losses, losses)):
            assert abs(reference - ours) <= 1e-4, f"rank {rank} step {step}: HF loss {reference:.6f} vs {ours:.6f}"
        worst = max(errors, key=errors.get)
        assert errors[worst] <= 1e-5, f"rank {rank}: {worst} differs from HF's after training by {errors[worst]:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vocab", VOCABS, ids=lambda v: f"v{v}")
def test_round_trip_is_bitwise(dtype, vocab):
    gpt2 = _random_gpt2(vocab, seed=3).to(dtype)
    expected = gpt2.state_dict()
    model = hf.from_gpt2(gpt2)
    assert model.config.params_dtype == dtype and model.padded_vocab_size % 128 == 0
    got = hf.to_gpt2_state_dict(model)
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].dtype == dtype and torch.equal(got[key], value), key
    assert got["lm_head.weight"] is got["transformer.wte.weight"]
    # through torch.compile's wrapper, as sharded_state_dict takes it (it was a ValueError)
    wrapped = hf.to_gpt2_state_dict(torch.compile(model))
    assert all(torch.equal(wrapped[key], value) for key, value in expected.items())
    fresh = transformers.GPT2LMHeadModel(_gpt2_config(vocab)).to(dtype)
    fresh.load_state_dict(got, strict=True)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda t: f"t{t}")
def test_round_trip_is_bitwise_under_tp(world_size, tmp_path_factory):
    for rank, rank_result in enumerate(ranks(world_size, tmp_path_factory)):
        assert all(rank_result["round_trips"].values()), f"rank {rank}: {rank_result['round_trips']}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda t: f"t{t}")
def test_a_state_dict_one_rank_rejects_is_a_value_error_on_every_rank(world_size, tmp_path_factory):
    """from_gpt2 checked the state dict on each rank alone: rank 0 raised while the others waited in the
    model's first collective until the process group's timeout (30 minutes by default)."""
    per_rank = ranks(world_size, tmp_path_factory)
    assert "h.0.mlp.c_fc.bias must have shape" in per_rank[0]["rejected"], per_rank[0]["rejected"]
    for rank, result in enumerate(per_rank[1:], 1):
        assert "rank(s) [0] rejected their arguments" in result["rejected"], (rank, result["rejected"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size", [2, 4], ids=lambda t: f"t{t}")
def test_padded_vocab_shards_match_one_device(world_size, tmp_path_factory):
    """Padding leaves ranks with a partial or empty vocabulary shard; loss and gradients still match."""
    real_rows = {vocab: [] for vocab in (300, 1000)}
    for rank_result in ranks(world_size, tmp_path_factory):
        for vocab, (rows, loss_error, grad_error, padded_grad) in rank_result["padded"].items():
            real_rows[vocab].append(rows)
            assert loss_error <= 1e-5 and grad_error <= 1e-5, (vocab, loss_error, grad_error)
            assert padded_grad == 0, f"{padded_grad} nonzero gradients in padded rows"
    assert all(sum(rows) == vocab for vocab, rows in real_rows.items()), real_rows
    if world_size == 4:
        assert real_rows[300] == [128, 128, 44, 0]


def test_from_state_dicts_with_and_without_prefix():
    gpt2 = _random_gpt2(1000, seed=5)
    expected = hf.from_gpt2(gpt2).full_state_dict()
    bare = transformers.GPT2Model(gpt2.config)
    bare.load_state_dict({k[len("transformer."):]: v for k, v in gpt2.state_dict().items() if k != "lm_head.weight"})
    sources = {"lm_model": (gpt2, None), "bare_model": (bare, None),
               "prefixed_dict": (gpt2.state_dict(), gpt2.config), "bare_dict": (bare.state_dict(), gpt2.config),
               "no_head_dict": ({k: v for k, v in gpt2.state_dict().items() if k != "lm_head.weight"}, gpt2.config)}
    for name, (source, config) in sources.items():
        got = hf.from_gpt2(source, config=config).full_state_dict()
        assert all(torch.equal(got[k], v) for k, v in expected.items()), name


@pytest.mark.parametrize("convert", ["from_gpt2", "from_llama"])
def test_converting_onto_the_meta_device_is_refused_up_front(convert):
    """device="meta" built the model and then refused the load with "call module.to_empty(device=...)
    first", advice for a module the caller never held."""
    source = _random_gpt2(1000) if convert == "from_gpt2" else transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16))
    with pytest.raises(ValueError, match=rf"hf.{convert}: device='meta' holds no values.*pass a real device"):
        getattr(hf, convert)(source, device="meta")
    with pytest.raises(ValueError, match="device='meta'"):
        getattr(hf, convert)(source, device=torch.device("meta"))


def test_settings_follow_the_config_and_arguments():
    gpt2 = _random_gpt2(1000, resid_pdrop=0.1, attn_pdrop=0.2, embd_pdrop=0.3, n_inner=200,
                        layer_norm_epsilon=1e-6, activation_function="gelu").train()
    model = hf.from_gpt2(gpt2, recompute="full", backend="torch")
    cfg = model.config
    assert (cfg.hidden_dropout, cfg.attention_dropout, model.embedding_dropout) == (0.1, 0.2, 0.3)
    assert (cfg.ffn_hidden_size, cfg.layernorm_epsilon, cfg.activation) == (200, 1e-6, "gelu")
    assert (cfg.recompute, cfg.backend, model.max_seq_len, model.vocab_size) == ("full", "torch", POSITIONS, 1000)
    assert model.training
    model = hf.from_gpt2(gpt2, dropout=0.0, params_dtype=torch.bfloat16)
    assert (model.config.hidden_dropout, model.config.attention_dropout, model.embedding_dropout) == (0.0, 0.0, 0.0)
    assert model.embedding.word_embeddings.weight.dtype == torch.bfloat16
    # erf GeLU, n_inner 200: still HF's numbers
    tokens = _tokens(1000)
    with torch.no_grad():
        torch.testing.assert_close(hf.from_gpt2(gpt2.eval())(tokens), gpt2(tokens).logits.transpose(0, 1),
                                   atol=2e-5, rtol=2e-5)


def test_the_eps_is_the_layer_norms_not_a_config_changed_since():
    """HF reads layer_norm_epsilon when it builds the LayerNorms: from_gpt2 read the config, so an eps set
    on the config afterwards converted to other numbers than HF computes."""
    gpt2 = _random_gpt2(1000).eval()
    gpt2.config.layer_norm_epsilon = 0.5
    tokens = _tokens(1000)
    model = hf.from_gpt2(gpt2)
    assert model.config.layernorm_epsilon == gpt2.transformer.ln_f.eps == 1e-5
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), gpt2(tokens).logits.transpose(0, 1), atol=2e-5, rtol=2e-5)


def test_a_config_json_read_as_a_namespace_has_gpt2_config_s_defaults():
    """A config.json without the dropout keys (HF: 0.1 each) or n_positions (1024), read without
    transformers: they were 0.0 and an error not naming the key."""
    import types
    gpt2 = _random_gpt2(1000)
    keys = {k: v for k, v in gpt2.config.to_dict().items()
            if k not in ("resid_pdrop", "attn_pdrop", "embd_pdrop", "n_positions")}
    state_dict = {k: v for k, v in gpt2.state_dict().items() if not k.endswith("wpe.weight")}
    state_dict["transformer.wpe.weight"] = torch.zeros(1024, gpt2.config.n_embd)
    model = hf.from_gpt2(state_dict, config=types.SimpleNamespace(**keys))
    assert (model.config.hidden_dropout, model.config.attention_dropout, model.embedding_dropout,
            model.max_seq_len) == (0.1, 0.1, 0.1, 1024)


def test_loss_mapping_matches_hf_labels():
    """HF's labels=input_ids (-100 for padding) == shift_labels + sum / count of GPTModel's per-token loss."""
    gpt2 = _random_gpt2(1000, seed=9).eval()
    model = hf.from_gpt2(gpt2)
    tokens = _tokens(1000, seed=2)
    hf_labels = tokens.clone()
    hf_labels[1, 20:] = -100
    labels = hf.shift_labels(hf_labels)
    assert torch.equal(labels[:, :-1], hf_labels[:, 1:]) and torch.all(labels[:, -1] == -100)
    with torch.no_grad():
        expected = gpt2(tokens, labels=hf_labels).loss
        loss = model(tokens, labels)
    assert loss.shape == (SEQ, BATCH) and loss.is_contiguous()   # HF-style code flattens it with .view(-1)
    torch.testing.assert_close(loss.sum() / (labels != -100).sum(), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="labels must be an int64 \\[b, s\\] tensor"):
        hf.shift_labels(tokens[0])
    assert hf.shift_labels(tokens[:, :0]).shape == (BATCH, 0)     # [b, s] -> [b, s] at s = 0 too


def test_a_head_not_resized_with_the_vocabulary_names_both_shapes():
    """After resize_token_embeddings with a head left at the old size, the tied-head errors said only
    "not tied" (every other vocabulary mismatch names the two shapes)."""
    gpt2 = _random_gpt2(260)
    state_dict = dict(gpt2.state_dict(), **{"lm_head.weight": gpt2.state_dict()["lm_head.weight"][:250]})
    with pytest.raises(ValueError, match=r"lm_head.weight is not tied to transformer.wte.weight \(shape \(250, "
                                         r"\d+\), the table's \(260, \d+\)\)"):
        hf.from_gpt2(state_dict, config=gpt2.config)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=True))
    state_dict = dict(llama.state_dict(), **{"lm_head.weight": llama.state_dict()["lm_head.weight"][:250]})
    with pytest.raises(ValueError, match=r"differs from model.embed_tokens.weight \(shape \(250, 32\), the table's "
                                         r"\(260, 32\)\) but the config has tie_word_embeddings=True"):
        hf.from_llama(state_dict, config=llama.config)


@pytest.mark.parametrize("setting, value", [
    ("scale_attn_by_inverse_layer_idx", True), ("add_cross_attention", True), ("scale_attn_weights", False),
    ("activation_function", "relu"), ("activation_function", "quick_gelu"), ("tie_word_embeddings", False)],
    ids=lambda v: str(v))
def test_unsupported_gpt2_variants_raise(setting, value):
    state_dict = _random_gpt2(1000).state_dict()
    with pytest.raises(ValueError, match=f"{setting}={value!r}"):
        hf.from_gpt2(state_dict, config=_gpt2_config(1000, **{setting: value}))


def test_every_accepted_activation_name_is_hf_s_function():
    """Each GPT-2 activation_function / Llama hidden_act name the loaders take computes, in HF's ACT2FN,
    what the seqpar activation it maps to computes (fp64, |x| <= 8)."""
    from transformers.activations import ACT2FN

    x = torch.linspace(-8, 8, 4001, dtype=torch.float64)
    seqpar_gelu = {"gelu": torch.nn.functional.gelu(x), "gelu_tanh": torch.nn.functional.gelu(x, approximate="tanh")}
    for name, ours in hf.GPT2_ACTIVATIONS.items():
        torch.testing.assert_close(ACT2FN[name](x), seqpar_gelu[ours], atol=1e-11, rtol=0, msg=name)
    for name in hf.LLAMA_ACTIVATIONS:
        torch.testing.assert_close(ACT2FN[name](x), torch.nn.functional.silu(x), atol=0, rtol=0, msg=name)


def test_other_models_and_configs_raise():
    with pytest.raises(ValueError, match="model_type 'llama' is not 'gpt2'"):
        hf.from_gpt2({}, config=transformers.LlamaConfig())
    with pytest.raises(ValueError, match="needs config="):
        hf.from_gpt2(_random_gpt2(1000).state_dict())
    with pytest.raises(ValueError, match="config= is only for a state-dict source"):
        hf.from_gpt2(_random_gpt2(1000), config=_gpt2_config())
    with pytest.raises(ValueError, match="source must be .* got str"):
        hf.from_gpt2("gpt2")
    with pytest.raises(ValueError, match="dropout must be None or a float in \\[0, 1\\), got 1.0"):
        hf.from_gpt2(_random_gpt2(1000), dropout=1.0)
    with pytest.raises(ValueError, match=r"model must be a seqpar.GPTModel \(or one wrapped by DDP / torch.compile\), got GPT2LMHeadModel"):
        hf.to_gpt2_state_dict(_random_gpt2(1000))


@pytest.mark.parametrize("config, model, match", [
    (dict(activation="swiglu"), {}, "'activation': 'swiglu'"),
    (dict(normalization="rmsnorm"), {}, "'normalization': 'rmsnorm'"),
    (dict(position_embedding="rope"), {}, "'position_embedding': 'rope'"),
    (dict(add_bias_linear=False), {}, "'add_bias_linear': False"),
    (dict(num_query_groups=2), {}, "'num_query_groups': 2"),
    ({}, dict(share_embeddings_and_output_weights=False), "'share_embeddings_and_output_weights': False"),
], ids=lambda v: str(v))
def test_to_gpt2_rejects_models_that_are_not_gpt2(config, model, match):
    cfg = seqpar.TransformerConfig(hidden_size=32, num_attention_heads=4, backend="torch", **config)
    for export in (hf.to_gpt2_state_dict, hf.to_gpt2_config):
        with pytest.raises(ValueError, match=f"model is not a GPT-2: it has .*{match}"):
            export(seqpar.GPTModel(cfg, 1, 53, 16, **model))


@pytest.mark.parametrize("activation, ffn, dtype", [("gelu_tanh", 96, torch.float32), ("gelu", None, torch.bfloat16)])
def test_a_model_trained_from_scratch_exports_to_hf(activation, ffn, dtype):
    """to_gpt2_config + to_gpt2_state_dict make a GPT2LMHeadModel of a GPTModel seqpar built: HF's logits
    are seqpar's, and from_gpt2 of it gives back the same config (the dtype too). No bos / eos ids (HF's
    default 50256 is past this vocabulary)."""
    transformers = pytest.importorskip("transformers")
    seqpar.manual_seed(0)
    cfg = seqpar.TransformerConfig(hidden_size=64, num_attention_heads=4, ffn_hidden_size=ffn, activation=activation,
                                   hidden_dropout=0.1, attention_dropout=0.2, layernorm_epsilon=1e-6, backend="torch",
                                   params_dtype=dtype)
    model = seqpar.GPTModel(cfg, 2, 300, 48, embedding_dropout=0.05).eval()
    config = transformers.AutoConfig.for_model(**hf.to_gpt2_config(model))
    gpt2 = transformers.AutoModelForCausalLM.from_config(config).eval()
    assert type(gpt2).__name__ == "GPT2LMHeadModel" and next(gpt2.parameters()).dtype == dtype
    assert config.eos_token_id is None and config.bos_token_id is None
    gpt2.load_state_dict(hf.to_gpt2_state_dict(model), strict=True)
    tokens = _tokens(300)
    with torch.no_grad():
        torch.testing.assert_close(gpt2(tokens).logits.transpose(0, 1), model(tokens),
                                   atol=2e-5 if dtype == torch.float32 else 0.05, rtol=0)
    back = hf.from_gpt2(gpt2, backend="torch")
    assert back.config == model.config and (back.max_seq_len, back.vocab_size, back.embedding_dropout) == (48, 300, 0.05)


def _drop(key):
    return lambda sd: sd.pop(key)


@pytest.mark.parametrize("change, match", [
    (_drop("transformer.h.1.mlp.c_fc.bias"), "missing \\['h.1.mlp.c_fc.bias'\\]"),
    (lambda sd: sd.update({"transformer.h.2.ln_1.weight": torch.ones(HIDDEN)}), "unexpected \\['h.2.ln_1.weight'\\]"),
    (lambda sd: sd.update({"transformer.h.0.attn.c_attn.weight": torch.zeros(3 * HIDDEN, HIDDEN)}),
     "h.0.attn.c_attn.weight must have shape \\(128, 384\\) for this config, got \\(384, 128\\)"),
    (lambda sd: sd.update({"transformer.wte.weight": torch.zeros(999, HIDDEN),
                           "lm_head.weight": torch.zeros(999, HIDDEN)}), "wte.weight must have shape \\(1000, 128\\)"),
    (lambda sd: sd.update({"lm_head.weight": sd["lm_head.weight"] + 1}), "lm_head.weight is not tied"),
    (lambda sd: sd.update({"wpe.weight": sd["transformer.wpe.weight"]}), "mixes 'transformer.'-prefixed keys"),
    # GPT2ForSequenceClassification's head: an unexpected key, not a prefix mix
    (lambda sd: sd.update({"score.weight": torch.zeros(2, HIDDEN)}), "missing \\[\\], unexpected \\['score.weight'\\]"),
], ids=["missing", "unexpected", "conv1d_layout", "vocab", "untied_head", "mixed_prefix", "classification_head"])
def test_bad_state_dicts_raise_naming_the_key(change, match):
    state_dict = dict(_random_gpt2(1000).state_dict())
    change(state_dict)
    with pytest.raises(ValueError, match=match):
        hf.from_gpt2(state_dict, config=_gpt2_config(1000))


def test_old_checkpoints_mask_buffers_are_ignored():
    """transformers releases before 4.31 saved the causal-mask buffers attn.bias / attn.masked_bias."""
    gpt2 = _random_gpt2(1000)
    state_dict = dict(gpt2.state_dict())
    for i in range(LAYERS):
        state_dict[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, POSITIONS, POSITIONS, dtype=torch.bool).tril()
        state_dict[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    got = hf.to_gpt2_state_dict(hf.from_gpt2(state_dict, config=gpt2.config))
    assert all(torch.equal(got[k], v) for k, v in gpt2.state_dict().items())


def test_import_does_not_need_transformers(monkeypatch):
    """A fresh import of seqpar.integrations.hf (GPT-2 and Llama) with transformers made unimportable."""
    class Block:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.split(".")[0] == "transformers":
                raise ImportError("transformers is blocked in this test")
            return None

    for name in [n for n in sys.modules if n.split(".")[0] == "transformers"] + ["seqpar.integrations.hf"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Block()] + sys.meta_path)
    monkeypatch.setattr(seqpar.integrations, "hf", hf)           # restored after the fresh import
    fresh = importlib.import_module("seqpar.integrations.hf")
    assert fresh is not hf and all(callable(getattr(fresh, name)) for name in fresh.__all__)
    assert not any(n.split(".")[0] == "transformers" for n in sys.modules)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["auto", "torch", "triton"])
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_bf16_logits_on_gpu(backend, recompute):
    """bf16 on the device: seqpar's logits error vs HF fp32 is at most 2x HF bf16's own error."""
    gpt2 = _random_gpt2(50257).eval().cuda()
    tokens = _tokens(50257).cuda()
    with torch.no_grad():
        reference = gpt2(tokens).logits.transpose(0, 1)
        hf_bf16 = gpt2.to(torch.bfloat16)(tokens).logits.transpose(0, 1)
        model = hf.from_gpt2(gpt2, recompute=recompute, backend=backend)           # bf16 like the source
        logits = model(tokens)
    assert logits.dtype == torch.bfloat16 and logits.shape == reference.shape
    error = (logits.float() - reference).abs().max().item()
    hf_error = (hf_bf16.float() - reference).abs().max().item()
    assert error <= 2 * hf_error + 1e-3, f"seqpar bf16 error {error:.3e} vs HF bf16 error {hf_error:.3e}"


def test_one_recompute_policy_per_layer():
    """from_gpt2 takes GPTModel's per-layer recompute list too (it was "unknown recompute")."""
    gpt2 = _random_gpt2(1000).eval()
    policies = (["full", "selective"] * LAYERS)[:LAYERS]
    model = hf.from_gpt2(gpt2, recompute=policies)
    assert [layer.config.recompute for layer in model.layers] == policies
    with torch.no_grad():
        torch.testing.assert_close(model(_tokens(1000)), gpt2(_tokens(1000)).logits.transpose(0, 1), atol=2e-5, rtol=0)
