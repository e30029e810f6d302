"""Fine-tune a HuggingFace GPT-2 with seqpar (tensor + sequence parallelism, selective recompute) and hand
the weights back: examples/hf_finetune.py's loop for GPT-2 (its options, less --family; Llama:
``examples/hf_finetune.py --family llama``).

    torchrun --nproc-per-node 2 examples/hf_gpt2_finetune.py --steps 20     # CPU, a small random GPT-2
    torchrun --nproc-per-node 8 examples/hf_gpt2_finetune.py --model gpt2-medium --dtype bf16 --seq-len 1024
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_finetune  # noqa: E402

if __name__ == "__main__":
    hf_finetune.main(family="gpt2")
