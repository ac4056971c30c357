"""`plugformer demo`: the whole loop offline in about a minute on a laptop CPU.

Trains a byte-level BPE tokenizer and a small plugformer language model on generated arithmetic sentences with
transformers' `Trainer`, reports held-out perplexity, saves the model and tokenizer (safetensors + remote code),
reloads them with `pipeline("text-generation")` and completes a few prompts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments, pipeline, set_seed

from ..capabilities import KERNELS
from ..configuration import PlugformerConfig
from ..data.corpus import arithmetic_sentences
from ..data.tokenization import generation_eos_token_ids, train_tokenizer
from ..modeling import PlugformerForCausalLM
from ..positions import POSITION_SCHEMES
from ..runtime.arguments import parse_arguments
from ..runtime.files import naming_a_full_disk, weights_with_umask_mode
from ..runtime.memory import check_model_fits
from ..runtime.run_folders import claim_folder, release_lock
from ..scores import ATTENTION_SCORES
from ..training.arguments import check_counts, check_trainer_arguments


MAX_SENTENCES = 10**7  # the demo's generated sentences, held in memory: ~0.5 GB of text


@dataclass
class DemoArguments:
    output_dir: str = field(default="outputs/demo", metadata={"help": "Where the model and tokenizer are saved."})
    preset: str = field(default="tiny", metadata={"help": "PlugformerConfig preset the model starts from."})
    attention_score: str = field(default="scaled_dot", metadata={"help": ATTENTION_SCORES.choices()})
    position_scheme: str = field(default="alibi", metadata={"help": POSITION_SCHEMES.choices()})
    attn_implementation: str | None = field(
        default=None, metadata={"help": "eager | sdpa | flex_attention (default: best valid)"}
    )
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int = 512
    train_sentences: int = 6000
    eval_sentences: int = 300
    max_steps: int = 300
    batch_size: int = 32
    learning_rate: float = 3e-3
    seed: int = 0
    prompts: list[str] = field(default_factory=lambda: ["12 plus 7 is", "The sum of 30 and 12 is", "45 + 5 ="])
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "save into an output_dir that holds another run (its checkpoints and records are removed); "
            "without it such a folder is refused, as by the train stages"
        },
    )


def build_model(args: DemoArguments, tokenizer) -> PlugformerForCausalLM:
    config = PlugformerConfig.from_preset(
        args.preset,
        attention_score=args.attention_score,
        position_scheme=args.position_scheme,
        hidden_size=args.hidden_size,
        intermediate_size=None,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        vocab_size=len(tokenizer),
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    if args.attn_implementation is not None:
        config._attn_implementation = args.attn_implementation
    check_model_fits(config, training=True, what="plugformer demo")
    model = PlugformerForCausalLM(config)
    model.generation_config.eos_token_id = generation_eos_token_ids(tokenizer)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def training_arguments(args: DemoArguments) -> TrainingArguments:
    """The `Trainer`'s options from the demo's, checked by the rule every training command follows
    (`check_trainer_arguments`: `--max_steps -5` trained 3 epochs, as transformers reads any negative count)."""
    # under their own names (not the trainer's per_device_train_batch_size); a -1 was refused after the folder claim
    check_counts(args, {"batch_size": 1, "train_sentences": 1, "eval_sentences": 1})
    for name in ("train_sentences", "eval_sentences"):  # generated in memory before the folder is claimed
        if getattr(args, name) > MAX_SENTENCES:
            raise ValueError(
                f"--{name} {getattr(args, name)}: at most {MAX_SENTENCES} (the demo generates them in "
                "memory; `plugformer train pretrain --train_examples N` prepares a corpus of any size)"
            )
    training_args = TrainingArguments(
        output_dir=str(Path(args.output_dir) / "checkpoints"),
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, args.max_steps // 20),
        logging_steps=max(1, args.max_steps // 10),
        save_strategy="no",
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=args.seed,
        disable_tqdm=True,
    )
    check_trainer_arguments(training_args)
    return training_args


def run(args: DemoArguments) -> dict:
    started = time.perf_counter()
    training_args = training_arguments(args)  # a bad count is refused before the folder is claimed or any work
    claim_folder(args.output_dir, "demo", args.overwrite_output_dir)  # another run's folder is refused, as by a stage
    try:
        return train_and_show(args, training_args, started)
    finally:
        release_lock(args.output_dir)


def train_and_show(args: DemoArguments, training_args: TrainingArguments, started: float) -> dict:
    set_seed(args.seed)
    train_texts = arithmetic_sentences(args.train_sentences, seed=args.seed)
    eval_texts = arithmetic_sentences(args.eval_sentences, seed=args.seed + 1)
    tokenizer = train_tokenizer(train_texts, vocab_size=args.vocab_size)
    model = build_model(args, tokenizer)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"model: {parameters / 1e6:.2f}M parameters, attention_score={model.config.attention_score}, "
        f"position_scheme={model.config.position_scheme}, kernel={KERNELS.of(model.config).name}"
    )
    # each sentence is a document: <bos> text <eos>
    encode = lambda text: tokenizer(tokenizer.bos_token + text + tokenizer.eos_token)  # noqa: E731
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=[encode(text) for text in train_texts],
        eval_dataset=[encode(text) for text in eval_texts],
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    initial = trainer.evaluate()["eval_loss"]
    trainer.train()
    with naming_a_full_disk(args.output_dir, "the demo model", "the model files in it are incomplete"):
        model.save_pretrained(args.output_dir)  # before the evaluation: a failure there keeps the trained model
        tokenizer.save_pretrained(args.output_dir)
    weights_with_umask_mode(args.output_dir)  # safetensors writes 0600: a shared folder stays readable
    final = trainer.evaluate()["eval_loss"]
    print(f"held-out perplexity: {math.exp(initial):.1f} before training -> {math.exp(final):.2f} after")
    generator = pipeline("text-generation", model=args.output_dir)
    completions = {}
    for prompt in args.prompts:
        text = generator(tokenizer.bos_token + prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
        completions[prompt] = text.removeprefix(tokenizer.bos_token)
        print(f"  {completions[prompt]!r}")
    print(
        f"saved to {args.output_dir} (load with AutoModelForCausalLM after `import plugformer`) "
        f"in {time.perf_counter() - started:.0f}s"
    )
    return {"initial_eval_loss": initial, "final_eval_loss": final, "completions": completions}


def main(argv: list[str]) -> dict:
    return run(parse_arguments(DemoArguments, argv, prog="plugformer demo"))
