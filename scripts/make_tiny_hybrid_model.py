"""Make a tiny random hybrid model (Mamba2 + attention layers, IBM Granite
4.0's ``GraniteMoeHybridForCausalLM`` without experts) and its tokenizer in a
local folder, for real vLLM on CPU without the hub.

Usage: ``python scripts/make_tiny_hybrid_model.py DIR``. Deterministic (fixed
seeds). The tokenizer is the tiny llama's (scripts/make_tiny_model.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from make_tiny_model import make_tokenizer


def make_model(out: Path, vocab_size: int) -> None:
    """Save a random bf16 GraniteMoeHybrid: layer 0 Mamba2, layer 1 attention
    (4 heads, 2 KV heads, head_dim 32), a dense MLP (no experts)."""
    import torch
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    torch.manual_seed(0)
    hidden = 128
    config = GraniteMoeHybridConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        shared_intermediate_size=4 * hidden,
        num_local_experts=0,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        position_embedding_type="rope",
        max_position_embeddings=1024,
        mamba_n_heads=8,
        mamba_d_head=32,
        mamba_n_groups=1,
        mamba_d_state=16,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=64,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    model = GraniteMoeHybridForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1 and "conv1d" not in name:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(args.out, args.vocab_size)
    make_model(args.out, vocab)
    print(f"tiny hybrid model in {args.out} (vocab {vocab})")


if __name__ == "__main__":
    main()
