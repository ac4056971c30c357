"""`plugformer attention-map`: the attention weights of one text as heatmaps (PNG), numbers (safetensors) and
tokens (JSON).

Weights come from one forward with `output_attentions=True` on the eager kernel (sdpa and flex return none); a
model on another kernel is switched to eager for that forward and switched back, which recomputes the same scores.
A seq2seq model gives three maps: encoder self-attention over `text`, decoder self-attention over the target and
cross-attention from target queries to source keys. The decomposable attention model gives its soft alignment of a
sentence pair (`text`, `text_pair`): each premise token's weights over the hypothesis tokens.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from numbers import Integral
from pathlib import Path

import torch

from ..capabilities import KERNELS
from ..decomposable import DecomposableAttentionConfig
from ..runtime.files import write_json_atomic
from .figures import pyplot


EXAMPLE_TEXT = "The chicken didn't cross the road because it was too tired"

# which Auto class loads a saved model, by the suffix of its `config.architectures` entry
AUTO_CLASS_BY_SUFFIX = {
    "ForCausalLM": "AutoModelForCausalLM",
    "ForMaskedLM": "AutoModelForMaskedLM",
    "ForSequenceClassification": "AutoModelForSequenceClassification",
    "ForTokenClassification": "AutoModelForTokenClassification",
    "ForConditionalGeneration": "AutoModelForSeq2SeqLM",
}


@dataclass
class AttentionMap:
    """Attention weights of one kind for the chosen layers and heads.

    Args:
        kind (`str`): `self` (a single stack), or `encoder`, `decoder`, `cross` (a seq2seq model).
        weights (`torch.Tensor` of shape `(layers, heads, Q, K)`): float32 on the CPU; each row sums to 1.
        layers (`list[int]`): the layer of each row of `weights`.
        heads (`list[int]`): the head of each column of `weights`.
        query_tokens (`list[str]`): the Q query tokens, decoded one id at a time.
        key_tokens (`list[str]`): the K key tokens.
    """

    kind: str
    weights: torch.Tensor = field(repr=False)
    layers: list[int]
    heads: list[int]
    query_tokens: list[str]
    key_tokens: list[str]


def load_model(path: str | Path):
    """A saved plugformer model through the Auto class its `config.architectures` names (`AutoModel` otherwise)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    names = [a for name in config.architectures or [] for s, a in AUTO_CLASS_BY_SUFFIX.items() if name.endswith(s)]
    auto_class = names[0] if names else "AutoModel"
    return getattr(transformers, auto_class).from_pretrained(path, config=config)


def token_strings(tokenizer, ids: Sequence[int]) -> list[str]:
    """Each id decoded on its own: readable text (`" road"`) rather than byte-level BPE symbols (`"Ġroad"`)."""
    return [tokenizer.decode([int(i)]) for i in ids]


@contextmanager
def eager_attention(model) -> Iterator[None]:
    """Runs the body on the eager kernel, which returns weights for every score, unless the model's kernel returns
    them already (its record's `attention_weights`), and restores the previous kernel."""
    previous = KERNELS.of(model.config)
    if previous.attention_weights:
        yield
        return
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous.name)


def select_indices(field_name: str, chosen: Sequence[int] | None, count: int, owner: str) -> list[int]:
    """`chosen` checked against `range(count)` (all of it when `None`); errors name the field and the range."""
    if chosen is None:
        return list(range(count))
    chosen = list(chosen)
    if not chosen:
        raise ValueError(f"{field_name}=[]: choose at least one index in 0..{count - 1}")
    for index in chosen:
        if isinstance(index, bool) or not isinstance(index, Integral) or not 0 <= index < count:
            raise ValueError(
                f"{field_name}={chosen}: {index!r} is out of range; {owner} has {count} {field_name} (0..{count - 1})"
            )
    return [int(index) for index in chosen]


def encode(tokenizer, text: str, bos: bool) -> list[int]:
    prefix = tokenizer.bos_token if bos and tokenizer.bos_token and not text.startswith(tokenizer.bos_token) else ""
    return tokenizer(prefix + text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def attention_weights(
    model,
    tokenizer,
    text: str,
    *,
    target_text: str | None = None,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    bos: bool | None = None,
) -> dict[str, AttentionMap]:
    """The attention weights of one forward over `text`, for the chosen layers and heads.

    Args:
        model ([`PreTrainedModel`]): a plugformer model (any head, or a [`PlugformerForConditionalGeneration`]).
        tokenizer: its tokenizer.
        text (`str`): the input (the source of a seq2seq model).
        target_text (`str`, *optional*): the decoder input of a seq2seq model (required there, refused
            elsewhere); the decoder reads `[decoder start] + target`, as in teacher forcing.
        layers (`Sequence[int]`, *optional*): layer indices; defaults to every layer (of each stack).
        heads (`Sequence[int]`, *optional*): head indices; defaults to every head.
        bos (`bool`, *optional*): prepend the tokenizer's bos token to `text`; by default as plugformer trains the
            model: yes for a single stack (pretraining starts every document with it), no for a seq2seq model,
            whose source is its tokens then end of text (the seq2seq stage's encoding, `evaluation.seq2seq`).

    Returns:
        `dict[str, AttentionMap]`: `{"self": ...}`, or `{"encoder": ..., "decoder": ..., "cross": ...}` for a
        seq2seq model; weights of shape `(layers, heads, Q, K)` (cross: Q target, K source tokens).
    """
    seq2seq = bool(model.config.is_encoder_decoder)
    if seq2seq and target_text is None:
        raise ValueError("target_text=None: a seq2seq model needs a target_text for the decoder")
    if not seq2seq and target_text is not None:
        raise ValueError(f"target_text={target_text!r}: only a seq2seq (encoder-decoder) model has a decoder input")
    source = encode(tokenizer, text, not seq2seq if bos is None else bos)
    if seq2seq and tokenizer.eos_token_id is not None:
        source.append(tokenizer.eos_token_id)  # as the seq2seq stage encodes a source
    check_token_count(len(source), "the text")
    inputs = {"input_ids": torch.tensor([source], device=model.device)}  # (1, S)
    if seq2seq:
        target = [model.decoder_start_token_id, *encode(tokenizer, target_text, bos=False)]
        check_token_count(len(target), "the target text")
        inputs["decoder_input_ids"] = torch.tensor([target], device=model.device)  # (1, T)
    if "use_cache" in inspect.signature(model.forward).parameters:
        inputs["use_cache"] = False  # one forward: no cache to build
    was_training = model.training
    model.eval()  # no dropout on the weights
    try:
        with eager_attention(model):
            outputs = model(**inputs, output_attentions=True)
    finally:
        model.train(was_training)
    if not seq2seq:
        source_tokens = token_strings(tokenizer, source)
        return {"self": gather("self", outputs.attentions, layers, heads, source_tokens, source_tokens)}
    source_tokens, target_tokens = token_strings(tokenizer, source), token_strings(tokenizer, target)
    return {
        "encoder": gather("encoder", outputs.encoder_attentions, layers, heads, source_tokens, source_tokens),
        "decoder": gather("decoder", outputs.decoder_attentions, layers, heads, target_tokens, target_tokens),
        "cross": gather("cross", outputs.cross_attentions, layers, heads, target_tokens, source_tokens),
    }


@torch.no_grad()
def alignment_weights(model, tokenizer, text: str, text_pair: str) -> dict[str, AttentionMap]:
    """The decomposable attention model's alignment of `text` (premise) with `text_pair` (hypothesis), encoded as
    the nli stage encodes a pair: `{"alignment": ...}` of shape `(1, 1, premise tokens, hypothesis tokens)`, each row
    softmax_j(F(a_i)·F(b_j)) (the weights β_i averages the hypothesis with)."""
    encoded = tokenizer(text, text_pair, return_tensors="pt").to(model.device)
    check_token_count(encoded["input_ids"].shape[1], "the pair")
    was_training = model.training
    model.eval()
    try:
        weights = model(**encoded, output_attentions=True).attentions[0][0]  # (T, T): premise rows, hypothesis columns
    finally:
        model.train(was_training)
    premise, hypothesis = (
        mask[0]
        for mask in model.sentence_masks(
            encoded["input_ids"], encoded.get("attention_mask"), encoded.get("token_type_ids")
        )
    )
    ids = encoded["input_ids"][0]
    aligned = weights[premise][:, hypothesis]  # (premise tokens, hypothesis tokens)
    return {
        "alignment": AttentionMap(
            "alignment",
            aligned[None, None].float().cpu(),
            [0],
            [0],
            token_strings(tokenizer, ids[premise]),
            token_strings(tokenizer, ids[hypothesis]),
        )
    }


def gather(kind, per_layer, layers, heads, query_tokens, key_tokens) -> AttentionMap:
    """Stacks the chosen layers and heads of a tuple of `(1, H, Q, K)` weights."""
    if not per_layer:
        raise ValueError(f"the model returned no {kind} attention weights for output_attentions=True")
    owner = "the model" if kind == "self" else f"the {'decoder' if kind == 'cross' else kind}"
    layers = select_indices("layers", layers, len(per_layer), owner)
    heads = select_indices("heads", heads, per_layer[0].shape[1], owner)
    weights = torch.stack([per_layer[layer][0, heads] for layer in layers])  # L x (h, Q, K) -> (L, h, Q, K)
    return AttentionMap(kind, weights.float().cpu(), layers, heads, query_tokens, key_tokens)


def label(token: str) -> str:
    return token.strip() or repr(token)


# a text longer than this many tokens, or a figure larger than this many pixels, is refused before it is drawn: a
# ~3,000-character text died in MemoryError (the figure grows with the token count, per layer and head)
MAX_TOKENS = 512
MAX_PIXELS = 40_000_000


def check_token_count(count: int, what: str) -> None:
    if count > MAX_TOKENS:
        raise ValueError(
            f"{what} is {count} tokens; attention-map draws at most {MAX_TOKENS} (one Q x K heatmap per "
            "layer and head): shorten it"
        )


def default_figsize(weights: torch.Tensor) -> tuple[float, float]:
    """Inches: a square cell per heatmap, growing with the token count, plus room for the colorbar."""
    num_layers, num_heads, queries, keys = weights.shape
    cell = max(2.5, 1.0 + 0.22 * max(queries, keys))
    return num_heads * cell + 1.2, num_layers * cell + 0.4


def plot_attention_map(
    attention: AttentionMap, path: str | Path, *, dpi: int = 100, figsize: tuple[float, float] | None = None
) -> Path:
    """A grid of heatmaps, one row per layer and one column per head (query tokens on y, key tokens on x), with a
    shared colorbar; written as a PNG of exactly `figsize × dpi` pixels.

    Args:
        attention ([`AttentionMap`]): what to draw.
        path (`str` or `Path`): the PNG file.
        dpi (`int`, *optional*, defaults to 100): pixels per inch.
        figsize (`tuple[float, float]`, *optional*): width and height in inches; defaults to [`default_figsize`].
    """
    plt = pyplot()
    figsize = figsize or default_figsize(attention.weights)
    width, height = round(figsize[0] * dpi), round(figsize[1] * dpi)
    if width * height > MAX_PIXELS:
        raise ValueError(
            f"the {attention.kind} attention figure would be {width} x {height} pixels ({len(attention.layers)} "
            f"layers x {len(attention.heads)} heads of {len(attention.query_tokens)} x "
            f"{len(attention.key_tokens)} tokens; at most {MAX_PIXELS} pixels): choose fewer --layers or "
            "--heads, a shorter --text, or a lower --dpi"
        )
    fig, axes = plt.subplots(
        len(attention.layers), len(attention.heads), figsize=figsize, squeeze=False, layout="constrained"
    )
    peak = float(attention.weights.max())
    size = 8 if max(len(attention.query_tokens), len(attention.key_tokens)) <= 16 else 6
    for row, layer in enumerate(attention.layers):
        for column, head in enumerate(attention.heads):
            ax = axes[row][column]
            image = ax.imshow(attention.weights[row, column].numpy(), cmap="viridis", vmin=0.0, vmax=peak)
            title = "premise (rows), hypothesis" if attention.kind == "alignment" else f"layer {layer} head {head}"
            ax.set_title(title, fontsize=9)
            ax.set_xticks(
                range(len(attention.key_tokens)), [label(t) for t in attention.key_tokens], rotation=90, fontsize=size
            )
            ax.set_yticks(range(len(attention.query_tokens)), [label(t) for t in attention.query_tokens], fontsize=size)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight")
    fig.suptitle(f"{attention.kind} attention (query ↓, key →)")
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return Path(path)


def save_attention_maps(
    maps: dict[str, AttentionMap],
    path: str | Path,
    *,
    dpi: int = 100,
    figsize: tuple[float, float] | None = None,
    metadata: dict | None = None,
) -> list[Path]:
    """Writes the heatmaps and the numbers behind them.

    `path` (e.g. `attention.png`) receives the heatmap of a single map; several maps go to `attention_<kind>.png`.
    Beside them, `attention.safetensors` holds each map's weights under `<kind>.layer<L>` with shape `(heads, Q, K)`
    and `attention.json` the layers, heads and tokens of each kind (plus `metadata`).

    Returns:
        `list[Path]`: the files written.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for kind, attention in maps.items():
        png = path if len(maps) == 1 else path.with_name(f"{path.stem}_{kind}{path.suffix or '.png'}")
        written.append(plot_attention_map(attention, png, dpi=dpi, figsize=figsize))
    written += save_attention_numbers(maps, path.with_suffix(""), metadata)
    return written


def save_attention_numbers(maps: dict[str, AttentionMap], stem: Path, metadata: dict | None = None) -> list[Path]:
    """`<stem>.safetensors` (`<kind>.layer<L>`: `(heads, Q, K)`) and `<stem>.json` (layers, heads, tokens)."""
    from safetensors.torch import save_file

    tensors = {
        f"{kind}.layer{layer}": attention.weights[row].contiguous()  # (heads, Q, K)
        for kind, attention in maps.items()
        for row, layer in enumerate(attention.layers)
    }
    weights_file, tokens_file = stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")
    save_file(tensors, str(weights_file))
    described = {
        kind: {"layers": a.layers, "heads": a.heads, "query_tokens": a.query_tokens, "key_tokens": a.key_tokens}
        for kind, a in maps.items()
    }
    write_json_atomic(tokens_file, {**(metadata or {}), "maps": described}, indent=2, ensure_ascii=False)
    return [weights_file, tokens_file]


@dataclass
class AttentionMapArguments:
    model: str = field(metadata={"help": "a saved plugformer model directory (with its tokenizer)"})
    text: str = field(default=EXAMPLE_TEXT, metadata={"help": "the input (a seq2seq model's source)"})
    target_text: str | None = field(default=None, metadata={"help": "a seq2seq model's decoder input"})
    text_pair: str | None = field(
        default=None, metadata={"help": "the hypothesis of a sentence pair, `text` its premise (the nli stage's model)"}
    )
    layers: list[int] | None = field(default=None, metadata={"help": "layer indices; None: every layer"})
    heads: list[int] | None = field(default=None, metadata={"help": "head indices; None: every head"})
    output: str = field(default="attention.png", metadata={"help": "PNG file; .safetensors and .json go beside it"})
    dpi: int = 100
    bos: bool | None = field(
        default=None,
        metadata={
            "help": "prepend the tokenizer's bos token to the text (default: as plugformer trains the model: "
            "yes, but not to a seq2seq model's source, which ends with end of text instead)"
        },
    )


def main(argv: list[str]) -> list[Path]:
    """`plugformer attention-map --model DIR [--text ...] [--layers 0 1] [--heads 0 2] [--output attention.png]`"""
    from transformers import AutoTokenizer

    from ..runtime.arguments import parse_arguments

    args = parse_arguments(AttentionMapArguments, argv, prog="plugformer attention-map")
    model, tokenizer = load_model(args.model), AutoTokenizer.from_pretrained(args.model)
    pairs = model.config.model_type == DecomposableAttentionConfig.model_type  # it reads sentence pairs
    if pairs != (args.text_pair is not None):
        raise ValueError(
            f"--text_pair {args.text_pair!r}: "
            + (
                "the decomposable attention model aligns a sentence "
                "pair: give the hypothesis as --text_pair, the premise as --text"
                if pairs
                else "only the decomposable attention model reads sentence pairs"
            )
        )
    if pairs:
        maps = alignment_weights(model, tokenizer, args.text, args.text_pair)
    else:
        maps = attention_weights(
            model,
            tokenizer,
            args.text,
            target_text=args.target_text,
            layers=args.layers,
            heads=args.heads,
            bos=args.bos,
        )
    metadata = {"model": args.model, "text": args.text, "target_text": args.target_text, "text_pair": args.text_pair}
    written = save_attention_maps(maps, args.output, dpi=args.dpi, metadata=metadata)
    print("\n".join(f"wrote {path}" for path in written))
    return written
