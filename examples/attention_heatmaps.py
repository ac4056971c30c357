"""Where a small model looks, and what each position scheme adds to the attention scores — offline, on a CPU.

Trains a byte-level BPE tokenizer and a small causal LM (T5 relative bias by default) for a few hundred steps on
plugformer's offline corpus (arithmetic facts, sentiment and NLI sentences), or reuses `--model DIR`, then writes
to `--output_dir`:

- `attention.png` (+ `attention.safetensors`, `attention.json`): self-attention of the chosen layers and heads over
  "The chicken didn't cross the road because it was too tired";
- `sinusoidal.png`: the sinusoidal position encoding of Vaswani et al. (position × dimension);
- `bias_alibi.png`, `bias_t5_bias.png`: the bias each head adds to a score against the distance key − query (ALiBi's
  fixed slopes; T5's learned buckets, from the trained model when it uses t5_bias, else an untrained table).

The defaults run in well under a minute:

    python examples/attention_heatmaps.py --output_dir outputs/attention_heatmaps
    python examples/attention_heatmaps.py --model outputs/pipeline/pretrain --layers 0 3 --heads 0 1
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

import plugformer  # noqa: F401  (registers plugformer with the Auto classes)
from plugformer import PlugformerConfig, PlugformerForCausalLM, train_tokenizer
from plugformer.data.corpus import arithmetic_sentences, nli_examples, sentiment_examples
from plugformer.evaluation.attention_maps import EXAMPLE_TEXT, attention_weights, load_model, save_attention_maps
from plugformer.evaluation.plots import plot_position_bias, plot_sinusoidal


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="outputs/attention_heatmaps")
    parser.add_argument("--model", default=None, help="a saved plugformer causal or masked LM to use instead")
    parser.add_argument("--text", default=EXAMPLE_TEXT)
    parser.add_argument("--position_scheme", default="t5_bias", help="of the trained model")
    parser.add_argument("--steps", type=int, default=300, help="training steps")
    parser.add_argument("--sentences", type=int, default=2000, help="sentences of each corpus generator")
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--hidden_size", type=int, default=64)
    parser.add_argument("--num_hidden_layers", type=int, default=2)
    parser.add_argument("--vocab_size", type=int, default=400)
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="default: first and last layer")
    parser.add_argument("--heads", type=int, nargs="+", default=None, help="default: heads 0 and 1")
    parser.add_argument("--dpi", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def corpus(count: int, seed: int) -> list[str]:
    """English-ish sentences from the three offline generators."""
    texts = arithmetic_sentences(count, seed=seed)
    texts += [text for text, _ in sentiment_examples(count, seed=seed)]
    texts += [f"{premise}, so {hypothesis}." for premise, hypothesis, _ in nli_examples(count, seed=seed)]
    return texts


def train_model(args: argparse.Namespace, directory: Path):
    """A tokenizer and a causal LM trained for `args.steps` steps on `<bos> text <eos>` documents; saved to
    `directory` so `plugformer attention-map --model` can reuse it."""
    torch.manual_seed(args.seed)
    texts = corpus(args.sentences, args.seed)
    tokenizer = train_tokenizer(texts, vocab_size=args.vocab_size)
    config = PlugformerConfig.from_preset(
        "tiny",
        position_scheme=args.position_scheme,
        hidden_size=args.hidden_size,
        intermediate_size=None,
        num_hidden_layers=args.num_hidden_layers,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = PlugformerForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(args.seed)
    for step in range(args.steps):
        documents = [
            tokenizer.bos_token + texts[i] + tokenizer.eos_token
            for i in torch.randint(len(texts), (args.batch_size,), generator=generator)
        ]
        batch = tokenizer(documents, padding=True, add_special_tokens=False, return_tensors="pt")
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)  # (B, T): no loss on padding
        loss = model(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step in (0, args.steps - 1):
            print(f"step {step + 1}/{args.steps}: loss {loss.item():.3f}")
    model.eval().save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model, tokenizer


def bias_source(model, scheme: str):
    """The model itself when it uses `scheme`, else a fresh config with its head count (ALiBi is fixed anyway)."""
    if model.config.position_scheme == scheme:
        return model
    if scheme != "alibi":
        print(f"{scheme}: the model uses {model.config.position_scheme}; plotting an untrained {scheme} table")
    config = model.config
    return PlugformerConfig.from_preset(
        "tiny", position_scheme=scheme, num_attention_heads=config.num_attention_heads, hidden_size=config.hidden_size
    )


def main(argv: list[str] | None = None) -> list[Path]:
    args = parse_args(argv)
    started = time.perf_counter()
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        model, tokenizer = train_model(args, output_dir / "model")
    else:
        model, tokenizer = load_model(args.model), AutoTokenizer.from_pretrained(args.model)
    last = model.config.num_hidden_layers - 1
    layers = args.layers if args.layers is not None else sorted({0, last})
    heads = args.heads if args.heads is not None else list(range(min(2, model.config.num_attention_heads)))
    maps = attention_weights(model, tokenizer, args.text, layers=layers, heads=heads)
    written = save_attention_maps(maps, output_dir / "attention.png", dpi=args.dpi, metadata={"text": args.text})
    plot_sinusoidal(64, 64, output_dir / "sinusoidal.png", dpi=args.dpi)
    written.append(output_dir / "sinusoidal.png")
    for scheme in ("alibi", "t5_bias"):
        path = output_dir / f"bias_{scheme}.png"
        plot_position_bias(bias_source(model, scheme), path, max_distance=24, dpi=args.dpi)
        written.append(path)
    print("\n".join(f"wrote {path}" for path in written) + f"\nin {time.perf_counter() - started:.0f}s")
    return written


if __name__ == "__main__":
    main()
