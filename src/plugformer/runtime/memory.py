"""A guard before building a model from a config: its parameter count in closed form, the bytes that weights (and,
when training, gradients and AdamW's two moments) take, against the memory available, refused with the fields that
drive the size unless `PLUGFORMER_SKIP_MEMORY_CHECK=1`.

The estimate is a lower bound (activations, the data, the allocator's slack and a second copy during a load are not
counted): a refusal means the model cannot fit, never that it might not. `tests/test_red_team.py` checks the count
against `sum(p.numel())` of real models.
"""

from __future__ import annotations

import os

import torch

from ..positions import POSITION_SCHEMES
from ..scores import ATTENTION_SCORES
from .files import size_text


OVERRIDE = "PLUGFORMER_SKIP_MEMORY_CHECK"
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim")  # fmt: skip
# bytes per parameter: fp32 weights; training adds an fp32 gradient and AdamW's two fp32 moments
INFERENCE_BYTES, TRAINING_BYTES = 4, 16


def attention_parameters(config) -> int:
    """q, k, v, o projections (GQA: k and v have `num_key_value_heads`) and the score function's own weights."""
    h, heads, kv_heads, d = config.hidden_size, config.num_attention_heads, config.num_key_value_heads, config.head_dim
    count = 2 * h * heads * d + 2 * h * kv_heads * d
    if config.attention_bias:
        count += heads * d + 2 * kv_heads * d + h
    if config.use_qk_norm:  # one (d,) gain each for q and k
        count += 2 * d
    if config.use_attention_sinks:  # one logit per query head
        count += heads
    return count + score_parameters(config)


def score_parameters(config) -> int:
    """The score function's own weights, read off its registered class built on the meta device (no memory): a new
    score is counted without an entry here."""
    with torch.device("meta"):
        score = ATTENTION_SCORES.get(config.attention_score)(config)
    return sum(parameter.numel() for parameter in score.parameters())


def norm_parameters(config) -> int:
    return {"layernorm": 2, "rmsnorm": 1}[config.norm_type] * config.hidden_size


def block_parameters(config, cross_attention: bool = False) -> int:
    """One block: self-attention, feed-forward (`glu` has a gate beside up), their two norms (+ cross-attention)."""
    h, i, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
    matrices = 3 if config.ffn_type == "glu" else 2
    ffn = matrices * h * i + ((matrices - 1) * i + h if bias else 0)
    count = attention_parameters(config) + ffn + 2 * norm_parameters(config)
    if cross_attention:
        count += attention_parameters(config) + norm_parameters(config)
    return count


def position_parameters(config, bidirectional: bool) -> int:
    """The position scheme's own weights (one set per stack), read off its registered class built on the meta device
    (no memory): a new scheme with weights (`kerple_log`'s coefficients) is counted without an entry here."""
    with torch.device("meta"):
        scheme = POSITION_SCHEMES.get(config.position_scheme)(config, bidirectional=bidirectional)
    return sum(parameter.numel() for parameter in scheme.parameters())


def stack_parameters(config, layers: int, bidirectional: bool, cross_attention: bool = False) -> int:
    """A stack without its token embedding: position tables, blocks, the final norm (pre-norm only)."""
    final_norm = norm_parameters(config) if config.norm_placement == "pre" else 0
    blocks = layers * block_parameters(config, cross_attention)
    return position_parameters(config, bidirectional) + blocks + final_norm


def parameter_count(config, head: str | None = None) -> int:
    """Parameters of the model `config` builds, shared (tied) ones counted once.

    Args:
        config ([`PlugformerConfig`]): The configuration.
        head (`str`, *optional*): `causal_lm`, `masked_lm`, `seq2seq`, `sequence_classification` or
            `token_classification`; by default the LM head the config implies (seq2seq, causal or masked).
    """
    head = head or ("seq2seq" if config.is_encoder_decoder else "causal_lm" if config.is_causal else "masked_lm")
    h, vocab = config.hidden_size, config.vocab_size
    embedding = vocab * h
    lm_head = 0 if config.tie_word_embeddings else vocab * h
    if head == "seq2seq":  # the decoder shares the encoder's embedding
        encoder = stack_parameters(config, config.num_hidden_layers, bidirectional=True)
        decoder = stack_parameters(config, config.num_decoder_layers, bidirectional=False, cross_attention=True)
        return embedding + encoder + decoder + lm_head
    stack = embedding + stack_parameters(config, config.num_hidden_layers, bidirectional=not config.is_causal)
    heads = {
        "causal_lm": lm_head,
        "masked_lm": lm_head,
        "sequence_classification": config.num_labels * h,  # no bias
        "token_classification": config.num_labels * h + config.num_labels,
    }
    if head not in heads:
        raise ValueError(f"head={head!r}: choose one of {['seq2seq', *heads]}")
    return stack + heads[head]


def available_memory(device: str | None = None) -> tuple[int | None, str]:
    """(bytes available, where) on `device` (`cuda[:N]` or `cpu`; by default CUDA when present): the free device
    memory, or the system's MemAvailable."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if str(device).startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return free, f"{device} has"
    try:
        import psutil  # accelerate's dependency

        return psutil.virtual_memory().available, "this machine has"
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "this machine has"
    except OSError:
        pass
    return None, "unknown"


def check_model_fits(config, training: bool, device: str | None = None, copies: int = 1, what: str = "") -> None:
    """Raises `ValueError` naming the size fields, the estimate and the memory available when the parameters (with
    `training`, also their gradients and AdamW's moments; `copies` models at once) exceed it; skipped when
    `PLUGFORMER_SKIP_MEMORY_CHECK` is set to anything but 0/false/no."""
    if os.environ.get(OVERRIDE, "").strip().lower() not in ("", "0", "false", "no"):
        return
    available, where = available_memory(device)
    if available is None:
        return
    parameters = parameter_count(config)
    per_parameter = TRAINING_BYTES if training else INFERENCE_BYTES
    needed = parameters * per_parameter * copies
    if needed <= available:
        return
    fields = ", ".join(f"{name}={getattr(config, name)}" for name in SIZE_FIELDS)
    kind = "fp32 weights, gradients and AdamW's two moments" if training else "fp32 weights"
    raise ValueError(
        f"{what + ': ' if what else ''}{fields} make {parameters / 1e9:.2f}B parameters, which need at least "
        f"{size_text(needed)} ({per_parameter} bytes each: {kind}{f', {copies} models' if copies > 1 else ''}) but "
        f"{where} {size_text(available)} available; make those fields smaller, or set {OVERRIDE}=1 to build it anyway"
    )
