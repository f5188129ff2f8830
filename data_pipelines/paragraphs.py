"""Back-compat name of the paragraph dedup step's logic (moved to `data_pipelines.steps.paragraph_dedup`)."""

from data_pipelines.steps.paragraph_dedup import (  # noqa: F401
    ALL_REMOVED, EXACT, HASH_CHARS, LOG_CHARS, NEAR, TOO_SHORT, UNITS, bottom_k, dedup_document, eligible_units,
    left_reason, log_entry, near_min_words, remove_units, split_units, star_cluster, unit_reason)
