"""Plugin managers: built-in components and third-party packages register the same way.

- The global manager loads DEFAULT_PLUGINS, then every entry point in the ``specflow`` group
  (unless SPECFLOW_DISABLE_PLUGIN_AUTOLOAD=1), checks that every hook name is known, and asks each
  plugin to name its components through ``specflow_register``.
- Each Pipeline gets a fresh manager holding exactly the stage objects its config selects.
"""
from __future__ import annotations

import difflib
import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

import pluggy

from specflow import groups, hookspecs
from specflow.errors import PluginError, SpecflowError

PROJECT = "specflow"
ENTRY_POINT_GROUP = "specflow"
AUTOLOAD_ENV = "SPECFLOW_DISABLE_PLUGIN_AUTOLOAD"
DEFAULT_PLUGINS = ("specflow.builtins",)

hookimpl = pluggy.HookimplMarker(PROJECT)

KINDS = groups.KINDS


@dataclass(frozen=True)
class Component:
    """A named building block: ``factory(cfg, ctx)`` builds it, ``schema`` validates its config,
    ``check(cfg)``, when given, checks at compose time what the composed config and the files it
    names say (a head folder against the target's config.json), and ``preflight(cfg, prompts)``
    what needs tokenizers or the prompts (the run's when known, else None), before any model of
    the pipeline loads."""

    kind: str
    name: str
    factory: Callable[..., Any]
    schema: type | None
    plugin: str
    preflight: Callable[..., None] | None = None
    check: Callable[..., None] | None = None


class Registry:
    """Named components by kind; filled by ``specflow_register`` implementations."""

    def __init__(self) -> None:
        self._items: dict[str, dict[str, Component]] = {kind: {} for kind in KINDS}
        self._current_plugin = "?"

    def add(self, kind: str, name: str, factory: Callable[..., Any], schema: type | None = None,
            preflight: Callable[..., None] | None = None,
            check: Callable[..., None] | None = None) -> None:
        if kind not in self._items:
            raise PluginError(f"plugin {self._current_plugin!r} registers kind {kind!r}; "
                              f"known kinds: {', '.join(KINDS)}")
        existing = self._items[kind].get(name)
        if existing is not None:
            raise PluginError(f"{kind} option {name!r} is registered twice: by plugin "
                              f"{existing.plugin!r} and by plugin {self._current_plugin!r}; "
                              f"rename one of them")
        self._items[kind][name] = Component(kind, name, factory, schema, self._current_plugin,
                                            preflight, check)

    def selected(self, cfg) -> list[Component]:
        """The components a composed config selects, group by group (a multi-select group's in
        its order): whose checks (Component.check, .preflight) a config's run calls."""
        out = []
        for kind in groups.KINDS:
            nodes = cfg.get(kind)
            if not nodes:
                continue
            for node in nodes.values() if kind in groups.MULTI else [nodes]:
                if "name" in node:
                    out.append(self.get(kind, node.name))
        return out

    def get(self, kind: str, name: str) -> Component:
        try:
            return self._items[kind][name]
        except KeyError:
            known = ", ".join(sorted(self._items.get(kind, {}))) or "none"
            raise PluginError(f"no {kind} named {name!r} is registered (registered: {known}); "
                              f"install the plugin that provides it or fix the name") from None

    def names(self, kind: str) -> list[str]:
        return sorted(self._items[kind])

    def all(self) -> list[Component]:
        return [c for kind in KINDS for c in self._items[kind].values()]


def new_plugin_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(PROJECT)
    pm.add_hookspecs(hookspecs)
    return pm


def plugin_label(pm: pluggy.PluginManager, plugin: object) -> str:
    """'name (dist version)' for a plugin, for error messages and `specflow plugins`."""
    name = pm.get_name(plugin) or getattr(plugin, "__name__", type(plugin).__name__)
    for p, dist in pm.list_plugin_distinfo():
        if p is plugin:
            return f"{name} ({dist.metadata['name']} {dist.version})"
    return name


def check_hooks(pm: pluggy.PluginManager) -> None:
    """Fail with the plugin's name when it implements a hook that does not exist (a typo)."""
    known = [name for name in dir(hookspecs) if name.startswith("specflow_")]
    for name in dir(pm.hook):
        if not name.startswith("specflow_") or name in known:
            continue
        for impl in getattr(pm.hook, name).get_hookimpls():
            if impl.optionalhook:
                continue
            hint = difflib.get_close_matches(name, known, n=1)
            fix = f"did you mean {hint[0]!r}?" if hint else f"known hooks: {', '.join(known)}"
            raise PluginError(f"plugin {plugin_label(pm, impl.plugin)} implements unknown hook "
                              f"{name!r}; {fix}")
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as exc:  # pragma: no cover - check above catches first
        raise PluginError(f"plugin {exc.plugin!r}: {exc}") from None


def _register_checked(pm: pluggy.PluginManager, plugin: object, name: str | None = None) -> None:
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {name or plugin!r} cannot be registered: {exc}") from None


def load_entry_points(pm: pluggy.PluginManager) -> None:
    try:
        pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    except pluggy.PluginValidationError as exc:
        raise PluginError(f"plugin {exc.plugin!r} cannot be registered: {exc}") from None
    except Exception as exc:  # an entry point whose module fails to import
        raise PluginError(f"a specflow plugin failed to load: {type(exc).__name__}: {exc}; "
                          f"fix or uninstall it, or set {AUTOLOAD_ENV}=1") from exc


@functools.lru_cache(maxsize=1)
def get_plugin_manager() -> pluggy.PluginManager:
    """The global manager: built-ins, then entry points; hook names checked."""
    pm = new_plugin_manager()
    for module_name in DEFAULT_PLUGINS:
        _register_checked(pm, importlib.import_module(module_name), module_name)
    if os.environ.get(AUTOLOAD_ENV, "") not in ("1", "true", "yes"):
        load_entry_points(pm)
    check_hooks(pm)
    return pm


@functools.lru_cache(maxsize=1)
def get_registry() -> Registry:
    """All named components, from every loaded plugin's ``specflow_register``."""
    pm = get_plugin_manager()
    registry = Registry()
    for impl in pm.hook.specflow_register.get_hookimpls():  # registration order: built-ins first
        registry._current_plugin = pm.get_name(impl.plugin) or str(impl.plugin)
        impl.function(registry=registry)
    registry._current_plugin = "?"
    return registry


@functools.lru_cache(maxsize=1)
def config_searchpath() -> list[str]:
    """Search-path entries contributed by plugins (added to Hydra's search path).

    A plugin's yaml that would shadow a built-in option, or another plugin's (the same
    group/option.yaml), is refused here with both names: Hydra would silently pick one.
    """
    pm = get_plugin_manager()
    entries: list[str] = []
    owners = {option: "specflow (built-in)" for option in conf_options("pkg://specflow.conf")}
    for impl in reversed(pm.hook.specflow_config_searchpath.get_hookimpls()):
        result = impl.function()
        mine = [result] if isinstance(result, str) else list(result or [])
        label = plugin_label(pm, impl.plugin)
        for entry in mine:
            for option in conf_options(entry, label):
                if option in owners and owners[option] != label:
                    raise PluginError(f"config option {option.replace('/', '=', 1)[:-5]!r} of "
                                      f"plugin {label} ({entry}) collides with the one of "
                                      f"{owners[option]}; rename the plugin's yaml and its name:")
                owners[option] = label
        entries.extend(mine)
    return entries


def conf_options(entry: str, label: str = "specflow") -> list[str]:
    """'group/option.yaml' for every option yaml under a search-path entry (pkg:// or file://).

    pkg:// takes Hydra's forms: `pkg://plugin.conf` and `pkg://plugin/conf`.
    """
    import pathlib
    from importlib import resources

    if entry.startswith("pkg://"):
        package = entry[len("pkg://"):].strip("/").replace("/", ".")
        try:
            root = resources.files(package)
            if not root.is_dir():
                raise TypeError(f"{package} is not a package")
        except Exception as exc:   # missing, a module, or an __init__ that raises
            raise PluginError(f"plugin {label} gives config search path {entry!r}, which is not "
                              f"an importable package ({type(exc).__name__}: {exc}); fix its "
                              f"specflow_config_searchpath or uninstall it") from None
    else:
        root = pathlib.Path(entry[len("file://"):] if entry.startswith("file://") else entry)
        if not root.is_dir():
            return []
    found = []
    for group in root.iterdir():
        if not group.is_dir() or group.name.startswith(("_", ".")):
            continue
        found += [f"{group.name}/{f.name}" for f in group.iterdir() if f.name.endswith(".yaml")]
    return found


def reset() -> None:
    """Forget the cached global manager and registry (tests that install plugins use this)."""
    get_plugin_manager.cache_clear()
    get_registry.cache_clear()
    config_searchpath.cache_clear()


def plugin_distributions() -> list[dict[str, Any]]:
    """What is loaded: name, distribution, version and hooks of every plugin (`specflow plugins`)."""
    pm = get_plugin_manager()
    dists = {id(p): d for p, d in pm.list_plugin_distinfo()}
    rows = []
    for name, plugin in pm.list_name_plugin():
        dist = dists.get(id(plugin))
        hooks = sorted(h.name for h in pm.get_hookcallers(plugin) or [])
        if dist is not None:
            package, version = dist.metadata["name"], dist.version
        else:
            from specflow.version import __version__
            package, version = "specflow (built-in)", __version__
        components = [f"{c.kind}={c.name}" for c in get_registry().all() if c.plugin == name]
        rows.append({"name": name, "package": package, "version": version, "hooks": hooks,
                     "components": components})
    return rows


# ---------------------------------------------------------------------------------------------
# blaming a plugin that raises
# ---------------------------------------------------------------------------------------------

def distribution_of(module: str) -> str | None:
    """'specflow-suffix 0.1.0' for a module of an installed distribution, else None."""
    import sys
    from importlib import metadata

    top = module.split(".")[0]
    for plugin, dist in get_plugin_manager().list_plugin_distinfo():   # entry-point plugins
        if getattr(plugin, "__name__", "").split(".")[0] == top:
            return f"{dist.metadata['name']} {dist.version}"
    names = metadata.packages_distributions().get(top, [])
    if len(names) > 1:      # a namespace package shared by several distributions: match the file
        path = getattr(sys.modules.get(module), "__file__", None)
        owning = [n for n in names if path and any(
            str(f.locate()) == path for f in (metadata.distribution(n).files or []))]
        names = owning or names
    for dist_name in names:
        try:
            return f"{dist_name} {metadata.version(dist_name)}"
        except metadata.PackageNotFoundError:   # pragma: no cover - a stale mapping
            continue
    return None


def _frames(exc: BaseException) -> list:
    """The traceback's frames, outermost first."""
    out, tb = [], exc.__traceback__
    while tb is not None:
        out.append(tb.tb_frame)
        tb = tb.tb_next
    return out


def _hook_impls(pm) -> dict:
    """code object -> [(hook name, HookImpl)] for every specflow hook implementation in `pm`
    (several when instances of one class, or subclasses, share the function)."""
    out: dict = {}
    for hook_name in dir(pm.hook):
        if not hook_name.startswith("specflow_"):
            continue
        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            code = getattr(impl.function, "__code__", None)
            if code is not None:
                out.setdefault(code, []).append((hook_name, impl))
    return out


def _raising_hook_impl(exc: BaseException, pm):
    """(hook name, HookImpl, frame) of the innermost hook implementation in the traceback.

    Read from the traceback alone: a frame whose code object is an implementation's function (a
    wrapper's teardown runs in its generator's frame, which has the function's code).
    """
    impls = _hook_impls(pm)
    found = None
    for frame in _frames(exc):
        candidates = impls.get(frame.f_code)
        if candidates:      # the instance whose method this frame runs, when there are several
            own = [c for c in candidates if c[1].plugin is frame.f_locals.get("self")]
            found = (*(own or candidates)[0], frame)
    return found


def _is_ours(module: str) -> bool:
    return module.split(".")[0] == PROJECT


def _innermost_owner(frames: list, plugin_top: str) -> str | None:
    """'plugin' or 'specflow': whose code ran last before the exception (libraries skipped)."""
    for frame in reversed(frames):
        top = str(frame.f_globals.get("__name__", "")).split(".")[0]
        if top == plugin_top:
            return "plugin"
        if top == PROJECT:
            return "specflow"
    return None


def _resource_errors() -> tuple[type, ...]:
    """Out-of-memory, by type: not a plugin's bug, and callers that back off on it must see it."""
    import torch

    types: list[type] = [MemoryError]
    for owner in (torch, getattr(torch, "cuda", None)):
        oom = getattr(owner, "OutOfMemoryError", None)
        if isinstance(oom, type):
            types.append(oom)
    return tuple(types)


def blame(exc: BaseException, where: str | None = None, module: str | None = None,
          name: str | None = None, pm=None) -> PluginError | None:
    """A PluginError naming the third-party plugin (and its package) an exception came from.

    The plugin is the hook implementation whose code the exception came out of, or, for a
    component factory, `module`. The plugin is blamed only when its own code ran last before the
    exception (a plugin calling into specflow code that fails is specflow's problem), never for
    specflow's own modules, and never for out-of-memory errors. SpecflowErrors pass through.
    Never raises: a failure to attribute returns None and the original exception stands.
    """
    if isinstance(exc, SpecflowError) or not isinstance(exc, Exception) or \
            isinstance(exc, _resource_errors()):
        return None
    try:
        frames = _frames(exc)
        found = _raising_hook_impl(exc, pm) if pm is not None else None
        if found is not None:
            hook_name, impl, frame = found
            module = str(frame.f_globals.get("__name__", "")) or type(impl.plugin).__module__
            name, where = impl.plugin_name, f"in hook {hook_name}"
            if name.isdigit():   # registered without a name: pluggy uses id(plugin)
                name = getattr(impl.plugin, "__name__", type(impl.plugin).__name__)
            frames = frames[frames.index(frame):]
        if module is None or _is_ours(module):
            return None
        if _innermost_owner(frames, module.split(".")[0]) == "specflow":
            return None
        dist = distribution_of(module)
        label = f"{name} ({dist})" if dist else f"{name} (module {module}, not an installed package)"
        text = str(exc).strip()
        first = text.splitlines()[0] if text else ""
    except Exception:   # pragma: no cover - attribution must never hide the real error
        return None
    kind = ("an environment error (check paths and permissions)" if isinstance(exc, OSError)
            else "the bug is in that plugin, not in specflow: report it to its authors or leave "
                 "it out of the config")
    error = PluginError(f"plugin {label} raised {type(exc).__name__}{': ' + first if first else ''} "
                        f"{where}; {kind} (SPECFLOW_TRACEBACK=1 shows the traceback)")
    error.__cause__ = exc
    return error
