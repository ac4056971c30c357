"""FSDP2 on CPU (torchrun, gloo), really sharded: a model whose blocks and root went through `fully_shard` trains to
the weights one process reaches on the whole batch, digests its sharded parameters, and saves a normal checkpoint —
plugformer's code and class in `auto_map`, no torch `_fsdp_*.py` files — that loads with `trust_remote_code` where
plugformer is not installed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_hf_integration import HIDE_PLUGFORMER

from plugformer import PlugformerConfig, PlugformerForCausalLM


WORKER = Path(__file__).with_name("fsdp_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """One checkpoint trained 3 steps twice: FSDP2 on 2 processes, and in one process."""
    root = tmp_path_factory.mktemp("fsdp")
    torch.manual_seed(0)
    # t5_bias: a learned table outside the blocks (sharded with the root), GQA, tied embeddings
    config = PlugformerConfig.from_preset("tiny", vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, position_scheme="t5_bias")  # fmt: skip
    PlugformerForCausalLM(config).save_pretrained(root / "start")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port())]  # fmt: skip
    for command, output in (([*torchrun, str(WORKER)], "sharded"), ([sys.executable, str(WORKER), "--single"], "one")):
        result = subprocess.run([*command, str(root / "start"), str(root / output)], env=ENV, capture_output=True,
                                text=True, timeout=300)  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
    return {name: root / name for name in ("start", "sharded", "one")}


def info(directory: Path) -> dict:
    return json.loads((directory / "worker.json").read_text())


def test_fsdp2_really_shards_and_trains_to_the_single_process_weights(runs):
    sharded = info(runs["sharded"])
    assert sharded["class"] == "FSDPPlugformerForCausalLM"  # fully_shard swapped the class: not DDP in disguise
    full = {name: tuple(t.shape) for name, t in load_file(runs["start"] / "model.safetensors").items()}
    for name, local in sharded["local_shapes"].items():
        assert local[0] == -(-full[name][0] // 2) and tuple(local[1:]) == full[name][1:], name  # dim 0 split over 2 ranks
    first, second = sharded["digests"]
    assert first == second  # digested whole (DTensor.full_tensor), the same on both ranks
    mine, reference = load_file(runs["sharded"] / "model.safetensors"), load_file(runs["one"] / "model.safetensors")
    assert mine.keys() == reference.keys()  # no tied copy (lm_head.weight) beside a plain checkpoint's keys
    for name in reference:
        assert not torch.equal(reference[name], load_file(runs["start"] / "model.safetensors")[name]), name
        torch.testing.assert_close(mine[name], reference[name], atol=1e-5, rtol=0)


def test_a_sharded_save_is_a_normal_checkpoint_with_plugformers_code(runs):
    directory = runs["sharded"]
    assert not list(directory.glob("_fsdp*")), "torch's FSDP files were saved as the checkpoint's code"
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["PlugformerForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling.PlugformerForCausalLM"
    assert (directory / "modeling.py").read_text() == (
        Path(__file__).parents[1] / "src/plugformer/modeling.py"
    ).read_text()


LOAD_SCRIPT = (
    HIDE_PLUGFORMER
    + """
import torch
from transformers import AutoModelForCausalLM
directory, out = sys.argv[1:]
model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True).eval()
with torch.no_grad():
    torch.save(model(torch.arange(3, 19)[None]).logits, out)
"""
)


def test_a_sharded_save_loads_with_trust_remote_code_without_the_package(runs, tmp_path):
    (tmp_path / "load.py").write_text(LOAD_SCRIPT)
    env = {**ENV, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    subprocess.run([sys.executable, str(tmp_path / "load.py"), str(runs["sharded"]), str(tmp_path / "logits.pt")],
                   check=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    model = PlugformerForCausalLM.from_pretrained(runs["sharded"]).eval()
    with torch.no_grad():
        expected = model(torch.arange(3, 19)[None]).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, atol=1e-6, rtol=0)
