"""The config files of the models the recipes name (Qwen3-8B and -1.7B, SmolLM2-135M and -360M
Instruct), as their hub repositories publish them, laid out as Hugging Face's cache holds a
download: enough for a dry run, which reads configs and no weights, on a machine without the hub."""

from __future__ import annotations

import json
from pathlib import Path

QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
SMOLLM2 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 49152,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
CONFIGS = {
    "Qwen/Qwen3-8B": QWEN3
    | {
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "tie_word_embeddings": False,
    },
    "Qwen/Qwen3-1.7B": QWEN3
    | {
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
    },
    "HuggingFaceTB/SmolLM2-135M-Instruct": SMOLLM2
    | {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
    },
    "HuggingFaceTB/SmolLM2-360M-Instruct": SMOLLM2
    | {
        "hidden_size": 960,
        "intermediate_size": 2560,
        "num_hidden_layers": 32,
        "num_attention_heads": 15,
        "num_key_value_heads": 5,
    },
}


def parameters(repo: str) -> int:
    """The parameter count of ``repo``, by hand from its config: embeddings (and an untied head),
    per layer the attention projections, the MLP's three and two norms (Qwen3 adds a norm of the
    queries and keys), and the final norm."""
    c = CONFIGS[repo]
    hidden, layers, inter = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
    head_dim = c.get("head_dim", hidden // c["num_attention_heads"])
    queries, keys = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    attention = hidden * queries + 2 * hidden * keys + queries * hidden
    norms = 2 * hidden + (2 * head_dim if c["model_type"] == "qwen3" else 0)
    per_layer = attention + 3 * hidden * inter + norms
    embeddings = c["vocab_size"] * hidden * (1 if c["tie_word_embeddings"] else 2)
    return embeddings + layers * per_layer + hidden


def lora_parameters(repo: str, rank: int) -> int:
    """LoRA of ``rank`` on every linear layer but the head: r x (in + out) each."""
    c = CONFIGS[repo]
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    head_dim = c.get("head_dim", hidden // c["num_attention_heads"])
    queries, keys = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    sides = (hidden + queries) * 2 + (hidden + keys) * 2 + (hidden + inter) * 3
    return c["num_hidden_layers"] * rank * sides


def hub_cache(root: Path) -> Path:
    """A Hugging Face cache at ``root`` holding each model's config.json."""
    for repo, config in CONFIGS.items():
        snapshot = root / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text(json.dumps(config))
        (snapshot.parents[1] / "refs").mkdir()
        (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    return root
