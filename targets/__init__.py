"""The per-target contract: specs, the public API for candidates, and the harness that judges them."""
