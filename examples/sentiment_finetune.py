"""Fine-tune a bidirectional plugformer encoder for sentiment with transformers' `Trainer`, offline, in under a
minute on two CPU cores (about 15 s at the defaults).

The data is plugformer's sentiment grammar ("the food was not really good" -> NEGATIVE): "not" flips the
adjective's polarity, so a bag of words scores about 60%. Train, dev and test splits are drawn with different seeds,
and a dev or test sentence that also occurs in the training split is dropped, so both are held out. A byte-level BPE
tokenizer is trained on the training split. The dev split is scored during training (`compute_metrics`); the test
split once at the end: accuracy with its 95% Wilson interval and macro F1, printed and written to
`<output_dir>/test_results.json`. The model and tokenizer are saved so that, after `import plugformer`,
`pipeline("sentiment-analysis", model=<output_dir>)` loads them.

    python examples/sentiment_finetune.py
    python examples/sentiment_finetune.py --attention_score scaled_dot --position_scheme rope --max_steps 300
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import DataCollatorWithPadding, Trainer, TrainingArguments, pipeline, set_seed

import plugformer  # registers model_type "plugformer" with the Auto classes, so pipeline() can load the output
from plugformer import PlugformerConfig, PlugformerForSequenceClassification, train_tokenizer
from plugformer.data.corpus import SENTIMENT_LABELS, sentiment_examples
from plugformer.evaluation.classification import compute_metrics, evaluate_classifier


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attention_score", default="additive", choices=plugformer.ATTENTION_SCORES.names())
    parser.add_argument("--position_scheme", default="t5_bias", choices=plugformer.POSITION_SCHEMES.names())
    parser.add_argument("--max_steps", type=int, default=150)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--train_examples", type=int, default=2000)
    parser.add_argument("--dev_examples", type=int, default=300)
    parser.add_argument("--test_examples", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output_dir", default="outputs/sentiment")
    return parser.parse_args(argv)


def held_out(count: int, seed: int, seen: set[str]) -> list[tuple[str, int]]:
    """Up to `count` examples drawn with `seed` whose text is not in `seen` (the grammar has under 2,000 sentences,
    so another seed alone repeats many training sentences)."""
    candidates = sentiment_examples(20 * count, seed=seed)
    return [(text, label) for text, label in candidates if text not in seen][:count]


def make_splits(args: argparse.Namespace) -> dict[str, list[tuple[str, int]]]:
    train = sentiment_examples(args.train_examples, seed=args.seed)
    seen = {text for text, _ in train}
    splits = {
        "train": train,
        "dev": held_out(args.dev_examples, args.seed + 1, seen),
        "test": held_out(args.test_examples, args.seed + 2, seen),
    }
    for name in ("dev", "test"):
        if not splits[name]:
            raise ValueError(f"--train_examples {args.train_examples} leaves no {name} sentence out; use fewer")
    print(", ".join(f"{name}: {len(rows)} examples" for name, rows in splits.items()) + " (dev, test: not in train)")
    return splits


def build_model(args: argparse.Namespace, tokenizer) -> PlugformerForSequenceClassification:
    config = PlugformerConfig.from_preset(
        "tiny",
        is_causal=False,  # a bidirectional encoder: "not" can attend to the adjective after it
        attention_score=args.attention_score,
        position_scheme=args.position_scheme,
        hidden_size=64,
        intermediate_size=128,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        num_labels=len(SENTIMENT_LABELS),
        id2label=SENTIMENT_LABELS,
        label2id={label: i for i, label in SENTIMENT_LABELS.items()},
    )
    return PlugformerForSequenceClassification(config)


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=128,
        learning_rate=args.learning_rate,
        warmup_steps=max(1, args.max_steps // 20),
        eval_strategy="steps",
        eval_steps=max(1, args.max_steps // 3),
        logging_steps=max(1, args.max_steps // 6),
        save_strategy="no",  # the final model is saved below, with its tokenizer
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=args.seed,
        disable_tqdm=True,
    )


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    started = time.perf_counter()
    set_seed(args.seed)
    splits = make_splits(args)
    tokenizer = train_tokenizer([text for text, _ in splits["train"]], vocab_size=300)
    model = build_model(args, tokenizer)
    print(
        f"model: {sum(p.numel() for p in model.parameters()) / 1e3:.0f}k parameters, "
        f"attention_score={args.attention_score}, position_scheme={args.position_scheme}"
    )

    def dataset(rows: list[tuple[str, int]]) -> Dataset:
        texts, labels = zip(*rows, strict=True)
        columns = Dataset.from_dict({"text": list(texts), "label": list(labels)})
        return columns.map(lambda batch: tokenizer(batch["text"]), batched=True, remove_columns=["text"])

    trainer = Trainer(
        model=model,
        args=training_arguments(args),
        train_dataset=dataset(splits["train"]),
        eval_dataset=dataset(splits["dev"]),
        data_collator=DataCollatorWithPadding(tokenizer),
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
    )
    trainer.train()

    texts, labels = zip(*splits["test"], strict=True)
    scores = evaluate_classifier(model, tokenizer, texts, labels)
    low, high = scores["accuracy_ci95"]
    print(
        f"test: accuracy {scores['accuracy']:.1%} (95% Wilson interval {low:.1%}-{high:.1%}), "
        f"macro F1 {scores['macro_f1']:.3f} on {scores['examples']} held-out sentences"
    )

    model.save_pretrained(args.output_dir)
    tokenizer.save_pretrained(args.output_dir)
    results = {
        **scores,
        "f1_per_class": {SENTIMENT_LABELS[i]: f1 for i, f1 in scores["f1_per_class"].items()},
        "support": {SENTIMENT_LABELS[i]: n for i, n in scores["support"].items()},
        "arguments": vars(args),
        "seconds": round(time.perf_counter() - started, 1),
    }
    Path(args.output_dir, "test_results.json").write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")

    classifier = pipeline("sentiment-analysis", model=args.output_dir)
    sentences = ["the concert was not boring", "my day was really awful"]
    results["pipeline"] = classifier(sentences)
    for sentence, prediction in zip(sentences, results["pipeline"], strict=True):
        print(f"  {sentence!r} -> {prediction['label']} ({prediction['score']:.2f})")
    print(f"saved to {args.output_dir} in {results['seconds']:.0f}s")
    return results


if __name__ == "__main__":
    main()
