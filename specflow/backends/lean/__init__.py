"""The lean wing: a decoder forward written over plain tensors (`forward.py`), its kernels and
weight layouts, the native C product and pass, static steps and graphs, and the timed choices
between them."""
