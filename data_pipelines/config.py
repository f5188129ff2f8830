"""`BuildConfig`: the source registry and one config per step (`pipeline.STEPS`), each gin-configurable by its class
name (``RuleConfig.min_words = 5``); gin files ``import data_pipelines.config``.

`BuildConfig.registry()` is the resolve phase: it parses the sources and checks every step's config against them
(each config's ``check(sources)``). `BuildConfig.to_json()` is the operative config written into the manifest.
"""

from __future__ import annotations

import dataclasses

import gin

from jaxpt.util.errors import ConfigError  # the one base (exit 2); re-exported as data_pipelines.config.ConfigError

from data_pipelines import pipeline
from data_pipelines.sources import FORMATS, Source
from data_pipelines.steps.admission import AdmissionConfig
from data_pipelines.steps.decontamination import DecontamConfig
from data_pipelines.steps.exact_dedup import ExactDedupConfig
from data_pipelines.steps.langid import LangIdConfig
from data_pipelines.steps.near_dedup import NearDedupConfig
from data_pipelines.steps.normalization import NormalizeConfig
from data_pipelines.steps.paragraph_dedup import ParagraphDedupConfig
from data_pipelines.steps.quality import QualityConfig
from data_pipelines.steps.quotas import QuotaConfig
from data_pipelines.steps.rules import RuleConfig
from data_pipelines.steps.write import OutputConfig

__all__ = ["AdmissionConfig", "BuildConfig", "ConfigError", "DecontamConfig", "ExactDedupConfig", "FORMATS",
           "LangIdConfig", "NearDedupConfig", "NormalizeConfig", "OutputConfig", "ParagraphDedupConfig",
           "QualityConfig", "QuotaConfig", "RuleConfig", "Source"]


class _Build:
    """`BuildConfig`'s methods (its fields: ``data_version``, ``source_root``, ``sources``, then one per step config,
    `pipeline.config_fields`)."""

    def step_configs(self) -> list:
        """The steps' configs, in step order."""
        return [getattr(self, name) for name, _ in pipeline.config_fields()]

    def registry(self) -> list[Source]:
        """Validated sources, every step's config checked against them. Raises ConfigError naming the offending
        entry."""
        if not self.sources:
            raise ConfigError("BuildConfig.sources: the source registry is empty")
        out = [Source.from_dict(d, i) for i, d in enumerate(self.sources)]
        names = [s.name for s in out]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ConfigError(f"BuildConfig.sources: duplicate source names {dup}")
        for c in self.step_configs():
            if hasattr(c, "check"):
                c.check(out)
        return out

    def to_json(self) -> dict:
        """Plain-JSON view of every setting (the operative config); a step config's ``operative(dict)`` edits its
        entry (None: left out)."""
        out = dataclasses.asdict(self)
        for name, _ in pipeline.config_fields():
            c = getattr(self, name)
            if hasattr(c, "operative"):
                entry = c.operative(out[name])
                if entry is None:
                    del out[name]
                else:
                    out[name] = entry
        return out


BuildConfig = gin.configurable(dataclasses.make_dataclass(
    "BuildConfig",
    [("data_version", str, ""), ("source_root", str, "."), ("sources", list, dataclasses.field(default_factory=list))]
    + [(name, cls, dataclasses.field(default_factory=cls)) for name, cls in pipeline.config_fields()],
    bases=(_Build,), namespace={"__module__": __name__}))
BuildConfig.__doc__ = "The whole build: the source registry plus each step's config."
