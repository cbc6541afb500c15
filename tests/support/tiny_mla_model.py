"""A tiny DeepSeek-V2 (dense MLA: the GLM-5.x latent cache without the indexer) made locally, no hub access.

vLLM's CPU build runs dense MLA (AMX_MLA, bf16 latent rows of 1,152 B) but refuses DSA sparse attention,
so this is the model a real CPU engine can serve with GlmPdConnector between prefill and decode. Random
weights with a fixed seed, scaled so greedy decoding does not collapse onto one token; a byte-level BPE
tokenizer trained with ``tokenizers``.
"""

from __future__ import annotations

from pathlib import Path

import torch

TEXT = [
    "the quick brown fox jumps over the lazy dog",
    "prefill and decode run on separate nodes and the handoff moves the kv cache exactly",
    "glm pd plans the suffix pages and verifies every region before decode runs",
]


def make_model(
    path: Path,
    *,
    num_layers: int = 3,
    hidden_size: int = 256,
    intermediate_size: int = 512,
    num_heads: int = 4,
    head_dim: int = 64,
    max_positions: int = 4096,
) -> Path:
    """Write the model and its tokenizer to ``path``. The defaults are the tests' model; a benchmark that needs
    many bytes of KV per token raises ``num_layers`` (every layer dense) and shrinks the rest, which sets the
    prefill compute but not the 1,152 B latent row per token per layer. ``head_dim``: qk_nope and v head dims."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT * 50, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(path)
    config = DeepseekV2Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        moe_intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        kv_lora_rank=512,  # with qk_rope_head_dim 64: the 576-wide latent row, 1,152 B in bf16
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=head_dim,
        v_head_dim=head_dim,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=num_layers,
        max_position_embeddings=max_positions,
        eos_token_id=0,
        bos_token_id=0,
        rope_scaling=None,
    )
    model = DeepseekV2ForCausalLM(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                scale = 4.0 if "embed" in name or "lm_head" in name else 1.0
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5 * scale)
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path
