"""Import transformers' causal LM checkpoints of the families in `families.CONVERTERS` (Llama, Qwen3, Qwen3-Next,
Mistral, Gemma 2, Phi-3, SmolLM3, GPT-2, dense DeepSeek-V3) into plugformer with identical logits.

That is the path from a pretrained public checkpoint to a variant study: convert, then switch `position_scheme` or
`attention_score` (the weights that still fit are kept, new variant parameters start fresh) and fine-tune.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedConfig

from ..configuration import PlugformerConfig
from ..modeling import PlugformerForCausalLM
from ..runtime.files import looks_local, naming_a_full_disk, weights_with_umask_mode
from ..runtime.memory import check_model_fits
from ..runtime.run_folders import claimed_folder
from .families import CONVERTERS


logger = logging.getLogger(__name__)


def check_output_dir(source: str | Path, output_dir: str | Path) -> None:
    """Raises `ValueError` before anything is loaded if saving to `output_dir` would destroy the source or save
    nothing: the source itself (or a folder inside it: the source's files would sit beside another model's), or an
    existing file. A folder holding another run or model is refused by the output-folder rule every command follows
    (`runtime.run_folders.claim_folder`)."""
    source, output = Path(source).resolve(), Path(output_dir).resolve()
    if output == source or source in output.parents:
        raise ValueError(
            f"output_dir={str(output_dir)!r} is {'the source' if output == source else 'inside the source'} "
            f"{str(source)!r}: converting would overwrite or mix with it; choose a folder outside it"
        )
    if output.exists() and not output.is_dir():
        raise ValueError(f"output_dir={str(output_dir)!r} is an existing file, not a folder; choose a new folder")


def convert(
    source: str | Path, output_dir: str | Path | None = None, overwrite: bool = False, **overrides: Any
) -> PlugformerForCausalLM:
    """Builds the plugformer model equivalent to the causal LM checkpoint in `source` and copies its weights.

    Args:
        source (`str` or `Path`): A local transformers checkpoint directory (a `model_type` of
            `families.CONVERTERS`).
        output_dir (`str` or `Path`, *optional*): Where to save the converted model (safetensors + code). Never the
            source or a folder inside it, nor an existing file; a folder that holds another run or model only with
            `overwrite`, and never one a live run holds (the rule of every command that writes a model:
            `runtime.run_folders.claim_folder`; the folder is locked while converting and records stage `convert`).
        overwrite (`bool`, *optional*, defaults to `False`): Replace the run or model already in `output_dir` (its
            checkpoints and run records are removed first, as `--overwrite_output_dir true` does for a stage).
        overrides: Config fields to change after import, e.g. `position_scheme="alibi"`. Weights that still fit are
            kept; a source tensor whose shape the overrides change (`num_key_value_heads=2`) and a new parameter are
            initialised anew, weights the new config has no place for dropped; the lists are logged.

    Returns:
        [`PlugformerForCausalLM`]: In eval mode; without overrides its logits equal the source model's.
    """
    if str(source).startswith("~"):
        source = Path(source).expanduser()  # transformers would read "~/..." as a Hub id
    if output_dir is not None:
        check_output_dir(source, output_dir)
    config, to_weights = converted_config(source, overrides)  # a bad source or override fails before the claim
    if output_dir is None:
        return build_converted(source, config, to_weights, overrides)
    # refused while another run or model is there, or a live run; a failure hands the folder back for a retry
    with claimed_folder(str(output_dir), "convert", overwrite):
        model = build_converted(source, config, to_weights, overrides)
        with naming_a_full_disk(
            output_dir, "the converted model", f"its partly written files are removed; the source {source} is untouched"
        ):
            model.save_pretrained(output_dir)
        weights_with_umask_mode(output_dir)  # safetensors writes 0600: a shared folder stays readable
    return model


def source_checkpoint_config(source: str | Path) -> PreTrainedConfig:
    """The transformers config of `source`; `ValueError` naming it when it is a missing local path (transformers
    read it as a Hub id: a validation or connection traceback), a file, a folder without `config.json`, or a name
    that is neither a local folder nor, offline, a Hub id in the local cache."""
    from huggingface_hub import constants

    path = Path(source).expanduser()
    if path.exists() and not path.is_dir():
        raise ValueError(
            f"convert {source}: a file, not a folder; give a transformers checkpoint folder "
            "(config.json and the weights)"
        )
    if path.is_dir() and not (path / "config.json").is_file():
        raise ValueError(
            f"convert {source}: the folder holds no config.json, so it is no transformers checkpoint; "
            "give the folder save_pretrained wrote"
        )
    if not path.exists() and looks_local(source):
        raise ValueError(f"convert {source}: no such folder ({path.absolute()}); give a transformers checkpoint folder")
    try:
        return AutoConfig.from_pretrained(path if path.exists() else source)
    except OSError as error:  # a Hub id: not found, or offline and not in the local cache
        offline = " and the Hugging Face Hub is offline (plugformer sets HF_HUB_OFFLINE=1 unless you set it)"
        raise ValueError(
            f"convert {source}: no local folder of that name{offline if constants.HF_HUB_OFFLINE else ''}"
            f", and no Hub checkpoint could be read ({' '.join(str(error).split())[:200]}); give a "
            "transformers checkpoint folder"
        ) from error


def converted_config(source: str | Path, overrides: dict[str, Any]) -> tuple[PlugformerConfig, Callable]:
    """(the plugformer config of `source` with `overrides`, its weight converter); refuses an unknown `model_type`,
    a bad override or a model too large for memory, before any weight is read."""
    source_config = source_checkpoint_config(source)
    if source_config.model_type not in CONVERTERS:
        raise ValueError(f"model_type={source_config.model_type!r} is not one of {list(CONVERTERS)}")
    to_config, to_weights = CONVERTERS[source_config.model_type]
    config = PlugformerConfig(**{**to_config(source_config), **overrides})
    check_model_fits(config, training=False, copies=2, what="convert (the source model and its conversion)")
    return config, to_weights


def build_converted(source, config: PlugformerConfig, to_weights: Callable, overrides: dict) -> PlugformerForCausalLM:
    """The plugformer model of `convert` with the source's weights (in eval mode), not saved."""
    reference = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    weights = to_weights(reference.state_dict(), config, reference.config)
    model = PlugformerForCausalLM(config)
    # an override that changes a tensor's shape (num_key_value_heads, head_dim, ...): that tensor starts fresh, as a
    # new parameter does; load_state_dict(strict=False) raised a size-mismatch traceback for it
    own = model.state_dict()
    resized = sorted(name for name, tensor in weights.items() if name in own and own[name].shape != tensor.shape)
    weights = {name: tensor for name, tensor in weights.items() if name not in resized}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [name for name in missing if not (config.tie_word_embeddings and name == "lm_head.weight")]
    if (missing or unexpected) and not overrides:
        raise RuntimeError(f"conversion bug: missing {missing}, unexpected {unexpected}")
    if missing or unexpected:
        fresh = [name for name in missing if name not in resized]
        logger.warning(
            "after overrides %s: %d source tensors of another shape initialised anew %s; newly "
            "initialised %s; dropped %s",
            overrides,
            len(resized),
            resized,
            fresh,
            unexpected,
        )
    model.generation_config = reference.generation_config
    model.eval()
    return model


@dataclasses.dataclass
class ConvertArguments:
    """The options of `plugformer convert SOURCE_DIR OUTPUT_DIR` (the two folders are positional)."""

    set: list[str] = dataclasses.field(
        default_factory=list,
        metadata={"help": "config override (repeat it: the overrides accumulate)", "metavar": "FIELD=VALUE"},
    )
    overwrite_output_dir: bool = dataclasses.field(
        default=False,
        metadata={
            "help": "replace the run or model already in OUTPUT_DIR (its checkpoints and records removed), as for "
            "`plugformer train`",
            "metavar": "BOOL",
        },
    )
    overwrite: bool = dataclasses.field(
        default=False, metadata={"help": "the same as --overwrite_output_dir true", "metavar": "BOOL"}
    )

    def overrides(self) -> dict[str, Any]:
        """The `--set` config overrides, each value read as YAML."""
        from ..runtime.yaml_text import load_yaml_text

        overrides = {}
        for item in self.set:
            field, separator, value = item.partition("=")
            if not separator:
                raise ValueError(f"--set {item!r}: expected FIELD=VALUE")
            overrides[field] = load_yaml_text(value, f"--set {field}")
        return overrides


def main(argv: list[str]) -> PlugformerForCausalLM:
    """`plugformer convert SOURCE_DIR OUTPUT_DIR [--set field=value ...] [--overwrite_output_dir true]`."""
    from transformers import HfArgumentParser

    from ..runtime.arguments import REPEATED_FLAGS_RULE, merge_repeated_flags

    parser = HfArgumentParser(
        ConvertArguments,
        prog="plugformer convert",
        allow_abbrev=False,
        epilog=REPEATED_FLAGS_RULE,
        description="Import a Llama, Qwen3, Qwen3-Next, GPT-2 or DeepSeek-V3 checkpoint.",
    )
    parser.add_argument(
        "source", help="transformers checkpoint directory (model_type llama, qwen3, qwen3_next, gpt2 or deepseek_v3)"
    )
    parser.add_argument("output_dir", help="where the plugformer model is saved")
    # argparse's own refusal of an unknown option ("unrecognized arguments"), as the other positional commands
    folders = parser.parse_args(merge_repeated_flags(parser, list(argv), parser.prog, extra=()))
    args = ConvertArguments(
        **{field.name: getattr(folders, field.name) for field in dataclasses.fields(ConvertArguments)}
    )
    overwrite = args.overwrite_output_dir or args.overwrite
    model = convert(folders.source, folders.output_dir, overwrite=overwrite, **args.overrides())
    config = model.config
    print(f"saved {type(model).__name__} ({config.attention_score}, {config.position_scheme}) to {folders.output_dir}")
    return model
