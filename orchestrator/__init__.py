"""The outer loop: CLI, rounds, search policies, git history, run state, reports."""
