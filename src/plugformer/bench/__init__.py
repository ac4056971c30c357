"""`plugformer bench`: plugformer against transformers' reference models, and the plugformer variants, in one run.

    plugformer bench --quick --output_dir outputs/bench              # CI: everything on tiny sizes, < 1 min
    plugformer bench --sizes tiny small --seq_lens 512 2048 --dtypes fp32 bf16 --sections train decode variants
    python -m plugformer.bench --sections variants --seq_lens 512 2048 4096 --repeats 7
    plugformer bench --sizes small --seq_lens 512 --sections train decode --readme model_cards/BENCHMARKS.md

Sections:

- `train` / `decode`, the A/B pairs: plugformer `scaled_dot + rope` with GQA against `LlamaForCausalLM`, and
  `scaled_dot + learned` against `GPT2LMHeadModel`, both on sdpa. The reference is built from a transformers config
  (random init, no download), saved and converted with `plugformer.integrations.convert`; logits must agree to 1e-4 before
  anything is timed. `train` times forward + backward + AdamW and measures peak memory and MFU; `decode` times
  greedy `generate` with the KV cache, split into prefill and decode. The `aa` pair times `LlamaForCausalLM` against
  its own copy: the A/A row, whose spread is the run's noise floor.
- `loss` (only when named): the `train` step of the `llama` pair with plugformer's fused loss (`model.fused_loss`,
  as `plugformer train` sets it) against Llama's full logits, at each of `--loss_vocab_sizes`.
- `variants`: every registered score function x position scheme, and scaled_dot + none with each attention modifier
  set to each of its values (`variants.ATTENTION_MODIFIERS`, when scaled_dot and none are among the rows asked for), on the kernel the model resolves (sdpa where plugformer's capabilities allow, else eager), each interleaved with
  scaled_dot + none on sdpa at the same size, dtype and length; the kernel that actually ran is read from the
  profiler (e.g. `sdpa:math` when a learned bias needs grad).

Every comparison runs its two models once per repeat in alternating order (A, B, B, A), so a shared machine's drift
hits both and neither always follows the other; the report gives ratios first (with the range of per-repeat paired
ratios), then absolute medians, then the machine.
How each number is measured is in `bench.md`'s Method section and in `measure.py`. The performance blocks of
`model_cards/BENCHMARKS.md` are generated from `bench.json` by `readme.py` (`python -m plugformer.bench.readme
BENCH_JSON ... --readme model_cards/BENCHMARKS.md`).

The prepared GPU check (every kernel against eager on CUDA, bf16 steps, the fused loss, cached decoding, MFU) is
`python -m plugformer.bench.gpu` (`gpu.py`).
"""

from .arguments import BenchArguments


__all__ = ["BenchArguments", "main", "run"]


def __getattr__(name: str):
    # the runner imports the converters, and they `datasets`: loaded on first use, so `plugformer.bench.gpu` runs
    # where only torch and transformers are installed (a GPU machine's image)
    if name == "run":
        from .runner import run

        return run
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: list[str] | None = None) -> dict:
    import sys

    from ..runtime.arguments import parse_arguments
    from . import run  # through the module's attribute: a test may have replaced it

    argv = sys.argv[1:] if argv is None else argv
    return run(parse_arguments(BenchArguments, argv, prog="plugformer bench"))
