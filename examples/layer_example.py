"""seqpar.TransformerLayer in your own code: tensor + sequence parallelism with selective recompute.

    torchrun --nproc-per-node 2 examples/layer_example.py                  # CPU, gloo
    torchrun --nproc-per-node 8 examples/layer_example.py --device cuda    # one GPU per rank, NCCL

Every rank builds the layer from the same unsharded weights, feeds its own sequence shard, runs forward
and backward, and measures the activation memory it keeps against the paper's Table 2. Rank 0 then checks
the sharded result against one unsharded layer run from the same seed (dropout included: the masks depend
only on the seed and global coordinates, never on the tensor-parallel layout).
"""
import argparse
import os

import torch
import torch.distributed as dist

import seqpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    args = parser.parse_args()
    for name in ("seq_len", "batch", "hidden", "heads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.hidden % args.heads:
        parser.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if args.seq_len % world or args.heads % world:
        parser.error(f"--seq-len {args.seq_len} and --heads {args.heads} must be divisible by the {world} ranks")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available")

    # torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT.
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    tp_group = dist.group.WORLD           # all ranks form one tensor-parallel group (or pass any subgroup)
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    s, b, h = args.seq_len, args.batch, args.hidden

    seqpar.manual_seed(1234)              # the same seed on every rank
    cfg = seqpar.TransformerConfig(hidden_size=h, num_attention_heads=args.heads,
                                   hidden_dropout=0.1, attention_dropout=0.1,
                                   sequence_parallel=True, recompute="selective", params_dtype=dtype)
    layer = seqpar.TransformerLayer(cfg, tp_group=tp_group, device=device, layer_number=0)
    # Optional: every rank loads the same UNSHARDED weights (PyTorch Linear layout) and keeps its shard.
    unsharded_state_dict = {key: torch.randn(shape, generator=torch.Generator().manual_seed(i)) * 0.02
                            for i, (key, shape) in enumerate(layer.full_shapes().items())}
    layer.load_full_state_dict(unsharded_state_dict)

    # Every rank sees the same full input here; each feeds its sequence shard [s/t, b, h].
    x_full = torch.randn(s, b, h, generator=torch.Generator().manual_seed(0)).to(device, dtype)
    x = seqpar.parallel.sequence_shard(x_full, tp_group).clone().requires_grad_()
    y = layer(x)                          # [s/t, b, h]; causal self-attention
    y.float().square().mean().backward()  # LayerNorm and bias gradients arrive summed over the group

    with seqpar.memory.ActivationMeter() as meter:
        layer(x)
    table2 = seqpar.memory.layer_activation_bytes(s, b, h, args.heads, tp=tp, sequence_parallel=True,
                                                  recompute="selective", bytes_per_element=x.element_size())

    # Check against one unsharded layer (t = 1) built from the same weights and seed.
    y_parts = [torch.empty_like(y) for _ in range(tp)]
    dist.all_gather(y_parts, y.detach().contiguous(), group=tp_group)
    if rank == 0:
        seqpar.manual_seed(1234)
        reference = seqpar.TransformerLayer(seqpar.TransformerConfig(
            hidden_size=h, num_attention_heads=args.heads, hidden_dropout=0.1, attention_dropout=0.1,
            params_dtype=dtype), device=device, layer_number=0)
        reference.load_full_state_dict(unsharded_state_dict)
        y_reference = reference(x_full)
        error = (torch.cat(y_parts) - y_reference).abs().max().item()
        print(f"t={tp}: y {list(y.shape)} per rank; max |y - unsharded y| = {error:.2e}")
        print(f"activation bytes per rank: {meter.bytes:,} measured, {table2:,.0f} Table 2 "
              f"(ratio {meter.bytes / table2:.2f}: dropout masks are regenerated, not stored)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
