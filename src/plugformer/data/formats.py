"""The data formats your files come in, as tables read by the loader (`user_data`), its checks (`validation`) and
the stages (`training.stage_table.Stage.data_format` is a key of `FORMAT_COLUMNS`)."""

from __future__ import annotations


# `datasets`' packaged builders that read --data_files; `load_dataset` takes these names before any local folder
BUILDERS = ("json", "csv", "text", "parquet", "arrow")
# the columns each of TRL's formats (`Stage.data_format`) needs from your data (`conversation`: one of TRL's SFT
# column sets, `data.validation.FORMAT_ALTERNATIVES`)
FORMAT_COLUMNS: dict[str, tuple[str, ...]] = {
    "text": ("text",),
    "conversation": (),  # TRL accepts text | messages | prompt + completion
    "preference": ("chosen", "rejected"),
    "prompt": ("prompt",),
    "prompt_answer": ("prompt", "answer"),
    "classification": ("text", "label"),
    "source_target": ("source", "target"),
    "sentence_pair": ("text", "text_pair", "label"),
}
# a column a format may find under another name: TRL's math datasets name the ground truth `solution` (a worked
# solution whose final answer `training.data.evaluation_data` reads as the `answer`)
STAND_INS = {"answer": "solution"}
# the formats a sequence classifier reads: its held-out rows are scored by accuracy
CLASSIFIER_FORMATS = ("classification", "sentence_pair")
# the columns of a format that a tokenizer reads as text: every value must be a string (or null, named elsewhere)
TEXT_COLUMNS = {"text": ("text",), **{name: ("text", "text_pair") for name in CLASSIFIER_FORMATS}}
