"""Config fuzzing with hypothesis: random `PlugformerConfig` fields, valid and hostile, against a written-out spec.

Each generated case either
(a) builds the model its config asks for (`PlugformerForConditionalGeneration` when `is_encoder_decoder`,
    `PlugformerForMaskedLM` when `is_causal=False`, else `PlugformerForCausalLM`), which then passes a forward
    (finite logits of the right shape), a backward (finite gradients) and, for causal and seq2seq models, decodes
    token by token with a cache to the logits of the full forward; or
(b) raises `ValueError` / `TypeError` whose message names one of the fields that `violations()` (the spec, written
    independently of `configuration.py`) says are at fault.
Anything else fails: another exception type, a message that names none of the fields, a config the spec refuses but
the code accepts, one the spec accepts but the code refuses, an example over `DEADLINE` (or `HANG_SECONDS`, a hang).

Models stay tiny (hidden <= 64, <= 3 layers, vocab <= 256, <= 24 tokens). Kernels: eager and sdpa; flex_attention is
left to the combination suite (each new shape compiles for seconds on CPU, and it has no CPU backward).

Profiles: the default runs `DEFAULT_EXAMPLES` derandomized examples (the same ones every run, well under a minute);
a deeper random search runs with

    PLUGFORMER_FUZZ_EXAMPLES=2000 pytest tests/test_fuzz.py -s

`-s` shows the tally `test_report_fuzz_tally` prints (cases run, built per model class, refused per exception type).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import os
import signal
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from tolerances import conditioned_tolerance
from transformers import DynamicCache, EncoderDecoderCache
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import plugformer
from plugformer import (
    PlugformerConfig,
    PlugformerForCausalLM,
    PlugformerForConditionalGeneration,
    PlugformerForMaskedLM,
)


DEFAULT_EXAMPLES = 100
EXAMPLES = int(os.environ.get("PLUGFORMER_FUZZ_EXAMPLES", DEFAULT_EXAMPLES))
DEADLINE = timedelta(seconds=30)  # generous: two shared CPU cores; a typical case takes a fraction of a second
HANG_SECONDS = 120
settings.register_profile(
    "plugformer-fuzz",
    max_examples=EXAMPLES,
    deadline=DEADLINE,
    derandomize=EXAMPLES == DEFAULT_EXAMPLES,  # the default run is reproducible; a larger one searches afresh
    database=None,  # no .hypothesis/ folder in the repository; failures print their reproduction
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FUZZ_SETTINGS = settings.get_profile("plugformer-fuzz")
TALLY: collections.Counter[str] = collections.Counter()

# ---------------------------------------------------------------------------------------------------------------
# The spec: what the docstring of `PlugformerConfig` promises, written out independently of its implementation.
# ---------------------------------------------------------------------------------------------------------------

# positive int fields -> whether None is allowed (None derives a default)
POSITIVE_INTS = {
    "vocab_size": False, "hidden_size": False, "intermediate_size": True, "num_hidden_layers": False,
    "num_decoder_layers": True, "num_attention_heads": False, "num_key_value_heads": True, "head_dim": True,
    "max_position_embeddings": False, "relative_attention_num_buckets": False,
    "relative_attention_max_distance": False, "max_relative_distance": False, "additive_chunk_size": True,
}  # fmt: skip
CHOICES = {
    "attention_score": plugformer.ATTENTION_SCORES.names(),
    "position_scheme": plugformer.POSITION_SCHEMES.names(),
    "norm_type": plugformer.NORMS.names(),
    "norm_placement": plugformer.NORM_PLACEMENTS.names(),
    "ffn_type": plugformer.FEED_FORWARDS.names(),
    "hidden_act": sorted(ACT2FN),
}
# float fields -> (low, high, high included)
RANGES = {
    "attention_dropout": (0.0, 1.0, False),
    "hidden_dropout": (0.0, 1.0, False),
    "rms_norm_eps": (1e-12, 1.0, True),
    "layer_norm_eps": (1e-12, 1.0, True),
    "initializer_range": (1e-12, 1.0, True),
}
BOOLS = ["is_causal", "is_encoder_decoder", "attention_bias", "mlp_bias", "tie_word_embeddings", "use_cache",
         "use_gated_attention", "exclusive_self_attention"]  # fmt: skip
TOKEN_IDS = ["pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"]
ROPE_TYPES = ["default", *ROPE_INIT_FUNCTIONS]
# keys transformers requires for each rope type it ships (its `_validate_<type>_rope_parameters`)
ROPE_REQUIRED = {
    "linear": {"factor"}, "dynamic": {"factor"}, "yarn": {"factor"}, "longrope": {"short_factor", "long_factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor"},
}  # fmt: skip


DEFAULTS = {name: PlugformerConfig.__dataclass_fields__[name].default for name in PlugformerConfig.__annotations__}


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def rope_violations(rope: dict, head_dim, max_positions) -> list[set[str]]:
    """Problems of a `rope_parameters` dict for `position_scheme="rope"` (after transformers fills in its defaults)."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        return [{"rope_parameters"}]
    found = []
    if ROPE_REQUIRED.get(rope_type, set()) - set(rope):
        found.append({"rope_parameters"})
    theta = rope.get("rope_theta", 10000.0)
    if not is_number(theta) or not (0 < theta < math.inf):
        found.append({"rope_parameters", "rope_theta"})
    if "factor" in rope and (not is_number(rope["factor"]) or not (1 <= rope["factor"] < math.inf)):
        found.append({"rope_parameters", "factor"})
    fraction = rope.get("partial_rotary_factor", 1.0)
    if not is_number(fraction) or not (0 < fraction <= 1):
        found.append({"rope_parameters", "partial_rotary_factor"})
    elif is_int(head_dim):
        rotary = int(head_dim * fraction)
        if rotary < 2 or rotary % 2:  # rotates pairs of dimensions
            found.append({"head_dim", "position_scheme", "rope_parameters", "partial_rotary_factor"})
        elif rope_type == "dynamic" and rotary < 4:  # NTK scaling: base ** (d / (d - 2))
            found.append({"head_dim", "rope_parameters", "partial_rotary_factor"})
        elif rope_type == "longrope" and not ROPE_REQUIRED["longrope"] - set(rope):
            if any(len(rope[key]) != rotary // 2 for key in ROPE_REQUIRED["longrope"]):
                found.append({"rope_parameters", "short_factor", "long_factor"})
            # its attention factor is sqrt(1 + log(factor) / log(original length)): the trained length must exceed 1
            if is_number(rope.get("factor", 1)) and rope.get("factor", 1) > 1 and max_positions == 1:
                found.append({"rope_parameters"})
    return found


def simple_violations(name: str, value) -> bool:
    """Whether `value` breaks the rules of field `name` taken alone (type, range, choices)."""
    if name in POSITIVE_INTS:
        return not (value is None and POSITIVE_INTS[name]) and not (is_int(value) and value >= 1)
    if name in CHOICES:
        return not isinstance(value, str) or value not in CHOICES[name]
    if name in RANGES:
        low, high, closed = RANGES[name]
        return not is_number(value) or not (low <= value <= high if closed else low <= value < high)
    if name in BOOLS:
        return not isinstance(value, bool)
    return False


def violations(fields: dict, kernel: str | None) -> tuple[list[set[str]], list[set[str]]]:
    """(must, may): the rules `fields` breaks, each as the set of names an error message may name. A `must` rule has
    to be refused; a `may` rule (unused rope parameters) may be refused or ignored. A rule combining several fields
    is judged only when each of them is valid alone (the code may check them in any order)."""
    values = {**DEFAULTS, **fields}
    must = [{name} for name, value in values.items() if simple_violations(name, value)]
    may = []

    def fine(*names: str) -> bool:
        return not any(simple_violations(name, values[name]) for name in names)

    if fine("vocab_size"):
        for name in TOKEN_IDS:
            value = values[name]
            ids = value if isinstance(value, list) and name == "eos_token_id" else [value]
            if any(i is not None and not (is_int(i) and 0 <= i < values["vocab_size"]) for i in ids):
                must.append({name})
    heads, kv_heads = values["num_attention_heads"], values["num_key_value_heads"]
    hidden, head_dim = values["hidden_size"], values["head_dim"]
    if fine("num_attention_heads", "hidden_size", "head_dim") and head_dim is None:
        if hidden % heads:
            must.append({"hidden_size", "num_attention_heads"})
        head_dim = hidden // heads
    if fine("num_attention_heads", "num_key_value_heads") and kv_heads is not None and heads % kv_heads:
        must.append({"num_attention_heads", "num_key_value_heads"})
    scheme = values["position_scheme"]
    if scheme == "sinusoidal" and fine("hidden_size") and hidden % 2:
        must.append({"hidden_size", "position_scheme"})
    buckets, distance = values["relative_attention_num_buckets"], values["relative_attention_max_distance"]
    if scheme == "t5_bias" and fine("relative_attention_num_buckets", "relative_attention_max_distance"):
        if not 4 <= buckets <= distance:
            must.append({"relative_attention_num_buckets", "relative_attention_max_distance"})
    rope = {} if values["rope_parameters"] is None and scheme == "rope" else values["rope_parameters"]
    if rope is not None and not isinstance(rope, dict):
        must.append({"rope_parameters"})
    elif rope is not None:
        head_dim = head_dim if is_int(head_dim) else None
        max_positions = values["max_position_embeddings"] if fine("max_position_embeddings") else None
        (must if scheme == "rope" else may).extend(rope_violations(rope, head_dim, max_positions))
        rotary_settings = rope.get("rope_type", "default") != "default" or set(rope) - {"rope_type", "rope_theta"}
        if scheme != "rope" and rotary_settings:  # RoPE settings a scheme without rotation would ignore
            must.append({"rope_parameters", "position_scheme"})
    if values["is_encoder_decoder"] is True and values["pad_token_id"] is None:
        must.append({"pad_token_id", "is_encoder_decoder"})
    if kernel not in (None, "eager") and values["attention_score"] in ("additive", "stick_breaking"):  # no softmax
        must.append({"attn_implementation", "attention_score"})
    if values["attention_score"] == "stick_breaking":  # the stick is broken backwards: causal self-attention only
        if values["is_encoder_decoder"] is True:
            must.append({"is_encoder_decoder", "attention_score"})
        if values["is_causal"] is False:
            must.append({"is_causal", "attention_score"})
    if values["attention_score"] == "differential":  # pairs of key/value heads; no dropout of a difference of maps
        if fine("num_attention_heads", "num_key_value_heads") and (heads if kv_heads is None else kv_heads) % 2:
            must.append({"num_key_value_heads", "attention_score"})
        if fine("attention_dropout") and values["attention_dropout"] != 0:
            must.append({"attention_dropout", "attention_score"})
    return must, may


# ---------------------------------------------------------------------------------------------------------------
# Strategies: mostly-plausible tiny configs, with hostile values swapped into some fields.
# ---------------------------------------------------------------------------------------------------------------

WRONG_TYPES = st.sampled_from(["8", 2.5, True, [4], {"a": 1}, b"x"])
HOSTILE_INTS = st.sampled_from([0, -1, -(2**40), None]) | WRONG_TYPES
HOSTILE_NAMES = st.sampled_from(["", "ROPE", "Scaled_Dot", "cosine_sim", None, 3, ["rope"]])
HOSTILE_FLOATS = st.sampled_from([-0.1, 1.0, 1.5, math.nan, math.inf, -math.inf, 0.0, 1e-13, "0.1", None, True])
HOSTILE_BOOLS = st.sampled_from(["yes", "False", 1, 0, 0.0, None, [True]])
HOSTILE_IDS = st.sampled_from([-1, 256, 10**9, "1", 1.5, True, [0, -3], [0, 10**6], ["1"]])
HOSTILE_ROPE = st.sampled_from(
    [
        "default",
        [1, 2],
        {"rope_type": "magic"},
        {"rope_type": "linear"},
        {"rope_type": "llama3", "factor": 8.0},
        {"rope_type": "default", "rope_theta": 0.0},
        {"rope_type": "default", "rope_theta": -10.0},
        {"rope_type": "default", "rope_theta": "big"},
        {"rope_type": "default", "rope_theta": math.inf},
        {"rope_type": "default", "partial_rotary_factor": 0.0},
        {"rope_type": "default", "partial_rotary_factor": 1.5},
        {"rope_type": "default", "partial_rotary_factor": -0.5},
        {"rope_type": "default", "partial_rotary_factor": "a"},
        {"rope_type": "default", "partial_rotary_factor": 0.01},
        {"rope_type": "linear", "factor": 0.5},
        {"rope_type": "dynamic", "factor": -2.0},
        {"rope_type": "yarn", "factor": "x"},
        {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
    ]
)


def hostile(name: str) -> st.SearchStrategy:
    if name in POSITIVE_INTS:
        return HOSTILE_INTS
    if name in CHOICES:
        return HOSTILE_NAMES
    if name in RANGES:
        return HOSTILE_FLOATS
    if name in BOOLS:
        return HOSTILE_BOOLS
    if name in TOKEN_IDS:
        return HOSTILE_IDS
    return HOSTILE_ROPE


HOSTILE_FIELDS = sorted([*POSITIVE_INTS, *CHOICES, *RANGES, *BOOLS, *TOKEN_IDS, "rope_parameters"])


@st.composite
def rope_parameters(draw, head_dim: int) -> dict | None:
    rope_type = draw(st.sampled_from(["default", "default", "linear", "dynamic", "yarn", "llama3", "longrope"]))
    rope = {"rope_type": rope_type, "rope_theta": draw(st.sampled_from([10000.0, 10.0, 500000.0, 1.5]))}
    if rope_type != "default":
        rope["factor"] = draw(st.sampled_from([1.0, 2.0, 8.0]))
    if rope_type == "llama3":
        rope.update(low_freq_factor=1.0, high_freq_factor=4.0)
    if draw(st.booleans()):
        rope["partial_rotary_factor"] = draw(st.sampled_from([0.25, 0.5, 1.0]))
    if rope_type == "longrope":
        rotary = int(head_dim * rope.get("partial_rotary_factor", 1.0))
        rope["short_factor"] = [1.0] * (rotary // 2)
        rope["long_factor"] = [draw(st.sampled_from([1.0, 2.0]))] * (rotary // 2)
    return rope


def rarely(draw) -> bool:
    """True about once in six draws (hypothesis favours small integers, so the rare branch is the largest one)."""
    return draw(st.integers(0, 5)) == 5


@st.composite
def shape_fields(draw) -> dict:
    """Heads, key/value heads, head_dim and hidden_size: usually consistent, sometimes not."""
    heads = draw(st.integers(1, 8))
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    kv_heads = draw(st.none() | st.sampled_from(divisors) if not rarely(draw) else st.integers(1, 8))
    widths = list(range(1, 64 // heads + 1))
    even_widths = [w for w in widths if w % 2 == 0] or widths  # rope needs an even head_dim: mostly give one
    width = draw(st.sampled_from(even_widths) | st.sampled_from(even_widths) | st.sampled_from(widths))
    head_dim = draw(st.none() | st.just(width))
    hidden = heads * width if not rarely(draw) else draw(st.integers(1, 64))  # mostly h · head_dim
    return dict(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=hidden)


@st.composite
def cases(draw) -> dict:
    fields = draw(shape_fields())
    vocab = draw(st.integers(1, 256))
    head_dim = fields["head_dim"] or max(fields["hidden_size"] // fields["num_attention_heads"], 1)
    fields.update(
        vocab_size=vocab,
        intermediate_size=draw(st.none() | st.integers(1, 128)),
        num_hidden_layers=draw(st.integers(1, 3)),
        num_decoder_layers=draw(st.none() | st.integers(1, 3)),
        max_position_embeddings=draw(st.integers(1, 48)),
        relative_attention_num_buckets=draw(st.integers(4, 16) | st.integers(1, 40)),
        relative_attention_max_distance=draw(st.integers(16, 40) | st.integers(1, 40)),
        max_relative_distance=draw(st.integers(1, 40)),
        additive_chunk_size=draw(st.none() | st.integers(1, 8)),
        rope_parameters=draw(st.none() | rope_parameters(head_dim)),
        **{name: draw(st.sampled_from(choices)) for name, choices in CHOICES.items() if name != "hidden_act"},
        hidden_act=draw(st.sampled_from(["silu", "gelu", "gelu_new", "relu", "tanh", "linear", "prelu", "xielu"])),
        attention_dropout=draw(st.sampled_from([0.0, 0.0, 0.1, 0.99])),
        hidden_dropout=draw(st.sampled_from([0.0, 0.0, 0.1, 0.99])),
        rms_norm_eps=draw(st.sampled_from([1e-6, 1e-12, 1.0])),
        layer_norm_eps=draw(st.sampled_from([1e-5, 1e-12, 1.0])),
        initializer_range=draw(st.sampled_from([0.02, 0.02, 1e-6, 0.2, 1.0])),
        **{name: draw(st.booleans()) for name in BOOLS if name != "is_encoder_decoder"},
        is_encoder_decoder=draw(st.integers(0, 2)) == 0,
        pad_token_id=draw(st.none() if rarely(draw) else st.integers(0, vocab - 1)),
        eos_token_id=draw(st.none() | st.integers(0, vocab - 1) | st.lists(st.integers(0, vocab - 1), max_size=2)),
        bos_token_id=draw(st.none() | st.integers(0, vocab - 1)),
        decoder_start_token_id=draw(st.none() | st.integers(0, vocab - 1)),
    )
    for name in draw(st.lists(st.sampled_from(HOSTILE_FIELDS), max_size=draw(st.sampled_from([0, 0, 0, 1, 1, 2])))):
        fields[name] = draw(hostile(name))
    # some fields left at their defaults (not the sizes: a default model is not tiny)
    fields = {
        k: v for k, v in fields.items() if k in ("vocab_size", "hidden_size", "num_hidden_layers") or not rarely(draw)
    }
    return dict(
        fields=fields,
        kernel=draw(st.sampled_from([None, "eager", "sdpa"])),
        batch=draw(st.integers(1, 2)),
        length=draw(st.integers(1, 24)),
        target_length=draw(st.integers(1, 12)),
        seed=draw(st.integers(0, 2**16)),
    )


# ---------------------------------------------------------------------------------------------------------------
# Running a case
# ---------------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def hang_guard(seconds: int):
    """hypothesis' deadline only judges an example after it returns; this interrupts one that never does."""
    if not hasattr(signal, "SIGALRM"):  # not on Windows
        yield
        return

    def interrupt(signum, frame):
        raise TimeoutError(f"a fuzz case ran over {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def model_class(config: PlugformerConfig) -> type:
    if config.is_encoder_decoder:
        return PlugformerForConditionalGeneration
    return PlugformerForCausalLM if config.is_causal else PlugformerForMaskedLM


def build(fields: dict, kernel: str | None, seed: int):
    config = PlugformerConfig(**fields)
    torch.manual_seed(seed)
    model = model_class(config)(config)
    if kernel is not None:
        model.set_attn_implementation(kernel)
    return model


def inputs(case: dict, config: PlugformerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Source ids (B, T) and target ids (B, T'); T fits a learned table, relative schemes may go past it.

    No pad ids while the vocabulary has others: an unmasked pad token embeds to exactly zero (`padding_idx`), and a
    residual stream of zeros through LayerNorm with `layer_norm_eps=1e-12` backpropagates ×1/sqrt(eps) = 1e6 per
    norm, overflowing float32 within a few layers (torch's LayerNorm, as BERT's; real inputs mask their padding).
    """
    limit = config.max_position_embeddings if config.position_scheme == "learned" else 24
    generator = torch.Generator().manual_seed(case["seed"])
    pad, vocab = config.pad_token_id, config.vocab_size
    skip_pad = pad is not None and vocab > 1

    def ids(length: int) -> torch.Tensor:
        drawn = torch.randint(0, vocab - skip_pad, (case["batch"], min(length, limit)), generator=generator)
        return drawn + (drawn >= pad).long() if skip_pad else drawn

    return ids(case["length"]), ids(case["target_length"])


def forward(model, source, target, **kwargs):
    if isinstance(model, PlugformerForConditionalGeneration):
        return model(source, decoder_input_ids=target, **kwargs)
    return model(source, **kwargs)


def check_forward_and_backward(model, source, target) -> None:
    model.eval()
    with torch.no_grad():
        logits = forward(model, source, target, use_cache=False).logits
    expected_length = target.shape[1] if isinstance(model, PlugformerForConditionalGeneration) else source.shape[1]
    assert logits.shape == (source.shape[0], expected_length, model.config.vocab_size)
    assert torch.isfinite(logits).all(), "non-finite logits"
    model.train()  # dropout, and the additive kernel's recomputation
    # a surrogate loss defined for every length (a causal LM's shifted loss has no target at length 1)
    loss = forward(model, source, target, use_cache=False).logits.float().logsumexp(-1).mean()
    assert torch.isfinite(loss), f"non-finite loss {loss}"
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads, "no parameter received a gradient"
    bad = [name for name, grad in grads.items() if not torch.isfinite(grad).all()]
    only_padding = model.config.vocab_size == 1 and model.config.pad_token_id == 0  # see `inputs`
    assert not bad or only_padding, f"non-finite gradients in {bad}"
    model.zero_grad(set_to_none=True)
    model.eval()


def check_cached_decoding(model, source, target) -> None:
    """Token by token with a cache == the full forward, in float64: hostile-but-valid configs (initializer_range=1
    with unscaled dot products) are so ill-conditioned that float32's different summation orders alone differ by
    1e-3, while the same comparison in float64 agrees to 1e-12. The bound measures the condition: the full forward in
    fp32 against fp64 (`conditioned_tolerance`); a wrong cache is off by the size of the logits."""
    with torch.no_grad():
        full = forward(model.eval(), source, target, use_cache=False)  # fp32
    model.double().eval()
    with torch.no_grad():
        if isinstance(model, PlugformerForConditionalGeneration):
            reference = forward(model, source, target, use_cache=False).logits
            encoder_outputs = model.encoder(source)
            decoder_config = model.config.get_text_config(decoder=True)
            cache = EncoderDecoderCache(DynamicCache(config=decoder_config), DynamicCache(config=decoder_config))
            steps = [
                model(
                    encoder_outputs=encoder_outputs, decoder_input_ids=target[:, i : i + 1], cache=cache, use_cache=True
                ).logits
                for i in range(target.shape[1])
            ]
        else:
            reference = model(source, use_cache=False).logits
            cache = DynamicCache(config=model.config)
            steps = [model(source[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(source.shape[1])]
    atol = conditioned_tolerance(model.config, reference, full.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), reference, atol=atol, rtol=0)


def length_with_fixed_frequencies(config: PlugformerConfig) -> int | None:
    """The length up to which cached decoding can equal a full forward (`None`: any length).

    RoPE types "dynamic" and "longrope" recompute their frequencies from the current length once it passes the
    trained one (transformers' `dynamic_rope_update`), so keys cached before that were rotated differently from a
    full forward's: by design (transformers' Llama and Phi-3 do the same). "dynamic" also keeps its grown
    frequencies for a later call of exactly the trained length: its output depends on the calls before it.
    """
    if config.position_scheme == "rope" and config.rope_parameters["rope_type"] in ("dynamic", "longrope"):
        return config.rope_parameters.get("original_max_position_embeddings", config.max_position_embeddings)
    return None


def run_case(case: dict) -> None:
    TALLY["cases"] += 1
    must, may = violations(case["fields"], case["kernel"])
    try:
        model = build(case["fields"], case["kernel"], case["seed"])
    except (ValueError, TypeError) as error:
        named = set().union(*must, *may)
        if not any(name in str(error) for name in named):
            problem = f"names none of {sorted(named)}" if must else "refuses a config the spec accepts"
            raise AssertionError(f"the error {problem}: {type(error).__name__}: {error}") from error
        TALLY[f"refused with {type(error).__name__}"] += 1
        event(f"refused with {type(error).__name__}")
        return
    assert not must, f"accepted although it breaks {must}: {case['fields']}"
    source, target = inputs(case, model.config)
    if not isinstance(model, PlugformerForMaskedLM):  # first, on a copy: "dynamic" RoPE keeps state between calls
        length = length_with_fixed_frequencies(model.config)
        check_cached_decoding(copy.deepcopy(model), source[:, :length], target[:, :length])
    check_forward_and_backward(model, source, target)
    TALLY[f"built {type(model).__name__}"] += 1
    event(f"built {type(model).__name__} on {model.config._attn_implementation}")


def regression(**fields) -> dict:
    """A case on a small base config (fields not given keep their defaults)."""
    base = dict(vocab_size=64, hidden_size=16, num_attention_heads=2, num_hidden_layers=1)
    return dict(fields={**base, **fields}, kernel=None, batch=1, length=5, target_length=3, seed=0)


# Regression examples, each a bug the fuzzer found: field types were not checked (the annotations were strings), so
# None / "yes" went through to torch; rope values crashed or gave NaN; transformers' rope check refused an odd
# head_dim under a scheme without rope; dynamic and longrope formulas divided by zero.
@example(case=regression(vocab_size=None))
@example(case=regression(is_causal="yes"))
@example(case=regression(pad_token_id=True))
@example(case=regression(rope_parameters=[1, 2]))
@example(case=regression(rope_parameters={"rope_type": "linear"}))
@example(case=regression(rope_parameters={"rope_type": "default", "rope_theta": -1.0}))
@example(case=regression(rope_parameters={"rope_type": "default", "partial_rotary_factor": 2.0}))
@example(case=regression(rope_parameters={"rope_type": "default", "partial_rotary_factor": "a"}))
@example(case=regression(hidden_size=56, num_attention_heads=8, position_scheme="none"))
@example(case=regression(hidden_size=2, num_attention_heads=1, rope_parameters={"rope_type": "dynamic", "factor": 1.0}))
@example(
    case=regression(
        hidden_size=2,
        num_attention_heads=1,
        max_position_embeddings=1,
        rope_parameters={"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0], "long_factor": [1.0]},
    )
)
@given(case=cases())
@FUZZ_SETTINGS
def test_fuzzed_configs_build_and_run_or_fail_naming_the_field(case):
    with hang_guard(HANG_SECONDS):
        run_case(case)


def test_report_fuzz_tally():
    """Runs after the fuzz test (file order): prints what it did, so runs can report their counts."""
    if not TALLY["cases"]:
        pytest.skip("the fuzz test did not run in this session")
    print(f"\nfuzz ({EXAMPLES} examples requested): " + ", ".join(f"{k}: {v}" for k, v in sorted(TALLY.items())))
    built = sum(v for k, v in TALLY.items() if k.startswith("built"))
    assert built > 0 and TALLY["cases"] - built > 0, "the fuzzer should both build models and hit refusals"


@pytest.mark.parametrize(
    "head,overrides,field",
    [
        (PlugformerForCausalLM, dict(is_causal=False), "is_causal"),
        (PlugformerForCausalLM, dict(is_encoder_decoder=True, pad_token_id=0), "is_encoder_decoder"),
        (PlugformerForMaskedLM, dict(is_causal=True), "is_causal"),
        (PlugformerForMaskedLM, dict(is_causal=False, is_encoder_decoder=True, pad_token_id=0), "is_encoder_decoder"),
        (PlugformerForConditionalGeneration, dict(is_encoder_decoder=False, pad_token_id=0), "is_encoder_decoder"),
        (PlugformerForConditionalGeneration, dict(is_encoder_decoder=True), "pad_token_id"),
    ],
)
def test_a_head_refuses_a_config_of_another_kind(head, overrides, field):
    """A causal LM over a bidirectional stack would read the tokens it predicts; heads check their config's kind."""
    config = PlugformerConfig.from_preset("tiny", **overrides)
    with pytest.raises(ValueError, match=field):
        head(config)


def test_default_profile_is_bounded():
    """The default profile must stay cheap: it runs on every test invocation."""
    assert FUZZ_SETTINGS.max_examples == EXAMPLES
    if EXAMPLES == DEFAULT_EXAMPLES:
        assert FUZZ_SETTINGS.derandomize and DEFAULT_EXAMPLES <= 100
