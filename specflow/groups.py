"""The config groups: one list, read by the config layer, the registry and the pipeline.

A group is a folder of options under conf/ and a kind of component in the registry.
"""
from __future__ import annotations

# every kind of component, in the order `specflow plugins` lists them
KINDS = ("model", "draft", "proposer", "logits", "constraint", "verifier", "stop", "policy",
         "workload", "observer")
MULTI = ("logits", "observer")                        # multi-select: a list of options, in order
SINGLE = tuple(k for k in KINDS if k not in MULTI)    # one option each
# single groups the pipeline registers as one stage each (model and draft are backends, workload
# is read by the app layer)
STAGES = ("proposer", "verifier", "stop", "policy", "constraint")
# what `~group` may not delete: a run needs one of each
REQUIRED = ("model", "proposer", "verifier", "stop", "policy", "workload")
# global overlays (`experiment=NAME`), not components
OVERLAYS = ("experiment",)
