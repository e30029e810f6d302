"""GPTModel on one device: token and label checking, ignore_index -100 against
torch.nn.functional.cross_entropy, the padded vocabulary, the embedding-dropout knob and the
model-level unsharded state dict (against a plain-torch GPT built from it)."""
import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils._python_dispatch

import seqpar

H, A, V, S, B = 32, 4, 50, 12, 3


def _model(vocab=V, layers=2, **cfg):
    config = seqpar.TransformerConfig(hidden_size=H, num_attention_heads=A, **cfg)
    return seqpar.GPTModel(config, num_layers=layers, vocab_size=vocab, max_seq_len=16)


def _tokens(vocab=V, seed=0):
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("bad", [-1, V, V + 1000, -100], ids=["minus1", "vocab", "far", "minus100"])
def test_token_ids_outside_vocab_raise_naming_the_id(bad):
    model = _model()
    tokens = _tokens()
    tokens[1, 7] = bad
    with pytest.raises(ValueError, match=rf"token id {bad} at \[1, 7\] is outside the vocabulary"):
        model(tokens)


@pytest.mark.parametrize("bad", [-1, -101, V, 2 * V], ids=["minus1", "minus101", "vocab", "twice"])
def test_labels_outside_vocab_raise_naming_the_id(bad):
    model = _model()
    tokens = _tokens()
    labels = tokens.roll(-1, 1)
    labels[2, 0] = bad
    with pytest.raises(ValueError, match=rf"label id {bad} at \[2, 0\] is outside the vocabulary"):
        model(tokens, labels)


def test_a_bad_token_is_named_before_a_bad_label():
    """Tokens and labels are checked with one host read; the tokens' problem is named first."""
    tokens = _tokens()
    labels = tokens.roll(-1, 1)
    tokens[0, 3], labels[1, 2] = V, -2
    with pytest.raises(ValueError, match=rf"token id {V} at \[0, 3\]"):
        _model()(tokens, labels)


@pytest.mark.gpu
def test_gpu_the_model_forward_is_captured_in_a_cuda_graph():
    """A CUDA graph capture failed on the id check's host read, even with check_rank_inputs = False
    (which the README asks for before capturing): while capturing the check is an in-graph assertion."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = _model().cuda().eval()
    model.check_rank_inputs = False
    static_tokens = _tokens().cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):
        for _ in range(2):   # warm-up (kernel compiles, allocations) outside the capture
            model(static_tokens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        static_logits = model(static_tokens)
    fresh = _tokens(seed=1).cuda()
    static_tokens.copy_(fresh)
    graph.replay()
    with torch.no_grad():
        torch.testing.assert_close(static_logits, model(fresh))


def test_a_backend_that_can_t_run_is_refused_before_the_embedding_dropout_draws():
    """The model's embedding dropout drew its seed, then the dropout op refused backend cuda on CPU
    tensors: the retry on a usable backend got other masks than a first call."""
    model = _model(hidden_dropout=0.1, backend="cuda")
    model.embedding_dropout = 0.1
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="backend 'cuda' can't run on cpu"):
        model(_tokens())
    assert torch.equal(torch.get_rng_state(), state)


def test_a_training_forward_with_dropout_refuses_a_cuda_graph_capture(monkeypatch):
    """Each training forward draws its dropout seeds on the host: a captured graph would replay one draw's
    masks on every replay, silently. The draw raises while a capture is under way (faked here: no GPU) and
    leaves torch's generator as it was; eval mode draws nothing and is unaffected."""
    model = _model(hidden_dropout=0.1, attention_dropout=0.1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    state = torch.get_rng_state()
    with pytest.raises(RuntimeError, match="a CUDA graph captured now would replay that one seed"):
        model(_tokens())
    assert torch.equal(torch.get_rng_state(), state)
    model.eval()
    model(_tokens())


@pytest.mark.gpu
def test_gpu_capturing_a_training_forward_with_dropout_raises():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    model = _model(hidden_dropout=0.1).cuda()
    model.check_rank_inputs = False
    tokens = _tokens().cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        model(tokens)   # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    with pytest.raises(RuntimeError, match="replay that one seed"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            model(tokens)


@pytest.mark.parametrize("shape", [(2, 0), (0, 4)], ids=["s0", "b0"])
def test_empty_tokens_are_named(shape):
    """The first layer refused them, naming x and an internal [s, b, h] shape."""
    with pytest.raises(ValueError, match=rf"tokens must be a non-empty int64 \[b, s\] tensor, got torch.int64 "
                                         rf"\({shape[0]}, {shape[1]}\)"):
        _model()(torch.zeros(shape, dtype=torch.int64))


def test_padding_row_starts_at_zero():
    """As nn.Embedding(padding_idx=...) and HF: the row its lookups never update started random."""
    seqpar.manual_seed(0)
    model = seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=H, num_attention_heads=A), num_layers=1,
                            vocab_size=V, max_seq_len=16, padding_idx=3)
    for _ in range(2):
        weight = model.embedding.word_embeddings.weight
        assert not weight[3].any() and weight[[2, 4]].abs().min() > 0
        model.reset_parameters()


def test_a_neg_inf_logit_outside_the_shard_does_not_make_the_loss_nan():
    """The vocabulary-parallel cross-entropy read a clamped column for labels outside this rank's shard
    and multiplied it by 0: a -inf there (an fp16 logit that overflowed) made NaN, which the group's
    sum spread to every rank's losses. Here one rank's view (group None): labels below vocab_start."""
    from seqpar.nn.model import _VocabParallelCrossEntropy

    logits = torch.randn(3, 2, 8, dtype=torch.float16)
    logits[..., 0] = float("-inf")
    labels = torch.full((3, 2), 5)                       # ids 0..7 at vocab_start 16: none in this shard
    loss = _VocabParallelCrossEntropy.apply(logits, labels, 16, -100, None)
    # this shard's part, no target term: log sum exp(z - max) (the max and the sums are the group's)
    expected = torch.logsumexp(logits.float(), -1) - logits.float().amax(-1)
    torch.testing.assert_close(loss, expected)


class _NewFullSizeStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the new storages of ``shape`` the ops inside it create, by dtype (in-place ops and views
    create none)."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.seen, self.counts = tuple(shape), set(), {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape:
                key = t.untyped_storage().data_ptr()
                if key not in self.seen and not any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr()
                                                    == key for a in args):
                    self.seen.add(key)
                    self.counts[t.dtype] = self.counts.get(t.dtype, 0) + 1
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_vocab_loss_makes_one_fp32_copy_of_the_logits(dtype):
    """The loss's forward made four fp32 [s, b, v] tensors (the cast, the shifted logits, their exp, the
    softmax), all alive together at the step's peak (4.5x the fp32 logits' bytes beside bf16 logits,
    more than F.cross_entropy on gathered fp32 logits); backward made three, then two (an fp32 gradient
    and its cast). Now one buffer in forward (the softmax it saves) and one in backward, the gradient in
    the logits' dtype (computed in fp32, rounded once: the same bits as the cast). Values:
    F.cross_entropy's."""
    from seqpar.nn.model import _VocabParallelCrossEntropy

    logits = (3 * torch.randn(5, 2, 40)).to(dtype).requires_grad_()
    labels = torch.randint(0, 40, (5, 2))
    labels[0, 1] = -100
    before = logits.detach().clone()
    with _NewFullSizeStorages(logits.shape) as forward:
        loss = _VocabParallelCrossEntropy.apply(logits, labels, 0, -100, None)
    assert forward.counts == {torch.float32: 1}, forward.counts
    assert torch.equal(logits.detach(), before)                           # the caller's logits untouched
    grad_loss = torch.randn(5, 2)
    with _NewFullSizeStorages(logits.shape) as backward:
        (grad,) = torch.autograd.grad(loss, logits, grad_loss, retain_graph=True)
    assert backward.counts == {dtype: 1}, backward.counts
    shifted = logits.detach().float() - logits.detach().float().amax(-1, keepdim=True)   # the forward's softmax
    softmax = shifted.exp() / shifted.exp().sum(-1, keepdim=True)   # ... and the former backward, bit for bit
    onehot = torch.nn.functional.one_hot(labels.clamp(min=0), 40).float() * (labels != -100).unsqueeze(-1)
    assert torch.equal(grad, ((softmax - onehot) * torch.where(labels != -100, grad_loss, 0.0).unsqueeze(-1)).to(dtype))
    reference = logits.detach().double().requires_grad_()
    want = F.cross_entropy(reference.flatten(0, 1), labels.flatten(), reduction="none").view(5, 2)
    torch.testing.assert_close(loss, want.float(), rtol=1e-5, atol=1e-5)
    (want_grad,) = torch.autograd.grad(want, reference, grad_loss.double())
    torch.testing.assert_close(grad.double(), want_grad, **({} if dtype == torch.float32 else
                                                           dict(rtol=1e-2, atol=1e-2)))
    (again,) = torch.autograd.grad(loss, logits, grad_loss)               # retain_graph: the same again
    assert torch.equal(again, grad)


def test_labels_must_be_int64_of_the_tokens_shape():
    model = _model()
    tokens = _tokens()
    for labels in (tokens[:, :-1], tokens.int()):
        with pytest.raises(ValueError, match="labels must be an int64 tensor"):
            model(tokens, labels)


@pytest.mark.parametrize("vocab", [V, 128, 300], ids=["v50", "v128", "v300"])
def test_ignore_index_loss_and_gradients_match_torch_cross_entropy(vocab):
    """-100 labels give 0 loss and no gradient; the rest is F.cross_entropy on the model's own logits."""
    tokens = _tokens(vocab)
    labels = tokens.roll(-1, 1)
    labels[:, -1] = -100
    labels[0, :5] = -100
    labels[2] = -100                                          # a whole sequence ignored
    seqpar.manual_seed(3)
    model = _model(vocab)
    loss = model(tokens, labels)                              # [s, b]
    loss.sum().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    logits = model(tokens)                                    # [s, b, v]
    assert logits.shape == (S, B, vocab)
    expected = F.cross_entropy(logits.reshape(S * B, vocab).double(), labels.t().reshape(-1), ignore_index=-100,
                               reduction="none").reshape(S, B)
    expected.sum().backward()
    torch.testing.assert_close(loss.double(), expected, atol=1e-5, rtol=1e-5)
    assert torch.all(loss.t()[labels == -100] == 0)
    for key, p in model.named_parameters():
        torch.testing.assert_close(grads[key], p.grad, atol=1e-6, rtol=1e-4, msg=key)


def test_all_labels_ignored_gives_zero_loss_and_zero_gradient():
    model = _model()
    tokens = _tokens()
    loss = model(tokens, torch.full_like(tokens, -100))
    loss.sum().backward()
    assert torch.equal(loss, torch.zeros(S, B))
    assert all(torch.count_nonzero(p.grad) == 0 for p in model.parameters())


@pytest.mark.parametrize("vocab, padded", [(1, 128), (V, 128), (128, 128), (129, 256), (1000, 1024), (50257, 50304)],
                         ids=lambda v: str(v))
def test_vocabulary_is_padded_and_padded_rows_stay_out(vocab, padded):
    model = _model(vocab, layers=1)
    weight = model.embedding.word_embeddings.weight
    assert model.padded_vocab_size == padded and weight.shape == (padded, H)
    assert (model.vocab_start, model.vocab_end) == (0, vocab)
    assert model.full_state_dict()["embedding.word_embeddings.weight"].shape == (vocab, H)
    tokens = _tokens(vocab)
    assert model(tokens).shape == (S, B, vocab)
    model(tokens, tokens.roll(-1, 1)).sum().backward()
    assert torch.count_nonzero(weight[vocab:]) == 0 and torch.count_nonzero(weight.grad[vocab:]) == 0


def _layer_zero_input(model, tokens):
    """The hidden state entering layer 0 (the embedding output after its dropout)."""
    seen = []
    handle = model.layers[0].input_layernorm.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach()))
    model(tokens)
    handle.remove()
    return seen[0]


def test_embedding_dropout_knob():
    tokens = _tokens()
    model = _model(recompute="full", hidden_dropout=0.0, attention_dropout=0.0)
    clean = _layer_zero_input(model.eval(), tokens)
    model.train()
    assert model.embedding_dropout == 0.0 and torch.equal(_layer_zero_input(model, tokens), clean)

    model = _model(recompute="full", hidden_dropout=0.0)
    model.load_full_state_dict(_model(recompute="full").full_state_dict())
    model.embedding_dropout = 0.5
    dropped = _layer_zero_input(model.train(), tokens)
    zero = dropped == 0
    assert 0.4 < zero.float().mean() < 0.6, zero.float().mean()
    torch.testing.assert_close(dropped[~zero], 2 * clean[~zero])

    # None follows hidden_dropout (the default of earlier releases); an explicit value overrides it
    assert _model(hidden_dropout=0.2).embedding_dropout == 0.2
    assert seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=H, num_attention_heads=A, hidden_dropout=0.2),
                           1, V, 16, embedding_dropout=0.0).embedding_dropout == 0.0


@pytest.mark.parametrize("p", [1.5, 0.999, -0.1, True, "0.1"], ids=repr)
def test_bad_embedding_dropout_is_rejected_at_construction(p):
    # 0.999: in [0, 1) but round(p * 256) = 256 would drop everything; TransformerConfig rejects it too.
    with pytest.raises(ValueError, match=f"embedding_dropout must be in \\[0, 1\\).*got {re.escape(repr(p))}"):
        seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=H, num_attention_heads=A), 1, V, 16,
                        embedding_dropout=p)


def _plain_gpt_logits(sd, tokens, layers, heads, eps=1e-5):
    """GPT written directly with torch ops from the unsharded state dict: the independent oracle."""
    h = sd["embedding.word_embeddings.weight"].shape[1]
    x = sd["embedding.word_embeddings.weight"][tokens] + sd["embedding.position_embeddings.weight"][:tokens.shape[1]]
    for i in range(layers):
        p = {k[len(f"layers.{i}."):]: v for k, v in sd.items() if k.startswith(f"layers.{i}.")}
        a1 = F.layer_norm(x, (h,), p["input_layernorm.weight"], p["input_layernorm.bias"], eps)
        q, k, v = (t.unflatten(-1, (heads, h // heads)).transpose(1, 2) for t in
                   F.linear(a1, p["self_attention.query_key_value.weight"],
                            p["self_attention.query_key_value.bias"]).split(h, dim=-1))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        x = x + F.linear(o, p["self_attention.dense.weight"], p["self_attention.dense.bias"])
        a2 = F.layer_norm(x, (h,), p["post_attention_layernorm.weight"], p["post_attention_layernorm.bias"], eps)
        m = F.gelu(F.linear(a2, p["mlp.dense_h_to_4h.weight"], p["mlp.dense_h_to_4h.bias"]))
        x = x + F.linear(m, p["mlp.dense_4h_to_h.weight"], p["mlp.dense_4h_to_h.bias"])
    x = F.layer_norm(x, (h,), sd["final_layernorm.weight"], sd["final_layernorm.bias"], eps)
    return (x @ sd["embedding.word_embeddings.weight"].t()).transpose(0, 1)      # [s, b, v]


def test_full_state_dict_keys_and_math():
    layers = 3
    model = _model(layers=layers)
    gen = torch.Generator().manual_seed(11)
    sd = {k: torch.randn(shape, generator=gen) * (0.2 if len(shape) == 2 else 0.1)
          + (1.0 if k.endswith("layernorm.weight") else 0.0) for k, shape in model.full_shapes().items()}
    layer_keys = seqpar.TransformerLayer(model.config).full_shapes()
    assert set(sd) == ({"embedding.word_embeddings.weight", "embedding.position_embeddings.weight",
                        "final_layernorm.weight", "final_layernorm.bias"}
                       | {f"layers.{i}.{k}" for i in range(layers) for k in layer_keys})
    assert sd["embedding.word_embeddings.weight"].shape == (V, H)
    assert sd["embedding.position_embeddings.weight"].shape == (16, H)
    model.load_full_state_dict(sd)
    out = model.full_state_dict()
    assert set(out) == set(sd) and all(torch.equal(out[k], sd[k]) for k in sd)
    tokens = _tokens()
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(tokens), _plain_gpt_logits(sd, tokens, layers, A),
                                   atol=1e-5, rtol=1e-5)


def test_load_full_state_dict_strict_false_loads_the_keys_it_has():
    """As nn.Module.load_state_dict(strict=False): the dict's keys are loaded, the model's other weights
    stay, the missing and unexpected keys come back; shapes are still checked."""
    model = _model(layers=3)
    seqpar.manual_seed(7)
    source = _model(layers=3).full_state_dict()
    before = model.full_state_dict()
    left_out = sorted([k for k in source if k.startswith("layers.1.")]
                      + ["layers.0.mlp.dense_h_to_4h.bias", "embedding.position_embeddings.weight"])
    partial = {k: v for k, v in source.items() if k not in left_out}
    partial["lm_head.weight"] = torch.zeros(V, H)
    assert model.load_full_state_dict(partial, strict=False) == (left_out, ["lm_head.weight"])
    after = model.full_state_dict()
    for key in source:
        assert torch.equal(after[key], before[key] if key in left_out else source[key]), key
    with pytest.raises(ValueError, match="final_layernorm.bias must have shape"):
        model.load_full_state_dict({"final_layernorm.bias": torch.zeros(H + 1)}, strict=False)
    with pytest.raises(ValueError, match="missing"):
        model.load_full_state_dict(partial)
    result = model.load_full_state_dict(source)
    assert result.missing_keys == [] and result.unexpected_keys == []


def test_load_full_state_dict_names_bad_keys_and_shapes():
    model = _model()
    sd = model.full_state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for change, match in (
            # the message names the loader (it read "state dict keys do not match the model")
            (lambda d: d.pop("layers.1.mlp.dense_h_to_4h.bias"),
             "^GPTModel.load_full_state_dict: state dict keys do not match the model: missing "
             "\\['layers.1.mlp.dense_h_to_4h.bias'\\]"),
            (lambda d: d.update({"layers.2.input_layernorm.weight": torch.ones(H)}),
             "unexpected \\['layers.2.input_layernorm.weight'\\]"),
            (lambda d: d.update({"embedding.word_embeddings.weight": torch.zeros(128, H)}),
             "embedding.word_embeddings.weight must have shape \\(50, 32\\) for this config, got \\(128, 32\\)"),
            (lambda d: d.update({"final_layernorm.bias": torch.zeros(H + 1)}), "final_layernorm.bias"),
            # the last keys: loading would have overwritten every other key before it failed or cast them
            (lambda d: d.update({"final_layernorm.bias": torch.ones(H, dtype=torch.bool)}),
             "final_layernorm.bias must be a floating-point tensor with data, got torch.bool"),
            (lambda d: d.update({"layers.1.mlp.dense_4h_to_h.weight": torch.ones(H, 4 * H, dtype=torch.int64)}),
             "layers.1.mlp.dense_4h_to_h.weight .* got torch.int64"),
            (lambda d: d.update({"final_layernorm.weight": torch.ones(H, dtype=torch.complex64)}),
             "final_layernorm.weight .* got torch.complex64"),
            (lambda d: d.update({"final_layernorm.weight": torch.empty(H, device="meta")}),
             "final_layernorm.weight .* got a meta tensor")):
        bad = dict(sd)
        change(bad)
        with pytest.raises(ValueError, match=match):
            model.load_full_state_dict(bad)
    # nothing was loaded from a rejected dict
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    model.load_full_state_dict({k: v.double() for k, v in sd.items()})   # other floating dtypes are cast
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_sequence_past_max_seq_len_says_what_the_limit_is_with_rope():
    """HF Llama runs past max_position_embeddings; from_llama makes it max_seq_len, which refused with a
    bare "exceeds max_seq_len": with RoPE nothing is sized by it, and the message now says so, with the
    remedy a from_llama user has (it takes no max_seq_len)."""
    cfg = seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2, position_embedding="rope")
    model = seqpar.GPTModel(cfg, 1, 20, 4)
    with pytest.raises(ValueError, match=r"sequence length 6 exceeds max_seq_len 4 \(with RoPE no table.*for "
                                         r"from_llama raise config.max_position_embeddings before converting"):
        model(torch.zeros(1, 6, dtype=torch.int64))


def test_gather_logits_at_t1_is_the_logits_and_checks_its_input():
    model = _model()
    logits = model(_tokens())
    assert model.gather_logits(logits) is logits
    for bad in (logits[..., :-1], logits.long(), "logits"):
        with pytest.raises(ValueError, match=r"logits_local must be this rank's floating \[\.\.\., 50\] logits"):
            model.gather_logits(bad)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_pipeline_stage_methods_compute_the_models_forward(tied):
    """embed -> layers[i] -> head, split into two stages at a detached boundary (as a pipeline sends the
    activation), computes forward's loss and gradients bit for bit, dropout included."""
    seqpar.manual_seed(0)
    config = seqpar.TransformerConfig(hidden_size=H, num_attention_heads=A, hidden_dropout=0.1, attention_dropout=0.1,
                                      sequence_parallel=True)
    whole = seqpar.GPTModel(config, 3, V, 16, share_embeddings_and_output_weights=tied)
    staged = seqpar.GPTModel(config, 3, V, 16, share_embeddings_and_output_weights=tied)
    staged.load_state_dict(whole.state_dict())
    tokens = _tokens()
    labels = tokens.roll(-1, 1)
    torch.manual_seed(5)
    whole(tokens, labels).sum().backward()
    torch.manual_seed(5)
    first = staged.embed(tokens)
    for layer in staged.layers[:2]:
        first = layer(first)
    boundary = first.detach().requires_grad_()          # what the next stage receives
    loss = staged.head(staged.layers[2](boundary), labels)
    loss.sum().backward()
    first.backward(boundary.grad)
    for (name, a), b in zip(whole.named_parameters(), staged.parameters()):
        assert torch.equal(a.grad, b.grad), name
    torch.manual_seed(5)
    assert torch.equal(loss, whole(tokens, labels))
    with torch.autocast("cpu", dtype=torch.bfloat16):   # as forward: as if converted to bf16
        torch.manual_seed(5)
        hidden = staged.embed(tokens)
        for layer in staged.layers:
            hidden = layer(hidden)
        staged_loss = staged.head(hidden, labels)
        torch.manual_seed(5)
        assert hidden.dtype == torch.bfloat16 and torch.equal(staged_loss, whole(tokens, labels))
    with pytest.raises(ValueError, match=r"labels must be an int64 \[b, s\] = \(3, 12\) tensor"):
        staged.head(boundary, labels[:, :5])
    with pytest.raises(ValueError, match="label id 50 at"):
        staged.head(boundary, torch.full_like(labels, V))
    with pytest.raises(ValueError, match="token id -1 at"):
        staged.embed(torch.full_like(tokens, -1))


@pytest.mark.parametrize("vocab", [128, 100], ids=["unpadded", "padded"])
def test_the_tied_head_slices_the_table_only_where_it_has_padded_rows(vocab):
    """The output GEMM read ``weight[:v_local]`` even when that is every row: its backward wrote the
    [v, h] gradient into a new zero-filled table (slice_backward), a read and write of the table per step.
    Now the table itself where nothing is padded; a padded table's real rows are still all it reads."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Ops.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    seqpar.manual_seed(0)
    model = seqpar.GPTModel(seqpar.TransformerConfig(hidden_size=16, num_attention_heads=2), 1, vocab, 8)
    tokens = torch.randint(0, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    loss = model(tokens, tokens).sum()
    with Ops():
        loss.backward()
    assert ("slice_backward" in Ops.names) == (vocab == 100), Ops.names
    assert torch.equal(model.embedding.word_embeddings.weight.grad[vocab:], torch.zeros(128 - vocab, 16))


@pytest.mark.parametrize("rewrite", ["prune", "weight_norm"])
def test_a_standalone_output_layer_rewritten_by_a_pre_hook_runs_under_autocast(rewrite):
    """prune and the old weight_norm set the output layer's ``weight`` from fp32 parameters in a forward
    pre-hook: under autocast its logits GEMM got that fp32 weight beside the bf16 input ("expected m1 and m2
    to have the same dtype"); it now reads it in the autocast dtype, as the parallel linears do."""
    import warnings

    from torch.nn.utils import prune

    from seqpar.nn.model import VocabParallelOutputLayer

    torch.manual_seed(0)
    layer = VocabParallelOutputLayer(256, 16)
    torch.nn.init.normal_(layer.weight)
    if rewrite == "prune":
        prune.l1_unstructured(layer, "weight", amount=0.3)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.nn.utils.weight_norm(layer, "weight")
    hidden = torch.randn(4, 2, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer(hidden)
        want = F.linear(hidden, layer.weight)
    assert logits.dtype == torch.bfloat16 and torch.equal(logits, want)
