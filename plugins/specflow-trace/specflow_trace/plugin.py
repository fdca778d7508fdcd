"""Entry point of specflow-trace: names the `trace` observer and adds its config folder."""
from __future__ import annotations

from specflow import hookimpl

from specflow_trace.tracer import Tracer, TraceConfig


@hookimpl
def specflow_register(registry):
    registry.add("observer", "trace", Tracer, TraceConfig)


@hookimpl
def specflow_config_searchpath():
    return "pkg://specflow_trace.conf"
