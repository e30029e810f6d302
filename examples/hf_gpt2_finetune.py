"""Fine-tune a HuggingFace GPT-2 with seqpar: tensor + sequence parallelism and selective recompute,
then hand the weights back to the HuggingFace model.

    # CPU, 2 gloo ranks, a small randomly initialised GPT-2 (nothing downloaded):
    torchrun --nproc-per-node 2 examples/hf_gpt2_finetune.py --steps 20
    # GPUs (NCCL), pretrained weights (a hub name or a local directory), bf16:
    torchrun --nproc-per-node 8 examples/hf_gpt2_finetune.py --model gpt2-medium --dtype bf16 --seq-len 1024

Every rank of the tensor-parallel group (here: all ranks) loads the same GPT-2 and sees the same
batch; seqpar keeps each rank's shard. Each step prints the loss (HF's: the mean over the predicted
tokens) and the activation memory this rank kept for backward (seqpar.memory.ActivationMeter), next
to the paper's Table 2 figure for the transformer layers alone. Replace ``batches()`` with your data.
"""
import argparse
import os

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel

import seqpar
from seqpar.integrations import hf
from seqpar.memory import ActivationMeter, layer_activation_bytes

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="GPT-2 to fine-tune (from_pretrained name or directory); "
                                        "default: a random GPT-2 of --layers/--hidden/--heads")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64, help="divisible by the number of ranks (SP)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="selective")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    parser.add_argument("--dropout", type=float, help="override GPT-2's resid/attn/embd dropout")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save", help="directory for the fine-tuned GPT-2 (save_pretrained, rank 0)")
    return parser.parse_args()


def batches(vocab_size, args, device):
    """Stand-in data: a few fixed random sequences, cycled (the same on every rank of the group).
    Yields HF-style (input_ids, labels) with labels = input_ids (HF shifts them inside its loss)."""
    gen = torch.Generator().manual_seed(args.seed)
    pool = torch.randint(0, vocab_size, (2, args.batch, args.seq_len), generator=gen)
    step = 0
    while True:
        input_ids = pool[step % len(pool)].to(device)
        yield input_ids, input_ids.clone()
        step += 1


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, t = dist.get_rank(), dist.get_world_size()
    tp_group = dist.group.WORLD        # with data parallelism too, build the TP groups with dist.new_group

    # The same GPT-2 on every rank: pretrained, or random from a fixed torch seed.
    if args.model:
        gpt2 = GPT2LMHeadModel.from_pretrained(args.model)
    else:
        torch.manual_seed(args.seed)
        gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.heads,
                                          n_positions=max(args.seq_len, 128)))
    gpt2.to(DTYPES[args.dtype])

    seqpar.manual_seed(args.seed)      # the same seed on every rank: dropout masks agree across ranks
    model = hf.from_gpt2(gpt2, tp_group=tp_group, sequence_parallel=args.sequence_parallel,
                         recompute=args.recompute, device=device, dropout=args.dropout).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    cfg = model.config
    if rank == 0:
        print(f"GPT-2 {len(model.layers)} layers, h={cfg.hidden_size}, {cfg.num_attention_heads} heads, vocab "
              f"{model.vocab_size} (padded to {model.padded_vocab_size}); t={t}, SP={cfg.sequence_parallel}, "
              f"recompute={cfg.recompute}, {args.dtype} on {device.type}", flush=True)
    table2 = len(model.layers) * layer_activation_bytes(
        args.seq_len, args.batch, cfg.hidden_size, cfg.num_attention_heads, tp=t,
        sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
        bytes_per_element=torch.finfo(cfg.params_dtype).bits // 8)

    data = batches(model.vocab_size, args, device)
    for step in range(1, args.steps + 1):
        input_ids, hf_labels = next(data)
        labels = hf.shift_labels(hf_labels)          # GPTModel takes labels already shifted
        with ActivationMeter() as meter:
            loss_per_token = model(input_ids, labels)    # [s, b], 0 where labels == -100
        loss = loss_per_token.sum() / (labels != -100).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rank == 0:
            peak = f", peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if cuda else ""
            print(f"step {step}/{args.steps} loss {loss.item():.4f} activations {meter.bytes / 2**20:.2f} MiB "
                  f"on this rank (Table 2, layers only: {table2 / 2**20:.2f} MiB){peak}", flush=True)

    # Hand the weights back: a collective (every rank calls it), then any rank can load them.
    state_dict = hf.to_gpt2_state_dict(model)
    model.eval()
    with torch.no_grad():
        seqpar_loss = model(input_ids, labels).sum() / (labels != -100).sum()
    if rank == 0:
        gpt2.load_state_dict(state_dict, strict=True)
        gpt2.to(device).eval()
        with torch.no_grad():
            hf_loss = gpt2(input_ids, labels=hf_labels).loss
        print(f"last batch: seqpar eval loss {seqpar_loss.item():.6f}, HF model after the hand-back "
              f"{hf_loss.item():.6f}", flush=True)
        if args.save:
            gpt2.save_pretrained(args.save)
            print(f"saved to {args.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
