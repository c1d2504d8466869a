"""The names the model's options accept, in a module light enough for config checks to import.

The config schemas (:mod:`smalti.llm.config_schema`) list these choices in their messages; importing the model
package for them would load torch's compiler, transformers and triton into every ``smalti-train`` run, even one
that trains no LLM. The model modules take their lists from here, so the two cannot drift apart.
"""

from __future__ import annotations

POSITIONS = ("alibi", "rope", "learned", "none")
NORM_TYPES = ("layernorm", "rmsnorm", "low_precision_layernorm", "low_precision_rmsnorm", "rmsnorm_plus_one")
FFN_TYPES = ("mlp", "glu", "moe")
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")
#: Weight dtypes an export or a registered model may be written in.
EXPORT_DTYPES = ("float32", "bfloat16", "float16")
