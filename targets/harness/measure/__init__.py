"""The harness's measure: judged and paired measurements, their metrics, the benchmark, tracking and
timelines."""
