"""The whole training pipeline from Python: pretrain -> SFT -> reward model -> RLHF (RLOO against the learned
reward), DPO and RLVR (GRPO with verifiable rewards), then what a researcher looks at afterwards: the held-out
table, the training curves of every stage, an attention heatmap of the final model reading a question, and the
answer it gives through `pipeline("text-generation")`.

    python examples/full_pipeline.py              # the shipped configs/*/tiny.yaml, about 12 minutes on 2 CPU cores
    python examples/full_pipeline.py --quick      # every stage for a few steps on a tiny model (about a minute)

`plugformer pipeline --config configs/pipeline/tiny.yaml` runs the same stages from the command line; finished
stages are reused when the script is run again.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from plugformer.evaluation.answers import prompt_text
from plugformer.evaluation.attention_maps import attention_weights, save_attention_maps
from plugformer.evaluation.plots import plot_training_curves
from plugformer.experiments.pipeline import PipelineArguments, run
from plugformer.training.common import load_tokenizer


ROOT = Path(__file__).resolve().parents[1]
# The stages configs/pipeline/tiny.yaml lists (the six the docstring names). PipelineArguments' default is every
# registered stage, which since the baselines (rft, sft_matched) were registered adds two opt-in stages of training.
STAGES = yaml.safe_load((ROOT / "configs" / "pipeline" / "tiny.yaml").read_text())["stages"]
QUICK = {"max_steps": 3, "train_examples": 64, "dev_examples": 8, "exact_match_examples": 4, "report_to": "none",
         "hidden_size": 32, "num_hidden_layers": 1, "per_device_train_batch_size": 8, "vocab_size": 300,
         "logging_steps": 1}  # fmt: skip


def quick_configs(directory: Path) -> str:
    """The shipped tiny YAMLs cut to a few steps of a smaller model (keys a stage does not have are not added)."""
    for path in (ROOT / "configs").glob("*/tiny.yaml"):
        if path.parent.name in STAGES:
            values = yaml.safe_load(path.read_text())
            values.update({key: value for key, value in QUICK.items() if key in values or key == "logging_steps"})
            (directory / f"{path.parent.name}.yaml").write_text(yaml.safe_dump(values))
    return str(directory / "{stage}.yaml")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default="outputs/examples/pipeline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few steps per stage on a tiny model")
    args = parser.parse_args(argv)
    output = Path(args.output_dir)
    with tempfile.TemporaryDirectory() as scratch:
        configs = quick_configs(Path(scratch)) if args.quick else str(ROOT / "configs" / "{stage}" / "tiny.yaml")
        results = run(
            PipelineArguments(
                output_dir=str(output),
                stages=STAGES,
                stage_configs=configs,
                seed=args.seed,
                test_examples=20 if args.quick else 200,
                max_new_tokens=8 if args.quick else 32,
            )
        )

    # training curves: every stage's loss on one plot (each stage writes its log history beside its model)
    stages = [output / stage for stage in results]
    plot_training_curves(stages, output / "training_curves.png", metrics=("loss",))

    # what the final model attends to when it reads a question (eager recompute; the model runs on sdpa)
    from transformers import AutoModelForCausalLM

    final = output / "grpo"
    tokenizer = load_tokenizer(str(final))
    question = prompt_text(tokenizer, [{"role": "user", "content": "What is 27 + 58?"}])
    maps = attention_weights(AutoModelForCausalLM.from_pretrained(final), tokenizer, question, layers=[0], bos=False)
    written = save_attention_maps(maps, output / "attention_final_model.png")
    print(f"\ntraining curves: {output / 'training_curves.png'}\nattention map: {written[0]}")
    return results


if __name__ == "__main__":
    main()
