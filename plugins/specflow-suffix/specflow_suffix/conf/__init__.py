# Hydra config folders of specflow-suffix, reached as pkg://specflow_suffix.conf
