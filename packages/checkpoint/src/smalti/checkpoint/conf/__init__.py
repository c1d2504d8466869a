"""Config options smalti-checkpoint adds to ``smalti-train`` (group ``checkpoint``)."""
