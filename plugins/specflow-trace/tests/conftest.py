"""specflow-trace's tests run with plugin autoload on: the plugin is found as users find it."""
import os

os.environ.pop("SPECFLOW_DISABLE_PLUGIN_AUTOLOAD", None)

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_plugins():
    from specflow import plugins
    plugins.reset()
    yield
    plugins.reset()
