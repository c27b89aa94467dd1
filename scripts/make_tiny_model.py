"""Make a tiny random Llama model and its tokenizer in a local folder, for
running real vLLM on CPU without the hub (``docs/vllm.md``).

Usage: ``python scripts/make_tiny_model.py DIR [--head-dim 32]
[--sliding-window W]`` (W: layer 0 attends to a sliding window of W tokens,
layer 1 to everything, like Gemma's alternating pattern). Deterministic
(fixed seeds), so two runs make the same weights. Needs torch, tokenizers and
transformers: vLLM's environment has them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Text for the byte-level BPE: enough merges for prompts of a few dozen tokens.
_CORPUS = [
    "KVGuard is a prefill decode proxy that never serves a corrupted KV cache.",
    "The producer checksums the prompt's key and value blocks after prefill.",
    "The consumer checksums every block it loads and compares the sums.",
    "A mismatch fails the load; the proxy retries on another prefill.",
    "Large language models attend over keys and values of earlier tokens.",
    "Disaggregated serving splits prefill and decode onto separate instances.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Numbers one two three four five six seven eight nine ten eleven twelve.",
    "Bits flip in memory, on the wire and in buggy kernels more often than",
    "anyone would like, and a silent flip in the cache changes every answer.",
]


def make_tokenizer(out: Path, vocab_size: int) -> int:
    """Train a byte-level BPE on the corpus and save it; returns its size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(out)
    return len(fast)


def make_model(
    out: Path, vocab_size: int, head_dim: int, sliding_window: int | None = None
) -> None:
    """Save a random bf16 LlamaForCausalLM (2 layers, 4 heads, 2 KV heads),
    its first layer windowed if ``sliding_window`` is given."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    num_heads = 4
    window: dict[str, object] = {}
    if sliding_window is not None:
        window = {
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": sliding_window,
        }
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=num_heads * head_dim,
        intermediate_size=4 * num_heads * head_dim,
        num_hidden_layers=2,
        num_attention_heads=num_heads,
        num_key_value_heads=2,
        head_dim=head_dim,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=1,
        torch_dtype="bfloat16",
        tie_word_embeddings=False,
        **window,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    # Larger than default init, so greedy decoding depends on the whole context
    # (and so on every bit of the KV cache) rather than settling on one token.
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    model.save_pretrained(out, safe_serialization=True)
    # Temperature 0 everywhere unless asked otherwise.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False})
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--head-dim", type=int, default=32, choices=(32, 64))
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--sliding-window", type=int, default=None)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    vocab = make_tokenizer(args.out, args.vocab_size)
    make_model(args.out, vocab, args.head_dim, args.sliding_window)
    print(f"tiny model in {args.out} (vocab {vocab}, head_dim {args.head_dim})")


if __name__ == "__main__":
    main()
