"""Every README command meant for GPUs is one that ``smalti plan`` says fits.

It lives in tests/ because the commands use every package (``checkpoint=dcp`` is smalti-checkpoint's).

The commands are read from the fenced code blocks of the root README and every package's README: each
``torchrun --nproc-per-node N [--nnodes M] ... -m smalti.core.cli.train <overrides>`` and each
``smalti-train -m hydra/launcher=submitit_slurm hydra.launcher.nodes=M hydra.launcher.gpus_per_node=N ...`` is
planned on H100s as written. A ``model.pretrained=/models/<name>`` folder is stood in for by a folder holding
Llama 3.1 8B's ``config.json`` (the plan builds the model on the meta device and reads no weight).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from smalti.core.plan.report import make_plan

ROOT = Path(__file__).resolve().parents[1]
READMES = [ROOT / "README.md", *sorted(ROOT.glob("packages/*/README.md"))]

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
    "bos_token_id": 128000, "eos_token_id": 128001,
}


def code_blocks(text: str) -> list[str]:
    """The fenced code blocks of a Markdown text (a fence may carry an info string: ```` ```bash runnable ````)."""
    blocks, current = [], None
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith("```"):
            if current is None:
                current = []
            else:
                blocks.append("".join(current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def gpu_commands() -> list[tuple[str, list[str]]]:
    """``(where, smalti plan arguments)`` of every GPU training command in the READMEs."""
    found = []
    for readme in READMES:
        text = readme.read_text(encoding="utf-8")
        for block in code_blocks(text):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                if "smalti.core.cli.train" not in line and "hydra/launcher=submitit_slurm" not in line:
                    continue
                try:
                    words = shlex.split(line)
                except ValueError:  # prose in a code block (an apostrophe)
                    continue
                if not any(w in ("torchrun", "smalti-train") for w in words):
                    continue
                where = f"{readme.relative_to(ROOT)}: {line[:90]}"
                found.append((where, plan_arguments(words)))
    return found


def plan_arguments(words: list[str]) -> list[str]:
    """The overrides of one command, with ``plan.gpus``/``plan.nodes`` from its launcher."""
    gpus, nodes, overrides = 1, 1, []
    for i, word in enumerate(words):
        key, _, value = word.partition("=")
        if key in ("--nproc-per-node", "--nproc_per_node"):
            gpus = int(value or words[i + 1])
        elif key == "--nnodes":
            nodes = int((value or words[i + 1]).split(":")[-1])
        elif key == "hydra.launcher.gpus_per_node":
            gpus = int(value)
        elif key == "hydra.launcher.nodes":
            nodes = int(value)
        elif "=" in word and not word.startswith(("-", "hydra")) and "." in key + "." and not key.isupper():
            overrides.append(word)
    return [*overrides, "plan.gpu=h100", f"plan.gpus={gpus}", f"plan.nodes={nodes}"]


COMMANDS = gpu_commands()


def test_the_readmes_hold_the_long_context_commands():
    assert any("llama3_8b" in " ".join(args) and "model.max_seq_len=131072" in args for _, args in COMMANDS)
    assert len(COMMANDS) >= 5


@pytest.mark.parametrize(("where", "args"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_gpu_command_of_the_readmes_fits_by_smalti_plan(tmp_path, where, args):
    folder = tmp_path / "Llama-3.1-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA_31_8B))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    (folder / "tokenizer.json").write_text("{}")
    args = [f"model.pretrained={folder}" if a.startswith("model.pretrained=") else a for a in args]
    plan = make_plan(args)
    assert plan.fits, (
        f"{where}\nsmalti plan {' '.join(args)}: {plan.peak / 2**30:.2f} GiB of {plan.budget / 2**30:.2f} usable: "
        + ", ".join(f"{k} {v / 2**30:.1f}" for k, v in plan.memory.items() if v)
    )
