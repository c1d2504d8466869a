"""Names of LoRA tensors inside a smalti model (import-light: the Hugging Face importer and the checkpoint
code ask these without building anything)."""

from __future__ import annotations

#: Wrapper segments torch.compile, activation checkpointing and FSDP put into parameter names.
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def is_adapter_parameter(name: str) -> bool:
    """Whether ``name`` (a model parameter's) is a LoRA adapter's ``lora_A``/``lora_B`` tensor."""
    return ".lora_A." in name or ".lora_B." in name


def clean_name(name: str) -> str:
    """A parameter or module name without wrapper segments."""
    for segment in _WRAPPERS:
        name = name.replace(segment, "")
    return name
