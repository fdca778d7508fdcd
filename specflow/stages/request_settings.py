"""What a request may set for itself (`generate(sampling=...)`, the server's request fields): the
values of the sampling processors and penalties the pipeline runs, checked by their own configs."""
from __future__ import annotations

from specflow.errors import ConfigError
from specflow.stages import penalties as pen
from specflow.stages.logits import MinPConfig, TemperatureConfig, TopKConfig, TopPConfig


def check_request_sampling(sampling: dict, configured: set[str], index: int) -> dict:
    """A request's sampling settings (temperature, top_k, top_p, min_p, and the repetition,
    frequency and presence penalties): only processors the pipeline runs, with valid values
    (the configs' own checks). -> the settings as floats / ints."""
    configs = {"temperature": (TemperatureConfig, "value", float), "top_k": (TopKConfig, "k", int),
               "top_p": (TopPConfig, "p", float), "min_p": (MinPConfig, "p", float),
               "repetition_penalty": (pen.RepetitionPenaltyConfig, "penalty", float),
               "frequency_penalty": (pen.FrequencyPenaltyConfig, "value", float),
               "presence_penalty": (pen.PresencePenaltyConfig, "value", float)}
    out = {}
    for key, value in sampling.items():
        if key not in configs:
            raise ConfigError(f"prompt {index}: sampling setting {key!r} is not one of "
                              f"{', '.join(configs)}")
        if key not in configured:
            raise ConfigError(f"prompt {index}: sampling {key}={value} needs the {key} processor "
                              f"in the pipeline (logits=[...,{key}]); requests may only change "
                              f"the values of configured processors")
        cls, name, kind = configs[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"prompt {index}: sampling {key}={value!r} must be a number")
        try:
            cls(**{name: kind(value)})
        except ConfigError as exc:
            raise ConfigError(f"prompt {index}: {exc}") from None
        out[key] = kind(value)
    return out
