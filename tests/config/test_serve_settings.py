"""`specflow serve`'s settings (conf/serve.yaml) are checked at compose time, before any model
loads: one line naming the value and the fix. Binding is tested in tests/test_bad_inputs.py and
tests/test_cli.py."""
from __future__ import annotations

import pytest

from specflow.config import compose
from specflow.errors import ConfigError

SYN = ["model=synthetic", "draft=synthetic"]


@pytest.mark.parametrize("override,needle", [
    ("server.port=abc", "server.port='abc' is not a whole number; give a TCP port"),
    ("server.port=70000", "server.port=70000 is out of range [0, 65535]"),
    ("server.port=-1", "server.port=-1 is out of range [0, 65535]"),
    ("server.port=80.5", "server.port=80.5 is not a whole number"),
    ("server.host=256.1.1.1", "server.host='256.1.1.1' is not a valid IP address"),
    ("server.host=1.2.3", "server.host='1.2.3' is not a valid IP address"),
    ("server.host='::zz'", "server.host='::zz' is not a valid IP address"),
    ("server.host=bad_host", "server.host='bad_host' is not a valid host name"),
    ("server.host=''", "server.host='' is not an address"),
    ("server.host=null", "server.host=None is not an address"),
    ("server.max_queue=-1", "server.max_queue=-1 must be >= 0"),
    ("server.max_tokens=0", "server.max_tokens=0 must be >= 1"),
    ("server.max_tokens=1.5", "server.max_tokens=1.5 is not a whole number"),
    ("server.max_prompt_tokens=0", "server.max_prompt_tokens=0 must be >= 1"),
    ("server.grace_seconds=-1", "server.grace_seconds=-1 must be a number of seconds >= 0"),
    ("server.grace_seconds=nan", "server.grace_seconds=nan must be a number of seconds >= 0"),
    ("server.grace_seconds=abc", "server.grace_seconds='abc' must be a number of seconds"),
    ("server.model_name=''", "server.model_name='' must be a non-empty name"),
])
def test_bad_server_settings_are_one_line_at_compose_time(override, needle):
    with pytest.raises(ConfigError) as info:
        compose([*SYN, override], "serve")
    assert needle in str(info.value) and "\n" not in str(info.value), str(info.value)


@pytest.mark.parametrize("good,bad", [
    ("server.host=localhost", "server.host=local_host"),
    ("server.host=my-box.example.org", "server.host=my-box..example.org"),
    ("server.host=0.0.0.0", "server.host=0.0.0.256"),
    ("server.host='::1'", "server.host='::g'"),
    ("server.port=0", "server.port=-1"),            # 0: any free port (the banner names it)
    ("server.port=65535", "server.port=65536"),
    ("server.max_queue=0", "server.max_queue=-1"),
    ("server.max_tokens=1", "server.max_tokens=0"),
    ("server.max_prompt_tokens=null", "server.max_prompt_tokens=-5"),
    ("server.grace_seconds=0.5", "server.grace_seconds=-0.5"),
])
def test_the_bounds_are_where_they_say(good, bad):
    compose([*SYN, good], "serve")
    with pytest.raises(ConfigError):
        compose([*SYN, bad], "serve")
