"""The worked example of the PagedAttention notes, reproduced with prefixcache.

Sequences of 10 and 7 tokens, block size 4, sharing their first block through the manager's
prefix matching. Prints the figures in the notes' key=value format:

    python examples/paged_attention_reference.py
"""

import torch

from prefixcache.demo import format_demo, run_demo

if __name__ == "__main__":
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.inference_mode():
        print(format_demo(run_demo(device), device))
