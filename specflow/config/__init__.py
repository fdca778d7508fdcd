"""Compose and validate configs: Hydra composes, each option's dataclass validates.

Every option of a group carries `name:`; the registry maps (group, name) to the component and its
schema dataclass. `validate` merges each group node into its schema (typos in keys and wrong types
fail) and instantiates it (the dataclass's __post_init__ checks values such as k >= 0), so a bad
config fails at compose time with one line, never deep inside a run.
"""
from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import asdict, is_dataclass
from typing import Iterator, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from specflow import groups
from specflow.errors import ConfigError, SpecflowError

CONFIG_MODULE = "specflow.conf"
SINGLE_GROUPS = groups.SINGLE
MULTI_GROUPS = groups.MULTI
GROUPS = groups.KINDS + groups.OVERLAYS
# keys whose values are free text (JSON, regexes, code): quoted for Hydra when given bare, and
# `${` kept literal (never an interpolation: a prompt may hold shell or JS templates)
FREE_TEXT_KEYS = ("prompt", "constraint.schema", "constraint.pattern", "constraint.model",
                  "workload.path", "model.path", "draft.path", "proposer.path", "calibrate.output")
# maps whose keys are the user's (token ids, kwargs, fields): `key={...}` may add keys, which
# Hydra's struct mode refuses for a plain override, so it is given as `++key={...}` (a merge)
FREE_DICT_KEYS = ("logits.logit_bias.bias", "logits.hf.kwargs", "workload.where",
                  "draft.noise_by_prefix")
# lists of free text, in Hydra's list syntax: `${` in them is kept literal
FREE_TEXT_LIST_KEYS = ("constraint.choices", "stop.strings", "logits.bad_words.words")
REQUIRED_GROUPS = groups.REQUIRED       # `~model` and the like are refused at compose time
DEVICES = re.compile(r"^(cpu|auto|cuda(:\d+)?|mps)$")
DTYPES = ("float32", "float16", "bfloat16", "int8", "int4", "auto")
ENGINES = ("specflow", "vllm")          # who decodes: specflow's pipeline, or an installed vLLM
DRAFTERS = ("own", "specflow")          # engine=vllm: vLLM's method, or specflow's drafter in it


def _demo_path(which: str) -> str:
    from specflow.paths import DEMO_DIR
    return str(DEMO_DIR / which)


def _data_path(name: str) -> str:
    import pathlib
    return str(pathlib.Path(__file__).resolve().parents[1] / "data" / name)


# `path: ${specflow_demo:target}` in conf/model/demo.yaml: the installed package's own copy;
# `${specflow_data:...}`: the prompt sets shipped in specflow/data
if not OmegaConf.has_resolver("specflow_demo"):
    OmegaConf.register_new_resolver("specflow_demo", _demo_path)
if not OmegaConf.has_resolver("specflow_data"):
    OmegaConf.register_new_resolver("specflow_data", _data_path)


CONFIG_PATH_ENV = "SPECFLOW_CONFIG_PATH"


def extra_searchpath() -> list[str]:
    """Config folders beside specflow's own: $SPECFLOW_CONFIG_PATH first (where `specflow
    calibrate` writes policy/calibrated.yaml), then every plugin's specflow_config_searchpath()."""
    import os

    from specflow.plugins import config_searchpath

    entries = []
    user = os.environ.get(CONFIG_PATH_ENV)
    if user:
        entries.append(f"file://{os.path.abspath(os.path.expanduser(user))}")
    return entries + config_searchpath()


def with_searchpath(overrides: Sequence[str]) -> list[str]:
    """Add the extra folders as Hydra's own `hydra.searchpath` override (kept with a user's)."""
    extra = extra_searchpath()
    if not extra:
        return list(overrides)
    out, merged = [], False
    for item in overrides:
        m = re.match(r"^(\+{0,2}hydra\.searchpath)=\[(.*)\]$", item)
        if m:
            given = [x for x in m.group(2).split(",") if x.strip()]
            item, merged = f"{m.group(1)}=[{','.join(extra + given)}]", True
        out.append(item)
    if not merged:
        out.append(f"hydra.searchpath=[{','.join(extra)}]")
    return out


def normalize_overrides(overrides: Sequence[str]) -> list[str]:
    """Make the command line forgiving where plain Hydra is not:
    - `+proposer=ngram` for a group the defaults list already has (Hydra refuses to append it);
    - `prompt=def fib(n):` with characters Hydra's grammar reserves: values of free-text keys
      (FREE_TEXT_KEYS: prompts, schemas, regexes, paths) are quoted for it, with `${` and
      backslashes kept literal (never an interpolation);
    - `${` inside lists of free text (FREE_TEXT_LIST_KEYS: choices, stop strings) kept literal.
    A value the user quoted Hydra's way is left to Hydra. Applying this twice changes nothing.
    """
    out = []
    for item in overrides:
        m = re.match(r"^\+(\w+)=(.*)$", item)
        if m and m.group(1) in GROUPS:
            item = f"{m.group(1)}={m.group(2)}"
        m = re.match(r"^(\+{0,2}(?:%s))=(.*)$" % "|".join(map(re.escape, FREE_TEXT_KEYS)), item,
                     flags=re.S)
        if m and m.group(2) and m.group(2) not in ("null", "-"):
            value = m.group(2)
            if QUOTED.match(value):     # quoted Hydra's way: Hydra unquotes, `${` stays text
                item = f"{m.group(1)}={_escape_bare_interpolations(value)}"
            else:
                item = f"{m.group(1)}={hydra_quote(value)}"
        m = re.match(r"^(?:%s)=\{.*\}$" % "|".join(map(re.escape, FREE_DICT_KEYS)), item, flags=re.S)
        if m:
            item = "++" + item
        m = re.match(r"^(\+{0,2}(?:%s))=(\[.*)$" % "|".join(map(re.escape, FREE_TEXT_LIST_KEYS)),
                     item, flags=re.S)
        if m:
            item = f"{m.group(1)}={_quote_list(m.group(2))}"
        m = re.match(r"^ab\.arms=(\{.*\})$", item, flags=re.S)
        if m:      # the arms replace the experiment's (a plain override would merge into them)
            out += ["~ab.arms", f"+ab.arms={_quote_arms(m.group(1))}"]
            continue
        out.append(item)
    return out


def _split_top(text: str, sep: str = ",") -> list[str]:
    """`a, [b, c], 'd, e'` -> ['a', '[b, c]', "'d, e'"]: split at `sep` outside brackets and
    quotes."""
    parts, current, depth, quote = [], "", 0, None
    for ch in text:
        if quote:
            quote = None if ch == quote and not current.endswith("\\") else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        current += ch
    if current.strip():
        parts.append(current.strip())
    return parts


def _quote_arms(value: str) -> str:
    """`{none: [proposer=none], ngram: [proposer=ngram, logits=[top_k]]}` -> each arm's
    overrides quoted for Hydra's grammar (which takes no bare `=` in a list); what does not read
    as arms of lists is left to Hydra."""
    arms = []
    for part in _split_top(value.strip()[1:-1]):
        name, colon, items = part.partition(":")
        items = items.strip()
        if not colon or not (items.startswith("[") and items.endswith("]")):
            return value
        quoted = [i if QUOTED.match(i) else hydra_quote(i) for i in _split_top(items[1:-1])]
        arms.append(f"{name.strip()}: [{', '.join(quoted)}]")
    return "{" + ", ".join(arms) + "}"


def _quote_list(value: str) -> str:
    """`[café, it's ${x}, 'quoted']` -> every bare element quoted (Hydra's lexer takes no
    non-ASCII or `${` bare); quoted elements are Hydra's, with a not yet escaped `${` escaped, so
    that a second pass changes nothing. A nested list is left to Hydra."""
    inner = value.strip()
    if not (inner.startswith("[") and inner.endswith("]")):
        return value
    items, current, quote = [], "", None
    for ch in inner[1:-1]:
        if quote:
            current += ch
            if ch == quote and not current[:-1].endswith("\\"):
                quote = None
        elif ch in "'\"" and not current.strip():
            current, quote = current.strip() + ch, ch
        elif ch == ",":
            items.append(current)
            current = ""
        elif ch in "[]":
            return value
        else:
            current += ch
    if quote:
        return value
    items.append(current)
    if len(items) == 1 and not items[0].strip():
        return "[]"
    out = []
    for element in items:
        element = element.strip()
        if element[:1] in ("'", '"'):
            out.append(_escape_bare_interpolations(element))
        else:
            out.append(hydra_quote(element))
    return "[" + ",".join(out) + "]"


# one whole quoted Hydra string: 'it\'s' or "say \"hi\"" (not `"Hello," she said`)
QUOTED = re.compile(r"""^(['"])(?:(?!\1)[^\\]|\\.)*\1$""", flags=re.S)


def _escape_bare_interpolations(quoted: str) -> str:
    """`${` not yet escaped, escaped (what the user quoted Hydra's way stays Hydra's otherwise);
    an escaped one is left, so a second pass changes nothing."""
    return re.sub(r"(?<!\\)\$\{", r"\\${", quoted)


def escape_interpolation(text: str) -> str:
    """Text OmegaConf reads back unchanged: `${` escaped, and backslashes right before it
    doubled (OmegaConf reads `\\${` as a backslash and then an interpolation)."""
    return re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", text)


def hydra_quote(text: str) -> str:
    """Any text as a quoted Hydra override value that composes back to exactly `text`."""
    value = escape_interpolation(text)
    # Hydra's quoted strings: a quote is escaped with a backslash, and backslashes right before
    # a quote (or at the end) are doubled
    value = re.sub(r"(\\*)'", lambda q: q.group(1) * 2 + "\\'", value)
    value += "\\" * (len(value) - len(value.rstrip("\\")))
    return f"'{value}'"


def _escaped(value):
    """A validated option's values made safe to store in OmegaConf again (strings escaped)."""
    if isinstance(value, str):
        return escape_interpolation(value)
    if isinstance(value, dict):
        return {k: _escaped(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_escaped(v) for v in value]
    return value


# Escapes in the free-text lists of a config (FREE_TEXT_LIST_KEYS: stop strings, choices, bad
# words), Python's and JSON's: Hydra keeps the backslashes of `'stop.strings=["\n\n"]'`, and a stop
# string of backslash-n never matches what a user means. generate(stop=[...]) takes real strings.
ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "/": "/", "$": "$",
           "a": "\a", "b": "\b", "f": "\f", "v": "\v"}
HEX_ESCAPES = {"x": 2, "u": 4, "U": 8}
ESCAPE_HELP = r"\n \t \r \\ \" \' \xHH \uXXXX \UXXXXXXXX"


def unescape(text: str, where: str) -> str:
    """`text` with its escapes decoded; ConfigError (one line) for a backslash that starts none,
    so a stop string that cannot be what the user meant never passes."""
    out, i = [], 0
    while i < len(text):
        j = text.find("\\", i)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        code = text[j + 1:j + 2]
        if code in ESCAPES:
            out.append(ESCAPES[code])
            i = j + 2
        elif code in HEX_ESCAPES:
            digits = text[j + 2:j + 2 + HEX_ESCAPES[code]]
            if len(digits) < HEX_ESCAPES[code] or not re.fullmatch(r"[0-9a-fA-F]+", digits) \
                    or int(digits, 16) > 0x10FFFF:
                raise ConfigError(f"{where} has the escape \\{code}{digits}, which needs "
                                  f"{HEX_ESCAPES[code]} hex digits of a Unicode code point; "
                                  f"write \\\\ for a backslash (escapes: {ESCAPE_HELP})")
            out.append(chr(int(digits, 16)))
            i = j + 2 + HEX_ESCAPES[code]
        else:
            what = f"\\{code}, which is not an escape" if code else "a lone \\ at the end"
            raise ConfigError(f"{where} has {what}; write \\\\ for a backslash (escapes: "
                              f"{ESCAPE_HELP})")
    decoded = re.sub("[\ud800-\udbff][\udc00-\udfff]", lambda m: m.group().encode(
        "utf-16", "surrogatepass").decode("utf-16"), "".join(out))     # JSON's "\ud83d\ude00"
    lone = re.search("[\ud800-\udfff]", decoded)
    if lone:
        raise ConfigError(f"{where} has the lone surrogate \\u{ord(lone.group()):04x}, which is "
                          f"not text; pair it (\\ud83d\\ude00) or write \\U0001f600")
    return decoded


def decode_escapes(cfg: DictConfig) -> DictConfig:
    """A composed config's free-text lists with their escapes decoded (`\\n` a newline, `\\\\` a
    backslash); once per composition: compose() does it, and so does the CLI for the config
    Hydra composes for its task. Returns cfg."""
    for key in FREE_TEXT_LIST_KEYS:
        node = OmegaConf.select(cfg, key, default=None)
        if not OmegaConf.is_list(node):
            continue
        values = OmegaConf.to_container(node, resolve=True)
        decoded = [unescape(v, f"{key}[{i}]") if isinstance(v, str) else v
                   for i, v in enumerate(values)]
        if decoded != values:
            with open_dict(cfg):
                OmegaConf.update(cfg, key, _escaped(decoded), merge=False)
    return cfg


@contextmanager
def _hydra(config_module: str) -> Iterator[None]:
    """initialize_config_module that also works inside another Hydra app (restores its state)."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    outer = GlobalHydra.instance().hydra if GlobalHydra.instance().is_initialized() else None
    GlobalHydra.instance().clear()
    try:
        with initialize_config_module(config_module=config_module, version_base="1.3"):
            yield
    finally:
        if outer is not None:
            GlobalHydra.instance().clear()
            GlobalHydra.instance().initialize(outer)


def compose(overrides: Sequence[str] = (), config_name: str = "config",
            config_module: str = CONFIG_MODULE) -> DictConfig:
    """Hydra-compose `config_name` with overrides, then validate every group option."""
    overrides = normalize_overrides(overrides)
    _refuse_deleted_groups(overrides)
    cfg = _hydra_compose(overrides, config_name, config_module)
    _refuse_new_root_keys(cfg, overrides, config_name, config_module)
    try:
        return validate(decode_escapes(cfg))
    except OmegaConfBaseException as exc:    # an interpolation in a value, say
        raise ConfigError(one_line_hydra_error(exc)) from None


def _hydra_compose(overrides: Sequence[str], config_name: str, config_module: str) -> DictConfig:
    from hydra import compose as hydra_compose

    try:
        with _hydra(config_module):
            return hydra_compose(config_name=config_name, overrides=with_searchpath(overrides))
    except SpecflowError:
        raise
    except Exception as exc:  # Hydra's and OmegaConf's composition errors
        raise ConfigError(_unknown_key_message(exc, overrides, config_name, config_module)
                          or one_line_hydra_error(exc)) from None


def _refuse_deleted_groups(overrides: Sequence[str]) -> None:
    """`~model`, `~stop`, ...: a run needs every one of REQUIRED_GROUPS."""
    for item in overrides:
        m = re.match(r"^~(\w+)(=.*)?$", item)
        if m and m.group(1) in REQUIRED_GROUPS:
            group = m.group(1)
            raise ConfigError(f"{item} deletes the {group} group, which every run needs; pick "
                              f"another option with {group}=<option> instead")


def _refuse_new_root_keys(cfg: DictConfig, overrides: Sequence[str], config_name: str,
                          config_module: str) -> None:
    """`+foo=1` adds a root key nothing reads: a typo that would otherwise pass silently."""
    added = [item for item in overrides
             if (m := re.match(r"^\+{1,2}(\w+)[.=]", item)) and m.group(1) not in GROUPS
             and m.group(1) != "hydra"]
    if not added:
        return
    base = _hydra_compose([o for o in overrides if o not in added], config_name, config_module)
    for item in added:
        key = re.match(r"^\+{1,2}(\w+)[.=]", item).group(1)
        if key not in base:
            keys = ", ".join(str(k) for k in base.keys())
            raise ConfigError(f"unknown config key {key!r} (from {item}); the root config has: "
                              f"{keys}")


def _unknown_key_message(exc, overrides, config_name, config_module) -> str | None:
    """'proposer.kk=3' -> name the key and list the keys its parent does have."""
    m = re.match(r"Could not override '([^']+)'", str(exc))
    if not m:
        return None
    key = m.group(1)
    parent = key.rpartition(".")[0]
    rest = [o for o in overrides if not o.lstrip("+~").startswith(key + "=")]
    try:
        cfg = compose(rest, config_name, config_module)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        keys = ", ".join(str(k) for k in node.keys())
    except Exception:
        return None
    if key in ("proposer.topk", "proposer.num_draft_tokens"):
        return (f"unknown config key {key!r}: proposer={node.get('name')} drafts chains only "
                f"(its keys: {keys}); token trees come from proposer=draft, eagle or ngram")
    return f"unknown config key {key!r}; {parent or 'the root config'} has: {keys}"


def one_line_hydra_error(exc: BaseException) -> str:
    """Hydra's message folded to one line, with the valid options or keys appended."""
    text = str(exc).strip()
    options = re.findall(r"^\t(\S+)$", text, flags=re.M)
    group = re.search(r"Available options in '([^']+)'", text)
    first = text.splitlines()[0] if text else type(exc).__name__
    first = re.sub(r"^In '[^']+': ", "", first)
    missing = re.search(r"Could not find '([^']+)'", first)
    if missing and group:
        return (f"{first}; valid options for {group.group(1)}: {', '.join(options)} "
                f"(use {group.group(1)}=<option>)")
    key = re.search(r"Could not override '([^']+)'", text)
    if key and "not in struct" in text:
        return (f"unknown config key {key.group(1)!r}; check the spelling "
                f"(`specflow run --cfg job` prints every key)")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()
             and not ln.startswith(("Config search path", "Set the environment", "\t"))]
    return "; ".join(lines[:3])


def _schema_node(kind: str, node: DictConfig, where: str):
    """Validate one option node against its registered schema; returns (typed node, object)."""
    from specflow.plugins import get_registry

    if not isinstance(node, DictConfig) or "name" not in node:
        raise ConfigError(f"{where} has no `name:`; every {kind} option must name its component")
    component = get_registry().get(kind, node.name)
    if component.schema is None:
        return node, node
    try:
        plain = OmegaConf.to_container(node, resolve=True)
        neg_inf_ok = getattr(component.schema, "NEG_INF_OK", ())
        for key, value in plain.items():
            _check_finite(value, f"{where}.{key}", key in neg_inf_ok)
        # resolved values: any `${` left in them is text, not an interpolation
        typed = OmegaConf.merge(OmegaConf.structured(component.schema), _escaped(plain))
        # again as converted: `Infinity` or 'nan' given as text becomes a float in the merge
        for key, value in OmegaConf.to_container(typed).items():
            _check_finite(value, f"{where}.{key}", key in neg_inf_ok)
        obj = OmegaConf.to_object(typed)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        msg = str(exc).splitlines()[0]
        key = getattr(exc, "full_key", None) or ""
        if key == where or key.startswith(where + "."):     # OmegaConf may give the full path
            key = key[len(where) + 1:]
        valid = ", ".join(f.name for f in component.schema.__dataclass_fields__.values())
        fix = "; give a value of that type" if "could not be converted" in msg else ""
        raise ConfigError(f"{where}{'.' + key if key else ''}: {msg}{fix} "
                          f"(valid keys: {valid})") from None
    if not is_dataclass(obj):
        return typed, obj
    # the resolved values go back into a node: keep any `${` in them literal there
    return OmegaConf.merge(OmegaConf.structured(type(obj)), _escaped(asdict(obj))), obj


def _check_finite(value, where: str, neg_inf_ok: bool = False) -> None:
    """Refuse NaN and infinite numbers anywhere in a field's value (a field a schema lists in
    NEG_INF_OK may hold -inf: a logit bias of -inf bans its token)."""
    import math

    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{where}.{key}", neg_inf_ok)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_finite(item, f"{where}[{i}]", neg_inf_ok)
    elif isinstance(value, float) and not math.isfinite(value):
        if value == float("-inf") and neg_inf_ok:
            return
        also = " or -inf (bans the token)" if neg_inf_ok else ""
        raise ConfigError(f"{where}={value} is not a finite number; give a finite value{also}")


def validate(cfg: DictConfig) -> DictConfig:
    """Check every group option and the root scalars; returns cfg with typed, resolved nodes."""
    with open_dict(cfg):
        for kind in SINGLE_GROUPS:
            if kind in cfg and cfg[kind] is not None:
                cfg[kind], _ = _schema_node(kind, cfg[kind], kind)
        for kind in MULTI_GROUPS:
            if kind in cfg and cfg[kind]:
                for key in list(cfg[kind].keys()):
                    cfg[kind][key], _ = _schema_node(kind, cfg[kind][key], f"{kind}.{key}")
    _check_root(cfg)
    _check_components(cfg)
    return cfg


def _check_components(cfg: DictConfig) -> None:
    """The selected components' own compose-time checks (Component.check): each knows what its
    settings must agree with (proposer=eagle's head folder with the target's config.json)."""
    from specflow.plugins import get_registry

    for component in get_registry().selected(cfg):
        if component.check is not None:
            component.check(cfg)


MAX_BATCH_SIZE = 4096         # running sequences; every slot reserves cache rows
MAX_SEED = 2 ** 63 - 2 ** 32   # request i uses seed + i: leave room below torch's limit
MAX_LOGPROBS = 1000


# a backend's own choices (a model group's `threads`, `pack`, `native`, which the root keys of
# the same names fill): what each means when auto, for the line that refuses a bad value
BACKEND_SETTINGS = {
    "pack": "pack the weights for oneDNN when a verification pass runs faster so, timed at start",
    "native": "run passes through the decoder layers as one native call where that measures "
              "faster at start",
}


def check_backend_settings(**values) -> None:
    """`threads` (auto or a count) and the auto/true/false switches in BACKEND_SETTINGS, as the
    root keys or a model group give them; one line for a bad one."""
    for name, value in values.items():
        if name == "threads":
            if value != "auto":
                whole_number(value, "threads", 1, 4096, "give threads=auto (the faster of all "
                             "cores and one, timed at start) or a number of CPU threads, e.g. "
                             "threads=2")
        elif value not in ("auto", True, False):
            raise ConfigError(f"{name}={value!r}; use auto ({BACKEND_SETTINGS[name]}), true or "
                              f"false")


def whole_number(value, name: str, lo: int, hi: int | None, fix: str,
                 error: type[SpecflowError] = ConfigError) -> int:
    """`value` as an int in [lo, hi] (hi None: no upper bound); a bool, a float or a string is
    refused with one line, never truncated. Root scalars and generate()'s arguments use it."""
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{name}={value!r} is not a whole number; {fix}")
    if value < lo:
        bound = f"must be >= {lo}" if hi is None else f"is out of range [{lo}, {hi}]"
        raise error(f"{name}={value} {bound}; {fix}")
    if hi is not None and value > hi:
        raise error(f"{name}={value} is out of range [{lo}, {hi}]; {fix}")
    return int(value)


def _root_int(cfg: DictConfig, key: str, lo: int, hi: int, fix: str, optional: bool = False
              ) -> None:
    if key in cfg and not (optional and cfg[key] is None):
        whole_number(cfg[key], key, lo, hi, fix)


def _check_root(cfg: DictConfig) -> None:
    _root_int(cfg, "max_new_tokens", 1, 2 ** 31 - 1, "give the most tokens to generate per "
              "prompt, e.g. max_new_tokens=64", optional=True)
    _root_int(cfg, "max_batch_size", 1, MAX_BATCH_SIZE, "give how many sequences run at once, "
              "e.g. max_batch_size=8")
    _root_int(cfg, "seed", 0, MAX_SEED, "give a non-negative seed, e.g. seed=0")
    _root_int(cfg, "logprobs", 0, MAX_LOGPROBS, "give null (off), 0 (the chosen tokens) or n "
              "(also the top n)", optional=True)
    if "show_progress" in cfg and not isinstance(cfg.show_progress, bool):
        raise ConfigError(f"show_progress={cfg.show_progress!r} must be true or false")
    if cfg.get("prompt") is not None and not isinstance(cfg.prompt, str):
        raise ConfigError(f"prompt={cfg.prompt!r} must be text; quote it")
    if str(cfg.get("chat", "auto")) not in ("auto", "on", "off"):
        raise ConfigError(f"chat={cfg.chat!r}; use auto (wrap prompt= in the tokenizer's chat "
                          f"template when it has one), on or off")
    check_backend_settings(**{k: cfg.get(k, "auto") for k in ("threads", *BACKEND_SETTINGS)})
    if not isinstance(cfg.get("retime", False), bool):
        raise ConfigError(f"retime={cfg.retime!r}; use false (read back the times that the "
                          f"choices at start measured in an earlier run on this machine) or true "
                          f"(time them again)")
    device = str(cfg.get("device", "cpu"))
    if not DEVICES.match(device):
        raise ConfigError(f"device={device!r} is not a device; use cpu, cuda, cuda:N or auto")
    dtype = str(cfg.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    if cfg.get("server") is not None:
        check_server(cfg.server)
    check_engine(cfg)
    check_token_ids(cfg)


# `specflow serve`'s whole-number settings (conf/serve.yaml): (key, lowest, may be null, the fix)
SERVER_INTS = (
    ("port", 0, False, "give a TCP port, e.g. server.port=8000 (0: any free port)"),
    ("max_queue", 0, False, "give how many requests may wait for a slot, e.g. server.max_queue=64"),
    ("max_prompt_tokens", 1, True, "give the longest prompt admitted in tokens, or null for the "
     "model's context"),
    ("max_tokens", 1, False, "give the most tokens a request may ask for, e.g. "
     "server.max_tokens=1024"),
)
HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?$")


def check_server(server) -> None:
    """The server's settings, before any model loads: an address or host name, ports and counts
    in range, a non-negative grace."""
    import ipaddress
    import math

    host = server.get("host")
    fix = "give an IP address or a host name, e.g. 127.0.0.1, 0.0.0.0 (every interface), ::1 or " \
          "localhost"
    if not isinstance(host, str) or not host:
        raise ConfigError(f"server.host={host!r} is not an address; {fix}")
    if ":" in host or re.fullmatch(r"[\d.]+", host):      # IP-looking: must be one
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ConfigError(f"server.host={host!r} is not a valid IP address; {fix}") from None
    elif not HOSTNAME.match(host):
        raise ConfigError(f"server.host={host!r} is not a valid host name; {fix}")
    for key, lo, nullable, why in SERVER_INTS:
        value = server.get(key)
        if not (nullable and value is None):
            whole_number(value, f"server.{key}", lo, 65535 if key == "port" else None, why)
    grace = server.get("grace_seconds")
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not math.isfinite(grace) \
            or grace < 0:
        raise ConfigError(f"server.grace_seconds={grace!r} must be a number of seconds >= 0; give "
                          f"how long requests in flight may finish at shutdown, e.g. 30")
    warm = server.get("warm_grammars", True)
    if not isinstance(warm, bool):
        raise ConfigError(f"server.warm_grammars={warm!r} must be true or false (compile "
                          f"response_format json_object's grammar at start)")
    model_name = server.get("model_name")
    if model_name is not None and (not isinstance(model_name, str) or not model_name.strip()):
        raise ConfigError(f"server.model_name={model_name!r} must be a non-empty name (the id "
                          f"/v1/models reports), or null for the model's path")


def config_token_ids(cfg: DictConfig) -> Iterator[tuple[str, object]]:
    """(option, id) for every token id a config names: stop.token_ids, a bad_words option's
    token_ids and a logit_bias option's bias keys."""
    stop = cfg.get("stop")
    for token in (stop.get("token_ids") or []) if stop is not None else []:
        yield "stop.token_ids", token
    for key, node in (cfg.get("logits") or {}).items():
        if node is None:
            continue
        if node.get("name") == "bad_words":
            for seq in node.get("token_ids") or []:
                for token in seq:
                    yield f"logits.{key}.token_ids", token
        if node.get("name") == "logit_bias":
            for token in node.get("bias") or {}:
                yield f"logits.{key}.bias", token


def check_token_ids(cfg: DictConfig, vocab_size: int | None = None) -> None:
    """Every token id in the config is >= 0 (at compose time) and inside the target's
    vocabulary (once the target is loaded and vocab_size known): one line naming the id."""
    for where, token in config_token_ids(cfg):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise ConfigError(f"{where} has {token!r}, which is not a token id; token ids are "
                              f"whole numbers from 0 up to the vocabulary size - 1")
        if vocab_size is not None and token >= vocab_size:
            raise ConfigError(f"{where} has token id {token}, outside the target's vocabulary of "
                              f"{vocab_size} tokens (ids 0 to {vocab_size - 1}); remove it or give "
                              f"an id below {vocab_size}")


def option(cfg: DictConfig, kind: str):
    """The validated dataclass instance of a group's option (None when the group is empty)."""
    node = cfg.get(kind)
    if node is None:
        return None
    return _schema_node(kind, node, kind)[1]


def resolved_copy(cfg: DictConfig) -> DictConfig:
    """A copy with every interpolation resolved; any `${` left in the values is text."""
    return OmegaConf.create(_escaped(OmegaConf.to_container(cfg, resolve=True)))


def check_engine(cfg: DictConfig) -> None:
    """`engine` and `vllm.*`, at compose time (no vLLM import)."""
    engine = cfg.get("engine", "specflow")
    if engine not in ENGINES:
        raise ConfigError(f"engine={engine!r}; use engine=specflow (specflow's pipeline) or "
                          f"engine=vllm (an installed vLLM decodes the same config)")
    node = cfg.get("vllm") or {}
    drafter = node.get("drafter", "own")
    if drafter not in DRAFTERS:
        raise ConfigError(f"vllm.drafter={drafter!r}; use own (vLLM's method for the proposer) or "
                          f"specflow (specflow's proposer and policy inside vLLM)")
    gib = node.get("kv_cache_gib", 2)
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0:
        raise ConfigError(f"vllm.kv_cache_gib={gib!r} must be a positive number of GiB for "
                          f"vLLM's CPU KV cache, e.g. vllm.kv_cache_gib=2")
