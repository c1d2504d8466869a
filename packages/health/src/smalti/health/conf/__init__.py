"""Config options smalti-health adds to ``smalti-train`` (group ``health``)."""
