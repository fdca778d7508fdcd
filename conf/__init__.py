# Hydra config root, importable as `specflow.conf` (pyproject maps this folder into the package)
# so that `pkg://specflow.conf` finds it in a wheel install as well as in a checkout.
