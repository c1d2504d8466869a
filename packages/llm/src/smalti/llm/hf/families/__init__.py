"""The Hugging Face families smalti ships, one module each; :mod:`smalti.llm.hf.registry` finds them."""
