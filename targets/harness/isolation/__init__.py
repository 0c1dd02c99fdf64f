"""The harness's isolation: where candidate code runs and how the harness drives it: the sandbox, the
harness child and its phases, the candidate's processes, the system run, the process watchdog."""
