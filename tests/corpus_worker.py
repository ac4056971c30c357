"""`python tests/corpus_worker.py RECORD ARGS...` (or under `accelerate launch`): `plugformer train pretrain ARGS`,
writing the `input_ids` of every batch each rank trains on, in order, to `RECORD.<rank>.json`."""

from __future__ import annotations

import json
import os
import sys

import transformers

from plugformer.training import run_stage


def main(record: str, argv: list[str]) -> None:
    seen = []
    original = transformers.Trainer.training_step

    def training_step(self, model, inputs, *args, **kwargs):
        seen.append(inputs["input_ids"].tolist())
        return original(self, model, inputs, *args, **kwargs)

    transformers.Trainer.training_step = training_step
    try:
        run_stage("pretrain", argv)
    finally:
        with open(f"{record}.{os.environ.get('RANK', '0')}.json", "w") as file:
            json.dump(seen, file)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
