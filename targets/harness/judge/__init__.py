"""The harness's judge: what decides whether a candidate is trusted: the integrity scan, accuracy
checks 1-3, the system-run audit, its replays and sampling tests (docs/judge.md)."""
