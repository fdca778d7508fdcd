"""What a request may set for itself (`generate(sampling=...)`, the server's request fields): the
values of the sampling processors and penalties the pipeline runs, checked by their own configs,
and its own `logit_bias` (token id -> bias in [-100, 100], as OpenAI's), which every pipeline
takes (a request-only logit_bias stage is registered when the config has none)."""
from __future__ import annotations

import math

from specflow.errors import ConfigError
from specflow.stages import penalties as pen
from specflow.stages.logits import MinPConfig, TemperatureConfig, TopKConfig, TopPConfig

MAX_BIAS = 100.0      # OpenAI's range for logit_bias values


def check_logit_bias(bias, index: int, vocab_size: int | None = None,
                     where: str | None = None) -> dict[int, float]:
    """A request's logit_bias -> {token id: bias}: ids as ints or digit strings (JSON keys), inside
    the vocabulary; biases finite in [-100, 100]. `where` names it in errors (default: the
    request's sampling setting; the server passes its field, `logit_bias`)."""
    where = where or f"prompt {index}: sampling logit_bias"
    if not isinstance(bias, dict):
        raise ConfigError(f"{where} must be an object mapping token ids (e.g. \"50256\") to "
                          f"biases in [-100, 100], not {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        if isinstance(key, bool) or not (isinstance(key, int) or isinstance(key, str)
                                         and key.isascii() and key.isdigit()):
            raise ConfigError(f"{where} key {key!r} is not a token id (a whole number >= 0, "
                              f"e.g. \"50256\")")
        token = int(key)
        if token < 0 or vocab_size is not None and token >= vocab_size:
            raise ConfigError(f"{where} key {key!r} is not a token id of this model's vocabulary "
                              f"(0 to {vocab_size - 1})")
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or not -MAX_BIAS <= value <= MAX_BIAS:
            raise ConfigError(f"{where}[{key!r}]={value!r} must be a number in [-100, 100] "
                              f"(-100 all but bans the token, 100 all but forces it)")
        out[token] = float(value)
    return out


def check_request_sampling(sampling: dict, configured: set[str], index: int,
                           vocab_size: int | None = None) -> dict:
    """A request's sampling settings (temperature, top_k, top_p, min_p, the repetition,
    frequency and presence penalties, logit_bias): only processors the pipeline runs, with valid
    finite values (the configs' own checks; top_k a whole number). -> the settings as floats /
    ints (logit_bias as {int: float})."""
    configs = {"temperature": (TemperatureConfig, "value", float), "top_k": (TopKConfig, "k", int),
               "top_p": (TopPConfig, "p", float), "min_p": (MinPConfig, "p", float),
               "repetition_penalty": (pen.RepetitionPenaltyConfig, "penalty", float),
               "frequency_penalty": (pen.FrequencyPenaltyConfig, "value", float),
               "presence_penalty": (pen.PresencePenaltyConfig, "value", float)}
    out = {}
    for key, value in sampling.items():
        if key not in configs and key != "logit_bias":
            raise ConfigError(f"prompt {index}: sampling setting {key!r} is not one of "
                              f"{', '.join(configs)}, logit_bias")
        if key not in configured:
            raise ConfigError(f"prompt {index}: sampling {key}={value} needs the {key} processor "
                              f"in the pipeline (logits=[...,{key}]); requests may only change "
                              f"the values of configured processors")
        if key == "logit_bias":
            out[key] = check_logit_bias(value, index, vocab_size)
            continue
        cls, name, kind = configs[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"prompt {index}: sampling {key}={value!r} must be a number")
        if not math.isfinite(value):
            raise ConfigError(f"prompt {index}: sampling {key}={value} must be a finite number")
        if kind is int and value != int(value):
            raise ConfigError(f"prompt {index}: sampling {key}={value} must be a whole number")
        try:
            cls(**{name: kind(value)})
        except ConfigError as exc:
            raise ConfigError(f"prompt {index}: {exc}") from None
        out[key] = kind(value)
    return out
