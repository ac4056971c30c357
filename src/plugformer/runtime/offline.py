"""Nothing leaves the machine unless asked: every `plugformer` command runs with the Hub offline and telemetry off.

TRL's trainers send a telemetry ping (trainer, `model_arch`, dataset source, topology) through
`huggingface_hub.send_telemetry` unless `HF_HUB_OFFLINE` or `HF_HUB_DISABLE_TELEMETRY` is set, and transformers,
datasets and huggingface_hub contact the Hub for names that are not local folders; from transformers 5.25
`from_pretrained` also fetches Hub kernels for the layers that name one unless `USE_HUB_KERNELS` is false
(`compat`). `apply_offline_defaults` sets the three variables where the user has not set them (an explicit
`HF_HUB_OFFLINE=0 HF_HUB_DISABLE_TELEMETRY=0 USE_HUB_KERNELS=YES` turns them back on), for this process and for the
processes it starts (`accelerate launch` workers).

Only those names decide: the libraries' other switches (`HF_DATASETS_OFFLINE`, `TRANSFORMERS_OFFLINE`,
`DISABLE_TELEMETRY`) cover one library each or only add to them, so a user who sets one of them (to be *more*
offline) must not make plugformer skip its own defaults — `HF_DATASETS_OFFLINE=1` once left transformers and
huggingface_hub online.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping


# variable -> the value set unless the user gave it a value (an empty value counts as not given)
OFFLINE_DEFAULTS: dict[str, str] = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "USE_HUB_KERNELS": "NO",  # transformers 5.25 fetches Hub kernels in from_pretrained otherwise (compat)
}


def apply_offline_defaults(environ: MutableMapping[str, str] | None = None) -> dict[str, str]:
    """Sets `HF_HUB_OFFLINE=1`, `HF_HUB_DISABLE_TELEMETRY=1` and `USE_HUB_KERNELS=NO` unless the user set them;
    returns what it set.

    huggingface_hub (and datasets) read the first two once, at import — and `import plugformer` has already
    imported huggingface_hub through transformers — so the imported modules' switches are set too; transformers
    5.25 reads `USE_HUB_KERNELS` at each `from_pretrained`.
    """
    environ = os.environ if environ is None else environ
    applied = {}
    for name, value in OFFLINE_DEFAULTS.items():
        if environ.get(name, "").strip():
            continue
        environ[name] = value
        applied[name] = value
    if environ is os.environ and applied:
        _switch_imported_modules(applied)
    return applied


def _switch_imported_modules(applied: dict[str, str]) -> None:
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        if "HF_HUB_OFFLINE" in applied:
            hub.HF_HUB_OFFLINE = True
        if "HF_HUB_DISABLE_TELEMETRY" in applied:
            hub.HF_HUB_DISABLE_TELEMETRY = True
    datasets_config = sys.modules.get("datasets.config")
    if datasets_config is not None and "HF_HUB_OFFLINE" in applied:
        datasets_config.HF_HUB_OFFLINE = datasets_config.HF_DATASETS_OFFLINE = True
