"""`BenchArguments`: what `plugformer bench` measures, validated up front (each error names its option)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ..configuration import PRESETS, PlugformerConfig
from ..positions import POSITION_SCHEMES
from ..runtime.variants import ATTENTION_MODIFIERS
from ..scores import ATTENTION_SCORES
from .markers import check_markers


SECTIONS = ("train", "decode", "variants", "loss")
DEFAULT_SECTIONS = ("train", "decode", "variants")  # `loss` builds a pair per vocabulary size: asked for by name
# `aa`: LlamaForCausalLM against its own copy, the A/A row: the spread a ratio of two identical models shows
PAIRS = ("llama", "gpt2", "aa")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_DTYPES = {"cpu": ["fp32", "bf16"], "cuda": ["bf16", "fp16"]}
# The dimensions a size may set; everything else (norms, activation, tying) comes from the preset or the defaults.
SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim",
)  # fmt: skip
# `--quick` (CI): every section on the tiny preset at a short length; fields the user changed are kept.
QUICK = dict(sizes=["tiny"], seq_lens=[64], batch_size=2, repeats=3, warmup=1, new_tokens=8, matmul_size=1024)


def parse_size(spec: str) -> tuple[str | None, dict[str, int]]:
    """`"small"` -> `("small", {})`; `"small,num_hidden_layers=2"` -> the preset with that change;
    `"hidden_size=256,num_hidden_layers=4"` -> no preset (the `PlugformerConfig` defaults) with those dimensions."""
    preset, dims = None, {}
    for position, item in enumerate(spec.split(",")):
        name, separator, value = item.partition("=")
        if not separator:
            if position or name not in PRESETS:
                raise ValueError(
                    f"sizes: {spec!r}: {name!r} is not a preset {list(PRESETS)} (only the first item "
                    "may name one) nor FIELD=VALUE"
                )
            preset = name
        elif name not in SIZE_FIELDS:
            raise ValueError(f"sizes: {spec!r}: {name!r} is not one of {list(SIZE_FIELDS)}")
        elif not value.isdigit() or int(value) < 1:
            raise ValueError(f"sizes: {spec!r}: {name}={value!r} must be a positive integer")
        else:
            dims[name] = int(value)
    return preset, dims


@dataclass
class BenchArguments:
    sizes: list[str] = field(
        default_factory=lambda: ["tiny", "small"],
        metadata={
            "help": "presets (tiny small gpt2-small llama), optionally with changes `small,num_hidden_layers=2`, "
            "or explicit dims `hidden_size=256,num_hidden_layers=4,num_attention_heads=4`"
        },
    )
    seq_lens: list[int] = field(
        default_factory=lambda: [512, 2048],
        metadata={"help": "training lengths and prompt lengths (add 4096 to opt in)"},
    )
    batch_size: int = field(default=2, metadata={"help": "sequences per training step and prompts per generate"})
    repeats: int = field(default=5, metadata={"help": "timed repeats per model (the median is reported)"})
    warmup: int = field(default=2, metadata={"help": "untimed repeats per model first (also interleaved)"})
    dtypes: list[str] = field(
        default_factory=list,
        metadata={"help": "fp32 bf16 fp16 (autocast; fp16 on CUDA only); default fp32 bf16 on CPU, bf16 fp16 on CUDA"},
    )
    sections: list[str] = field(
        default_factory=lambda: list(DEFAULT_SECTIONS),
        metadata={
            "help": "what runs: "
            "train (A/B training step) decode (A/B generate) variants (score x position rows) "
            "loss (training step with the fused loss against Llama, per --loss_vocab_sizes; "
            "not run unless named)"
        },
    )
    loss_vocab_sizes: list[int] = field(
        default_factory=lambda: [8192, 32768, 131072],
        metadata={"help": "section loss: the vocabulary sizes (each replaces the size's vocab_size)"},
    )
    pairs: list[str] = field(
        default_factory=lambda: list(PAIRS),
        metadata={"help": "A/B pairs: llama gpt2, and aa (LlamaForCausalLM against its own copy: the noise floor)"},
    )
    attention_scores: list[str] = field(default_factory=ATTENTION_SCORES.names, metadata={"help": "variant rows"})
    position_schemes: list[str] = field(default_factory=POSITION_SCHEMES.names, metadata={"help": "variant rows"})
    attention_modifiers: list[str] = field(
        default_factory=lambda: list(ATTENTION_MODIFIERS),
        metadata={
            "help": "variant rows of scaled_dot + none with one of these fields set, a row per value ("
            + ", ".join(f"{name}={' | '.join(map(repr, values))}" for name, values in ATTENTION_MODIFIERS.items())
            + "), run when scaled_dot and none are among the variant rows; none (or [] in a --config YAML): no "
            "modifier rows"
        },
    )
    new_tokens: int = field(default=32, metadata={"help": "tokens generated per prompt (min = max: EOS never stops)"})
    matmul_size: int = field(default=4096, metadata={"help": "n of the n x n matmul timed for the peak FLOP/s"})
    device: str = field(default="auto", metadata={"help": "auto (cuda when present) | cpu | cuda"})
    seed: int = 0
    output_dir: str = field(default="outputs/bench", metadata={"help": "bench.md and bench.json go here"})
    quick: bool = field(
        default=False,
        metadata={"help": f"CI preset, in well under a minute: {QUICK} for the options left at their defaults"},
    )
    readme: str | None = field(
        default=None,
        metadata={
            "help": "after the run, regenerate the block between "
            "<!-- bench:begin --> and <!-- bench:end --> in this file (the project's: "
            "model_cards/BENCHMARKS.md) from it; the markers are checked before anything runs"
        },
    )

    def __post_init__(self):
        if self.quick:
            defaults = {
                f.name: f.default_factory() if callable(f.default_factory) else f.default
                for f in dataclasses.fields(self)
            }
            for name, value in QUICK.items():
                if getattr(self, name) == defaults[name]:
                    setattr(self, name, list(value) if isinstance(value, list) else value)
        _choice("device", [self.device], ["auto", "cpu", "cuda"])
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda': no CUDA device is available")
        self.dtypes = self.dtypes or list(DEFAULT_DTYPES[self.device])
        _choice("dtypes", self.dtypes, list(DTYPES) if self.device == "cuda" else ["fp32", "bf16"])
        _choice("sections", self.sections, list(SECTIONS))
        _choice("pairs", self.pairs, list(PAIRS))
        _choice("attention_scores", self.attention_scores, ATTENTION_SCORES.names())
        _choice("position_schemes", self.position_schemes, POSITION_SCHEMES.names())
        # no modifier rows: `--attention_modifiers none` on the command line, `attention_modifiers: []` in a YAML
        if self.attention_modifiers == ["none"]:
            self.attention_modifiers = []
        _choice("attention_modifiers", self.attention_modifiers, list(ATTENTION_MODIFIERS), allow_none=True)
        for name, low in (("batch_size", 1), ("repeats", 1), ("warmup", 0), ("new_tokens", 2), ("matmul_size", 64)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}={getattr(self, name)!r} must be at least {low}")
        if not self.loss_vocab_sizes or min(self.loss_vocab_sizes) < 4:
            raise ValueError(f"loss_vocab_sizes={self.loss_vocab_sizes!r}: expected vocabulary sizes of at least 4")
        if not self.seq_lens or min(self.seq_lens) < 2:
            raise ValueError(f"seq_lens={self.seq_lens!r}: expected lengths of at least 2 tokens")
        if not self.sizes:
            raise ValueError("sizes: expected at least one size")
        if self.readme is not None:
            try:
                check_markers(self.readme)
            except (OSError, ValueError) as error:
                raise ValueError(f"readme: {error}") from error
        for spec in self.sizes:
            try:
                config = self.model_config(spec)
            except (ValueError, TypeError) as error:
                raise ValueError(f"sizes: {spec!r}: {error}") from error
            pairs_run = {"train", "decode", "loss"} & set(self.sections)
            if (
                pairs_run
                and "gpt2" in self.pairs
                and config.head_dim * config.num_attention_heads != config.hidden_size
            ):
                raise ValueError(
                    f"sizes: {spec!r}: the gpt2 pair needs head_dim · num_attention_heads = hidden_size "
                    f"(GPT-2 has no head_dim of its own); got {config.head_dim}, "
                    f"{config.num_attention_heads}, {config.hidden_size}"
                )

    def model_config(self, spec: str, **overrides: Any) -> PlugformerConfig:
        """The plugformer config of size `spec`, long enough for the longest prompt plus the generated tokens."""
        preset, dims = parse_size(spec)
        fields = {"max_position_embeddings": max(self.seq_lens) + self.new_tokens, **dims, **overrides}
        return PlugformerConfig.from_preset(preset, **fields) if preset else PlugformerConfig(**fields)


def _choice(option: str, values: list[str], choices: list[str], allow_none: bool = False) -> None:
    if not values and not allow_none:
        raise ValueError(f"{option}: expected at least one of {choices}")
    for value in values:
        if value not in choices:
            raise ValueError(f"{option}: {value!r} is not one of {choices}")
