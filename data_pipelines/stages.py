"""Back-compat names of the steps' per-document logic (moved to `data_pipelines.steps`; import from there)."""

from data_pipelines.draws import uniform  # noqa: F401
from data_pipelines.steps.decontamination import (  # noqa: F401
    DECONTAM_RULES, DECONTAM_UNITS, EvalIndex, decontamination_report, length_class, ngram_hashes, sequence_hash,
    unit_word_sequences)
from data_pipelines.steps.exact_dedup import exact_key  # noqa: F401
from data_pipelines.steps.langid import LanguageIdentifier, spread_sample  # noqa: F401
from data_pipelines.steps.normalization import _fix_text, _ftfy_fixed_point, normalize  # noqa: F401
from data_pipelines.steps.quality import HashedNgramLM, _feature_ids  # noqa: F401
from data_pipelines.steps.quotas import (  # noqa: F401
    entropy_bits, quota_cutoff, quota_keep_fractions, quota_share_warnings)
from data_pipelines.steps.rules import (  # noqa: F401
    _ALPHA_RE, _CJK_RE, RULES, is_cross_reference, rule_reason, rule_stats)
