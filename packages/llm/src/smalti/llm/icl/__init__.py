"""In-context-learning evaluation: language modeling, multiple choice, schema and generation tasks."""

from smalti.llm.icl.evaluate import evaluate_tasks
from smalti.llm.icl.tasks import ICLTask, load_tasks

__all__ = ["ICLTask", "evaluate_tasks", "load_tasks"]
