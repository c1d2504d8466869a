"""smalti-health: find sick GPUs, slow links, hangs and stragglers, and keep bad nodes out of the job."""

__version__ = "0.1.0"
