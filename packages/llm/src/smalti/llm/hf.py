"""Hugging Face interop for the Llama, Mistral and Qwen2 families: read a local ``save_pretrained`` folder into
smalti's :class:`LLM` (``model=hf``), and the name mapping the export in :mod:`smalti.llm.hf_export` uses.

Both sides use the half-split rotary convention, so the attention weights map one to one; smalti's fused
``wqkv`` is Hugging Face's ``q_proj``, ``k_proj`` and ``v_proj`` stacked by rows. A ``config.json`` field that
smalti's model cannot reproduce exactly is refused when the model is built, naming the field.

Weights are read per parameter from the safetensors files (only the rows a rank holds, when FSDP2 has sharded
the parameter), after the model is built on the meta device: no process ever holds a full random or full
fp32 copy before its shard.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from smalti.llm.errors import ConversionError
from smalti.llm.model.transformer import LLM
from smalti.llm.tokenizer import looks_like_hub_name

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: model_type -> the transformers class its folders load as.
FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
#: Tokenizer files copied from the source folder to an export, when present.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json")
_ROPE_TYPES = ("default", "linear", "llama3")


# ---------------------------------------------------------------------------------------------- config.json


def resolve_folder(pretrained: str | os.PathLike, key: str = "model.pretrained") -> Path:
    """``pretrained`` as an existing local folder with a ``config.json``; a Hub name or a missing folder is an
    error that says smalti reads only local folders and how to get one."""
    folder = Path(os.path.expanduser(str(pretrained)))
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ConversionError(
                f"{key}={str(pretrained)!r}: {folder} has no config.json; give a folder written by "
                "save_pretrained (config.json, *.safetensors and the tokenizer files)"
            )
        return folder
    text = str(pretrained)
    hub_like = looks_like_hub_name(text)
    what = "looks like a Hugging Face Hub name" if hub_like else "is not an existing folder"
    raise ConversionError(
        f"{key}={text!r} {what}: smalti only reads local folders written by save_pretrained and never downloads. "
        f"Download it once, e.g. `huggingface-cli download {text if hub_like else '<org>/<model>'} --local-dir "
        f"./models/{Path(text).name or 'model'}`, then pass {key}=./models/{Path(text).name or 'model'}"
    )


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's ``config.json`` as a dict (errors name the file)."""
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConversionError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(cfg, dict):
        raise ConversionError(f"{path} must hold a JSON object")
    return cfg


def _rope(cfg: dict[str, Any], path: Path) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either layout: ``rope_theta`` + ``rope_scaling`` (transformers 4)
    or ``rope_parameters`` (transformers 5)."""
    params = dict(cfg.get("rope_parameters") or {})
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    scaling = dict(cfg.get("rope_scaling") or params)
    field = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind not in _ROPE_TYPES:
        raise ConversionError(
            f"{path}: {field}.rope_type={kind!r} is not supported (smalti reproduces {', '.join(_ROPE_TYPES)} "
            "rotary embeddings exactly); use a model with one of those"
        )
    for extra in ("partial_rotary_factor", "mrope_section"):
        if scaling.get(extra) not in (None, 1.0):
            raise ConversionError(f"{path}: {field}.{extra}={scaling[extra]!r} is not supported by smalti's RoPE")
    if kind == "default":
        return theta, None
    scaling.pop("attention_factor", None)  # unused by linear and llama3 rotary embeddings
    return theta, {"type": kind, **scaling}


def _sliding_window(cfg: dict[str, Any], family: str, path: Path) -> int | None:
    """Mistral's window applies to every layer; Qwen2's only with ``use_sliding_window``, and then to the layers
    from ``max_window_layers`` on (or as ``layer_types`` says): smalti reproduces it when that is every layer."""
    if family == "mistral":
        window = cfg.get("sliding_window")
    elif family == "qwen2" and cfg.get("use_sliding_window"):
        window = cfg.get("sliding_window")
        n = cfg.get("num_hidden_layers", 0)
        first = cfg.get("max_window_layers", 0)
        types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
        if window is not None and set(types) != {"sliding_attention"}:
            raise ConversionError(
                f"{path}: use_sliding_window=true with max_window_layers={first} (layer_types) mixes full and "
                "sliding-window layers, which smalti does not reproduce; use max_window_layers=0 or "
                "use_sliding_window=false"
            )
    else:
        return None
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ConversionError(f"{path}: sliding_window={window!r} must be a positive int or null")
    return window


def llm_kwargs(cfg: dict[str, Any], path: Path) -> dict[str, Any]:
    """:class:`LLM` constructor arguments equal to the model ``cfg`` (a ``config.json``) describes.

    Raises :class:`ConversionError` naming the field when the family or a setting cannot be reproduced exactly.
    """
    family = cfg.get("model_type")
    if family not in FAMILIES:
        raise ConversionError(
            f"{path}: model_type={family!r} is not supported; smalti imports {', '.join(FAMILIES)} "
            "(Llama 1/2/3/3.1, Mistral, Qwen2)"
        )
    if cfg.get("quantization_config"):
        raise ConversionError(f"{path}: quantization_config is set; give the unquantised model's folder")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConversionError(f"{path}: hidden_act={act!r} is not supported ({family} in smalti uses silu)")
    for key, value in cfg.items():
        if "dropout" in key and isinstance(value, int | float) and value:
            raise ConversionError(f"{path}: {key}={value} is not supported (smalti's model has no dropout); set it to 0")
    hidden, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or hidden // n_heads
    if head_dim * n_heads != hidden:
        raise ConversionError(f"{path}: head_dim={head_dim} with num_attention_heads={n_heads} != hidden_size={hidden} "
                              "is not supported")
    theta, scaling = _rope(cfg, path)
    attn_bias = bool(cfg.get("attention_bias", False)) if family == "llama" else False
    return {
        "d_model": hidden, "n_heads": n_heads, "n_kv_heads": cfg.get("num_key_value_heads") or n_heads,
        "n_layers": cfg["num_hidden_layers"], "vocab_size": cfg["vocab_size"],
        "max_seq_len": cfg.get("max_position_embeddings", 2048), "ffn_hidden_size": cfg["intermediate_size"],
        "position": "rope", "rope_theta": theta, "rope_scaling": scaling, "norm_type": "rmsnorm",
        "norm_eps": cfg.get("rms_norm_eps", 1e-6), "ffn_type": "glu", "activation": "silu", "bias": False,
        "attn_bias": attn_bias, "qkv_bias": True if family == "qwen2" else attn_bias,
        "ffn_bias": bool(cfg.get("mlp_bias", False)) if family == "llama" else False,
        "sliding_window": _sliding_window(cfg, family, path),
        "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "init_std": cfg.get("initializer_range", 0.02),
    }


def family_of(model: LLM) -> str:
    """The Hugging Face family ``model``'s shape belongs to (``llama``, ``mistral`` or ``qwen2``)."""
    c = model.config
    problems = []
    if c["position"] != "rope":
        problems.append(f"position={c['position']!r} (they use rope)")
    if c["norm_type"] not in ("rmsnorm", "low_precision_rmsnorm"):
        problems.append(f"norm_type={c['norm_type']!r} (they use rmsnorm)")
    if c["ffn_type"] != "glu" or c["activation"] != "silu":
        problems.append(f"ffn_type={c['ffn_type']!r}/activation={c['activation']!r} (they use glu/silu)")
    for key in ("qk_norm", "clip_qkv", "softmax_scale"):
        if c[key]:
            problems.append(f"{key}={c[key]!r} (they have none)")
    attn_bias, qkv_bias = c.get("attn_bias", c["bias"]), c.get("qkv_bias", c.get("attn_bias", c["bias"]))
    window = c.get("sliding_window")
    if qkv_bias and not attn_bias:
        family = "qwen2"
        if c.get("ffn_bias"):
            problems.append("ffn_bias with qkv_bias (Qwen2 has no MLP bias)")
    elif window is not None:
        family = "mistral"
        if attn_bias or c.get("ffn_bias"):
            problems.append("biases with sliding_window (Mistral has none)")
    else:
        family = "llama"
        if qkv_bias != attn_bias:
            problems.append("qkv_bias without attn_bias")
    if problems:
        raise ConversionError("this model cannot be exported as a Hugging Face model: " + "; ".join(problems))
    return family


def _check_exportable(model: LLM) -> None:
    family_of(model)


def hf_config(model: LLM, dtype: str = "float32", source: dict[str, Any] | None = None,
              eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of the Hugging Face model equal to ``model``.

    With ``source`` (the ``config.json`` the model was imported from) the result is that file with the dtype
    set: same family, same fields (after checking that it still describes ``model``).
    """
    family = family_of(model)
    if source is not None:
        expected = llm_kwargs(source, Path("the source config.json"))
        changed = [k for k, v in expected.items() if k != "max_seq_len" and model.config.get(k) != v]
        if changed:
            raise ConversionError(f"the model differs from its source config.json in {changed}; cannot export it "
                                  "under the source's config")
        out = {k: v for k, v in source.items() if k not in ("_name_or_path", "torch_dtype", "dtype")}
        out["architectures"] = [FAMILIES[source["model_type"]]]
        out["torch_dtype" if "torch_dtype" in source else "dtype"] = dtype
        return out
    c = model.config
    config: dict[str, Any] = {
        "architectures": [FAMILIES[family]], "model_type": family, "hidden_size": c["d_model"],
        "intermediate_size": c["ffn_hidden_size"], "num_attention_heads": c["n_heads"],
        "num_key_value_heads": c["n_kv_heads"], "num_hidden_layers": c["n_layers"],
        "head_dim": c["d_model"] // c["n_heads"], "vocab_size": c["vocab_size"],
        "max_position_embeddings": c["max_seq_len"], "rms_norm_eps": c["norm_eps"], "rope_theta": c["rope_theta"],
        "rope_scaling": _hf_rope_scaling(c["rope_scaling"]), "hidden_act": "silu",
        "tie_word_embeddings": bool(c["tie_embeddings"]), "initializer_range": c["init_std"],
        "torch_dtype": dtype, "use_cache": True,
    }
    if family == "llama":
        config["attention_bias"] = bool(c.get("attn_bias", c["bias"]))
        config["mlp_bias"] = bool(c.get("ffn_bias", c["bias"]))
    elif family == "mistral":
        config["sliding_window"] = c["sliding_window"]
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=c["n_layers"])
    if eos_token_id is not None:
        config["eos_token_id"] = eos_token_id
    return config


def llama_config(model: LLM, dtype: str = "float32", eos_token_id: int | None = None) -> dict[str, Any]:
    """The ``config.json`` of a ``LlamaForCausalLM`` equal to ``model`` (see :func:`hf_config`)."""
    if family_of(model) != "llama":
        raise ConversionError("this model is not Llama-shaped (it has a sliding window or a q/k/v-only bias)")
    return hf_config(model, dtype, eos_token_id=eos_token_id)


def _hf_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    if not scaling:
        return None
    out = dict(scaling)
    out["rope_type"] = out.pop("type", out.get("rope_type"))
    return out


# ---------------------------------------------------------------------------------------------- weight names


def weight_parts(config: dict[str, Any]) -> dict[str, list[tuple[str, int, int]]]:
    """For each smalti parameter of an :class:`LLM` with ``config``, the Hugging Face tensors it is made of:
    ``[(hf_name, first_row, stop_row), ...]`` (rows of the smalti tensor; one part unless fused)."""
    c = config
    hd = c["d_model"] // c["n_heads"]
    q, kv = c["n_heads"] * hd, c["n_kv_heads"] * hd
    bias = bool(c.get("bias", False))
    attn_bias = bias if c.get("attn_bias") is None else bool(c["attn_bias"])
    qkv_bias = attn_bias if c.get("qkv_bias") is None else bool(c["qkv_bias"])
    ffn_bias = bias if c.get("ffn_bias") is None else bool(c["ffn_bias"])
    d, hidden, vocab = c["d_model"], c["ffn_hidden_size"], c["vocab_size"]
    out: dict[str, list[tuple[str, int, int]]] = {"wte.weight": [("model.embed_tokens.weight", 0, vocab)]}
    for i in range(c["n_layers"]):
        src, dst = f"blocks.{i}.", f"model.layers.{i}."
        out[src + "norm_1.weight"] = [(dst + "input_layernorm.weight", 0, d)]
        kinds = ("weight", "bias") if qkv_bias else ("weight",)
        for kind in kinds:
            out[src + f"attn.wqkv.{kind}"] = [(dst + f"self_attn.{p}_proj.{kind}", a, b)
                                              for p, a, b in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv))]
        for kind in ("weight", "bias") if attn_bias else ("weight",):
            out[src + f"attn.out_proj.{kind}"] = [(dst + f"self_attn.o_proj.{kind}", 0, d)]
        out[src + "norm_2.weight"] = [(dst + "post_attention_layernorm.weight", 0, d)]
        for kind in ("weight", "bias") if ffn_bias else ("weight",):
            for proj, rows in (("gate_proj", hidden), ("up_proj", hidden), ("down_proj", d)):
                out[src + f"ffn.{proj}.{kind}"] = [(dst + f"mlp.{proj}.{kind}", 0, rows)]
    out["norm_f.weight"] = [("model.norm.weight", 0, d)]
    if not c.get("tie_embeddings", True):
        out["lm_head.weight"] = [("lm_head.weight", 0, vocab)]
    return out


def to_hf_state_dict(model: LLM) -> dict[str, torch.Tensor]:
    """``model``'s (unsharded) weights under Hugging Face names."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    return {hf: sd[name][a:b] for name, parts in weight_parts(model.config).items() for hf, a, b in parts}


def from_hf_state_dict(hf: dict[str, torch.Tensor], config: dict[str, Any], source: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors ``hf`` under smalti's parameter names, for an :class:`LLM` with ``config`` (its
    constructor arguments). Missing tensors raise :class:`ConversionError` naming ``source``."""
    out = {}
    for name, parts in weight_parts(config).items():
        missing = [hf_name for hf_name, _, _ in parts if hf_name not in hf]
        if missing:
            raise ConversionError(f"{source}: missing weight {missing[0]!r} (the config asks for it)")
        out[name] = torch.cat([hf[hf_name] for hf_name, _, _ in parts], 0) if len(parts) > 1 else hf[parts[0][0]]
    return out


# ---------------------------------------------------------------------------------------------- weight loading


def weight_files(folder: Path) -> dict[str, Path]:
    """Hugging Face tensor name -> the safetensors file holding it (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise ConversionError(f"{index} is not a safetensors index (no weight_map): {exc}") from exc
        return {name: folder / file for name, file in weight_map.items()}
    single = folder / "model.safetensors"
    if not single.is_file():
        bins = sorted(p.name for p in folder.glob("*.bin"))
        hint = f" (it has {bins[0]}: re-save with safe_serialization=True)" if bins else ""
        raise ConversionError(f"{folder} has neither model.safetensors nor model.safetensors.index.json{hint}")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


def _local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The tensor this process fills for ``param`` and the rows of the whole parameter it covers."""
    from torch.distributed.tensor import DTensor

    if not isinstance(param, DTensor):
        return param, 0, param.shape[0]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    if any(offset[1:]) or tuple(shape[1:]) != tuple(param.shape[1:]):
        raise ConversionError(f"a parameter is sharded along dim > 0 ({param.placements}); smalti loads row shards")
    return param.to_local(), offset[0], offset[0] + shape[0]


@torch.no_grad()
def load_hf_weights(model: LLM, folder: Path) -> None:
    """Fill ``model``'s parameters (whole, or this rank's FSDP2 shards) from the safetensors in ``folder``,
    reading only the rows each one holds; buffers start at zero."""
    from safetensors import safe_open

    files = weight_files(folder)
    parts = weight_parts(model.config)
    hf_shapes: dict[str, list[int]] = {}
    with ExitStack() as stack:
        handles: dict[Path, Any] = {}

        def open_slice(hf_name: str) -> Any:
            if hf_name not in files:
                raise ConversionError(f"{folder}: missing weight {hf_name!r} (config.json asks for it)")
            path = files[hf_name]
            if path not in handles:
                handles[path] = stack.enter_context(safe_open(str(path), framework="pt"))
            return handles[path].get_slice(hf_name)

        for name, param in model.named_parameters():
            if name not in parts:
                raise ConversionError(f"smalti parameter {name!r} has no Hugging Face counterpart")
            local, lo, hi = _local_rows(param)
            for hf_name, a, b in parts[name]:
                piece = open_slice(hf_name)
                shape = list(piece.get_shape())
                expected = [b - a, *param.shape[1:]]
                if shape != expected:
                    raise ConversionError(f"{files[hf_name]}: {hf_name} has shape {shape}, config.json implies {expected}")
                hf_shapes[hf_name] = shape
                start, stop = max(lo, a), min(hi, b)
                if start < stop:
                    local[start - lo : stop - lo].copy_(piece[start - a : stop - a])
        for buf in model.buffers():
            buf.zero_()


# ---------------------------------------------------------------------------------------------- model=hf


class PretrainedLLM(LLM):
    """smalti's :class:`LLM` equal to a Hugging Face Llama, Mistral or Qwen2 folder (``model=hf``).

    Built on the meta device: the trainer allocates it (after FSDP2 has sharded it, under ``fsdp``) and calls
    :meth:`init_weights`, which reads each parameter's rows from the folder's safetensors.

    Args:
        pretrained: a local folder written by ``save_pretrained`` (never a Hub name).
        require_tokenizer: refuse a folder without ``tokenizer.json`` (the chat data and the export need it).
        init_device: ``meta`` (the trainer fills it) or ``cpu`` (filled now).
        **overrides: :class:`LLM` arguments that do not change the model's function: ``max_seq_len``,
            ``activation_checkpointing``, ``attn_uses_sequence_id``.
    """

    OVERRIDABLE = ("max_seq_len", "activation_checkpointing", "attn_uses_sequence_id")

    def __init__(self, pretrained: str | os.PathLike, require_tokenizer: bool = True, init_device: str = "meta",
                 **overrides: Any) -> None:
        folder = resolve_folder(pretrained)
        source = read_config(folder)
        kwargs = llm_kwargs(source, folder / "config.json")
        bad = sorted(set(overrides) - set(self.OVERRIDABLE))
        if bad:
            raise ConversionError(
                f"model.{bad[0]} cannot be set for model=hf: the architecture comes from {folder / 'config.json'}; "
                f"only {', '.join(self.OVERRIDABLE)} may be given"
            )
        if require_tokenizer and not (folder / "tokenizer.json").is_file():
            raise ConversionError(
                f"{folder} has no tokenizer.json: save the model's tokenizer into the same folder "
                "(AutoTokenizer.from_pretrained(...).save_pretrained(folder)) so that training and the export use it"
            )
        weight_files(folder)  # fail now, not after the model is sharded, when the weights are missing
        kwargs.update({k: v for k, v in overrides.items() if v is not None})
        super().__init__(**kwargs, init_device="meta")
        #: Where the weights come from, and its ``config.json`` (the export writes the same family).
        self.hf_folder = folder
        self.hf_config = source
        if init_device != "meta":
            self.to_empty(device=init_device)
            self.init_weights()

    def init_weights(self) -> None:
        """Fill every parameter (or this rank's shard of it) with the pretrained weights."""
        load_hf_weights(self, self.hf_folder)


def export_hf(model: LLM, folder: str | os.PathLike, dtype: str | None = None, tokenizer: Any = None,
              max_shard_size: int | str = "2GB") -> Path:
    """Write ``model`` (unsharded, one process) as a Hugging Face folder; see :mod:`smalti.llm.hf_export`.

    ``tokenizer`` (a name or path for :func:`smalti.llm.tokenizer.load_tokenizer`) puts its ``tokenizer.json``
    beside the weights; a :class:`PretrainedLLM` brings its source folder's tokenizer files anyway.
    """
    from smalti.llm.hf_export import export_model

    eos, extra = None, {}
    if tokenizer is not None and getattr(model, "hf_folder", None) is None:
        from smalti.llm.tokenizer import BPETokenizer, load_tokenizer

        tok = load_tokenizer(tokenizer)
        eos = tok.eos_id
        if isinstance(tok, BPETokenizer):
            extra["tokenizer.json"] = Path(tok.path)
    out = export_model(model, folder, dtype, max_shard_size, eos_token_id=eos, extra_files=extra)
    if extra:  # tokenizer_config.json and the special tokens too: AutoTokenizer and lm-eval need them
        from smalti.llm.hf_mpt import write_tokenizer_files

        write_tokenizer_files(tokenizer, Path(out))
    return out


def import_hf(folder: str | os.PathLike, **overrides: Any) -> LLM:
    """An :class:`LLM` on the CPU with the weights of a local Hugging Face Llama, Mistral or Qwen2 folder
    (``config.json`` + safetensors, such as ``save_pretrained`` writes). ``overrides``: see
    :class:`PretrainedLLM`. Built on meta and filled from the files, so no random copy is made first."""
    return PretrainedLLM(folder, require_tokenizer=False, init_device="cpu", **overrides).train()
