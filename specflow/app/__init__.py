"""The app layer: what every front end does with a composed config, below the CLI.

`specflow run`, each `specflow ab` job and (later) a server are clients of these functions. They
raise SpecflowError for people and never print or exit; printing and exit codes are the CLI's.
"""
