"""The reference implementation: engine, trainer, GRPO math and the co-located synchronous loop."""
