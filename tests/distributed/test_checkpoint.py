"""torch.distributed.checkpoint (DCP) with seqpar's sharded state dicts: a GPTModel and its AdamW state
saved at one tensor-parallel size resume at another, loading exactly the saved weights, and take the
same next step as the saving run does without the checkpoint. (The reference is that run, not a
single-process one: after two Adam steps, t = 1 and t = 2 already differ by 1.5e-5 where gradients are
near zero. Adam scales a gradient of rounding noise up: GPT's K bias has a zero gradient in exact
arithmetic, and its resumed step differs by 4e-5 between t = 2 and t = 4, the other tensors by < 1e-7.
A misplaced piece of a weight or of Adam's moments shows as an error of ~lr = 1e-2, so 1e-4 tells them
apart.)

The models run under sequence parallelism: a Llama-style GPT (fused grouped-query QKV: three pieces per
rank; SwiGLU's gate / up: two; an untied vocabulary head whose 50 real rows all sit on rank 0 at t = 4,
ranks 1-3 holding only padding) and GPT's own block (split and replicated biases, a learned position
table, the head tied to the embedding)."""
import warnings

import pytest
import torch
import torch.distributed as dist

import seqpar
from seqpar.nn import load_sharded_optimizer_state_dict, sharded_optimizer_state_dict, sharded_state_dict

from launcher import run_ranks

VOCAB, S, B, LR = 50, 8, 2, 1e-2
STEPS_BEFORE_SAVE = 2


FAMILIES = {   # Llama's block with an untied head; GPT's (biases: split column-parallel ones, replicated
               # row-parallel ones; a learned position table) with the head tied to the embedding
    "llama": (dict(num_query_groups=4, ffn_hidden_size=96, normalization="rmsnorm", activation="swiglu",
                   add_bias_linear=False, position_embedding="rope"), False),
    "gpt": ({}, True),
}


def _model(group, seed, family="llama"):
    seqpar.manual_seed(seed)
    kwargs, tied = FAMILIES[family]
    cfg = seqpar.TransformerConfig(hidden_size=64, num_attention_heads=8, sequence_parallel=group is not None,
                                   backend="torch", **kwargs)
    return seqpar.GPTModel(cfg, 2, VOCAB, S, tp_group=group, share_embeddings_and_output_weights=tied)


def _batch(step):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (B, S + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def _train(model, optimizer, steps):
    for step in steps:
        tokens, labels = _batch(step)
        optimizer.zero_grad()
        model(tokens, labels).mean().backward()
        optimizer.step()


def _optimizer(model, lr=LR):
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)


def _by_value(state):
    """Tensors as numpy arrays: a tensor returned from a rank is shared memory that dies with the rank."""
    return {key: value.numpy() for key, value in state.items()}


def _tp_group(world_size, tp):
    """This rank's tensor-parallel group: consecutive ranks, ``world_size / tp`` data-parallel replicas."""
    if world_size == 1:
        return None
    groups = [dist.new_group(list(range(first, first + tp))) for first in range(0, world_size, tp)]
    return groups[dist.get_rank() // tp]


def _fully_shard(model, world_size, tp, how):
    """FSDP2 over this rank's data-parallel group (the ranks r, r + tp, ...): each layer, then the model.
    ``how == "hsdp"`` (t = 1, world 4): HSDP, two replicas [0, 1] and [2, 3] of a 2-way FSDP2."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.fsdp import fully_shard
    if how == "hsdp":
        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
    else:
        groups = [dist.new_group(list(range(r, world_size, tp))) for r in range(tp)]
        mesh = DeviceMesh.from_group(groups[dist.get_rank() % tp], "cpu")
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _save_worker(rank, world_size, path, tp, family, fsdp):
    model = _model(_tp_group(world_size, tp), seed=1, family=family)
    if fsdp:
        _fully_shard(model, world_size, tp, fsdp)
    optimizer = _optimizer(model)
    _train(model, optimizer, range(STEPS_BEFORE_SAVE))
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)},
             checkpoint_id=path)
    saved = _by_value(model.full_state_dict())
    _train(model, optimizer, [STEPS_BEFORE_SAVE])       # the reference: the next step without the checkpoint
    return saved, _by_value(model.full_state_dict())


def _resume_worker(rank, world_size, path, family, tp, fsdp):
    """The large-model recipe: build on the meta device (FSDP2: shard it there), allocate (to_empty),
    load. Every parameter is NaN before the load, padded vocabulary rows included: what the load doesn't
    fill must never be read."""
    import torch.distributed.checkpoint as dcp
    with torch.device("meta"):
        model = _model(_tp_group(world_size, tp), seed=2, family=family)
    if fsdp:
        _fully_shard(model, world_size, tp, fsdp)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float("nan"))
    optimizer = _optimizer(model, lr=0.5)                # another rate: the load must restore the saved one
    state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)  # DCP's own ShardedTensor use
        dcp.load(state, checkpoint_id=path)
    load_sharded_optimizer_state_dict(model, optimizer, state["optim"])
    loaded = _by_value(model.full_state_dict())
    _train(model, optimizer, [STEPS_BEFORE_SAVE])
    return loaded, _by_value(model.full_state_dict()), optimizer.param_groups[0]["lr"]


# (world size, t, FSDP2 over the world / t data-parallel ranks: no / "fsdp2" / "hsdp") of the saving and
# the resuming run
PLAIN_T2, T4, T1 = (2, 2, None), (4, 4, None), (1, 1, None)
DP2_T2, FSDP2_T2, HSDP_T1 = (4, 2, None), (4, 2, "fsdp2"), (4, 1, "hsdp")


@pytest.mark.timeout(240)
# (GPT's biases, LayerNorm and tied head resume in the HSDP case; the vocabulary rows at t = 4 in the first.)
@pytest.mark.parametrize("family, save, resume", [("llama", PLAIN_T2, T4), ("llama", DP2_T2, T1),
                                                  ("llama", FSDP2_T2, T1), ("gpt", HSDP_T1, FSDP2_T2)],
                         ids=["t2-to-t4", "t2-dp2-to-t1", "t2-fsdp2-to-t1", "gpt-t1-hsdp-to-t2-fsdp2"])
def test_resume_at_another_tensor_parallel_size_continues_the_trajectory(tmp_path, family, save, resume):
    """Saved at t = 2 (alone, as two data-parallel replicas of it: DCP writes each piece once, or with
    FSDP2 over those two: each rank holds half its shard's rows) or at t = 1 under HSDP (two replicas
    of a 2-way FSDP2), resumed at t = 4, t = 1 or at t = 2 under FSDP2 (sharded on meta)."""
    path = str(tmp_path / "ckpt")
    saved, reference = run_ranks(_save_worker, save[0], path, save[1], family, save[2], timeout_s=120)[0]
    results = run_ranks(_resume_worker, resume[0], path, family, resume[1], resume[2], timeout_s=120)
    for rank, (loaded, resumed, lr) in enumerate(results):
        assert lr == LR, rank
        for key in saved:                                 # the saved weights, exactly, at the new size
            assert (loaded[key] == saved[key]).all(), (rank, key)
        for key in reference:                             # then the step the saving run takes
            torch.testing.assert_close(torch.from_numpy(resumed[key]), torch.from_numpy(reference[key]), rtol=0,
                                       atol=1e-4, msg=f"{rank} {key}")


def _pieces_worker(rank, world_size):
    """The pieces each rank offers DCP: where its rows of the fused QKV and the vocabulary lie."""
    model = _model(dist.group.WORLD, seed=1)
    state = sharded_state_dict(model)
    # Under DistributedDataParallel (over a data-parallel group: here each rank alone) the same keys.
    data_parallel = [dist.new_group([r]) for r in range(world_size)][rank]
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=data_parallel)
    ddp_keys = [set(sharded_state_dict(wrapped)) for wrapped in (ddp, torch.compile(ddp))]   # compile(DDP(m))
    # A DTensor split other than FSDP2's (Shard(0) on one mesh dim): a ValueError that says so, not a
    # silent misplacement or an error deep inside a collective.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world_size,))
    linear = torch.nn.Linear(4, 4)
    linear.weight = torch.nn.Parameter(distribute_tensor(linear.weight.detach(), mesh, [Shard(1)]))
    linear.weight.grad = distribute_tensor(torch.ones(4, 4), mesh, [Shard(1)])
    refused = []
    for call in (lambda: sharded_state_dict(linear), lambda: seqpar.nn.clip_grad_norm_(linear, 1.0)):
        try:
            call()
        except ValueError as exc:
            refused.append("Shard(dim=1)" in str(exc) and "FSDP2" in str(exc))
    qkv = state["layers.0.self_attention.query_key_value.weight"]
    head = state["output_layer.weight"]
    return ([(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in qkv.local_shards()],
            [(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in head.local_shards()],
            tuple(qkv.size()), tuple(head.size()),
            qkv.local_shards()[0].tensor.data_ptr() == model.layers[0].self_attention.query_key_value.weight.data_ptr(),
            all(keys == set(state) for keys in ddp_keys), refused)


@pytest.mark.timeout(120)
def test_pieces_are_views_at_their_offsets_in_the_unsharded_tensor():
    """Also: DDP and compile(DDP(model)) give the model's keys; DTensor splits other than FSDP2's are refused."""
    # h = 64, 8 query heads and 4 KV groups of d = 8: Q rows 64, K rows 32, V rows 32, split over t = 4.
    results = run_ranks(_pieces_worker, 4, timeout_s=90)
    for rank, (qkv, head, qkv_size, head_size, is_view, same_keys_under_ddp, refused) in enumerate(results):
        assert same_keys_under_ddp and refused == [True, True], (rank, refused)
        assert qkv == [([16 * rank, 0], [16, 64]), ([64 + 8 * rank, 0], [8, 64]), ([96 + 8 * rank, 0], [8, 64])]
        # Padded to 512 rows, 128 a rank: all 50 real rows on rank 0; the others offer an empty piece.
        assert head == [([0, 0], [VOCAB, 64])] if rank == 0 else [([VOCAB, 0], [0, 64])]
        assert qkv_size == (128, 64) and head_size == (VOCAB, 64) and is_view


def _async_save_worker(rank, world_size, path):
    import torch.distributed.checkpoint as dcp

    model = _model(dist.group.WORLD, 0, "gpt")
    try:
        dcp.async_save({"model": sharded_state_dict(model)}, checkpoint_id=path).result()
    except RuntimeError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_async_save_of_split_tensors_fails_in_torch_s_staging_as_the_readme_says(tmp_path):
    """README and sharded_state_dict's docstring: save with dcp.save, not dcp.async_save, under TP (its
    staging copy reads data_ptr(), which a ShardedTensor refuses). When a torch release stages
    ShardedTensors this fails, and the caveat can go."""
    errors = run_ranks(_async_save_worker, 2, str(tmp_path / "async"), timeout_s=90)
    assert all(error is not None and "ShardedTensor" in error for error in errors), errors


def test_one_rank_values_are_plain_views_of_real_rows():
    model = _model(None, seed=1)
    state = sharded_state_dict(model)
    assert set(state) == set(model.full_shapes())
    head = state["output_layer.weight"]
    assert type(head) is torch.Tensor and head.shape == (VOCAB, 64)    # not the 128 padded rows
    assert head.data_ptr() == model.output_layer.weight.data_ptr()
    for key, value in model.full_state_dict().items():
        assert torch.equal(state[key], value), key


def test_misuse_is_a_value_error_naming_it():
    model = _model(None, seed=1)
    with torch.device("meta"):
        meta = _model(None, seed=1)
    with pytest.raises(ValueError, match="meta device"):
        sharded_state_dict(meta)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="1 parameter"):
        sharded_optimizer_state_dict(model, torch.optim.SGD(list(model.parameters()) + [other.weight], lr=0.1))
    optimizer = _optimizer(model)
    state = sharded_optimizer_state_dict(model, optimizer)
    state["param_groups"][0]["params"] = state["param_groups"][0]["params"][::-1]
    with pytest.raises(ValueError, match="param_groups"):
        load_sharded_optimizer_state_dict(model, optimizer, state)
    # an algorithm flag of the checkpoint's (amsgrad: its max_exp_avg_sq was not loaded: a KeyError at the
    # next step) is refused before anything is set; an implementation flag (foreach) may differ
    state = sharded_optimizer_state_dict(model, optimizer)
    state["param_groups"][0]["amsgrad"] = True
    lr = optimizer.param_groups[0]["lr"]
    state["param_groups"][0]["lr"] = 2 * lr
    with pytest.raises(ValueError, match="param group 0 has amsgrad=False where the checkpoint's had amsgrad=True"):
        load_sharded_optimizer_state_dict(model, optimizer, state)
    assert optimizer.param_groups[0]["lr"] == lr and not optimizer.param_groups[0]["amsgrad"]
    state["param_groups"][0]["amsgrad"], state["param_groups"][0]["foreach"] = False, True
    load_sharded_optimizer_state_dict(model, optimizer, state)
    assert optimizer.param_groups[0]["lr"] == 2 * lr
    param = next(model.parameters())
    optimizer.state[param]["exp_avg"] = torch.zeros(3)
    with pytest.raises(ValueError, match="'exp_avg' of embedding.word_embeddings.weight"):
        sharded_optimizer_state_dict(model, optimizer)


def test_placeholder_state_changes_nothing_in_the_optimizer_or_the_model():
    """A fresh optimizer's dict holds placeholders (made by the optimizer's own step at lr 0, zero
    gradients) that stay out of the optimizer: parameters, gradients, rates and state are untouched."""
    model = _model(None, seed=1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens, labels = _batch(0)
    model(tokens, labels).mean().backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    optimizer = _optimizer(model)
    state = sharded_optimizer_state_dict(model, optimizer)
    assert set(state["state"]) == set(before) and not any(int(v) for v in state["has_state"].values())
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, grads[k]) for k, p in model.named_parameters())
    assert optimizer.param_groups[0]["lr"] == LR and not optimizer.state
    placeholder = state["state"]["layers.0.mlp.dense_h_to_4h.weight"]
    assert set(placeholder) == {"step", "exp_avg", "exp_avg_sq"} and not placeholder["exp_avg"].any()


def test_placeholder_state_runs_no_step_hooks_and_a_fresh_optimizers_state_is_checked():
    """The placeholders came from the optimizer's public step(): its pre/post hooks ran (an EMA hook
    moved the EMA weights while saving) and an LR scheduler's wrapper counted a step. A fresh Adafactor
    (factored moments, not the parameter's shape) failed deep in torch instead of naming its state."""
    model = _model(None, seed=1)
    optimizer = _optimizer(model)
    calls = []
    optimizer.register_step_pre_hook(lambda *args: calls.append("pre"))
    optimizer.register_step_post_hook(lambda *args: calls.append("post"))
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    counted = optimizer._opt_called if hasattr(optimizer, "_opt_called") else None
    sharded_optimizer_state_dict(model, optimizer)
    assert calls == [] and scheduler.last_epoch == 0
    assert (optimizer._opt_called if hasattr(optimizer, "_opt_called") else None) == counted
    if hasattr(torch.optim, "Adafactor"):
        with pytest.raises(ValueError, match="state 'row_var' of .* must be a tensor of the parameter's shape"):
            sharded_optimizer_state_dict(model, torch.optim.Adafactor(model.parameters()))


def _three_steps(tmp_path, save, resume):
    """Three AdamW steps at t = 1; final_layernorm.weight is frozen for the first, so it has no state
    after it. ``save``: a checkpoint after step 1. ``resume``: steps 2-3 in a new model and optimizer
    resumed from it. Returns the final weights and whether final_layernorm.weight had state after the
    load (None without resume)."""
    import torch.distributed.checkpoint as dcp
    model = _model(None, seed=1)
    optimizer = _optimizer(model)
    model.final_layernorm.weight.requires_grad_(False)
    _train(model, optimizer, [0])
    model.final_layernorm.weight.requires_grad_(True)
    path, had_state = str(tmp_path / "ckpt"), None
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)   # one process
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        if save:
            dcp.save({"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)},
                     checkpoint_id=path)
        if resume:
            model = _model(None, seed=2)
            optimizer = _optimizer(model, lr=0.5)
            state = {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer)}
            dcp.load(state, checkpoint_id=path)
            load_sharded_optimizer_state_dict(model, optimizer, state["optim"])
            had_state = model.final_layernorm.weight in optimizer.state
    _train(model, optimizer, [1, 2])
    return model.full_state_dict(), had_state


def test_saving_changes_no_later_step_and_resume_keeps_stateless_parameters_stateless(tmp_path):
    """A parameter without optimizer state when the checkpoint is saved (frozen until then) has none
    after the resume either: its first update is a first step's, as in the run that never saved. The
    earlier design gave it state at the save (step 1, zero moments): AdamW's first update of it was then
    7.5e-3 instead of 1e-2, in the saving run too."""
    uninterrupted, _ = _three_steps(tmp_path / "a", save=False, resume=False)
    saving, _ = _three_steps(tmp_path / "b", save=True, resume=False)
    resumed, had_state = _three_steps(tmp_path / "c", save=True, resume=True)
    assert had_state is False
    for key, value in uninterrupted.items():
        assert torch.equal(saving[key], value) and torch.equal(resumed[key], value), key


def test_keys_leave_out_checkpointing_and_compile_wrappers():
    """A model whose layers carry activation checkpointing's wrapper, or a compiled one, saves and loads
    the plain model's keys (as full_state_dict() names them)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    plain = set(sharded_state_dict(_model(None, seed=1)))
    wrapped = _model(None, seed=1)
    apply_activation_checkpointing(wrapped, check_fn=lambda m: isinstance(m, seqpar.TransformerLayer))
    assert "_checkpoint_wrapped_module" in next(k for k, _ in wrapped.named_parameters() if k.startswith("layers"))
    assert set(sharded_state_dict(wrapped)) == plain == set(wrapped.full_state_dict())
    compiled = torch.compile(_model(None, seed=1))
    assert set(sharded_state_dict(compiled)) == plain
    optimizer = _optimizer(compiled)
    assert set(sharded_optimizer_state_dict(compiled, optimizer)["state"]) == plain
