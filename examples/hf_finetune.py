"""Fine-tune a HuggingFace GPT-2 or Llama (Mistral, Qwen2, Qwen3, Phi-3) with seqpar: tensor + sequence parallelism and
selective recompute, then hand the weights back to the HuggingFace model.

    # CPU, 2 gloo ranks, a small randomly initialised model (nothing downloaded):
    torchrun --nproc-per-node 2 examples/hf_finetune.py --steps 20
    torchrun --nproc-per-node 2 examples/hf_finetune.py --family llama --heads 8 --kv-heads 2 --steps 20
    # a resumable checkpoint after step 10, then 10 more steps on 1 rank (any number of ranks resumes it):
    torchrun --nproc-per-node 2 examples/hf_finetune.py --steps 10 --checkpoint ckpt
    torchrun --nproc-per-node 1 examples/hf_finetune.py --steps 20 --resume ckpt
    # data parallelism too: 2 FSDP2 replicas of a 2-rank tensor-parallel group, each its own batch:
    torchrun --nproc-per-node 4 examples/hf_finetune.py --data-parallel 2 --steps 20
    # GPUs (NCCL), pretrained weights (a hub name or a local directory), bf16:
    torchrun --nproc-per-node 8 examples/hf_finetune.py --model gpt2-medium --dtype bf16 --seq-len 1024
    torchrun --nproc-per-node 4 examples/hf_finetune.py --family llama \
        --model TinyLlama/TinyLlama-1.1B-Chat-v1.0 --dtype bf16 --seq-len 2048
    torchrun --nproc-per-node 8 examples/hf_finetune.py --family llama \
        --model meta-llama/Llama-3.1-8B --dtype bf16 --seq-len 8192   # Llama 3.1's scaled RoPE included
    torchrun --nproc-per-node 2 examples/hf_finetune.py --family qwen2 \
        --model Qwen/Qwen2.5-0.5B --dtype bf16 --seq-len 2048          # q / k / v biases, tied head
    torchrun --nproc-per-node 8 examples/hf_finetune.py --family qwen3 \
        --model Qwen/Qwen3-8B --dtype bf16 --seq-len 4096              # per-head q / k norms
    torchrun --nproc-per-node 2 examples/hf_finetune.py --family phi3 \
        --model microsoft/phi-4 --dtype bf16 --seq-len 4096            # fused projections

Every rank of the tensor-parallel group (all ranks, or WORLD_SIZE / --data-parallel of them) loads the
same model and sees the same batch; seqpar keeps each rank's shard. With ``--data-parallel N`` the ranks
form a 2-D mesh (N replicas x t tensor-parallel ranks, README "Multi-GPU"): FSDP2 shards each replica's
weights over the replicas, each replica trains on its own rows of the global batch (N x --batch rows).
Each step prints the loss (HF's: the mean over the predicted tokens of the global batch) and the
activation memory this rank kept for backward (seqpar.memory.ActivationMeter), next to
seqpar.memory.model_activation_bytes' figure for the whole model (the paper's Table 2 per layer for
GPT-2's block, plus the embedding and the logits). Replace ``batches()`` with your data.

``--checkpoint`` saves the model, the AdamW state, the step and seqpar's RNG state
(``seqpar.random.get_rng_state()``: the seqpar seed and torch's CPU generator, which together decide the
dropout seeds) with torch.distributed.checkpoint, each rank writing only its shards (``checkpoint_state``);
``--resume`` loads it at any number of ranks and continues the same run: seqpar's dropout masks do not
depend on the tensor-parallel size.
"""
import argparse
import math
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import seqpar
from seqpar.integrations import hf
from seqpar.nn import (clip_grad_norm_, load_sharded_optimizer_state_dict, sharded_optimizer_state_dict,
                       sharded_state_dict)
from seqpar.memory import ActivationMeter, architecture_kwargs, model_activation_bytes
from seqpar.ops import select_attention_backend

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: --family -> (its transformers config and causal-LM classes); all but gpt2 convert with hf.from_llama
FAMILIES = {"gpt2": ("GPT2Config", "GPT2LMHeadModel"), "llama": ("LlamaConfig", "LlamaForCausalLM"),
            "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM")}


def parse_args(family=None):
    """The options; ``family`` given: the script is that family's (no --family option)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if family is None:
        parser.add_argument("--family", choices=sorted(FAMILIES), default="gpt2",
                            help="GPT2LMHeadModel (hf.from_gpt2), or LlamaForCausalLM, MistralForCausalLM, "
                                 "Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM (hf.from_llama)")
    else:
        parser.set_defaults(family=family)
    parser.add_argument("--model", help="model to fine-tune (from_pretrained name or directory); "
                                        "default: a random one of --layers/--hidden/--heads/--kv-heads")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    if family != "gpt2":
        parser.add_argument("--kv-heads", type=int,
                            help="llama / mistral / qwen2 / qwen3 / phi3: k/v heads (default: --heads)")
    else:
        parser.set_defaults(kv_heads=None)
    parser.add_argument("--seq-len", type=int, default=64, help="divisible by the number of ranks (SP)")
    parser.add_argument("--batch", type=int, default=4, help="sequences per replica")
    parser.add_argument("--data-parallel", type=int, default=1,
                        help="replicas (FSDP2), each of WORLD_SIZE / this tensor-parallel ranks")
    parser.add_argument("--steps", type=int, default=10, help="the last step (a resumed run continues to it)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--clip-grad", type=float, default=1.0,
                        help="max norm of the unsharded gradients (seqpar.nn.clip_grad_norm_); 0: no clipping")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--recompute", choices=["none", "selective", "full"], default="selective")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel", action="store_false")
    parser.add_argument("--dropout", type=float, help="gpt2: override its resid/attn/embd dropout")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--save", help="directory for the fine-tuned model (save_pretrained, rank 0)")
    parser.add_argument("--checkpoint", help="directory for a resumable checkpoint after the last step "
                                             "(torch.distributed.checkpoint, every rank writes its shards)")
    parser.add_argument("--resume", help="checkpoint directory to continue from (saved at any number of ranks)")
    args = parser.parse_args()
    if args.family == "gpt2" and args.kv_heads is not None:
        parser.error("--kv-heads is for the Llama family (--family llama, mistral, qwen2, qwen3, phi3)")
    if args.family != "gpt2" and args.dropout is not None:
        parser.error("--dropout is for --family gpt2 (the Llama family's dropout is its config's)")
    if args.resume and not os.path.isdir(args.resume):
        parser.error(f"--resume {args.resume} is not a directory (a --checkpoint directory of an earlier run)")
    if not args.clip_grad >= 0:
        parser.error(f"--clip-grad must be >= 0 (0: no clipping), got {args.clip_grad}")
    for name in ("layers", "hidden", "heads", "seq_len", "batch", "steps", "data_parallel", "kv_heads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world % args.data_parallel:
        parser.error(f"--data-parallel {args.data_parallel} must divide the {world} ranks")
    t = world // args.data_parallel        # each replica's tensor-parallel ranks
    if args.sequence_parallel and args.seq_len % t:
        parser.error(f"--seq-len {args.seq_len} must be divisible by the {t} ranks (sequence parallelism; "
                     f"or --no-sequence-parallel)")
    if args.model is None:  # the random model's sizes (a pretrained model brings its own, checked on load)
        kv_heads = args.kv_heads or args.heads
        if args.hidden % args.heads:
            parser.error(f"--hidden {args.hidden} must be divisible by --heads {args.heads}")
        if args.heads % kv_heads:
            parser.error(f"--heads {args.heads} must be divisible by --kv-heads {kv_heads}")
        if kv_heads % t:
            parser.error(f"the {kv_heads} k/v heads must be divisible by the {t} ranks")
    return args


def random_model(args):
    """A randomly initialised HF model of the requested size (the same on every rank: torch seed)."""
    torch.manual_seed(args.seed)
    positions = max(args.seq_len, 128)
    if args.family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=args.layers, n_embd=args.hidden, n_head=args.heads, n_positions=positions))
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[args.family])
    extra = dict(sliding_window=None) if args.family == "mistral" else {}   # seqpar's attention is full causal
    if args.family == "qwen3":   # heads twice hidden / heads wide, as Qwen3-0.6B's (128 channels, h 1024, 16 heads)
        extra = dict(head_dim=2 * args.hidden // args.heads)
    if args.family == "phi3":    # Phi3Config's default pad / bos / eos ids (32000, 1) are not this vocabulary's
        extra = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)
    return model_class(config_class(
        num_hidden_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads, intermediate_size=11 * args.hidden // 4,
        vocab_size=1000, max_position_embeddings=positions, **extra))


def batches(vocab_size, args, device, replica=0, step=0):
    """Stand-in data: a few fixed random global batches (--data-parallel x --batch sequences), cycled,
    from the batch of ``step``; a replica takes its rows (the same on every rank of its tensor-parallel
    group). Yields HF-style (input_ids, labels) with labels = input_ids (HF shifts them inside its loss)."""
    gen = torch.Generator().manual_seed(args.seed)
    pool = torch.randint(0, vocab_size, (2, args.data_parallel * args.batch, args.seq_len), generator=gen)
    while True:
        input_ids = pool[step % len(pool), replica * args.batch:(replica + 1) * args.batch].to(device)
        yield input_ids, input_ids.clone()
        step += 1


def checkpoint_state(model, optimizer, step):
    """What a checkpoint holds, as torch.distributed.checkpoint saves and loads it (in place): the model's
    and the optimizer's sharded state dicts (keyed by the unsharded tensors, so any tensor-parallel size
    loads them), the step, and seqpar's RNG state (the seqpar seed and torch's CPU generator state: what
    decides the dropout seeds; the same on every rank)."""
    return {"model": sharded_state_dict(model), "optim": sharded_optimizer_state_dict(model, optimizer),
            "step": torch.tensor(step), "rng": seqpar.random.get_rng_state()}


def resume(path, model, optimizer):
    """Load the checkpoint at ``path`` into the model, the optimizer and seqpar's RNG state; its step."""
    state = checkpoint_state(model, optimizer, 0)
    with warnings.catch_warnings():   # DCP's own code reads a ShardedTensor's device, which it deprecated
        warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
        dcp.load(state, checkpoint_id=path)
    load_sharded_optimizer_state_dict(model, optimizer, state["optim"])   # fresh parameters' state, lr, betas
    seqpar.random.set_rng_state(state["rng"])
    return int(state["step"])


def main(family=None):
    args = parse_args(family)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, replicas = dist.get_rank(), args.data_parallel
    t = dist.get_world_size() // replicas
    mesh = init_device_mesh(device.type, (replicas, t), mesh_dim_names=("dp", "tp"))
    tp_group, replica = mesh["tp"].get_group(), mesh["dp"].get_local_rank()

    # The same model on every rank: pretrained, or random from a fixed torch seed.
    # A pretrained model in its own class (a Qwen2 loaded as a LlamaForCausalLM would lose its q / k / v biases)
    hf_model = (transformers.AutoModelForCausalLM.from_pretrained(args.model) if args.model
                else random_model(args)).to(DTYPES[args.dtype])

    seqpar.manual_seed(args.seed)      # the same seed on every rank: dropout masks agree across ranks
    common = dict(tp_group=tp_group, sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                  device=device)
    if args.family == "gpt2":
        model = hf.from_gpt2(hf_model, dropout=args.dropout, **common).train()
    else:
        # max_seq_len: the length trained on (a sliding window at least that long converts: Mistral v0.1)
        model = hf.from_llama(hf_model, max_seq_len=args.seq_len, **common).train()
    if replicas > 1:                   # FSDP2 over the replicas: each layer, then the rest
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    done = resume(args.resume, model, optimizer) if args.resume else 0
    if done >= args.steps:
        sys.exit(f"--steps {args.steps}: the checkpoint in {args.resume} is already after step {done}")
    cfg = model.config
    if rank == 0:
        print(f"{args.family} {len(model.layers)} layers, h={cfg.hidden_size}, {cfg.num_attention_heads} heads "
              f"({cfg.num_query_groups or cfg.num_attention_heads} k/v), vocab "
              f"{model.vocab_size} (padded to {model.padded_vocab_size}); t={t} x {replicas} FSDP2 replicas, "
              f"SP={cfg.sequence_parallel}, "
              f"recompute={cfg.recompute}, {args.dtype} on {device.type}"
              + (f"; resumed from {args.resume} after step {done}" if args.resume else ""), flush=True)
    # The whole model's formula: the block's terms, no dropout-mask bytes (seqpar regenerates masks), and
    # flash-style attention (o and the fp32 LSE instead of s^2 probabilities) when the backend that runs
    # here is (triton on a GPU).
    q = torch.empty(args.batch, cfg.num_attention_heads // t, args.seq_len, cfg.head_dim, device=device,
                    dtype=cfg.params_dtype)
    flash = select_attention_backend(q, q, q, causal=True, backend=cfg.backend).recompute_free
    formula = model_activation_bytes(
        args.seq_len, args.batch, cfg.hidden_size, cfg.num_attention_heads, len(model.layers), model.vocab_size,
        tp=t, sequence_parallel=cfg.sequence_parallel, recompute=cfg.recompute,
        bytes_per_element=torch.finfo(cfg.params_dtype).bits // 8, bytes_per_mask=0, flash_attention=flash,
        **architecture_kwargs(cfg))

    data = batches(model.vocab_size, args, device, replica, done)
    for step in range(done + 1, args.steps + 1):
        input_ids, hf_labels = next(data)
        labels = hf.shift_labels(hf_labels)          # GPTModel takes labels already shifted
        with ActivationMeter() as meter:
            loss_per_token = model(input_ids, labels)    # [s, b], 0 where labels == -100
        loss = loss_per_token.sum() / (labels != -100).sum()
        loss.backward()
        # The norm of the whole (unsharded) model's gradients, the same on every rank: torch's clip on a
        # rank's shards would clip each rank by another factor.
        grad_norm = clip_grad_norm_(model, args.clip_grad if args.clip_grad > 0 else math.inf)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if replicas > 1:                 # the global batch's loss: the replicas' mean (equal token counts)
            loss = loss.detach().clone()
            dist.all_reduce(loss, group=mesh["dp"].get_group())
            loss /= replicas
        if rank == 0:
            peak = f", peak allocated {torch.cuda.max_memory_allocated() / 2**20:.1f} MiB" if cuda else ""
            print(f"step {step}/{args.steps} loss {loss.item():.4f} grad norm {grad_norm.item():.3f} "
                  f"activations {meter.bytes / 2**20:.2f} MiB "
                  f"on this rank (formula: {formula / 2**20:.2f} MiB){peak}", flush=True)

    if args.checkpoint:   # every rank, its own shards (and one copy of the replicated tensors)
        dcp.save(checkpoint_state(model, optimizer, args.steps), checkpoint_id=args.checkpoint)
        if rank == 0:
            print(f"checkpoint after step {args.steps} in {args.checkpoint}", flush=True)

    # Hand the weights back: a collective (every rank calls it), then any rank can load them.
    # In the loaded model's own family (a pretrained --model keeps its class whatever --family says): Phi-3's
    # keys are its own (fused projections)
    state_dict = hf.to_gpt2_state_dict(model) if args.family == "gpt2" else \
        hf.to_llama_state_dict(model, model_type=hf_model.config.model_type)
    model.eval()
    with torch.no_grad():
        seqpar_loss = model(input_ids, labels).sum() / (labels != -100).sum()
    if rank == 0:
        hf_model.load_state_dict(state_dict, strict=True)
        hf_model.to(device).eval()
        with torch.no_grad():
            hf_loss = hf_model(input_ids, labels=hf_labels).loss
        print(f"last batch: seqpar eval loss {seqpar_loss.item():.6f}, HF model after the hand-back "
              f"{hf_loss.item():.6f}", flush=True)
        if args.save:
            hf_model.save_pretrained(args.save)
            print(f"saved to {args.save}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
