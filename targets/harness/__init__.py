"""The harness: owns environments, the model and its reference, the clock, the trace, the checks.

Candidates never import from here (only ``targets.api``); the judge enforces that.
"""
