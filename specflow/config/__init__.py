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

from specflow.errors import ConfigError, SpecflowError

CONFIG_MODULE = "specflow.conf"
SINGLE_GROUPS = ("model", "draft", "proposer", "constraint", "verifier", "stop", "policy", "workload")
MULTI_GROUPS = ("logits", "observer")
GROUPS = SINGLE_GROUPS + MULTI_GROUPS + ("experiment",)
# keys whose values are free text (JSON, regexes, code): quoted for Hydra when given bare
FREE_TEXT_KEYS = ("prompt", "constraint.schema", "constraint.pattern", "constraint.model",
                  "workload.path", "model.path", "draft.path")
DEVICES = re.compile(r"^(cpu|auto|cuda(:\d+)?|mps)$")
DTYPES = ("float32", "float16", "bfloat16", "auto")


def _demo_path(which: str) -> str:
    from specflow.models.hf import DEMO_DIR
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
      (FREE_TEXT_KEYS: prompts, schemas, regexes, paths) are quoted for it.
    """
    out = []
    for item in overrides:
        m = re.match(r"^\+(\w+)=(.*)$", item)
        if m and m.group(1) in GROUPS:
            item = f"{m.group(1)}={m.group(2)}"
        m = re.match(r"^(\+{0,2}(?:%s))=(.*)$" % "|".join(map(re.escape, FREE_TEXT_KEYS)), item,
                     flags=re.S)
        if m and m.group(2) and m.group(2)[0] not in "'\"" and m.group(2) not in ("null", "-"):
            # Hydra's quoted strings: a quote is escaped with a backslash, and backslashes
            # right before a quote (or at the end) are doubled
            value = re.sub(r"(\\*)'", lambda q: q.group(1) * 2 + "\\'", m.group(2))
            value += "\\" * (len(value) - len(value.rstrip("\\")))
            item = f"{m.group(1)}='{value}'"
        out.append(item)
    return out


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
    from hydra import compose as hydra_compose

    overrides = normalize_overrides(overrides)
    try:
        with _hydra(config_module):
            cfg = hydra_compose(config_name=config_name, overrides=with_searchpath(overrides))
    except SpecflowError:
        raise
    except Exception as exc:  # Hydra's and OmegaConf's composition errors
        raise ConfigError(_unknown_key_message(exc, overrides, config_name, config_module)
                          or one_line_hydra_error(exc)) from None
    return validate(cfg)


def _unknown_key_message(exc, overrides, config_name, config_module) -> str | None:
    """'proposer.kk=3' -> name the key and list the keys its parent does have."""
    m = re.match(r"Could not override '([^']+)'", str(exc))
    if not m:
        return None
    key = m.group(1)
    parent, _, leaf = key.rpartition(".")
    rest = [o for o in overrides if not o.lstrip("+~").startswith(key + "=")]
    try:
        cfg = compose(rest, config_name, config_module)
        node = OmegaConf.select(cfg, parent) if parent else cfg
        keys = ", ".join(str(k) for k in node.keys())
    except Exception:
        return None
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
        typed = OmegaConf.merge(OmegaConf.structured(component.schema), plain)
        obj = OmegaConf.to_object(typed)
    except ConfigError:
        raise
    except OmegaConfBaseException as exc:
        msg = str(exc).splitlines()[0]
        key = getattr(exc, "full_key", None) or ""
        valid = ", ".join(f.name for f in component.schema.__dataclass_fields__.values())
        fix = "; give a value of that type" if "could not be converted" in msg else ""
        raise ConfigError(f"{where}{'.' + key if key else ''}: {msg}{fix} "
                          f"(valid keys: {valid})") from None
    return OmegaConf.structured(obj) if is_dataclass(obj) else typed, obj


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
    return cfg


def _check_root(cfg: DictConfig) -> None:
    if cfg.get("max_new_tokens", 1) is not None and int(cfg.get("max_new_tokens", 1)) < 1:
        raise ConfigError(f"max_new_tokens={cfg.max_new_tokens} must be >= 1")
    if int(cfg.get("max_batch_size", 1)) < 1:
        raise ConfigError(f"max_batch_size={cfg.max_batch_size} must be >= 1")
    device = str(cfg.get("device", "cpu"))
    if not DEVICES.match(device):
        raise ConfigError(f"device={device!r} is not a device; use cpu, cuda, cuda:N or auto")
    dtype = str(cfg.get("dtype", "float32"))
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {', '.join(DTYPES)}")


def option(cfg: DictConfig, kind: str):
    """The validated dataclass instance of a group's option (None when the group is empty)."""
    node = cfg.get(kind)
    if node is None:
        return None
    return _schema_node(kind, node, kind)[1]


def to_plain(obj) -> dict:
    return asdict(obj) if is_dataclass(obj) else OmegaConf.to_container(obj, resolve=True)
