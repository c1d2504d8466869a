"""LoRA and QLoRA finetuning for any :class:`~smalti.llm.LLM` (``model.lora``), saved in PEFT's adapter format.

* :mod:`~smalti.llm.lora.config`: the ``model.lora`` settings.
* :mod:`~smalti.llm.lora.layer`: :class:`LoRALinear`, a frozen (bf16 or NF4) linear layer with adapters.
* :mod:`~smalti.llm.lora.apply`: putting adapters on a model, filling them, folding them into the weights.
* :mod:`~smalti.llm.lora.peft_format`: PEFT's ``adapter_config.json`` / ``adapter_model.safetensors``.
* :mod:`~smalti.llm.lora.export`: the merged model and a run's adapter and merged folders.
"""

from smalti.llm.lora.apply import apply_lora, finish_lora_init, merged_state_dict, trainable_parameters
from smalti.llm.lora.config import LoRAConfig
from smalti.llm.lora.layer import LoRALinear
from smalti.llm.lora.peft_format import load_adapter, save_adapter

__all__ = ["LoRAConfig", "LoRALinear", "apply_lora", "finish_lora_init", "load_adapter", "merged_state_dict",
           "save_adapter", "trainable_parameters"]
